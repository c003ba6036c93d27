A="--config configs/flux_8gb.yaml --sample-steps 4 --steps 4 --warm 2"
timeout -k 5 150 python3 tools/bench.py $A --memory-limit 7.5 > $OUT/r35e_b2_75.json 2> $OUT/r35e_b2_75.err; echo "b2 7.5 rc=$?"
timeout -k 5 80 python3 tools/bench.py $A --memory-limit 7.0 > $OUT/r35e_b2_70.json 2> $OUT/r35e_b2_70.err; echo "b2 7.0 rc=$?"
timeout -k 5 80 python3 tools/bench.py $A --memory-limit 7.0 --batch 1 --accumulate 4 > $OUT/r35e_b1_70.json 2> $OUT/r35e_b1_70.err; echo "b1 7.0 rc=$?"
for f in $OUT/r35e_*.json; do echo $f; tail -1 $f | grep -o '"s_per_step": [0-9.]*\|"peak_alloc_GiB": [0-9.]*\|"peak_reserved_GiB": [0-9.]*\|"sample_peak_GiB": [0-9.]*\|"error": "[^"]\{0,200\}'; done
