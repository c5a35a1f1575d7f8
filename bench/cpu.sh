#!/usr/bin/env bash
# CPU benchmark, ours and the CPU peers in one run on this machine:
#   bash bench/cpu.sh     (needs: pip install maxsim-cpu==0.1.0 numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --bench cpu 2>/dev/null | grep '^{'
python3 bench/cpu_peers.py
