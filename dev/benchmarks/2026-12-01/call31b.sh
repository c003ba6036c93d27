#!/usr/bin/env bash
# Call 31, second command: where does cuDNN's SDPA fail inside FLUX (each case its own process, ~20 s).
P="python3 tools/sdpa_probe.py --model flux --tokens 4096 --backend cudnn --reps 2 --warm 1"
run() { name=$1; shift; echo "== $name: $*"; timeout -k 5 "$T" "$@" > $OUT/$name.out 2>&1; echo "rc=$?"; tail -c 1500 $OUT/$name.out | grep -v Warning; }
T=60
run d1b2 $P --double 1 --single 0 --batch 2
run s1b2 $P --double 0 --single 1 --batch 2
run d1b1 $P --double 1 --single 0 --batch 1
run d1b2fwd $P --double 1 --single 0 --batch 2 --forward-only
run d1b2blocking env CUDA_LAUNCH_BLOCKING=1 $P --double 1 --single 0 --batch 2
T=240
run sanitizer compute-sanitizer --tool memcheck --print-limit 8 $P --double 1 --single 0 --batch 1 --reps 1 --warm 0
T=60
run d1b2nocache env PYTORCH_NO_CUDA_MEMORY_CACHING=1 CUDA_LAUNCH_BLOCKING=1 $P --double 1 --single 0 --batch 2
