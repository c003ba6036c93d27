#!/bin/bash
# Call 3 (nvidia-h200-x2): DDP scaling, interleaved repeats (the machine's timings vary ~10% between runs):
# 1 GPU, 2 GPUs with LoraDDPStrategy, 2 GPUs with Lightning's DDP; 12 timed steps each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
run() { echo "== $*" | tee -a $OUT/err.txt; timeout ${T:-150} python3 tools/bench.py --steps 12 --warm 3 --plan 0 "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r3.jsonl; }
B="--quant none --rank 16 --gc 0"
N="--quant nf4 --rank 4 --gc 1"
for i in 1 2; do
  run $B --devices 1; run $B --devices 2; run $B --devices 2 --strategy lightning-ddp
done
for i in 1 2; do run $N --devices 1; run $N --devices 2; done
