#!/usr/bin/env bash
# Stop what start_one_node_slurm.sh started (by the pid files it wrote).
STATE=${1:-/tmp/td-slurm}
for pidfile in "$STATE"/slurmd.pid "$STATE"/slurmctld.pid; do
    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
exit 0
