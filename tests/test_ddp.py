"""Two processes of Lightning DDP on the CPU (gloo): a fit and a resume through the real command.

Each rank builds its own model; the cache is built once (rank 0's prepare_data, the other waits); the bucket
sampler gives each rank its slice of one global batch per step; checkpoints hold the random state of both ranks.
Two ranks with batch b train the LoRA that one rank with batch 2b trains: the global batch is the same samples, the
noise and timesteps are drawn per sample (not per rank), and DDP averages the gradients of the two halves.

The LoRA alone barely shows a wrong average: AdamW's step ``m / sqrt(v)`` is the same for gradients twice as large but
for its ``eps`` (doubled gradients on the two ranks moved this tiny LoRA by 2e-3 of a tensor's largest value; larger
gradients, less). Its moments show it in full: ``exp_avg`` is linear in the gradients and ``exp_avg_sq`` quadratic, so
the last checkpoint's optimizer state is compared too, each tensor to its own scale. Measured: one rank and two agree
within 2e-6 of each tensor's largest value; doubled gradients are off by 100% (``exp_avg``) and 300% (``exp_avg_sq``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import fit_in_subprocess, run_cli, write_config
from safetensors.torch import load_file


@pytest.mark.subprocess
def test_two_ranks_of_batch_b_train_what_one_rank_of_batch_2b_trains(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    # Square buckets only: every global batch is full (a partial one is kept by 1 rank but cannot be split over 2).
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}
    common = {"trainer.max_steps": 3, "data.max_aspect_ratio": 1.0, "trainer.callbacks": [checkpoint]}
    lora, moments = {}, {}
    for name, devices, batch in (("one", 1, 2), ("two", 2, 1)):
        folder = tmp_path / name
        folder.mkdir()
        strategy = {"trainer.strategy": "ddp"} if devices > 1 else {}
        overrides = {**common, **strategy, "trainer.devices": devices, "data.batch_size": batch}
        config = write_config(folder, tiny_flux_dir, photos_dir, **overrides)
        if devices == 1:  # the reference: in this process (a process start is ~8 s of CPU on CI)
            run_cli(["fit", "--config", str(config)])
        else:  # the ranks: the command, which starts the second one
            run = fit_in_subprocess(config)
            assert run.returncode == 0, run.stderr[-3000:]
        lora[name] = load_file(folder / "run" / "lora" / "lora.safetensors")
        last = torch.load(folder / "run" / "checkpoints" / "last.ckpt", weights_only=True)
        assert last["global_step"] == 3
        moments[name] = last["optimizer_states"][0]["state"]
    assert lora["one"].keys() == lora["two"].keys()
    up = [k for k in lora["one"] if "lora_B" in k or "lora_up" in k]
    assert up and all(lora["one"][k].abs().max() > 0 for k in up)  # B starts at zero: it trained
    for key, value in lora["one"].items():
        torch.testing.assert_close(lora["two"][key], value, rtol=1e-4, atol=1e-6)
    # The gradients themselves, through AdamW's moments (see the module docstring), each to its own scale.
    assert moments["one"].keys() == moments["two"].keys() and moments["one"]
    for index, state in moments["one"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            expected = state[moment]
            assert expected.abs().max() > 0, (index, moment)
            atol = 1e-4 * expected.abs().max().item()
            torch.testing.assert_close(moments["two"][index][moment], expected, rtol=1e-4, atol=atol)


@pytest.mark.subprocess
def test_two_process_ddp_fit_and_resume(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """With offloaded blocks too: each rank streams its own copy of the frozen weights."""
    options = {"trainer.devices": 2, "trainer.strategy": "ddp", "trainer.max_steps": 3, "data.batch_size": 1}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **options, **{"model.offload_blocks": 3})
    first = fit_in_subprocess(config)
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 3 and len(ckpt["rng_states"]) == 2  # both ranks' generators
    assert not torch.equal(ckpt["rng_states"][0]["torch"], ckpt["rng_states"][1]["torch"])
    second = fit_in_subprocess(config, "--ckpt_path", "last", "--trainer.max_steps", "5")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(step 5)" in second.stdout  # resumed at 3, trained to 5
    from lightning_lora.export import read_metadata

    assert read_metadata(tmp_path / "run" / "lora" / "lora.safetensors")["lightning_lora.steps"] == "5"
