# Call 1: bench/micro/plaid_gather.cu as first written (k0 = the session-7 kernel,
# k1 = lean variants without the early code load, kg = bare gathers; the kg rows
# other than 128-byte ones gathered some rows twice there and are not used).
.gpu/pg | tee $OUT/pg.jsonl
PG_ITERS=0 ncu --clock-control none --metrics gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,lts__t_requests_srcunit_tex_op_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,smsp__inst_executed.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__d_sectors_fill_sysmem.sum,dram__bytes_read.sum -k regex:"k0|k1|kg" .gpu/pg > $OUT/ncu_m.txt 2>&1
