"""Checks shared by tests/test_sdxl.py and tests/test_sd15.py: a CLI fit, export in both formats, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from helpers import build_model
from safetensors.torch import load_file
from test_cli import run_cli, write_config

from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions

RANK, ALPHA = 4, 8.0


def family_config(
    tmp_path: Path, model_dir: Path, photos: Path, family: str, init_args: dict[str, Any], **overrides: object
) -> Path:
    """tests/test_cli.py's tiny-run config with a UNet family (samples with CFG, 32x32, 3 steps)."""
    config = write_config(
        tmp_path,
        model_dir,
        photos,
        **{"model.family": {"class_path": f"lightning_lora.families.{family}", "init_args": init_args}, **overrides},
    )
    data = yaml.safe_load(config.read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("SampleImages"):
            callback["init_args"].update(guidance_scale=5.0, steps=3)
    config.write_text(yaml.safe_dump(data))
    return config


def lora_model(family: DiffusionFamily, model_dir: Path, targets: str | list[str], seed: int = 0) -> torch.nn.Module:
    """The tiny model of ``family`` with a rank-4, alpha-8 LoRA whose B matrices are random (a fresh LoRA would be a
    no-op)."""
    model = build_model(
        family, ModelSource(str(model_dir), dtype=torch.float32), LoraOptions(rank=RANK, alpha=ALPHA, targets=targets)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def unet_inputs(unet: torch.nn.Module, batch: int = 2) -> dict[str, Any]:
    """Fixed UNet inputs (an 8x8 latent, a text context, and SDXL's added conditions when the UNet has them)."""
    g = torch.Generator().manual_seed(0)
    c = unet.config
    inputs: dict[str, Any] = {
        "sample": torch.randn(batch, c.in_channels, 8, 8, generator=g),
        "timestep": torch.tensor([100, 700][:batch]),
        "encoder_hidden_states": torch.randn(batch, 77, c.cross_attention_dim, generator=g),
    }
    if c.addition_embed_type == "text_time":
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, pooled, generator=g),
            "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]).repeat(batch, 1),
        }
    return inputs


@torch.no_grad()
def unet_output(unet: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return unet(**inputs, return_dict=False)[0]


def lora_layers(unet: torch.nn.Module) -> set[str]:
    return {n for n, m in unet.named_modules() if hasattr(m, "lora_A") and len(getattr(m, "lora_A", {})) > 0}


def check_fit_lowers_eval_loss(cli: Any) -> None:
    from lightning_lora.callbacks import FixedEvalLoss

    evals = next(cb for cb in cli.trainer.callbacks if isinstance(cb, FixedEvalLoss)).history
    assert evals[0][0] == 0 and evals[-1][0] == cli.trainer.global_step
    assert evals[-1][1] < 0.97 * evals[0][1], f"fixed eval loss did not go down: {evals}"


# -- exact resume ---------------------------------------------------------------------------------------------------

STEPS = 6


def resume_config(root: Path, model_dir: Path, photos: Path, family: str, init_args: dict[str, Any], name: str) -> Path:
    folder = root / name
    folder.mkdir()
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": -1},
    }
    config = family_config(
        folder,
        model_dir,
        photos,
        family,
        init_args,
        **{
            "trainer.max_steps": STEPS,
            "trainer.callbacks": [checkpoint],
            "model.lora": {"rank": RANK, "alpha": ALPHA, "targets": "locon", "dropout": 0.1},  # RNG in every step
            "model.scheduler": {
                "class_path": "lightning_lora.schedules.CosineWithWarmup",
                "init_args": {"total_steps": STEPS, "warmup_steps": 2},
            },
        },
    )
    data = yaml.safe_load(config.read_text())
    data["data"]["cache_dir"] = str(root / "cache")
    config.write_text(yaml.safe_dump(data))
    return config


def check_exact_resume(root: Path, model_dir: Path, photos: Path, family: str, init_args: dict[str, Any]) -> None:
    """Stopped at step 3 (inside an epoch: 2 batches per epoch) and resumed: the same LoRA, bit for bit."""
    a = resume_config(root, model_dir, photos, family, init_args, "a")
    assert run_cli(["fit", "--config", str(a)]).trainer.global_step == STEPS
    b = resume_config(root, model_dir, photos, family, init_args, "b")
    run_cli(["fit", "--config", str(b), "--trainer.max_steps", "3"])
    cli = run_cli(["fit", "--config", str(b), "--ckpt_path", "last"])
    assert cli.trainer.global_step == STEPS
    lora_a = load_file(a.parent / "run" / "lora" / "lora.safetensors")
    lora_b = load_file(b.parent / "run" / "lora" / "lora.safetensors")
    assert lora_a.keys() == lora_b.keys() and any(v.ndim == 4 for v in lora_a.values())  # conv LoRA included
    differing = [k for k in lora_a if not torch.equal(lora_a[k], lora_b[k])]
    assert not differing, f"{len(differing)} LoRA tensors differ after resume, e.g. {differing[:2]}"
