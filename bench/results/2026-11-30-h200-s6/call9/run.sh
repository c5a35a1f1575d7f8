mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 60 $B --train --iters 30 --no-reference 2>&1 | tee $OUT/train.jsonl
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error" | tee $OUT/tests.txt | grep -E "FAIL|result|panicked|rel err|Error"
timeout 100 compute-sanitizer --tool memcheck $T cuda_backward_modes 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/memcheck.txt
pip install -q --no-index --no-deps --target /tmp/site .whl/late_interaction*.whl 2>&1 | grep -v WARN | tail -2
PYTHONPATH=/tmp/site timeout 150 python3 bench/peers.py --train --fresh 2 2>&1 | tee $OUT/peers_train.jsonl | tail -6
timeout 60 $B --train --iters 30 --no-reference 2>&1 | tee -a $OUT/train.jsonl
