"""Run tools/bench.py and the reference recipe (shared/bench/ref_recipe.py) side by side, one process per case.

    python tools/bench_suite.py --ref .bench/ref_recipe.py --out results.jsonl flux-bf16-r16 flux-nf4-r4-gc ...

A case name is ``<family>-<quant>-r<rank>[-gc][-<h>x<w>][-compile]``; each case runs ours, then the reference with
the same shapes (the reference has no FP8-compute mode: its row is skipped). Every run writes one JSON line to
``--out`` (and stdout), including failures, with the exact command that produced it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASE = re.compile(r"^(flux|sdxl)-(bf16|nf4|fp8|fp8c)-r(\d+)((?:-gc)?)((?:-\d+x\d+)?)((?:-compile)?)((?:-adafactor)?)$")


def commands(case: str, ref: str | None, steps: int, warm: int) -> list[tuple[str, list[str]]]:
    m = CASE.match(case)
    if not m:
        raise SystemExit(f"bad case {case!r}: expected e.g. flux-nf4-r4-gc-1024x1024")
    family, quant, rank, gc, size, compile_, adafactor = m.groups()
    h, w = ((512, 768) if family == "flux" else (1024, 1024)) if not size else map(int, size[1:].split("x"))
    ours_quant = {"bf16": "none", "nf4": "nf4", "fp8": "fp8", "fp8c": "fp8_compute"}[quant]
    common = ["--rank", rank, "--gc", "1" if gc else "0", "--h", str(h), "--w", str(w), "--steps", str(steps)]
    common += ["--warm", str(warm)]
    if adafactor:
        common += ["--opt", "adafactor"]
    ours = [sys.executable, str(HERE / "bench.py"), "--family", family, "--quant", ours_quant, *common]
    if compile_:
        ours += ["--compile", "1"]
    runs = [("ours", ours)]
    ref_mode = {"bf16": "bf16", "nf4": "nf4"}.get(quant)  # FP8 rows compare with the bf16 reference
    if ref and ref_mode and not compile_:
        # FLUX's default SDPA crashes in the reference (REFERENCE.md); SDXL's default works and is faster there.
        sdp = ["--sdp", "nocudnn"] if family == "flux" else []
        reference = [sys.executable, ref, f"{family}-{ref_mode}", *common, *sdp]
        runs.append(("ref", reference))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+")
    p.add_argument("--ref", default=None, help="path to ref_recipe.py (omit to run ours only)")
    p.add_argument("--out", default="bench_results.jsonl")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--only", choices=["ours", "ref"], default=None)
    a = p.parse_args()
    with open(a.out, "a") as out:
        for case in a.cases:
            for who, command in commands(case, a.ref, a.steps, a.warm):
                if a.only and who != a.only:
                    continue
                t0 = time.time()
                try:
                    proc = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout)
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                    row = json.loads(lines[-1]) if lines else {"error": proc.stderr[-800:]}
                except subprocess.TimeoutExpired:
                    row = {"error": f"timeout after {a.timeout} s"}
                row.update(case=case, who=who, wall=round(time.time() - t0, 1), command=" ".join(command[1:]))
                line = json.dumps(row)
                print(line, flush=True)
                out.write(line + "\n")
                out.flush()


if __name__ == "__main__":
    main()
