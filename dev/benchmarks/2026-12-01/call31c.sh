#!/usr/bin/env bash
# Call 31, third command: one block of either kind ran with cuDNN (second command); which pair of blocks fails.
P="python3 tools/sdpa_probe.py --model flux --tokens 4096 --backend cudnn --reps 2 --warm 1"
run() { name=$1; shift; echo "== $name: $*"; timeout -k 5 "$T" "$@" > $OUT/$name.out 2>&1; echo "rc=$?"; grep -E '^\{|ERROR|Invalid|at 0x|kernel|Error' $OUT/$name.out | head -30; }
T=60
run d2b2 $P --double 2 --single 0 --batch 2
run s2b2 $P --double 0 --single 2 --batch 2
run d1s1b2 $P --double 1 --single 1 --batch 2
run d2b1 $P --double 2 --single 0 --batch 1
run chain2 python3 tools/sdpa_probe.py --backend cudnn --chain 2
run chain4 python3 tools/sdpa_probe.py --backend cudnn --chain 4 --batch 1 --tokens 4608
run d2b2blocking env CUDA_LAUNCH_BLOCKING=1 $P --double 2 --single 0 --batch 2
T=200
run sanitizer2 compute-sanitizer --tool memcheck --print-limit 6 $P --double 2 --single 0 --batch 1 --reps 1 --warm 0
