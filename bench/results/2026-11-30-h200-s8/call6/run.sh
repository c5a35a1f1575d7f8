mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl 2>&1 | grep -v WARN | tail -2
timeout 30 $B --plaid-approx --iters 30 --no-reference 2>&1 | tee $OUT/plaid.jsonl
PYTHONPATH=/tmp/site timeout 120 python3 bench/peers_plaid.py 2>&1 | tee $OUT/peers_plaid.jsonl
timeout 30 $B --plaid-approx --iters 30 --no-reference 2>&1 | tee -a $OUT/plaid.jsonl
timeout 60 $B --residual --iters 30 --no-reference 2>&1 | tee $OUT/residual.jsonl
timeout 250 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error|assert" > $OUT/tests.txt; grep -E "FAIL|result|panicked|rel err|assert" $OUT/tests.txt
timeout 150 compute-sanitizer --tool memcheck $T plaid residual 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/sanitizer.txt
