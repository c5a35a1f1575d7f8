mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error|assert" > $OUT/tests.txt; grep -E "FAIL|result|panicked|rel err|assert" $OUT/tests.txt
for t in hlarge hmid hsmall large small narrow; do
  echo "== $t" >> $OUT/tests.txt; CANDLE_MAXSIM_TILE=$t timeout 60 $T argmax 2>&1 | grep -E "test result|panicked|FAIL|assert" | tee -a $OUT/tests.txt
done
timeout 100 compute-sanitizer --tool memcheck $T argmax_ties cuda_backward_modes_hot 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/sanitizer.txt
