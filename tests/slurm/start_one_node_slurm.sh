#!/usr/bin/env bash
# Start a one-node SLURM cluster (munged, slurmctld, slurmd) on this machine, for
# tests/test_real_launchers.py. Needs Debian's slurm-wlm and munge, and root:
#     apt-get install -y slurm-wlm munge     (the test installs them when it may)
#     bash tests/slurm/start_one_node_slurm.sh [STATE_DIR]
# Prints "slurm ready" once `sinfo` shows the node idle; exits non-zero (with the reason on
# stderr) where this machine cannot run it. Stop it with tests/slurm/stop_one_node_slurm.sh.
set -euo pipefail
STATE=${1:-/tmp/td-slurm}
HOST=$(hostname -s)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc answers OMP_NUM_THREADS where set
mkdir -p "$STATE"/{spool,state,log} /etc/slurm /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "/usr/sbin/munged" || /usr/sbin/munged --force
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=td
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
rm -f /etc/slurm/cgroup.conf  # the defaults (cgroup/v1 autodetected, or none)
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 1 30); do
    if sinfo -h -o "%t" 2>/dev/null | grep -qE "idle|mix|alloc"; then
        echo "slurm ready"
        exit 0
    fi
    sleep 1
done
echo "slurm did not come up: $(sinfo 2>&1 | tail -2); $(tail -3 "$STATE"/log/slurmd.log 2>/dev/null)" >&2
exit 1
