"""Two processes of Lightning DDP on the CPU (gloo): a fit and a resume through the real command.

Each rank builds its own model; the cache is built once (rank 0's prepare_data, the other waits); the bucket
sampler gives each rank its slice of one global batch per step; checkpoints hold the random state of both ranks.
(The equality "2 ranks x b == 1 rank x 2b" of the issue needs per-sample noise that does not depend on the rank
count; the data order part of it is tested in test_buckets.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from test_cli import write_config


def test_two_process_ddp_fit_and_resume(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    config = write_config(
        tmp_path,
        tiny_flux_dir,
        photos_dir,
        **{"trainer.devices": 2, "trainer.strategy": "ddp", "trainer.max_steps": 3, "data.batch_size": 1},
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_lora", "fit", "--config", str(config)]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 3 and len(ckpt["rng_states"]) == 2  # both ranks' generators
    assert not torch.equal(ckpt["rng_states"][0]["torch"], ckpt["rng_states"][1]["torch"])
    second = subprocess.run(
        [*command, "--ckpt_path", "last", "--trainer.max_steps", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(step 5)" in second.stdout  # resumed at 3, trained to 5
    from lightning_lora.export import read_metadata

    assert read_metadata(tmp_path / "run" / "lora" / "lora.safetensors")["lightning_lora.steps"] == "5"
