mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 60 $B --train --iters 30 --no-reference 2>&1 | tee $OUT/train.jsonl
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error|assert" | tee $OUT/tests.txt | grep -E "FAIL|result|panicked|rel err|assert"
for t in hlarge hmid hsmall large small narrow; do
  echo "== $t" | tee -a $OUT/tests.txt; CANDLE_MAXSIM_TILE=$t timeout 60 $T argmax gradients_through 2>&1 | grep -E "test result|panicked|FAIL|assert" | tee -a $OUT/tests.txt
done
timeout 150 compute-sanitizer --tool memcheck $T cuda_backward_modes argmax_ties 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/sanitizer.txt
timeout 150 compute-sanitizer --tool racecheck $T cuda_backward_deterministic 2>&1 | grep -E "test result|RACECHECK SUMMARY|ERROR SUMMARY" | tee -a $OUT/sanitizer.txt
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl 2>&1 | grep -v WARN | tail -2
PYTHONPATH=/tmp/site timeout 150 python3 bench/peers.py --train --fresh 2 2>&1 | tee $OUT/peers_train.jsonl | tail -6
timeout 60 $B --train --iters 30 --no-reference 2>&1 | tee -a $OUT/train.jsonl
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:"maxsim_bwd|hlarge_d128_argmax|fill" $B --shape 128,128,128,1024,128 --train --iters 2 --no-reference > $OUT/ncu_step.txt 2>&1
grep -E "^  [a-z_0-9]+ \(|gpu__time" $OUT/ncu_step.txt | paste - - | awk '{print $1, $(NF-1), $NF}' | tail -8
