#!/bin/bash
# Call 13 (nvidia-h200): SDXL with the ResNets compiled too, inductor's C++ wrapper (SDXL and FLUX bf16 r16), each
# beside the reference and beside our plain compiled FLUX row.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r13.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r13.jsonl; }
S="--family sdxl --opt adafactor --rank 32 --h 1024 --w 1024 --tlen 77 --gc 0"
T=150 run $S --compile 1
ref sdxl-bf16 --rank 32 --gc 0 --h 1024 --w 1024 --opt adafactor
T=150 run $S --compile 1 --cpp-wrapper 1
T=150 run --quant none --rank 16 --gc 0 --compile 1 --cpp-wrapper 1
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
T=110 run --quant none --rank 16 --gc 0 --compile 1
