#!/bin/bash
# Call 1 (nvidia-h200-x2): DDP scaling 1 vs 2 GPUs (bf16 r16 no-ckpt, NF4 r4 ckpt), then a bare-loop
# diagnosis, the reference and a profile of our bf16 step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
env | grep -E "NCCL_NVLS|MULTICAST|NVSHMEM_DISABLE" 
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,diffusers,peft,lightning,bitsandbytes as b;print(torch.__version__,torch.version.cuda,diffusers.__version__,peft.__version__,lightning.__version__,b.__version__,torch.cuda.device_count())"
N=0
run() { N=$((N+1)); echo "== $*" >&2; timeout ${T:-200} python3 tools/bench.py "$@" 2>$OUT/err_$N.txt | grep '^{' | tail -1 | tee -a $OUT/ddp.jsonl; }
run --quant none --rank 16 --gc 0 --devices 1
run --quant none --rank 16 --gc 0 --devices 2
run --quant nf4 --rank 4 --gc 1 --devices 1
run --quant nf4 --rank 4 --gc 1 --devices 2
run --quant none --rank 16 --gc 0 --loop bare
echo "== ref" >&2; timeout 150 python3 ../ref_recipe.py flux-bf16 --rank 16 --gc 0 --sdp nocudnn 2>$OUT/err_ref.txt | grep '^{' | tail -1 | tee -a $OUT/ddp.jsonl
run --quant none --rank 16 --gc 0 --steps 4 --profile $OUT/profile_bf16_r16.txt
