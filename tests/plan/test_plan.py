"""The memory planner on CPU: storage arithmetic, the meta-device activation count, and the suggestions (the
``plan`` verb is in tests/cli/test_plan_verb.py).
Its accuracy against measured GPU peaks is in BENCHMARKS.md (tools/bench.py prints both)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.module import LoraModule
from lightning_lora.plan import MemoryPlan, plan_training, weight_bytes
from lightning_lora.plan.estimate import GIB
from lightning_lora.plan.live_bytes import saved_activation_bytes
from lightning_lora.precision import BF16, FP8, NF4


def test_weight_bytes_by_storage_format() -> None:
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.LayerNorm(64))  # 8192 + 128 parameters
    assert weight_bytes(model, BF16()) == (8192 + 128) * 2
    assert weight_bytes(model, FP8()) == 8192 + 64 * 4 + 128 * 2
    nf4 = 8192 / 2 + 8192 / 64 * (1 + 4 / 256) + 128 * 4  # 4-bit codes, 8-bit absmax (+ its fp32 scales), fp32 norm
    assert weight_bytes(model, NF4()) == pytest.approx(nf4)
    plain_nf4 = 8192 / 2 + 8192 / 64 * 4 + 128 * 4
    assert weight_bytes(model, NF4(double_quant=False)) == pytest.approx(plain_nf4)


def test_meta_count_matches_a_real_forward() -> None:
    """The count on the meta device equals the bytes autograd really keeps on the CPU (no attention involved)."""
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    real[0].weight.requires_grad_(False)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    meta[0].weight.requires_grad_(False)
    counted, largest, _ = saved_activation_bytes(meta, {"input": torch.empty(8, 32, device="meta")})
    real_bytes, _, _ = saved_activation_bytes(real, {"input": torch.randn(8, 32)})
    assert counted == real_bytes > 0
    assert largest == 8 * 64 * 4  # the GELU input / Linear output, float32


def test_the_planned_shard_is_what_fsdp2_keeps_on_each_rank(tiny_flux_dir: Path) -> None:
    """``plan_training(shards=N)``: each GPU keeps 1/N of every block (as ``shard_base`` shards them: checked against
    FSDP2's own shards, in one process over a fake process group of 4 ranks), the root unit whole (it stays gathered
    from the forward to its backward) and two whole blocks in flight; the LoRA, its gradients and optimizer state are
    divided by N; the activations are each GPU's own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_lora.model.assembly import build_lora_model
    from lightning_lora.model.offload import repeated_blocks
    from lightning_lora.model.sharding import shard_base
    from lightning_lora.plan.estimate import sharded_weight_bytes

    def frozen_bytes(modules: list[nn.Module]) -> int:
        tensors = {id(p): p for m in modules for p in m.parameters() if not p.requires_grad}
        return sum(getattr(p, "to_local", lambda p=p: p)().numel() * p.element_size() for p in tensors.values())

    module = LoraModule(str(tiny_flux_dir))
    recipe = module.recipe
    model = build_lora_model(recipe)
    blocks = repeated_blocks(model)
    whole_blocks = sorted((frozen_bytes([b]) for b in blocks), reverse=True)
    root = frozen_bytes([model]) - sum(whole_blocks)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        assert shard_base(model, init_device_mesh("cpu", (4,))) == blocks
        local_blocks = frozen_bytes(blocks)
    finally:
        dist.destroy_process_group()
    assert local_blocks < sum(whole_blocks) / 3  # FSDP2 did shard them (a quarter, and a padded row or two)

    skeleton = recipe.family.denoiser_skeleton(recipe.source)
    per_gpu, in_flight = sharded_weight_bytes(skeleton, recipe.precision, 4)
    assert in_flight == whole_blocks[0] + whole_blocks[1]
    assert per_gpu - in_flight - root == pytest.approx(local_blocks, rel=0.02)  # padding: < 2%

    whole, sharded = (plan_training(recipe, 64, 64, 1, 16, shards=n) for n in (1, 4))
    assert sharded.weights == pytest.approx(per_gpu / 2**30) and sharded.weights < whole.weights
    assert sharded.lora == pytest.approx(whole.lora / 4) and sharded.optimizer == pytest.approx(whole.optimizer / 4)
    assert sharded.activations == whole.activations
    assert any("sharded over 4 GPUs" in note for note in sharded.notes)


def test_plan_of_the_tiny_flux(tiny_flux_dir: Path, photos_dir: Path) -> None:
    def plan(**options: object) -> MemoryPlan:
        precision = options.pop("precision", None)
        optimizer = str(options.pop("optimizer", "AdamW"))
        module = LoraModule(str(tiny_flux_dir), **options)  # type: ignore[arg-type]
        if precision is not None:
            module.use_precision(precision)  # type: ignore[arg-type]
        return plan_training(module.recipe, 256, 256, 2, 32, optimizer=optimizer)

    full, checkpointed = plan(), plan(gradient_checkpointing=True)
    assert checkpointed.activations < full.activations
    assert plan(precision=FP8()).weights < full.weights
    from lightning_lora.families.flux import Flux

    assert plan(compile_blocks=True).activations == pytest.approx(
        Flux.planning.compiled_saved_fraction * full.activations
    )
    # Checkpointed blocks keep only their inputs: compiling does not shrink those.
    assert plan(compile_blocks=True, gradient_checkpointing=True).activations == checkpointed.activations
    assert full.lora > 0 and full.optimizer == pytest.approx(2 * full.lora)  # AdamW: two fp32 moments per weight
    assert full.peak_gib == pytest.approx(full.static + full.activations + full.transient + full.overhead)
    # Samples drawn mid-run: the optimizer state stays beside the model (8-bit AdamW: less of it).
    eight_bit = plan(optimizer="AdamW8bit")
    assert 0 < eight_bit.optimizer < full.optimizer
    assert full.sampling_peak - eight_bit.sampling_peak == pytest.approx(full.optimizer - eight_bit.optimizer)


def test_suggestions_try_partial_checkpointing_first(tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's suggestions, fastest first: one block in 3, in 2, then every block, then quantization. Each is
    a new recipe; one the recipe refuses (NF4 with offloading) is left out."""
    from types import SimpleNamespace

    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import search

    def fake_plan(
        recipe: ModelRecipe, datamodule: object, optimizer: str, shards: int = 1, ema_copies: int = 0
    ) -> SimpleNamespace:
        if not recipe.gradient_checkpointing:
            peak = 30.0
        else:
            peak = {1: 20.0, 2: 23.5, 3: 26.0}[recipe.checkpoint_every]
        if type(recipe.precision).__name__ != "BF16":
            peak -= 12.0
        if recipe.offload_activations:
            peak -= 1.0
        if recipe.offload_blocks > 16:
            raise ConfigError("more than the model's 16 repeated blocks")
        peak -= 0.5 * recipe.offload_blocks
        return SimpleNamespace(peak_gib=peak, run_peak=peak)

    monkeypatch.setattr(search, "plan_for", fake_plan)
    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)))
    data = DataRecipe()  # the data options' defaults: 512 pixels, batch 1
    fits = search.fitting_changes(recipe, data, vram=26.0)  # 0.95 x 26 = 24.7: every 2 and every 1 fit, 3 does not
    assert fits[0].startswith("--model.gradient_checkpointing true --model.checkpoint_every 2")
    assert fits[1].startswith("--model.gradient_checkpointing true   ")
    assert fits[2].startswith("--model.gradient_checkpointing true --model.offload_activations true   ")
    assert "(~19.0 GiB)" in fits[2] and "--trainer.plugins lightning_lora.precision.FP8" in fits[3]
    assert not any("checkpoint_every 3" in f for f in fits)
    # The fewest offloaded blocks that fit, without checkpointing: 30 - 0.5 x 12 = 24 <= 24.7 (10 gives 25).
    assert [f.split("   ")[0] for f in fits if "offload_blocks" in f] == ["--model.offload_blocks 12"]
    assert recipe.gradient_checkpointing is False and recipe.offload_blocks == 0  # a recipe never changes
    assert not any("offload_blocks" in f for f in search.fitting_changes(recipe, data, vram=10.0))  # 16: not enough
    # Already offloading: the NF4 alternatives, which the recipe refuses with offloading, are left out.
    offloading = recipe.replace(gradient_checkpointing=True, offload_blocks=4)
    suggested = search.fitting_changes(offloading, data, vram=10.0)
    assert suggested and not any("NF4" in f for f in suggested) and any("precision.FP8" in f for f in suggested)
    partial = recipe.replace(gradient_checkpointing=True, checkpoint_every=3)
    assert search.fitting_changes(partial, data, vram=22.0)[0].startswith("--model.checkpoint_every 1")
    checkpointed = recipe.replace(gradient_checkpointing=True)
    assert search.fitting_changes(checkpointed, data, vram=20.5)[0].startswith("--model.offload_activations true   ")


def _applied(recipe: Any, flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the command-line options ``flags`` set: the recipe's fields (as ``memory_settings`` names them, the base
    format by class name) and the data options."""
    settings, data = recipe.memory_settings(), {}
    for option in flags.split("--")[1:]:
        name, value = option.split()
        section, field = name.split(".")
        if name == "trainer.plugins":
            settings["precision"] = value.rsplit(".", 1)[1]
        elif section == "model":
            settings[field] = {"true": True, "false": False}.get(value, value if not value.isdigit() else int(value))
        else:
            data[field] = int(value)
    return settings, data


@pytest.mark.parametrize(
    "configured",
    [
        {},
        {"gradient_checkpointing": True},
        {"gradient_checkpointing": True, "checkpoint_every": 3},
        {"gradient_checkpointing": True, "offload_activations": True},
        {"offload_blocks": 4},
    ],
)
def test_each_suggestion_writes_exactly_what_it_changes(tiny_flux_dir: Path, configured: dict[str, Any]) -> None:
    """Every alternative the planner tries (and may print) changes something, and its options, applied to the
    configured run, make the recipe it planned: no option repeats the configured value (``--model.checkpoint_every 1``
    on a run that checkpoints every block), none is left out (a run checkpointing one block in 3 that is planned with
    every block checkpointed says ``--model.checkpoint_every 1``), and no two alternatives write the same options."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import search

    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir))).replace(**configured)
    tries = search._candidates(recipe, DataRecipe(resolutions=(1024,), batch_size=2)) + search._faster(recipe)
    assert tries
    for flags, changes, data in tries:
        try:
            planned = recipe.replace(**changes)
        except ConfigError:  # refused (NF4 with offloaded blocks): never suggested
            continue
        assert _applied(recipe, flags) == (planned.memory_settings(), data) and flags != "", flags
        for option in flags.split("--")[1:]:  # each option changes the configured value
            assert _applied(recipe, "--" + option) != _applied(recipe, ""), (option, flags)
    assert len({flags for flags, _, _ in tries}) == len(tries)


def test_a_slower_way_to_the_same_gib_is_not_suggested(tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the sample images set the run's peak, inputs in CPU memory on top of checkpointing every block save
    nothing: the slower of two suggestions at the same GiB on the same base is left out; another base format at the
    same GiB is another choice, kept."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import search

    def fake_plan(
        recipe: ModelRecipe, datamodule: object, optimizer: str, shards: int = 1, ema_copies: int = 0
    ) -> MemoryPlan:
        weights = {"BF16": 12.0, "FP8": 6.0, "NF4": 3.5}[type(recipe.precision).__name__]
        activations = 8.0 if not recipe.gradient_checkpointing else 2.0 - 1.5 * recipe.offload_activations
        # overhead 0: the samples need weights + 3.5 GiB, more than the checkpointed steps (weights + 2 or + 0.5)
        return MemoryPlan(weights, 0.0, 0.0, 0.0, activations, 0.0, overhead=0.0, sampling_peak=weights + 3.5)

    monkeypatch.setattr(search, "plan_for", fake_plan)
    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)))
    fits = [f.split("   ")[0] for f in search.fitting_changes(recipe, DataRecipe(), vram=17.0)]
    fp8, nf4 = ("--trainer.plugins lightning_lora.precision." + name for name in ("FP8", "NF4"))
    assert fits == [
        "--model.gradient_checkpointing true --model.checkpoint_every 3",  # 15.5 GiB: the samples' peak
        fp8,  # 14.0: the steps' peak (6 + 8)
        f"{fp8} --model.gradient_checkpointing true",  # 9.5: the samples'
        nf4,  # 11.5
        f"{nf4} --model.gradient_checkpointing true",  # 7.0
    ]


def test_the_sample_images_must_fit_too(tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose steps fit but whose sample images do not (the decode at full resolution beside the resident base)
    does not fit: ``model.memory: auto`` and ``plan --vram`` pick a change under which both fit."""

    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import search

    def fake_plan(
        recipe: ModelRecipe, datamodule: object, optimizer: str, shards: int = 1, ema_copies: int = 0
    ) -> MemoryPlan:
        weights = 12.0 if type(recipe.precision).__name__ == "BF16" else 6.0
        # overhead 0: the steps need weights + 2 GiB, the samples weights + 3.5 (BF16: 14 and 15.5 GiB)
        return MemoryPlan(weights, 0.0, 0.0, 0.0, 2.0, 0.0, overhead=0.0, sampling_peak=weights + 3.5)

    monkeypatch.setattr(search, "plan_for", fake_plan)
    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)))
    data = DataRecipe()  # the data options' defaults: 512 pixels, batch 1
    chosen = search.choose_for_memory(recipe, data, vram=16.0)  # 15.2 usable: the steps fit, the samples do not
    assert chosen is not None and chosen.changes, chosen  # not "as configured"
    assert chosen.peak_gib <= 15.2
    assert search.fitting_changes(recipe, data, vram=16.0)
    assert search.choose_for_memory(recipe, data, vram=17.0) == search.Fit("", 15.5)  # 16.15 usable: both fit


def test_sdxl_sampling_peak_holds_the_measured_decode_at_1024() -> None:
    """SDXL at 1024x1024 with CFG: the planned sampling peak holds the VAE's weights and the larger of the two
    transients measured on the meta device, the VAE decode (at its first full-resolution group norm: the 256-channel
    bf16 activation, autocast's float32 copy and the float32 output, 2.5 GiB) and the UNet's no-grad forward at batch
    2; and it is within 10% of the sample peak measured on an H200 (configs/sdxl_24gb.yaml: 8.85 GiB, 2026-12-01)."""
    import diffusers

    from lightning_lora.families import SDXL, ModelSource
    from lightning_lora.families.base import build_from_config
    from lightning_lora.families.sdxl import SDXL_VAE
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan.live_bytes import flash_like_attention, peak_bytes

    source = ModelSource("stabilityai/stable-diffusion-xl-base-1.0", dtype=torch.bfloat16)
    recipe = ModelRecipe(SDXL(), source, lora=LoraOptions(rank=32, targets="attention"))
    plan = plan_training(recipe, 256, 256, 1, 77, optimizer="Adafactor", sample_size=(1024, 1024))

    vae: Any = build_from_config(diffusers.AutoencoderKL, SDXL_VAE, torch.bfloat16)
    latents = torch.empty(1, 4, 128, 128, device="meta", dtype=torch.bfloat16)
    with flash_like_attention():
        decode, op = peak_bytes(lambda: vae.decode(latents, return_dict=False)[0], torch.bfloat16)
    assert op == "aten.native_group_norm.default"
    assert decode == pytest.approx(256 * 1024 * 1024 * (2 + 4 + 4), rel=1e-3)
    unet = recipe.family.denoiser_skeleton(source)
    inputs = recipe.family.example_inputs(unet, 2, 1024, 1024, 77, device="meta", dtype=torch.bfloat16)
    with flash_like_attention():
        forward, _ = peak_bytes(lambda: unet(**inputs), torch.bfloat16)
    assert 0 < forward < decode

    vae_weights = sum(p.numel() * 2 for p in vae.parameters())
    static = plan.weights + plan.lora + plan.optimizer + plan.overhead
    assert plan.sampling_peak - static >= (vae_weights + max(decode, forward)) / GIB
    assert plan.sampling_peak == pytest.approx(8.85, rel=0.10)


def test_zimage_samples_are_planned_with_flux_vae_decode() -> None:
    """Z-Image decodes with FLUX.1's VAE: its 1024x1024 sample is planned with that decode measured on the meta device
    (the same 2.5 GiB at the first full-resolution group norm as SDXL's VAE, which has the same widths), not with the
    family's hand estimate, which counted 1 GiB for it."""
    from lightning_lora.families import ModelSource
    from lightning_lora.families.zimage import ZImage
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import sampling_pieces

    source = ModelSource("Tongyi-MAI/Z-Image-Turbo", dtype=torch.bfloat16)
    recipe = ModelRecipe(ZImage(), source, lora=LoraOptions(rank=16, targets="attention"))
    skeleton = recipe.family.denoiser_skeleton(source)
    pieces = sampling_pieces(recipe, skeleton, 1024, 1024, 512)
    assert pieces is not None
    assert pieces.decode == pytest.approx(256 * 1024 * 1024 * (2 + 4 + 4), rel=1e-3)
    assert pieces.total > recipe.family.sampling_bytes(skeleton, 1024, 1024, 512)


def test_sampling_without_a_vae_architecture_uses_the_family_estimate(tiny_flux_dir: Path) -> None:
    """A family that declares no VAE architecture plans sampling with its own ``sampling_bytes``."""
    from lightning_lora.families import Flux, ModelSource
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import sampling_bytes, sampling_pieces

    class NoVae(Flux):
        planning = replace(Flux.planning, vae_architecture=None)

    recipe = ModelRecipe(NoVae(), ModelSource(str(tiny_flux_dir)))
    model = recipe.family.denoiser_skeleton(recipe.source)
    assert sampling_pieces(recipe, model, 64, 64, 8) is None
    assert sampling_bytes(recipe, model, 64, 64, 8) == recipe.family.sampling_bytes(model, 64, 64, 8)
    tiny = ModelRecipe(Flux(), recipe.source)  # the tiny pipeline's own vae/config.json is measured
    pieces = sampling_pieces(tiny, model, 64, 64, 8)
    assert pieces is not None and pieces.decode > 0 and pieces.vae_weights < 1e6


@pytest.mark.parametrize(
    ("family_name", "pretrained", "measured_gib"),
    [("zimage", "Tongyi-MAI/Z-Image-Turbo", 28.52), ("flux2", "black-forest-labs/FLUX.2-klein-base-4B", 19.49)],
)
def test_compiled_blocks_keep_their_familys_measured_share_of_the_eager_saved_tensors(
    family_name: str, pretrained: str, measured_gib: float
) -> None:
    """The planner scales the eager count of compiled blocks by the family's own share, measured on compiled full-width
    blocks on the CPU (dev/probes/saved_share.py), not FLUX.1's. Z-Image 0.5: its blocks keep a float32 copy per
    RMSNorm in the eager forward, which compiling fuses away; FLUX.2 0.80 (0.73 of the eager count as the CPU runs it,
    without autocast and with the q/k norms decomposed). Checked against the H200: bf16, no
    checkpointing, compiled, 1024x1024, text 512, rank 16 `attention`, AdamW peaked at 28.52 GiB (Z-Image, BENCHMARKS.md
    call 30) and 19.49 (FLUX.2 klein base 4B, calls 30 and 31), where FLUX.1's share planned 40.8 and 22.01."""
    from lightning_lora.families import FAMILIES, Flux, ModelSource
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe

    family = FAMILIES[family_name]()
    source = ModelSource(pretrained, dtype=torch.bfloat16)
    recipe = ModelRecipe(family, source, lora=LoraOptions(rank=16, targets="attention"), compile_blocks=True)
    compiled = plan_training(recipe, 1024, 1024, 1, 512, optimizer="AdamW")
    eager = plan_training(recipe.replace(compile_blocks=False), 1024, 1024, 1, 512, optimizer="AdamW")
    assert "planning" in vars(type(family))  # its own facts, its own share
    assert family.planning.compiled_saved_fraction != Flux.planning.compiled_saved_fraction
    assert compiled.activations == pytest.approx(family.planning.compiled_saved_fraction * eager.activations)
    assert abs(compiled.peak_gib - measured_gib) / measured_gib < 0.10, compiled.peak_gib


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)


def test_saved_bytes_count_attention_as_the_fused_kernels_keep_it_unless_asked_to_count_what_runs() -> None:
    """On the meta device PyTorch runs SDPA's math backend, which keeps the whole attention matrix; the planner counts
    what the GPU's fused kernels keep (q, k, v, the output, the log-sum-exp). ``as_run`` counts what actually ran: what
    dev/probes/saved_share.py needs for real tensors on the CPU, whose fused kernel it must not replace."""
    heads, tokens, dim = 2, 512, 8
    q, k, v = (torch.empty(1, heads, tokens, dim, device="meta", requires_grad=True) for _ in range(3))
    fused, _, _ = saved_activation_bytes(_Attention(), {"q": q, "k": k, "v": v})
    ran, _, _ = saved_activation_bytes(_Attention(), {"q": q, "k": k, "v": v}, attention="as_run")
    tensor = heads * tokens * dim * 4
    assert fused == 4 * tensor + heads * tokens * 4  # q, k, v, out and a float32 log-sum-exp per row
    assert ran >= heads * tokens * tokens * 4  # the math backend's attention weights


class _Norms(nn.Module):
    """FLUX's q/k norm (``torch.nn.RMSNorm`` over the head dimension) and its modulation norm (a LayerNorm without
    weights over the width), each on an input that needs gradients."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.rms = nn.RMSNorm(head_dim, dtype=torch.bfloat16)
        self.ln = nn.LayerNorm(heads * head_dim, elementwise_affine=False)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.rms(q).flatten(2) + self.ln(x)


def test_norms_are_counted_as_the_gpu_keeps_them_under_autocast() -> None:
    """On an H200 (torch 2.11, bf16 autocast: dev/benchmarks/2026-12-01/norms33e.txt) ``rms_norm`` keeps its bf16 input
    and a float32 rstd per row (the fused kernel), ``layer_norm`` a float32 copy of its input and a float32 mean and
    rstd per row (autocast's float32 list). The meta device decomposes rms_norm into float32 copies and, without
    autocast, keeps layer_norm's bf16 input: counted so, FLUX.2 klein's single-stream block was 13% over what the GPU
    keeps."""
    rows, heads, head_dim = 4608, 24, 128
    q = torch.empty(1, rows, heads, head_dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    x = torch.empty(1, rows, heads * head_dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with torch.device("meta"):
        norms = _Norms(heads, head_dim)
    counted, _, _ = saved_activation_bytes(norms, {"q": q, "x": x}, autocast=torch.bfloat16)
    rms_norm = rows * heads * head_dim * 2 + rows * heads * 4
    layer_norm = rows * heads * head_dim * 4 + 2 * rows * 4
    assert counted == rms_norm + layer_norm
    ran, _, _ = saved_activation_bytes(norms, {"q": q, "x": x}, attention="as_run")  # what the meta device keeps
    assert ran != counted


def test_flux2_blocks_keep_what_they_kept_on_an_h200() -> None:
    """FLUX.2 klein base 4B's blocks at full width, 1024x1024, text 512, rank 16 `attention`: on an H200 under bf16
    autocast a double-stream block kept 611.6 MiB for its backward and a single-stream block 597.0 (norms33e.txt: the
    difference between models of 1 + 1, 2 + 1 and 1 + 2 blocks). Counted on the meta device as the GPU runs them
    (autocast, the fused rms_norm) both are within 1%; without autocast and with rms_norm decomposed they were 565.9
    (-7.5%) and 676.6 (+13%)."""
    from lightning_lora.families import FAMILIES, ModelSource
    from lightning_lora.families.base import build_from_config
    from lightning_lora.lora import LoraOptions
    from lightning_lora.plan.estimate import add_counted_lora

    family = FAMILIES["flux2"]()
    source = ModelSource("black-forest-labs/FLUX.2-klein-base-4B", dtype=torch.bfloat16)
    real = family.denoiser_config(source, family.denoiser_cls().load_config)

    def saved(double: int, single: int) -> float:
        config = {**real, "num_layers": double, "num_single_layers": single}
        model = build_from_config(family.denoiser_cls(), config, torch.bfloat16, device="meta")
        model.requires_grad_(False)
        add_counted_lora(model, family, LoraOptions(rank=16, targets="attention"), torch.bfloat16)
        model.train()
        inputs = family.example_inputs(model, 1, 1024, 1024, 512, device="meta", dtype=torch.bfloat16)
        return saved_activation_bytes(model, inputs, autocast=torch.bfloat16)[0] / 2**20

    base = saved(1, 1)
    double, single = saved(2, 1) - base, saved(1, 2) - base
    assert single == pytest.approx(597.0, rel=0.01)
    assert double == pytest.approx(611.6, rel=0.01)


def test_flux2_klein_24gb_plans_its_measured_peak() -> None:
    """configs/flux2_klein_24gb.yaml's settings as measured (bf16, eager, one block in 2 checkpointed: it ships with one
    in 3 since, on this plan; rank 16 `attention`, AdamW, 1024x1024, text 512) peaked at 15.82 GiB on an H200 (calls 30
    and 33); planned 17.44 (+10.2%) counted without autocast and with rms_norm decomposed."""
    from lightning_lora.families import FAMILIES, ModelSource
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe

    source = ModelSource("black-forest-labs/FLUX.2-klein-base-4B", dtype=torch.bfloat16)
    recipe = ModelRecipe(
        FAMILIES["flux2"](),
        source,
        lora=LoraOptions(rank=16, targets="attention"),
        gradient_checkpointing=True,
        checkpoint_every=2,
    )
    planned = plan_training(recipe, 1024, 1024, 1, 512, optimizer="AdamW").peak_gib
    assert abs(planned - 15.82) / 15.82 < 0.06, planned


@pytest.mark.parametrize(("batch", "measured_gib"), [(2, 3.72), (8, 9.73)])
def test_sd15_compiled_plan_is_within_ten_percent_of_the_gpu(batch: int, measured_gib: float) -> None:
    """sd15_8gb's settings (bf16, rank 16 ``attention_ff``, 8-bit AdamW, 512², compiled: the transformer blocks, the
    ResNets eager) peaked at 3.72 and 9.73 GiB at batch 2 and 8 on an H100 (dev/LOG.md, call 52g). SDXL's share (the
    UNets', 0.60) plans 8.37 at batch 8, 14% under this."""
    from lightning_lora.families import SD15, ModelSource
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe

    source = ModelSource("stable-diffusion-v1-5/stable-diffusion-v1-5", dtype=torch.bfloat16)
    lora = LoraOptions(rank=16, alpha=8, targets="attention_ff")
    recipe = ModelRecipe(SD15(), source, lora=lora, compile_blocks=True)
    plan = plan_training(recipe, 512, 512, batch, 77, optimizer="AdamW8bit")
    assert SD15.compiling.regions == ()  # what the share was measured with
    assert abs(plan.peak_gib - measured_gib) / measured_gib < 0.10, plan.peak_gib


def test_sdxl_compiled_plan_is_within_ten_percent_of_the_gpu() -> None:
    """sdxl_24gb's settings (bf16, rank 32 ``attention``, Adafactor, 1024², batch 1, compiled: the transformer blocks,
    the ResNets eager) peaked at 10.34 GiB on an H100 (dev/LOG.md, call 53f; 9.65 with the ResNets compiled too)."""
    from lightning_lora.families import SDXL, ModelSource
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe

    source = ModelSource("stabilityai/stable-diffusion-xl-base-1.0", dtype=torch.bfloat16)
    recipe = ModelRecipe(SDXL(), source, lora=LoraOptions(rank=32, alpha=32, targets="attention"), compile_blocks=True)
    plan = plan_training(recipe, 1024, 1024, 1, 77, optimizer="Adafactor")
    assert SDXL.compiling.regions == ()  # what the share was measured with
    assert abs(plan.peak_gib - 10.34) / 10.34 < 0.10, plan.peak_gib


def test_compiled_saved_bytes_between_no_and_every_block_checkpointed() -> None:
    """The pure part: no block checkpointed keeps the compiled share of the eager count, every block checkpointed
    keeps their inputs, and in between the plan only grows as fewer blocks are checkpointed."""
    from lightning_lora.plan import compiled_saved_bytes

    eager, inputs, share = 100.0, 10.0, 0.72
    assert compiled_saved_bytes(eager, eager, inputs, share) == pytest.approx(share * eager)
    assert compiled_saved_bytes(inputs, eager, inputs, share) == pytest.approx(inputs)
    half = compiled_saved_bytes(55.0, eager, inputs, share)  # one block in two: half the blocks at their eager size
    assert half == pytest.approx(share * 55.0 + (1 - share) * 0.5 * inputs)
    kept = [compiled_saved_bytes(s, eager, inputs, share) for s in (10.0, 40.0, 55.0, 70.0, 100.0)]
    assert kept == sorted(kept) and kept[-1] < eager
    assert compiled_saved_bytes(7.0, 7.0, 7.0, share) == 7.0  # nothing to checkpoint


def _flux_recipe(precision: object, rank: int, targets: str, every: int | None) -> object:
    from lightning_lora.families import Flux, ModelSource
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe

    source = ModelSource("black-forest-labs/FLUX.1-dev", dtype=torch.bfloat16)
    return ModelRecipe(
        Flux(),
        source,
        lora=LoraOptions(rank=rank, alpha=rank, targets=targets),
        precision=precision,  # type: ignore[arg-type]
        compile_blocks=True,
        gradient_checkpointing=every is not None,
        checkpoint_every=every or 1,
    )


@pytest.mark.parametrize(
    ("case", "measured_gib"),
    [("flux_h100 batch 4, one block in 2", 65.76), ("flux_4090, one block in 3", 17.00)],
)
def test_compiled_plan_with_one_block_in_n_checkpointed_is_within_ten_percent(case: str, measured_gib: float) -> None:
    """Compiled FLUX with one block in N checkpointed, as the GPU kept it (H100, BENCHMARKS.md): flux_h100's settings
    (bf16, rank 32 ``attention_all``, AdamW, 1024², text 512) at batch 4 with one block in 2, 65.76 GiB (call 53b;
    planned 77.92 before the compiled share was applied to the blocks not checkpointed); flux_4090's (FP8 compute,
    rank 16 ``attention``, 8-bit AdamW, 512², batch 1) with one in 3, 17.00 GiB (call 52f)."""
    from lightning_lora.precision import BF16, FP8Compute

    if case.startswith("flux_h100"):
        recipe = _flux_recipe(BF16(), 32, "attention_all", 2)
        plan = plan_training(recipe, 1024, 1024, 4, 512, optimizer="AdamW")  # type: ignore[arg-type]
    else:
        recipe = _flux_recipe(FP8Compute(), 16, "attention", 3)
        plan = plan_training(recipe, 512, 512, 1, 512, optimizer="AdamW8bit")  # type: ignore[arg-type]
    assert abs(plan.peak_gib - measured_gib) / measured_gib < 0.10, plan.peak_gib


def test_compiled_plan_grows_as_fewer_blocks_are_checkpointed() -> None:
    """Compiled FLUX (bf16, rank 16, 512²): checkpointing one block in N plans less than checkpointing none, and more
    than one in fewer. Before, the blocks not checkpointed were planned at their eager size: one in 4 planned more than
    none."""
    from lightning_lora.precision import BF16

    peaks = [
        plan_training(_flux_recipe(BF16(), 16, "attention", every), 512, 512, 1, 512).peak_gib  # type: ignore[arg-type]
        for every in (1, 2, 4, 8, None)
    ]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks), peaks


def test_the_planner_builds_the_model_once_and_computes_each_op_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes ``plan`` answer in seconds, counted rather than timed: per process, one meta-device build of the
    denoiser and one LoRA injection however many alternatives the search plans (each count runs on a fast copy); one
    forward pass per distinct count, none for what was counted before; and on the meta device the shapes of an op seen
    before with the same arguments are not computed again (FLUX.1's 57 blocks run the same ops: most of a forward
    pass's time was torch's Python shape functions)."""
    from collections import Counter

    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.families.base import DiffusionFamily, ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import choose_for_memory, estimate, live_bytes, plan_for, sampling

    for cache in ("_SKELETONS", "_WITH_LORA", "_COUNTED", "_CACHING"):  # as in a new process
        monkeypatch.setattr(estimate, cache, {})
    monkeypatch.setattr(sampling, "_SAMPLING", {})
    monkeypatch.setattr(live_bytes, "_OUTPUTS", {})
    ops = Counter[str]()
    monkeypatch.setattr(live_bytes, "OPS", ops)
    calls = Counter[str]()

    def spy(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    spy(DiffusionFamily, "denoiser_skeleton")
    spy(estimate, "add_counted_lora")
    spy(estimate, "saved_activation_bytes")
    spy(sampling, "peak_bytes")
    recipe = ModelRecipe(Flux(), ModelSource("black-forest-labs/FLUX.1-dev"), LoraOptions(rank=16))
    data = DataRecipe(resolutions=(512,), batch_size=1)

    plan = plan_for(recipe, data)
    # One build, one LoRA, one training forward pass, the sample's denoiser pass and VAE decode.
    assert calls == {"denoiser_skeleton": 1, "add_counted_lora": 1, "saved_activation_bytes": 1, "peak_bytes": 2}
    assert 0 < 20 * ops["computed"] < ops["remade"], ops  # the first block's ops (and the VAE's few) computed

    # The search: checkpointing one block in 3, in 2, every block, with inputs in CPU memory, then FP8 (the same
    # count as configured: the skeleton is never quantized), which fits a 24 GiB card: four new counts, no new build.
    computed = ops["computed"]
    fit = choose_for_memory(recipe, data, 24)
    assert fit is not None and "FP8" in fit.flags
    assert calls["denoiser_skeleton"] == 1 and calls["add_counted_lora"] == 1
    assert calls["saved_activation_bytes"] == len(estimate._COUNTED) == 5
    assert ops["computed"] - computed < 100  # checkpointing adds a few ops of its own; the blocks' are known

    assert plan_for(recipe, data) == plan  # planned again: nothing counted again
    assert calls["saved_activation_bytes"] == 5 and calls["peak_bytes"] == 2
