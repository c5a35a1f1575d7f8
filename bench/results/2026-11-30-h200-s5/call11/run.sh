mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error" | tee $OUT/tests.txt | grep -E "FAIL|result|panicked|rel err"
timeout 100 compute-sanitizer --tool memcheck $T residual_cuda 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/memcheck.txt
timeout 100 compute-sanitizer --tool memcheck $T from_hidden_cuda 2>&1 | grep -E "test result|ERROR SUMMARY" | tee -a $OUT/memcheck.txt
timeout 40 $B --residual --iters 30 2>&1 | tee $OUT/residual.jsonl
