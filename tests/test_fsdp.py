"""``trainer.strategy: fsdp`` through the command: a bf16 base sharded over two CPU processes (gloo) with FSDP2
(:class:`lightning_lora.model.parallel.LoraFSDPStrategy`) trains the LoRA that two processes of DDP train, writes
checkpoints in DDP's layout (full LoRA tensors and optimizer state, compared key by key), resumes from them on the DDP
path, and exports the LoRA its checkpoint holds.

Tolerance (measured: the LoRA after 1-5 steps differs from DDP's by at most 5e-6 of each tensor's largest value, the
RNG states are equal): both strategies run the same two processes on the same global batches with the same per-sample
noise and average the two ranks' gradients over gloo (a division by 2 is exact, so the order of dividing and summing
does not matter), and AdamW is elementwise. What differs is where the weights live: FSDP2 computes each block with
parameters unsharded into its all-gather buffer, DDP with its own tensors, and the CPU matrix kernels may block a
product differently for another memory layout: a float32 rounding per product (relative ~1e-7), which AdamW's division
by ``sqrt(v)`` amplifies for a gradient near zero. Hence ``rtol=1e-4, atol=1e-6``, the tolerance of tests/test_ddp.py's
one-rank / two-rank comparison; a wrong average (a missing or doubled division by the world size) or a lost shard would
be off by 1e-2 or more. The checkpoint and the exported file agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fit_in_subprocess, resume_config
from helpers.resume import DDP_RUN_LAYOUT, DDP_RUN_STEPS
from safetensors.torch import load_file

pytestmark = pytest.mark.subprocess

STEPS, STOP = DDP_RUN_STEPS, 3
SAMPLES = {
    "class_path": "lightning_lora.callbacks.SampleImages",
    "init_args": {"prompts": ["a photo of sks cat"], "every_n_steps": 0, "steps": 2, "height": 32, "width": 32},
}
FSDP: dict[str, Any] = {"trainer.strategy": "fsdp", "callbacks": [SAMPLES]}  # samples: every rank draws, in step
LAYOUT: dict[str, Any] = {k: v for k, v in DDP_RUN_LAYOUT.items() if k != "trainer.strategy"}  # 2 processes, batch 1


def run(config: Path, *extra: str) -> str:
    result = fit_in_subprocess(config, *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def state(config: Path, step: int) -> dict[str, Any]:
    """The LoRA tensors, optimizer state and RNG states of the step-``step`` checkpoint of the run of ``config``."""
    ckpt = torch.load(config.parent / "run" / "checkpoints" / f"step{step:04d}.ckpt", weights_only=True)
    assert ckpt["global_step"] == step
    return {"lora": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"], "rng": ckpt["rng_states"]}


def assert_equal_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same LoRA, optimizer state (in the same layout: index keys, whole tensors) and RNG states, within the
    tolerance of the module docstring."""
    rtol, atol = 1e-4, 1e-6
    assert a["lora"].keys() == b["lora"].keys() and a["lora"]
    torch.testing.assert_close(a["lora"], b["lora"], rtol=rtol, atol=atol)
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=rtol, atol=atol)
    assert len(a["rng"]) == len(b["rng"]) == 2
    for rng_a, rng_b in zip(a["rng"], b["rng"], strict=True):  # the same draws: the same generator states
        assert torch.equal(rng_a["torch"], rng_b["torch"])
    for rng_a, rng_b in zip(a["rng"], b["rng"], strict=True):
        assert torch.equal(rng_a["torch"], rng_b["torch"])


@pytest.mark.xdist_group("ddp_run")  # the shared run (tests/conftest.py), made once per process
def test_fsdp_trains_what_ddp_trains_resumes_and_exports_its_checkpoint(
    ddp_run: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    ddp = ddp_run
    root = ddp.parent.parent
    config = resume_config(root, tiny_flux_dir, photos_dir, "fsdp", steps=STEPS, **LAYOUT, **FSDP)
    run(config, "--trainer.max_steps", str(STOP))
    assert_equal_state(state(ddp, STOP), state(config, STOP))
    # The resume reads FSDP's own checkpoint, which holds full tensors in DDP's layout (compared with DDP's above,
    # key by key): a lost optimizer state or RNG state would leave DDP's path by far more than the tolerance.
    out = run(config, "--ckpt_path", "last")
    assert f"(step {STEPS})" in out
    assert_equal_state(state(ddp, STEPS), state(config, STEPS))

    # The exported file holds the checkpoint's LoRA (the same tensors `lightning-lora export` takes from it), and
    # the DDP run's file.
    from lightning_lora.export import checkpoint_lora, export_lora

    exported = load_file(config.parent / "run" / "lora" / "lora.safetensors")
    ckpt = checkpoint_lora(config.parent / "run" / "checkpoints" / f"step{STEPS:04d}.ckpt")
    again = export_lora(
        ckpt.state,
        root / "from_ckpt.safetensors",
        format="diffusers",
        lora=ckpt.lora,
        family=ckpt.family,
        info=ckpt.info,
    )
    expected = load_file(again)
    assert exported.keys() == expected.keys() and exported
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    reference = load_file(ddp.parent / "run" / "lora" / "lora.safetensors")
    torch.testing.assert_close(exported, reference, rtol=1e-4, atol=1e-6)
    assert list((config.parent / "run" / "samples").glob("step000005_*.png"))  # every rank drew; rank 0 wrote


def test_a_quantized_base_is_refused_before_loading(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused in the launching process, before any rank starts (so in-process here)."""
    from lightning_lora.cli import main

    for plugin in ("NF4", "FP8"):
        config = resume_config(
            tmp_path,
            tiny_flux_dir,
            photos_dir,
            plugin,
            steps=2,
            **LAYOUT,
            **{
                "trainer.strategy": "fsdp",
                "trainer.precision": None,
                "trainer.plugins": [
                    {"class_path": f"lightning_lora.precision.{plugin}", "init_args": {"dtype": "fp32"}}
                ],
            },
        )
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err[-3000:]
        assert "trainer.strategy: LoraFSDPStrategy shards the base model's weights" in err
        assert f"trainer.plugins: {plugin} base" in err and "Use trainer.strategy: ddp" in err
        assert not (config.parent / "run" / "checkpoints").exists() and not (tmp_path / "cache").exists()
