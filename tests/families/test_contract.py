"""The family contract: what every registered model family must do, checked on its own tiny pipeline.

A family (``lightning_lora.families.base.DiffusionFamily``) is accepted by registering it (a ``name`` of its own, which
puts it in :data:`~lightning_lora.families.base.FAMILIES`) and giving it a tiny random pipeline
(:meth:`~lightning_lora.families.base.DiffusionFamily.save_tiny`). Every test here is parametrized over the registry
(plus the variants that load another pipeline class, :data:`VARIANTS`, each on its own tiny pipeline) and asks the
family object for what differs between families, never the family's name:

* the class path that chooses it in a config (its module and class name);
* the image side (32 pixels, rounded up to a multiple of its ``architecture.latent_divisor``);
* the LoRA targets: every layer of every one of its presets (``architecture.lora_presets``), the convolutions of a LoCon
  preset too;
* the LoRA file formats it writes (``lora_files.formats``);
* the denoiser's inputs (``example_inputs``, the planner's) and its pipeline (``model_index.json``'s class, loaded by
  ``DiffusionPipeline.from_pretrained``).

For each family:

(a) the training loss of a batch encoded by the family itself is finite, one value per sample, and its gradients
    reach every LoRA tensor; the losses a fit logs are finite;
(b) a short fit through the command lowers the fixed evaluation loss;
(c) a run stopped inside an epoch and resumed with ``--ckpt_path last`` ends with the same LoRA, bit for bit, and the
    same loss curve after the stop, as the run that never stopped;
(d) the fit's LoRA file in each format the family declares that says it loads in diffusers (its ``loads_in``; a
    ComfyUI-layout file of Z-Image does not: test_lora_files.py checks each file in every tool) loads into a fresh
    diffusers pipeline with ``load_lora_weights`` and gives the trained model's output, and the pipeline's image
    changes with it (diffusers' kohya converter for FLUX is made to read the tiny widths,
    :mod:`helpers.diffusers_quirks`; it is not used for the other families' files), every trained layer loaded and,
    from a diffusers file, no tensor left over; every file's header (ModelSpec) names the family, so a copy without our
    family entry is read back as this family;
(e) offloaded and checkpointed repeated blocks train the same gradients as the plain model;
(f) each LoRA preset matches layers of the model, and the adapter sits on exactly those;
(g) the text encoders stored in FP8 / NF4 for caching give close embeddings under keys of their own;
(h) a hub id the family knows is checked without a download, fails to load offline with a clear line, and plans as a
    folder of its shipped configs does;
(i) the batch it describes without data (``example_batch``, the benchmark's) is the batch it encodes, key by key;
(j) a mask's weights reach the loss packed as the family packs its latents: the target elements of the masked-out
    latents are exactly where the weights are 0, and the prediction there gets exactly zero gradient;
(k) DOP's target is the adapter-off prediction (the same model with a zero update), computed without gradients, the
    adapter trainable again afterwards, and a loss against it trains the LoRA.
(l) the benchmark (tools/bench.py) can build it with random weights (``random_models()``): a denoiser it knows, tiny
    denoiser and VAE configs that build, the released scheduler.

An edit family (one whose ``editing`` takes control images: FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit) runs all of this
on edit pairs (:func:`lightning_lora.cli.demo.write_edits`: each photo's negative, its control the photo), beside the
photos as text-to-image items where it trains those too: its batches and the fits carry controls (so (c) is exact
resume with controls), its prompts are encoded with them where its prompt encoder sees them, and its pipelines in (d)
draw from a control image.

One fit of ``STEPS`` steps is the reference of (b), (c) and (d); a second one stops at ``STOP`` and resumes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    assert_same_run,
    build_tiny,
    check_fit_lowers_eval_loss,
    denoiser_output,
    diffusers_kohya_reads_flux_widths,
    family_class_path,
    lora_layers,
    lora_model,
    loss_curve,
    qwen_processor_without_torchvision,
    random_inputs,
    resume_config,
    run_cli,
    small_edit_images,
)
from PIL import Image

from lightning_lora.cli.fit import LoraCLI
from lightning_lora.errors import ConfigError
from lightning_lora.families import FAMILIES, DiffusionFamily, ModelSource
from lightning_lora.families.base import build_from_config

STEPS, STOP = 8, 3  # 4 photos in batches of 2: the stop is inside the second epoch
PROMPT = "a photo of sks cat"


def resolution(family: DiffusionFamily) -> int:
    """The image side of the contract's runs: 32 pixels, rounded up to what the family's latents need."""
    return math.ceil(32 / family.architecture.latent_divisor) * family.architecture.latent_divisor


def every_preset(family: DiffusionFamily) -> str:
    """LoRA targets: the layers of all the family's presets (one regular expression)."""
    return "|".join(f"(?:{pattern})" for pattern in family.architecture.lora_presets.values())


def images(family: DiffusionFamily, photos: Path, edits: Path) -> Any:
    """``data.images`` of the contract's runs: the photos; for an edit family the edit pairs too (alone where it
    needs controls for every target)."""
    if not family.editing.takes_controls:
        return str(photos)
    pairs = {"path": str(edits), "controls": [str(photos)]}
    return [pairs] if family.editing.needs_controls else [pairs, str(photos)]


def control_image(photos: Path, side: int) -> Image.Image:
    """The first photo as a ``side x side`` control image (PIL)."""
    first = sorted(photos.glob("*.png"))[0]
    return Image.open(first).convert("RGB").resize((side, side))


@dataclass
class Runs:
    """The contract's fits of one family: ``a`` never stopped, ``b`` stopped at ``STOP`` and resumed."""

    family: DiffusionFamily
    model_dir: Path
    a: Path
    b: Path
    cli_a: LoraCLI
    cli_b: LoraCLI


# The cases: every registered family with its defaults, and each variant that loads another pipeline class (another
# text encoder, other denoiser inputs) with the init_args that choose it and the session fixture of its tiny pipeline.
CASES: dict[str, tuple[str, dict[str, Any]]] = {name: (name, {}) for name in sorted(FAMILIES)}
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "flux2-dev": ("flux2", {"variant": "dev"}, "tiny_flux2_dev_dir"),  # Flux2Pipeline: Mistral3 text, guidance input
}
CASES.update({case: (name, init_args) for case, (name, init_args, _) in VARIANTS.items()})


GROUP_BY = "case"
"""``make test`` hands a case's tests to one process (tests/conftest.py), which trains its ``runs`` once: handed out one
by one, the tests that read them trained them in both processes (~70 s of the suite)."""


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def family(case: str) -> DiffusionFamily:
    name, init_args = CASES[case]
    return FAMILIES[name](**init_args)


@pytest.fixture(scope="module")
def model_dir(case: str, tiny_pipeline: Callable[[str], Path], request: pytest.FixtureRequest) -> Path:
    if case in VARIANTS:
        return Path(request.getfixturevalue(VARIANTS[case][2]))
    return tiny_pipeline(CASES[case][0])


@pytest.fixture(scope="module")
def runs(
    case: str,
    family: DiffusionFamily,
    model_dir: Path,
    photos_dir: Path,
    edits_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Runs:
    root = tmp_path_factory.mktemp(f"contract-{case}")
    export = {
        "class_path": "lightning_lora.callbacks.LoraExport",
        "init_args": {"formats": list(family.lora_files.formats)},
    }
    options = {
        "model.family": {"class_path": family_class_path(family), "init_args": CASES[case][1]},
        "model.lora.targets": every_preset(family),
        "data.resolution": resolution(family),
        "data.images": images(family, photos_dir, edits_dir),
        "callbacks": [export],
    }
    # Checkpoints at the stop (and its multiples) only: the resume reads that one (a checkpoint every step was a fifth
    # of the three fits' time).
    a = resume_config(root, model_dir, photos_dir, "a", steps=STEPS, every=STOP, **options)
    cli_a = run_cli(["fit", "--config", str(a)])
    b = resume_config(root, model_dir, photos_dir, "b", steps=STEPS, every=STOP, **options)
    run_cli(["fit", "--config", str(b), "--trainer.max_steps", str(STOP)])
    cli_b = run_cli(["fit", "--config", str(b), "--ckpt_path", "last"])
    return Runs(family, model_dir, a, b, cli_a, cli_b)


def test_a_cases_tests_go_to_one_process_together(request: pytest.FixtureRequest) -> None:
    """``GROUP_BY``: every test of a case carries that case's ``xdist_group`` (tests/conftest.py), so the process that
    runs them trains its ``runs`` once (tests/test_suite.py checks that the groups reach one process)."""
    here = [item for item in request.session.items if item.path == request.node.path]
    grouped = {
        item.callspec.params["case"]: {m.args[0] for m in item.iter_markers("xdist_group")}  # type: ignore[attr-defined]
        for item in here
        if hasattr(item, "callspec")
    }
    assert grouped and all(groups == {f"test_contract-{case}"} for case, groups in grouped.items()), grouped


def test_the_registry_holds_the_families() -> None:
    """The tests below are parametrized over the registry: an empty one would pass by running nothing."""
    assert FAMILIES and all(FAMILIES[name].name == name for name in FAMILIES)


def test_the_benchmark_can_build_it_with_random_weights(family: DiffusionFamily) -> None:
    """``random_models()``, what tools/bench.py builds for the family without a download: a denoiser the family knows,
    a tiny one (a few of that config's fields changed) and a tiny VAE that both build, and the released scheduler."""
    import diffusers

    models = family.random_models()
    real = family.planning.known_denoisers[models.denoiser]
    vae = family.planning.vae_architecture
    assert vae is not None and set(models.tiny_denoiser) <= set(real), set(models.tiny_denoiser) - set(real)
    for config in (dict(real, **models.tiny_denoiser), dict(vae, **models.tiny_vae)):
        built = build_from_config(getattr(diffusers, config["_class_name"]), config, torch.float32, "meta")
        assert 0 < sum(p.numel() for p in built.parameters()) < 10_000_000, config["_class_name"]
    assert getattr(diffusers, models.scheduler).from_config(models.scheduler_config).config.num_train_timesteps == 1000


@pytest.fixture(scope="module")
def batch(family: DiffusionFamily, model_dir: Path, photos_dir: Path) -> dict[str, torch.Tensor]:
    """Two images (not square: no transposes) and two prompts, encoded by the family itself from its tiny pipeline; an
    edit family's with a control image each (its prompts seen with it where its prompt encoder sees controls)."""
    source = ModelSource(str(model_dir), dtype=torch.float32)
    side, d = resolution(family), family.architecture.latent_divisor
    pixels = torch.rand(2, 3, side, side + d, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae, encoders = family.load_vae(source), family.load_text_encoders(source)
    latents = family.encode_images(vae, pixels)
    if not family.editing.takes_controls:
        return {"latents": latents, **family.encode_prompts(encoders, [PROMPT, ""])}
    control = control_image(photos_dir, side).resize((side + d, side))
    controls = family.encode_images(vae, torch.tensor(np.asarray(control)).permute(2, 0, 1)[None] / 127.5 - 1.0)
    if family.editing.prompt_sees_controls:
        text = family.encode_prompts_with_controls(encoders, [PROMPT, ""], [[control], [control]])
    else:
        text = family.encode_prompts(encoders, [PROMPT, ""])
    return {"latents": latents, "controls": controls.expand(2, -1, -1, -1)[:, None], **text}


def test_training_loss_is_finite_and_reaches_every_lora_tensor(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor]
) -> None:
    g = torch.Generator().manual_seed(0)
    latents = batch["latents"]
    model = lora_model(family, model_dir, every_preset(family), train=True)
    noise, timesteps = family.sample_noise(latents, g), family.sample_timesteps(latents, g)
    losses = family.loss(model, batch, noise, timesteps)
    assert losses.shape == (2,) and torch.isfinite(losses).all(), losses
    losses.mean().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    missing = [n for n, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no finite gradient for {missing[:3]}"
    assert all(p.grad.abs().max() > 0 for n, p in trainable.items() if "lora_B" in n)


def test_checkpointing_recomputes_the_repeated_blocks_as_the_family_says(
    family: DiffusionFamily, model_dir: Path
) -> None:
    """``compiling.checkpoints_only_repeated_blocks``: compiled blocks are checkpointed inside each repeated block
    rather than by diffusers (``assembly.apply_gradient_checkpointing``), the same checkpointing only where diffusers
    recomputes the repeated blocks that run and nothing else. Recorded: the modules diffusers hands its checkpointing
    function, and the repeated blocks that ran (a family's optional blocks, Z-Image's SigLIP refiner, may not run)."""
    from lightning_lora.model.offload import repeated_blocks

    model = family.load_denoiser(ModelSource(str(model_dir), dtype=torch.float32)).train()
    handed: list[int] = []
    ran: list[int] = []

    def record(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        handed.append(id(module))
        return module(*args, **kwargs)

    model.enable_gradient_checkpointing(record)
    for block in repeated_blocks(model):
        block.register_forward_pre_hook(lambda module, args: ran.append(id(module)))
    model(**random_inputs(family, model, 1))
    assert handed and ran
    assert (sorted(handed) == sorted(ran)) is family.compiling.checkpoints_only_repeated_blocks


def test_the_example_batch_has_the_cached_batchs_keys_and_shapes(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor]
) -> None:
    """``example_batch`` (what the benchmark trains on with no data) has every key of a batch the family encodes, each
    of its shape, in its dtype or the cache's bf16, and the family's loss takes it."""
    model = lora_model(family, model_dir, train=True)
    side, d = resolution(family), family.architecture.latent_divisor
    controls = batch["controls"].shape[1] if "controls" in batch else 0
    example = family.example_batch(dict(model.config), 2, side, side + d, family.text_tokens, controls=controls)
    # The length of a prompt seen with its controls is its own and the controls' vision tokens: it is not compared.
    unsized = ("prompt_embeds", "prompt_embeds_mask") if family.editing.prompt_sees_controls else ()
    for key, value in batch.items():
        shape = (lambda t: t.shape[:1] + t.shape[2:]) if key in unsized else (lambda t: t.shape)
        assert key in example and shape(example[key]) == shape(value), (key, example.get(key, value).shape, value.shape)
        assert example[key].dtype in (value.dtype, torch.bfloat16), key
    latents = example["latents"]
    losses = family.loss(model, example, family.sample_noise(latents), family.sample_timesteps(latents))
    assert losses.shape == (2,) and torch.isfinite(losses).all()


def _masked_batch(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``batch`` with a mask of its latents' grid (``loss_mask``: the left half of each row 0, the rest 1, as the cache
    serves a mask with ``unmasked_weight`` 0), and where the mask is 0 (``[B, 1, h, w]``)."""
    latents = batch["latents"]
    out = torch.ones(latents.shape[0], 1, *latents.shape[-2:])
    out[..., : latents.shape[-1] // 2] = 0.0
    return {**batch, "loss_mask": out}, out == 0


def test_a_masked_out_region_gets_exactly_zero_gradient(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family packs the mask as it packs its latents: changing the noise only under the masked-out half changes the
    target exactly where the packed weights are 0; and the loss's gradient with respect to the prediction is exactly 0
    there, not 0 elsewhere. The loss itself is the mean over the weighted elements."""
    from lightning_lora.families import base

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def spy(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        prediction.retain_grad()
        seen.append((prediction, target, weights))
        return masked_mse(prediction, target, weights)

    from lightning_lora.objectives import masked_mse

    monkeypatch.setattr(base, "masked_mse", spy)
    model = lora_model(family, model_dir, every_preset(family), train=True)
    masked, out = _masked_batch(batch)
    x0, g = batch["latents"], torch.Generator().manual_seed(0)
    noise, timesteps = family.sample_noise(x0, g), family.sample_timesteps(x0, g)
    losses = family.loss(model, masked, noise, timesteps)
    losses.sum().backward()
    family.loss(model, masked, noise + out.float(), timesteps)  # other noise under the masked-out half only
    (prediction, target, weights), (_, moved_target, _) = seen
    assert weights.shape == prediction.shape and set(weights.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(moved_target != target, weights == 0)
    assert prediction.grad is not None
    assert torch.all(prediction.grad[weights == 0] == 0)
    assert torch.all(prediction.grad[weights == 1].abs().sum() > 0)
    kept = ((prediction - target).float() ** 2 * weights).flatten(1).sum(1) / weights.flatten(1).sum(1)
    torch.testing.assert_close(losses.detach(), kept.detach())


def test_dop_trains_towards_the_adapter_off_prediction(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor]
) -> None:
    """``adapters_disabled`` gives the prediction of the same model with a zero update (bit for bit), without
    gradients, and leaves the adapter on and trainable; the family's loss against that reference (DOP) for one row of
    the batch is the plain loss for the other row, and its gradients reach the LoRA."""
    import copy

    from lightning_lora.lora import adapters_disabled
    from lightning_lora.objectives import Reference

    model = lora_model(family, model_dir, every_preset(family), train=True)
    x0, g = batch["latents"], torch.Generator().manual_seed(0)
    noise, timesteps = family.sample_noise(x0, g), family.sample_timesteps(x0, g)
    zero = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in zero.named_parameters():
            if "lora_B" in name:
                p.zero_()
        base_prediction = family.predict(zero, batch, noise, timesteps).prediction
        adapted = family.predict(model, batch, noise, timesteps).prediction
    with torch.no_grad(), adapters_disabled(model) as disabled:
        reference = family.predict(model, batch, noise, timesteps).prediction
    assert disabled > 0 and torch.equal(reference, base_prediction) and not torch.equal(adapted, base_prediction)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    plain = family.loss(model, batch, noise, timesteps)
    rows = torch.tensor([1])
    losses = family.loss(model, batch, noise, timesteps, Reference(reference[1:], rows))
    assert losses[0] == plain[0] and losses[1] != plain[1] and losses[1] > 0
    losses[1].backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(grad is not None and torch.isfinite(grad).all() for grad in grads)
    assert any(grad.abs().max() > 0 for grad in grads if grad is not None)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloading_and_checkpointing_train_the_same_gradients(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor], checkpointing: bool
) -> None:
    """``model.offload_blocks`` (every repeated block but the last) and ``gradient_checkpointing`` on the family's
    repeated blocks (``_repeated_blocks``, in the order they run): the gradients of two steps of the family's loss are
    the plain model's, and each offloaded block is copied in once per pass, in the order they run."""
    from lightning_lora.model.offload import repeated_blocks

    x0 = batch["latents"]

    def grads(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
        out = []
        for seed in (1, 3):
            model.zero_grad()
            g = torch.Generator().manual_seed(seed)
            family.loss(model, batch, family.sample_noise(x0, g), family.sample_timesteps(x0, g)).mean().backward()
            out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        return out

    plain = grads(build_tiny(model_dir, 0, checkpointing, family=family))
    offloaded = len(repeated_blocks(lora_model(family, model_dir))) - 1
    model = build_tiny(model_dir, offloaded, checkpointing, family=family)
    for before, after in zip(plain, grads(model), strict=True):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(after[name], grad)
    assert model._lora_offloader.loads == (2 * offloaded - 1) + (2 * offloaded - 2)  # no extra copies


def test_each_preset_adapts_exactly_the_layers_it_names(family: DiffusionFamily, model_dir: Path) -> None:
    """Every LoRA preset (``architecture.lora_presets``) matches layers of the model, and the injected adapter sits on
    exactly the linear and convolution layers it matches, no more."""
    for preset, pattern in family.architecture.lora_presets.items():
        model = lora_model(family, model_dir, preset)
        layers = {n for n, m in model.named_modules() if isinstance(getattr(m, "base_layer", m), _ADAPTABLE)}
        matched = {n for n in layers if re.fullmatch(pattern, n)}
        assert matched and lora_layers(model) == matched, preset


_ADAPTABLE = (torch.nn.Linear, torch.nn.Conv2d)


def test_the_drift_compares_the_adapted_and_the_adapter_off_prediction(
    family: DiffusionFamily, model_dir: Path, batch: dict[str, torch.Tensor]
) -> None:
    """``eval/drift``'s pieces (:mod:`lightning_lora.callbacks.evaluation`) on the family's own batch with one of its
    drift prompts for both samples: the prediction of its loss's one forward, per sample; with the adapter off it is
    the base's (the model without any LoRA), and a non-zero LoRA moves it."""
    from lightning_lora.callbacks.evaluation import denoiser_prediction, with_prompt
    from lightning_lora.lora import adapter_disabled

    # A family whose prompt is read only with its controls has no trigger-free prompt: no drift prompts (FixedEvalLoss
    # refuses given ones in one line); the pieces still hold on its own prompt.
    assert bool(family.drift_prompts) != family.editing.prompt_sees_controls
    assert not any("sks" in p for p in family.drift_prompts)
    text = {k: v[:1] for k, v in batch.items() if k != "latents"}  # the first prompt, as the text cache gives one
    drifted = with_prompt(batch, text)
    assert all(torch.equal(drifted[k][1], batch[k][0]) for k in text)
    x0 = batch["latents"]
    g = torch.Generator().manual_seed(0)
    noise, timesteps = family.sample_noise(x0, g), family.sample_timesteps(x0, g)
    model = lora_model(family, model_dir)
    with torch.no_grad():
        adapted = denoiser_prediction(family, model, drifted, noise, timesteps)
        with adapter_disabled(model):
            base = denoiser_prediction(family, model, drifted, noise, timesteps)
        plain = family.load_denoiser(ModelSource(str(model_dir), dtype=torch.float32)).eval()
        reference = denoiser_prediction(family, plain, drifted, noise, timesteps)
    assert adapted.shape[0] == 2 and adapted.shape == base.shape
    torch.testing.assert_close(base, reference)
    assert (adapted - base).square().reshape(2, -1).mean(dim=1).min() > 0
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)  # the adapter trains again


# NF4's relative error grows with the padded positions the cache keeps: FLUX.2 klein's 512 (its default) give 0.30.
@pytest.mark.parametrize(("mode", "tolerance"), [("fp8", 0.1), ("nf4", 0.35)])
def test_the_text_encoders_in_fp8_and_nf4_for_caching(
    family: DiffusionFamily, model_dir: Path, photos_dir: Path, tmp_path: Path, mode: str, tolerance: float
) -> None:
    """``data.text_encoder_quantization``: every linear layer of the family's text encoders (those its
    ``architecture.text_encoders`` names) that the format stores (NF4: inputs a multiple of 64 wide; the tiny CLIP and
    T5 encoders are narrower) and the encoder does not keep in float32 is stored in FP8 / NF4 while caching, the
    embeddings close to the plain ones, under keys of their own (a prompt seen with a control image where the family's
    prompt encoder sees controls)."""
    import bitsandbytes as bnb

    from lightning_lora.data.buckets import cover
    from lightning_lora.data.cache import ControlImage, LatentCache, file_digest, quantize_text_encoders
    from lightning_lora.precision.fp8 import FP8Linear

    source = ModelSource(str(model_dir), dtype=torch.float32)
    first = sorted(photos_dir.glob("*.png"))[0]
    control = ControlImage(first, file_digest(first), cover(*Image.open(first).size, (32, 32)))
    seen = [(control,)] if family.editing.prompt_sees_controls else None
    white = (255, 255, 255)
    plain = LatentCache(tmp_path, family, source)
    plain.text_embeddings([PROMPT], torch.device("cpu"), seen, white)
    reference = plain.load_text(plain.pair_key(PROMPT, seen[0] if seen else (), white))
    cache = LatentCache(tmp_path, family, source, text_encoder_quantization=mode)
    key = cache.pair_key(PROMPT, seen[0] if seen else (), white)
    assert key != plain.pair_key(PROMPT, seen[0] if seen else (), white)
    encoders = family.load_text_encoders(source)
    components = family.architecture.text_encoders
    swapped = quantize_text_encoders(encoders, components, mode, torch.device("cpu"), torch.float32)
    kind = {"fp8": FP8Linear, "nf4": bnb.nn.Linear4bit}[mode]
    stored = sum(isinstance(m, kind) for c in components for m in getattr(encoders, c).modules())
    assert swapped == stored
    for component in components:
        encoder = getattr(encoders, component)
        kept = getattr(encoder, "_keep_in_fp32_modules", None) or []
        left = [
            name
            for name, m in encoder.named_modules()
            if type(m) is torch.nn.Linear
            and not any(name == k or name.endswith("." + k) for k in kept)
            and not (mode == "nf4" and m.in_features % 64)
        ]
        assert not left, f"{component}: {left[:3]} not stored in {mode}"
    cache.text_embeddings([PROMPT], torch.device("cpu"), seen, white)
    got = cache.load_text(key)
    assert got.keys() == reference.keys()
    for key, value in got.items():
        if not value.is_floating_point():  # masks
            assert torch.equal(value, reference[key]), key
        elif swapped:
            a, b = value.float(), reference[key].float()
            assert not torch.equal(a, b) and (a - b).norm() < tolerance * b.norm(), key


def known_hub_id(family: DiffusionFamily) -> str:
    """A hub id whose architecture the family ships (``planning.known_denoisers``) and that its options accept."""
    for hub_id in family.planning.known_denoisers:
        try:
            family.check_source(ModelSource(hub_id))
        except ConfigError:
            continue
        return hub_id
    raise AssertionError(f"{family.name}: no hub id its options accept among {list(family.planning.known_denoisers)}")


def test_a_hub_id_is_accepted_offline_and_loading_it_fails_clearly(
    family: DiffusionFamily, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id passes ``check_source`` before anything is loaded; offline and not downloaded, loading from it fails
    with one line naming the option, the id and why."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_id = known_hub_id(family)
    with pytest.raises(ConfigError, match=rf"model\.pretrained.*{re.escape(hub_id)}.*offline"):
        family.load_text_encoders(ModelSource(hub_id))


def test_the_hub_model_plans_with_nothing_downloaded_like_its_local_configs(
    family: DiffusionFamily, tmp_path: Path
) -> None:
    """``plan`` on a hub id the family knows reads no file (the real configs ship with the family:
    ``planning.known_denoisers`` and ``known_text_encoders``) and plans as a local folder holding those configs does."""
    from lightning_lora.data.recipe import DataRecipe
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.plan import plan_for

    hub_id = known_hub_id(family)
    folder = tmp_path / "local"
    (folder / family.architecture.denoiser_subfolder).mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": family.pipeline_class}))
    config = family.planning.known_denoisers[hub_id]
    (folder / family.architecture.denoiser_subfolder / "config.json").write_text(json.dumps(config))
    for component, encoder in family.planning.known_text_encoders[hub_id].items():
        (folder / component).mkdir()
        config = {"architectures": [encoder["_class"]], **{k: v for k, v in encoder.items() if k != "_class"}}
        (folder / component / "config.json").write_text(json.dumps(config))
    (folder / "scheduler").mkdir()  # a UNet family reads its noise schedule from a local folder when it is checked
    schedule = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(schedule))
    data = DataRecipe(resolutions=(256,), batch_size=1)  # the size does not matter here; a small one plans faster
    # Without gradient checkpointing: checkpointed, SDXL's plans of the same configs differ by up to 4% of the
    # activations between a hub id and a folder, and from one process to the next (the planner's, seen on main too).
    hub = ModelRecipe(family, ModelSource(hub_id), LoraOptions(rank=8))
    assert plan_for(hub, data) == plan_for(hub.replace(source=ModelSource(str(folder))), data)


def test_fit_lowers_the_fixed_eval_loss(runs: Runs) -> None:
    assert runs.cli_a.trainer.global_step == STEPS
    check_fit_lowers_eval_loss(runs.cli_a)
    losses = loss_curve(runs.a)
    assert sorted(losses) == list(range(STEPS)) and all(math.isfinite(v) for v in losses.values()), losses


def test_stopped_and_resumed_run_is_exact(runs: Runs) -> None:
    assert runs.cli_b.trainer.global_step == STEPS
    assert_same_run(runs.a, runs.b, after_step=STOP)


def test_exported_files_load_into_a_fresh_pipeline(
    runs: Runs, photos_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file, save_file

    from lightning_lora.callbacks import LoraExport
    from lightning_lora.export import _family_from_keys, read_lora_file, read_metadata

    family, trained = runs.family, runs.cli_a.model.denoiser.eval()
    export = next(cb for cb in runs.cli_a.trainer.callbacks if isinstance(cb, LoraExport))
    files = export.paths(runs.cli_a.trainer, export.name)
    assert sorted(files) == sorted(family.lora_files.formats) and all(f.is_file() for f in files.values())
    inputs = random_inputs(family, trained, 1)
    expected = denoiser_output(trained, inputs)
    side = resolution(family)
    draw = {"prompt": PROMPT, "height": side, "width": side, "num_inference_steps": 2, "output_type": "pt"}
    if family.editing.takes_controls:  # an edit pipeline draws from a control (64 pixels: FLUX.2's least)
        qwen_processor_without_torchvision(monkeypatch)
        small_edit_images(monkeypatch)
        draw.update(family.control_inputs([control_image(photos_dir, 64)]))

    def fresh() -> Any:
        pipe = DiffusionPipeline.from_pretrained(runs.model_dir)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    base = fresh()
    base_output = denoiser_output(getattr(base, family.architecture.denoiser_subfolder), inputs)
    base_image = base(generator=torch.Generator().manual_seed(0), **draw).images
    assert (expected - base_output).abs().max() > 1e-3, "the trained LoRA does not change the output"
    diffusers_kohya_reads_flux_widths(monkeypatch)  # the tiny FLUX is narrower than FLUX.1 (no effect on the others)
    for fmt, path in files.items():
        tensors = load_file(path)
        # A file without our family entry (made elsewhere) is told apart by what its header says of the model.
        meta = read_metadata(path)
        assert {k: meta[f"modelspec.{k}"] for k in family.lora_files.modelspec} == dict(family.lora_files.modelspec)
        unnamed = tmp_path / f"unnamed.{fmt}.safetensors"
        save_file(tensors, unnamed, metadata={k: v for k, v in meta.items() if k != "lightning_lora.family"})
        assert type(read_lora_file(unnamed).family) is type(family), fmt
        if "diffusers" not in json.loads(meta["lightning_lora.loads_in"]):
            continue
        pipe = fresh()
        pipe.load_lora_weights(path)  # as a user does: no .eval() (the run trained with lora dropout 0.1)
        denoiser = getattr(pipe, family.architecture.denoiser_subfolder)
        assert lora_layers(denoiser) == lora_layers(trained), f"{fmt}: not every LoRA layer was loaded"
        if fmt == "diffusers":  # every tensor of the file went into the adapter, none left over
            assert sum(".lora_" in n for n, _ in denoiser.named_parameters()) == len(tensors)
            claimed = _family_from_keys(tensors)  # no other family claims its names (but the one it varies)
            assert claimed is None or issubclass(type(family), claimed), claimed
        loaded = denoiser_output(denoiser, inputs)
        torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-4, msg=lambda m, f=fmt: f"{f} file: {m}")
        image = pipe(generator=torch.Generator().manual_seed(0), **draw).images
        assert not torch.allclose(base_image, image, atol=1e-4), f"{fmt}: the LoRA did not change the image"
