#!/bin/bash
# Call 2 (nvidia-h200-x2): DDP scaling with LoraDDPStrategy, the SDXL rank sweep, a profile of our FLUX bf16 step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
python3 -c "import torch,diffusers,peft,lightning,bitsandbytes as b;print(torch.__version__,diffusers.__version__,peft.__version__,lightning.__version__,b.__version__,torch.cuda.device_count())"
run() { echo "== $*" | tee -a $OUT/err.txt; timeout ${T:-150} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r2.jsonl; }
run --quant none --rank 16 --gc 0 --devices 1
run --quant none --rank 16 --gc 0 --devices 2
run --quant nf4 --rank 4 --gc 1 --devices 1
run --quant nf4 --rank 4 --gc 1 --devices 2
S="--family sdxl --opt adafactor --gc 0 --h 1024 --w 1024 --tlen 77"
for r in 1 32 128 256; do run $S --rank $r; done
echo "== ref sdxl r32" | tee -a $OUT/err.txt; timeout 120 python3 ../ref_recipe.py sdxl-bf16 --rank 32 --gc 0 --h 1024 --w 1024 --opt adafactor 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r2.jsonl
run --quant none --rank 16 --gc 0 --steps 3 --profile $OUT/profile_bf16_r16.txt
