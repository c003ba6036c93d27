#!/usr/bin/env bash
# Call 31, fourth command: a double block followed by a single block fails with cuDNN (third command). Which kernel,
# and does handing SDPA's backward dO in O's strides avoid it?
P="python3 tools/sdpa_probe.py --model flux --tokens 4096 --backend cudnn --reps 2 --warm 1 --double 1 --single 1"
run() { name=$1; shift; echo "== $name: $*"; timeout -k 5 "$T" "$@" > /tmp/$name.out 2>&1; echo "rc=$?"; grep -E '^\{|ERROR|Invalid|at 0x|kernel|Error|line [0-9]|^  File' /tmp/$name.out | grep -v Warning | tail -40; }
T=60
run d1s1b1 $P --batch 1
run d1s1fwd $P --batch 2 --forward-only
run d1s1fix $P --batch 2 --grad-fix
run d1s1cudnnfix $P --batch 2 --grad-fix --dispatch cudnn
run d1s1blocking env CUDA_LAUNCH_BLOCKING=1 $P --batch 2
run d2s2fix python3 tools/sdpa_probe.py --model flux --tokens 4096 --backend cudnn --reps 3 --warm 1 --double 2 --single 2 --batch 2 --grad-fix
T=200
run sanitizer3 compute-sanitizer --tool memcheck --print-limit 6 $P --batch 2 --reps 1 --warm 0
