#!/bin/bash
# Call 8 (nvidia-h200): block offloading (FLUX 1024 bf16 ckpt, FLUX 512x768 bf16 r4 ckpt, SDXL ckpt) beside the
# reference, checkpoint_every 2, SDXL without checkpointing with attention auto (= cuDNN SDPA now) beside the reference.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
python3 -c "import torch,diffusers,peft,lightning,bitsandbytes as b;print(torch.__version__,diffusers.__version__,peft.__version__,lightning.__version__,b.__version__,torch.cuda.get_device_name())" | tee -a $OUT/err.txt
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r8.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r8.jsonl; }
F="--quant none --rank 16 --gc 1 --h 1024 --w 1024"
run $F --offload 12
ref flux-bf16 --rank 16 --gc 1 --h 1024 --w 1024 --sdp nocudnn
run $F --offload 0
run --quant none --rank 4 --gc 1 --offload 8
run --quant none --rank 16 --gc 1 --every 2
S="--family sdxl --opt adafactor --rank 32 --h 1024 --w 1024 --tlen 77"
run $S --gc 1 --offload 12
ref sdxl-bf16 --rank 32 --gc 1 --h 1024 --w 1024 --opt adafactor
run $S --gc 0
ref sdxl-bf16 --rank 32 --gc 0 --h 1024 --w 1024 --opt adafactor
run $S --gc 1 --offload 0
