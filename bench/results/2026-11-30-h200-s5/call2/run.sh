mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl .whl/flash_maxsim*.whl > /dev/null 2>&1
timeout 120 $T residual 2>&1 | grep -E "^test |test result|panicked|Error" | tee $OUT/tests_res.txt
timeout 60 $B --residual --iters 20 2>&1 | tee $OUT/residual.jsonl
CANDLE_MAXSIM_RESIDUAL=tile timeout 60 $B --residual --iters 20 2>&1 | sed 's/"fused"/"fused_tile"/' | tee -a $OUT/residual.jsonl
PYTHONPATH=/tmp/site timeout 120 python3 bench/peers_plaid.py 2>&1 | tail -4 | tee $OUT/peers_plaid.jsonl
timeout 90 ncu --clock-control none -k regex:maxsim_res_ -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats $B --residual --iters 1 > $OUT/ncu_res.txt 2>&1
grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|L2 Cache Thr|DRAM Thr|Compute \(SM\)" $OUT/ncu_res.txt
timeout 120 compute-sanitizer --tool memcheck $T residual_cuda 2>&1 | tail -2
timeout 60 $B --hidden --iters 20 2>&1 | tee $OUT/hidden.jsonl
timeout 120 $T from_hidden 2>&1 | grep -E "^test |test result|panicked" | tee $OUT/tests_hidden.txt
