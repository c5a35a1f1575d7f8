set -x
mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
nvidia-smi --query-gpu=name,driver_version --format=csv
ls /tmp/g/tests
( time /tmp/g/tests/test-gpu ) > $OUT/tests.txt 2>&1; tail -5 $OUT/tests.txt
for i in 1 2 3 4 5; do /tmp/g/tests/test-gpu -q normalize 2>&1 | grep "test result"; done > $OUT/normalize_x5.txt; cat $OUT/normalize_x5.txt
compute-sanitizer --tool memcheck /tmp/g/tests/test-gpu normalize > $OUT/memcheck_normalize.txt 2>&1; tail -3 $OUT/memcheck_normalize.txt
for t in /tmp/g/tests/test-*; do [ "$t" = /tmp/g/tests/test-gpu ] && continue; $t -q 2>&1 | grep -E "test result|panicked"; done > $OUT/other.txt; cat $OUT/other.txt
