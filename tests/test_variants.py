"""LoRA variants (``model.lora.variant``: lora, dora, lokr, loha) through peft: each builds on the bases it supports,
trains only its own tensors (all of them), is counted by the planner as built, and is refused where it cannot work."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import build_model, precision_for, random_inputs, resume_config, run_cli
from safetensors.torch import load_file

from lightning_lora.errors import ConfigError
from lightning_lora.families import Flux
from lightning_lora.families.base import ModelSource
from lightning_lora.lora import VARIANTS, LoraOptions, is_adapter_param, parse_key
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan import plan_training


@pytest.fixture(scope="module")
def flux64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX with widths that are multiples of 64 (what NF4 quantizes)."""
    from lightning_lora.tiny.flux import save_tiny_flux

    return save_tiny_flux(tmp_path_factory.mktemp("models") / "flux64", seed=0, dim64=True)


SUPPORTED = [
    (variant, mode)
    for variant in VARIANTS
    for mode in ("none", "fp8", "nf4")
    if not (variant == "dora" and mode == "fp8") and not (variant in ("lokr", "loha") and mode == "nf4")
]


@pytest.mark.parametrize(("variant", "mode"), SUPPORTED, ids=[f"{v}-{m}" for v, m in SUPPORTED])
def test_each_variant_trains_its_own_tensors(flux64: Path, variant: str, mode: str) -> None:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    family = Flux(max_sequence_length=8)
    lora = LoraOptions(rank=4, variant=variant, targets="all_linear")  # type: ignore[arg-type]
    model = build_model(family, ModelSource(str(flux64), dtype=dtype), lora, precision=precision_for(mode, dtype))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    kinds = {parse_key(n).variant for n in trainable}  # type: ignore[union-attr]
    expected = {"lora": {"LoRA"}, "dora": {"LoRA", "DoRA"}, "lokr": {"LoKr"}, "loha": {"LoHa"}}[variant]
    assert kinds == expected and all(is_adapter_param(n) for n in trainable)
    assert not any(is_adapter_param(n) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.dtype == torch.float32 for p in trainable.values())  # adapters train in float32 on any base
    with torch.no_grad():  # a non-zero update everywhere, so that every adapter tensor gets a gradient
        for p in trainable.values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    inputs = random_inputs(family, model, 1, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "none"):
        model(**inputs)[0].float().square().mean().backward()
    missing = [n for n, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing[:3]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_planner_counts_the_variant_as_built(flux64: Path, variant: str) -> None:
    lora = LoraOptions(rank=4, variant=variant)  # type: ignore[arg-type]
    source = ModelSource(str(flux64), dtype=torch.float32)
    recipe = ModelRecipe(Flux(max_sequence_length=8), source, lora, precision_for("none", torch.float32))
    built = sum(p.numel() for p in build_model(recipe.family, recipe.source, lora).parameters() if p.requires_grad)
    plan = plan_training(recipe, 64, 64, 1, 8)
    assert plan.lora * 2**30 / 4 == pytest.approx(built)


@pytest.mark.parametrize(
    ("lora", "mode", "match"),
    [
        ({"variant": "dora"}, "fp8", "variant: dora .* float8"),
        ({"variant": "lokr"}, "nf4", "variant: lokr .* NF4"),
        ({"variant": "loha"}, "nf4", "variant: loha .* NF4"),
        ({"variant": "lokr", "dropout": 0.1}, "none", "model.lora.dropout: 0.1 drops LoRA inputs"),
        ({"variant": "lohaa"}, "none", "model.lora.variant: 'lohaa' is not one of"),
    ],
)
def test_what_cannot_work_is_refused_before_loading(lora: dict, mode: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        options = LoraOptions(**lora)
        ModelRecipe(Flux(), ModelSource("black-forest-labs/FLUX.1-dev"), options, precision_for(mode))


@pytest.mark.parametrize("variant", ["dora", "lokr", "loha"])
def test_each_variant_fits_samples_and_resumes_exactly(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, variant: str
) -> None:
    """Through the command: a run of each variant that stops at step 2 and resumes ends with the same LoRA files, bit
    for bit, as one that never stopped; both draw sample images; the kohya file holds the variant's own tensors."""
    samples = {
        "class_path": "lightning_lora.callbacks.SampleImages",
        "init_args": {"prompts": ["a photo of sks cat"], "every_n_steps": 0, "steps": 2, "height": 32, "width": 32},
    }
    options = {"model.lora.variant": variant, "model.lora.dropout": 0.0, "callbacks": [samples]}
    # Each run says, before training, which tool will not apply some layers as trained (DoRA in ComfyUI, LoKr / LoHa
    # in diffusers, FLUX's unfused parts in sd-scripts).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = resume_config(tmp_path, tiny_flux_dir, photos_dir, "a", steps=4, **options)
        assert run_cli(["fit", "--config", str(a)]).trainer.global_step == 4
        b = resume_config(tmp_path, tiny_flux_dir, photos_dir, "b", steps=4, **options)
        run_cli(["fit", "--config", str(b), "--trainer.max_steps", "2"])
        assert run_cli(["fit", "--config", str(b), "--ckpt_path", "last"]).trainer.global_step == 4
    said = [str(w.message) for w in caught if str(w.message).startswith("LoraExport: ")]
    assert len(said) >= 3 and all(re.search(r"will not apply \d+ trained layer", m) for m in said), said
    files = sorted(p.name for p in (a.parent / "run" / "lora").glob("*.safetensors"))
    assert "lora.kohya.safetensors" in files and ("lora.safetensors" in files) == (variant == "dora")
    for name in files:
        first, resumed = (load_file(c.parent / "run" / "lora" / name) for c in (a, b))
        assert first.keys() == resumed.keys()
        assert all(torch.equal(first[k], resumed[k]) for k in first), name
    kohya = load_file(a.parent / "run" / "lora" / "lora.kohya.safetensors")
    tensor = {"dora": ".dora_scale", "lokr": ".lokr_w1", "loha": ".hada_w1_a"}[variant]
    assert any(k.endswith(tensor) for k in kohya)
    for config in (a, b):
        assert list((config.parent / "run" / "samples").rglob("*.png"))
