#!/bin/bash
# Call 9 (nvidia-h200): regional compilation beside the eager reference in one call (bf16 r16, NF4 r4 ckpt),
# CUDA graphs over the compiled blocks (experiment), FP8 storage with offloaded blocks on the GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-150} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r9.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r9.jsonl; }
B="--quant none --rank 16 --gc 0"
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
run $B --compile 1
run $B
run --quant fp8 --rank 4 --gc 1 --offload 8
ref flux-nf4 --rank 4 --gc 1 --sdp nocudnn
run --quant nf4 --rank 4 --gc 1 --compile 1
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
T=200 run $B --compile 1 --compile-mode reduce-overhead
