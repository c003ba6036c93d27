# Call 44's rows 2-3: the same row warm, with one intra-op / OpenMP thread and with the default (one per core).
A="--config configs/sdxl_12gb.yaml --memory-limit 12 --callbacks 0 --steps 6 --warm 3"
OMP_NUM_THREADS=1 timeout 120 python3 tools/bench.py $A --stacks $OUT/stacks44_omp1.txt > $OUT/r44_omp1.json 2> $OUT/r44_omp1.err
timeout 120 python3 tools/bench.py $A --stacks $OUT/stacks44_warm.txt > $OUT/r44_warm.json 2> $OUT/r44_warm.err
