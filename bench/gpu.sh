#!/usr/bin/env bash
# One GPU benchmark table: this crate's bench binary and the peers back to back
# on the same GPU, then the markdown table (bench/table.py).
#
#   bench/gpu.sh forward|families|int8|train|plaid|head|attention
#
# What it needs on the GPU machine:
#   - the bench binary: `cargo build --release --features cuda --example bench`
#     (nvcc at build time; the tables used CUDA 13.0) leaves it at
#     target/release/examples/bench. Run from a checkout, or copy the binary to
#     the GPU machine with bench/ and point BENCH_BIN at it.
#   - the peers, for forward, train and plaid: torch and triton, plus
#     late-interaction-kernels==0.4.5 and (forward only, optional)
#     flash-maxsim==0.3.0. Either importable already, or their wheels in the
#     folder WHEELS, which this script installs with
#     `pip install --no-index --no-deps --target "$SITE"` and puts on PYTHONPATH.
#     (Get the wheels anywhere with network: `pip download --no-deps
#     late-interaction-kernels==0.4.5 flash-maxsim==0.3.0 -d wheels/`.)
#
# Environment:
#   BENCH_BIN  bench binary (default: target/release/examples/bench of this checkout)
#   WHEELS     folder of peer wheels to install first (default: none)
#   SITE       install target for them (default: /tmp/candle-maxsim-peers)
#   RESULTS    folder for the raw JSON lines (default: a new temporary folder)
#   BEFORE_BIN families only: an earlier build's bench binary, timed in the
#              same invocation for the before/after columns (default: none)
#
# Ours is timed before and after the peers; table.py shows the slower run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: bench/gpu.sh forward|families|int8|train|plaid|head|attention"
workload=${1:?$usage}
case $workload in forward | families | int8 | train | plaid | head | attention) ;; *) echo "$usage" >&2; exit 2 ;; esac
B=${BENCH_BIN:-$here/../target/release/examples/bench}
[ -x "$B" ] || { echo "no bench binary at $B: build it (see the top of $0) or set BENCH_BIN" >&2; exit 1; }
out=${RESULTS:-$(mktemp -d)}
mkdir -p "$out"

if [ "$workload" != head ] && [ "$workload" != int8 ] && [ "$workload" != families ] && [ "$workload" != attention ]; then
    if [ -n "${WHEELS:-}" ]; then
        SITE=${SITE:-/tmp/candle-maxsim-peers}
        python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    python3 -c 'import late_interaction_kernels' ||
        { echo "late-interaction-kernels is not importable: set WHEELS (see the top of $0)" >&2; exit 1; }
fi

peers=(--impl lik)
if [ "$workload" = forward ] && python3 -c 'import flash_maxsim' 2>/dev/null; then
    peers+=(--impl flash)
fi

case $workload in
forward)
    # The six standard shapes, bf16, dim 128.
    "$B" --iters 30 --no-reference > "$out/forward.jsonl"
    python3 "$here/peers.py" "${peers[@]}" --fresh 2 > "$out/peers_forward.jsonl"
    "$B" --iters 30 --no-reference >> "$out/forward.jsonl"
    # Dims 96 and 48 and F16 at the two in-batch shapes, F32 (ours only).
    inbatch=(--shape 128,128,128,1024,128 --shape 256,256,32,256,128)
    "$B" --iters 50 --no-reference --shape 128,128,128,1024,96 --shape 256,256,32,256,96 \
        --shape 128,128,128,1024,48 --shape 256,256,32,256,48 > "$out/forward_dims.jsonl"
    "$B" --iters 50 --no-reference --dtype f16 "${inbatch[@]}" >> "$out/forward_dims.jsonl"
    for opt in "--dim 96" "--dim 48" "--dtype f16"; do
        # shellcheck disable=SC2086
        python3 "$here/peers.py" "${peers[@]}" --fresh 1 --case colpali_inbatch --case colbert_inbatch $opt
    done > "$out/peers_forward_dims.jsonl"
    "$B" --iters 50 --no-reference --dtype f32 "${inbatch[@]}" > "$out/forward_f32.jsonl"
    files=("$out"/forward.jsonl "$out"/forward_dims.jsonl "$out"/forward_f32.jsonl
        "$out"/peers_forward.jsonl "$out"/peers_forward_dims.jsonl)
    ;;
families)
    # No peer: scores and argmax forward (bf16, dim 128 unless given) on the
    # standard shapes and the families the static rule treats apart (short
    # documents, small dims, mid-size grids; the last is nearest_centroids'
    # assignment of 8 192 tokens to 262 144 centroids), twice, with
    # BEFORE_BIN's first.
    shapes=(--shape 128,128,128,1024,128 --shape 256,256,32,256,128 --shape 1,1000,32,300,128
        --shape 1,1000,128,1024,128 --shape 16,32,32,8192,128 --shape 32,10000,32,256,128
        --shape 32,10000,32,64,128 --shape 64,5000,16,128,128 --shape 128,2000,32,256,128
        --shape 256,256,32,256,96 --shape 256,256,32,256,48 --shape 64,2000,32,300,96
        --shape 64,64,32,300,128 --shape 32,32,32,300,128 --shape 256,256,32,64,128
        --shape 64,1,128,262144,128)
    for _ in 1 2; do
        if [ -n "${BEFORE_BIN:-}" ]; then
            "$BEFORE_BIN" --iters 30 --no-reference --argmax "${shapes[@]}" | sed 's/^{/{"build":"before",/'
        fi
        "$B" --iters 30 --no-reference --argmax "${shapes[@]}"
    done > "$out/forward_families.jsonl"
    files=("$out"/forward_families.jsonl)
    ;;
int8)
    # No peer: maxsim_quantized (I8, and e4m3 on Hopper) against this crate's
    # bf16 maxsim on the same shapes (the six standard ones, short documents,
    # a mid-size grid, dim 96), each dtype twice, interleaved.
    shapes=(--shape 128,128,128,1024,128 --shape 256,256,32,256,128 --shape 1,1000,32,300,128
        --shape 1,1000,128,1024,128 --shape 16,32,32,8192,128 --shape 32,10000,32,256,128
        --shape 32,10000,32,64,128 --shape 64,64,32,300,128 --shape 128,128,128,1024,96)
    dts=(bf16 i8)
    if [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)" = 9.0 ]; then
        dts+=(e4m3)
    fi
    for _ in 1 2; do
        for dt in "${dts[@]}"; do "$B" --iters 30 --no-reference --dtype "$dt" "${shapes[@]}"; done
    done > "$out/int8.jsonl"
    files=("$out"/int8.jsonl)
    ;;
train)
    "$B" --train --iters 30 --no-reference > "$out/train.jsonl"
    python3 "$here/peers.py" --train --fresh 2 > "$out/peers_train.jsonl"
    "$B" --train --iters 30 --no-reference >> "$out/train.jsonl"
    files=("$out"/train.jsonl "$out"/peers_train.jsonl)
    ;;
plaid)
    "$B" --plaid-approx --iters 30 --no-reference > "$out/plaid_approx.jsonl"
    "$B" --residual --iters 30 --no-reference > "$out/residual.jsonl"
    python3 "$here/peers_plaid.py" > "$out/peers_plaid.jsonl"
    "$B" --plaid-approx --iters 30 --no-reference >> "$out/plaid_approx.jsonl"
    "$B" --residual --iters 30 --no-reference >> "$out/residual.jsonl"
    files=("$out"/plaid_approx.jsonl "$out"/residual.jsonl "$out"/peers_plaid.jsonl)
    ;;
attention)
    # nn::attention_varlen against torch's scaled_dot_product_attention (the
    # torch the GPU machine has), ours before and after; on sm_90 also the
    # sm_80 kernels (CANDLE_MAXSIM_ATTENTION=mma) beside the default (wgmma).
    "$B" --attention --iters 50 > "$out/attention.jsonl"
    python3 "$here/attention_peers.py" --iters 50 >> "$out/attention.jsonl"
    "$B" --attention --iters 50 --impl varlen --impl varlen_train >> "$out/attention.jsonl"
    if [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)" = 9.0 ]; then
        CANDLE_MAXSIM_ATTENTION=mma "$B" --attention --iters 50 --impl varlen --impl varlen_train |
            sed 's/^{/{"build":"mma",/' >> "$out/attention.jsonl"
    fi
    files=("$out"/attention.jsonl)
    ;;
head)
    # No peer: the fused head against this crate's own linear + bias + l2_normalize + maxsim.
    "$B" --hidden --iters 20 > "$out/head.jsonl"
    files=("$out"/head.jsonl)
    ;;
esac

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 | sed 's/, / driver /' || true)
echo "${gpu:-unknown GPU}, $(date -u +%F); raw JSON lines in $out"
echo
python3 "$here/table.py" "$workload" "${files[@]}"
