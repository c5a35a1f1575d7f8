# Call 2: bench/micro/plaid_gather.cu as committed (nvcc -O3 -arch=sm_90a -std=c++17).
.gpu/pg | tee $OUT/pg.jsonl
PG_ITERS=0 ncu --clock-control none --metrics gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_long_scoreboard -k regex:"k1|k2" .gpu/pg > $OUT/ncu_m.txt 2>&1
