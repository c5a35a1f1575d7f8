mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 120 $B --iters 30 --no-reference > $OUT/fwd.jsonl 2>&1; cut -c1-150 $OUT/fwd.jsonl
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error|assert" > $OUT/tests.txt; grep -E "FAIL|result|panicked|rel err|assert" $OUT/tests.txt
for t in hlarge hmid hsmall large small narrow; do
  echo "== $t" >> $OUT/tests.txt; CANDLE_MAXSIM_TILE=$t timeout 60 $T argmax gradients_through masked_and_empty dense_lengths 2>&1 | grep -E "test result|panicked|FAIL|assert" | tee -a $OUT/tests.txt
done
timeout 100 compute-sanitizer --tool memcheck $T argmax_ties masked_and_empty 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/sanitizer.txt
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl 2>&1 | grep -v WARN | tail -2
PYTHONPATH=/tmp/site timeout 240 python3 bench/peers.py --impl lik --fresh 2 > $OUT/peers_fwd.jsonl 2>&1; cut -c1-150 $OUT/peers_fwd.jsonl
timeout 120 $B --iters 30 --no-reference 2>&1 | tee -a $OUT/fwd.jsonl | cut -c1-150
timeout 60 $B --train --iters 30 --no-reference 2>&1 | tee $OUT/train.jsonl | cut -c1-150
