#!/bin/bash
# Call 11 (nvidia-h200): text encoders while caching (bf16 / NF4 / FP8, real sizes), and the compiled bf16 row
# between two reference runs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
echo "== bench_text" | tee -a $OUT/err.txt
timeout 170 python3 tools/bench_text.py 2>>$OUT/err.txt | grep '^{' | tee -a $OUT/r11.jsonl
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-110} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r11.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-80} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r11.jsonl; }
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
run --quant none --rank 16 --gc 0 --compile 1 --plan 0
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
