#!/bin/bash
# Call 14 (nvidia-h200-x2): issue 7's FLUX table in one call. GPU 0 runs ours, GPU 1 the reference recipe, at the
# same time, in two phases so that no compile (many CPU threads) overlaps a reference timing:
#   phase 1: our eager rows (GPU 0) | the five reference rows (GPU 1)
#   phase 2: our compiled rows (GPU 0) | SDXL checkpointed rows with the grouped Adafactor (GPU 1, memory only)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.bench/pkg HF_HUB_OFFLINE=1
cd .bench/pkg
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $OUT/err.txt
# one process per row, output through a file (a killed run's compile workers cannot hold a pipe open)
one() { local gpu=$1 t=$2 who=$3; shift 3; local f=$OUT/tmp_$gpu.txt
  echo "== gpu$gpu $who $*" >> $OUT/err_$gpu.txt
  if [ "$who" = ours ]; then CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 $t python3 tools/bench.py "$@" > $f 2>>$OUT/err_$gpu.txt
  else CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 $t python3 ../ref_recipe.py "$@" > $f 2>>$OUT/err_$gpu.txt; fi
  echo "{\"gpu\": $gpu, \"who\": \"$who\", \"args\": \"$*\", \"result\": $(grep '^{' $f | tail -1 || true)}" | sed 's/"result": }/"result": null}/' >> $OUT/r14.jsonl; }
(
  one 0 90 ours --quant fp8_compute --rank 16 --gc 0
  one 0 90 ours --quant fp8 --rank 4 --gc 1
  one 0 100 ours --quant none --rank 16 --gc 1 --h 1024 --w 1024 --offload 12
) &
(
  one 1 90 ref flux-nf4 --rank 4 --gc 1 --sdp nocudnn
  one 1 90 ref flux-nf4 --rank 16 --gc 0 --sdp nocudnn
  one 1 90 ref flux-bf16 --rank 16 --gc 0 --sdp nocudnn
  one 1 90 ref flux-bf16 --rank 4 --gc 1 --sdp nocudnn
  one 1 100 ref flux-bf16 --rank 16 --gc 1 --h 1024 --w 1024 --sdp nocudnn
) &
wait
echo "phase 2 $(date +%T)" >> $OUT/err.txt
(
  one 0 120 ours --quant nf4 --rank 4 --gc 1 --offload-act 1 --compile 1
  one 0 100 ours --quant none --rank 16 --gc 0 --compile 1
  one 0 90 ours --quant nf4 --rank 16 --gc 0 --compile 1
) &
(
  S="--family sdxl --opt adafactor --rank 32 --h 1024 --w 1024 --tlen 77 --gc 1"
  one 1 90 ours $S --offload 12
  one 1 90 ours $S --offload-act 1
  one 1 90 ref sdxl-bf16 --rank 32 --gc 1 --h 1024 --w 1024 --opt adafactor
) &
wait
echo "done $(date +%T)" >> $OUT/err.txt
