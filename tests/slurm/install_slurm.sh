#!/usr/bin/env bash
# Install what tests/test_real_launchers.py's SLURM test needs (Debian's slurm-wlm and munge;
# root). Optional: without them that test skips, saying so.
set -euo pipefail
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
