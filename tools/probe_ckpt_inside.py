"""Probe (issue 17): every block checkpointed with the checkpoint *inside* each compiled block, for the next GPU call.

Diffusers' gradient checkpointing (``checkpoint_every: 1``) wraps the call of each compiled block, so a step calls each
compiled region twice forward (the forward, then the recomputation in the backward) and once backward: 456 + 228
calls per step of ``flux_8gb`` (BENCHMARKS.md call 34), each with a few milliseconds of host time on a host-bound
step. With ``checkpoint_every: N > 1`` the project already wraps a block's ``forward`` in ``torch.utils.checkpoint``
before compiling it, so dynamo traces the checkpoint and the recomputation runs inside the compiled backward: one
forward call per block. This probe runs ``tools/bench.py`` (same arguments) with ``checkpoint_every: 1`` done that way
for every repeated block (transformer families: their repeated blocks are what diffusers checkpoints), to measure
whether it is faster and keeps the same memory before the product does it by default.

    python tools/probe_ckpt_inside.py --config configs/flux_8gb.yaml --memory-limit 8 --callbacks 0 --steps 6 --warm 3
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402

from lightning_lora import assembly  # noqa: E402
from lightning_lora.offload import repeated_blocks  # noqa: E402
from lightning_lora.recompute import recomputed  # noqa: E402

_original = assembly.apply_gradient_checkpointing


def checkpoint_inside(denoiser, every: int = 1, offload_inputs: bool = False) -> int:  # noqa: ANN001
    """``every=1`` as ``every=N`` does it (each block's forward under the checkpoint, then compiled), for models whose
    repeated blocks are what diffusers checkpoints (not the UNets: diffusers checkpoints their ResNets too)."""
    blocks = repeated_blocks(denoiser)
    if every != 1 or offload_inputs or not blocks or "UNet" in type(denoiser).__name__:
        return _original(denoiser, every, offload_inputs)
    denoiser._lora_input_offloader = None
    for block in blocks:
        block.forward = recomputed(block.forward)  # type: ignore[method-assign]
    return len(blocks)


def main(argv: list[str]) -> None:
    assembly.apply_gradient_checkpointing = checkpoint_inside  # type: ignore[assignment]
    bench.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
