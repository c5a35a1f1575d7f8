mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 250 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error" | tee $OUT/tests.txt | grep -E "FAIL|result|panicked|rel err"
timeout 150 compute-sanitizer --tool memcheck $T plaid 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/memcheck.txt
timeout 60 $B --plaid-approx --iters 30 --no-reference 2>&1 | tee $OUT/plaid_approx.jsonl
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl 2>&1 | grep -v WARN | tail -2
PYTHONPATH=/tmp/site timeout 90 python3 bench/peers_plaid.py 2>&1 | grep approx | tee $OUT/peers_plaid.jsonl
