#!/usr/bin/env bash
# The CPU table: benches/cpu.rs (this crate's fused CPU op and `reference`,
# F32 and BF16), the machine's FMA peak and read bandwidth (bench/micro/fma_peak.rs)
# and the CPU peers (bench/cpu_peers.py: maxsim-cpu 0.1.0, numpy einsum) back
# to back on this machine, then the markdown table (bench/table.py).
#
#   pip install maxsim-cpu==0.1.0 numpy && bash bench/cpu.sh
#
# RESULTS: folder for the raw JSON lines (default: a new temporary folder).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${RESULTS:-$(mktemp -d)}
mkdir -p "$out"
(cd "$here/.." && cargo bench --bench cpu) | grep '^{' > "$out/cpu.jsonl"
(cd "$here/.." && cargo bench --bench fma_peak) | grep '^{' > "$out/fma_peak.jsonl"
python3 "$here/cpu_peers.py" > "$out/peers_cpu.jsonl"
echo "$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(date -u +%F); raw JSON lines in $out"
echo
python3 "$here/table.py" cpu "$out/cpu.jsonl" "$out/peers_cpu.jsonl"
echo
cat "$out/fma_peak.jsonl"
