#!/bin/bash
# Call 12 (nvidia-h200): grouped Adafactor + LoRA input casts skipped (SDXL eager / compiled beside the reference and
# beside transformers' Adafactor), NF4 r4 ckpt with offload_activations beside the reference, FLUX bf16 r16 compiled
# beside the reference, and a profile of the compiled FLUX step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
python3 -c "import torch,diffusers,peft,lightning,transformers,bitsandbytes as b;print(torch.__version__,diffusers.__version__,peft.__version__,lightning.__version__,transformers.__version__,b.__version__,torch.cuda.get_device_name())" | tee -a $OUT/err.txt
run() { echo "== ours $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 tools/bench.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r12.jsonl; }
ref() { echo "== ref $*" | tee -a $OUT/err.txt; timeout ${T:-120} python3 ../ref_recipe.py "$@" 2>>$OUT/err.txt | grep '^{' | tail -1 | tee -a $OUT/r12.jsonl; }
S="--family sdxl --opt adafactor --rank 32 --h 1024 --w 1024 --tlen 77 --gc 0"
run $S
ref sdxl-bf16 --rank 32 --gc 0 --h 1024 --w 1024 --opt adafactor
run $S --opt adafactor-hf
T=200 run $S --compile 1
N="--quant nf4 --rank 4 --gc 1"
T=160 run $N --offload-act 1 --compile 1
ref flux-nf4 --rank 4 --gc 1 --sdp nocudnn
run $N --offload-act 1
T=150 run --quant none --rank 16 --gc 0 --compile 1
ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
T=150 run --quant none --rank 16 --gc 0 --compile 1 --steps 3 --profile $OUT/profile12_flux_bf16_r16_compiled.txt
