#!/bin/bash
# Call 10 (nvidia-h200): NF4 + regional compile + checkpointing after the bias fix, NF4 rows compiled beside the
# eager reference, and the bf16 compiled row once more beside the reference.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-150} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r10.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r10.jsonl; }
run --quant nf4 --rank 4 --gc 1 --compile 1
ref flux-nf4 --rank 4 --gc 1 --sdp nocudnn
run --quant nf4 --rank 4 --gc 1
run --quant nf4 --rank 16 --gc 0 --compile 1
ref flux-nf4 --rank 16 --gc 0 --sdp nocudnn
run --quant none --rank 16 --gc 0 --compile 1
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
