mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
T=/tmp/g/tests/test-gpu
B=/tmp/g/examples/bench
timeout 200 $T 2>&1 | grep -E "^test |test result|panicked|rel err|Error|assert" | tee $OUT/tests.txt | grep -E "FAIL|result|panicked|rel err|assert"
for t in hlarge hmid hsmall large small narrow; do
  echo "== $t"; CANDLE_MAXSIM_TILE=$t timeout 60 $T argmax 2>&1 | grep -E "test result|panicked|FAIL|assert" | tee -a $OUT/tests_tiles.txt
done
timeout 30 $B --train --iters 30 --no-reference 2>&1 | tee $OUT/train.jsonl
timeout 30 $B --plaid-approx --iters 30 --no-reference 2>&1 | tee $OUT/plaid.jsonl
timeout 200 compute-sanitizer --tool memcheck $T cuda_backward plaid_approx argmax_ties 2>&1 | grep -E "test result|ERROR SUMMARY" | tee $OUT/memcheck.txt
timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:"maxsim_bwd|hlarge" $B --shape 128,128,128,1024,128 --train --iters 2 --no-reference > $OUT/ncu_step.txt 2>&1
timeout 60 ncu --section SpeedOfLight --section InstructionStats --section WarpStateStats -k regex:"maxsim_bwd_dd|plaid_approx" -c 2 $B --shape 128,128,128,1024,128 --train --iters 1 --no-reference > $OUT/ncu_dd.txt 2>&1
grep -E "maxsim_bwd_dd|Duration|Executed Instructions  |Issue Slots Busy" $OUT/ncu_dd.txt | head
timeout 60 ncu --section SpeedOfLight --section InstructionStats --section WarpStateStats --section Occupancy -k regex:"plaid_approx" -c 1 $B --plaid-approx --iters 1 --no-reference > $OUT/ncu_plaid.txt 2>&1
grep -E "plaid_approx|Duration|Executed Instructions  |Issue Slots Busy|Achieved Occ|L2 Cache Th" $OUT/ncu_plaid.txt | head
timeout 90 ncu --set full --import-source no -k regex:"hlarge_d128_nograd" -c 1 -o $OUT/fwd_nograd $B --shape 128,128,128,1024,128 --iters 1 --no-reference > /dev/null 2>&1
timeout 90 ncu --set full --import-source no -k regex:"hlarge_d128_argmax" -c 1 -o $OUT/fwd_argmax $B --shape 128,128,128,1024,128 --train --iters 1 --no-reference > /dev/null 2>&1
for k in nograd argmax; do ncu -i $OUT/fwd_$k.ncu-rep --page details > $OUT/fwd_${k}_details.txt 2>&1; ncu -i $OUT/fwd_$k.ncu-rep --page source --csv --print-source sass > $OUT/fwd_${k}_sass.csv 2>/dev/null; grep -E "Duration|Executed Instructions  |Issue Slots Busy|Registers Per|Eligible Warps" $OUT/fwd_${k}_details.txt; done
