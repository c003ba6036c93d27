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
(d) the fit's LoRA file in each format the family declares loads into a fresh diffusers pipeline with
    ``load_lora_weights`` and gives the trained model's output, and the pipeline's image changes with it (diffusers'
    kohya converter for FLUX is made to read the tiny widths, :mod:`helpers.diffusers_quirks`; it is not used for the
    other families' files).

One fit of ``STEPS`` steps is the reference of (b), (c) and (d); a second one stops at ``STOP`` and resumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_same_run,
    check_fit_lowers_eval_loss,
    denoiser_output,
    diffusers_kohya_reads_flux_widths,
    family_class_path,
    lora_model,
    loss_curve,
    random_inputs,
    resume_config,
    run_cli,
)

from lightning_lora.cli.fit import LoraCLI
from lightning_lora.families import FAMILIES, DiffusionFamily, ModelSource

STEPS, STOP = 8, 3  # 4 photos in batches of 2: the stop is inside the second epoch
PROMPT = "a photo of sks cat"


def resolution(family: DiffusionFamily) -> int:
    """The image side of the contract's runs: 32 pixels, rounded up to what the family's latents need."""
    return math.ceil(32 / family.architecture.latent_divisor) * family.architecture.latent_divisor


def every_preset(family: DiffusionFamily) -> str:
    """LoRA targets: the layers of all the family's presets (one regular expression)."""
    return "|".join(f"(?:{pattern})" for pattern in family.architecture.lora_presets.values())


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
    case: str, family: DiffusionFamily, model_dir: Path, photos_dir: Path, tmp_path_factory: pytest.TempPathFactory
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
        "callbacks": [export],
    }
    a = resume_config(root, model_dir, photos_dir, "a", steps=STEPS, **options)
    cli_a = run_cli(["fit", "--config", str(a)])
    b = resume_config(root, model_dir, photos_dir, "b", steps=STEPS, **options)
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


def test_training_loss_is_finite_and_reaches_every_lora_tensor(family: DiffusionFamily, model_dir: Path) -> None:
    source = ModelSource(str(model_dir), dtype=torch.float32)
    side = resolution(family)
    g = torch.Generator().manual_seed(0)
    pixels = (
        torch.rand(2, 3, side, side + family.architecture.latent_divisor, generator=g) * 2 - 1
    )  # not square: no transposes
    latents = family.encode_images(family.load_vae(source), pixels)
    batch = {"latents": latents, **family.encode_prompts(family.load_text_encoders(source), [PROMPT, ""])}
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


def test_fit_lowers_the_fixed_eval_loss(runs: Runs) -> None:
    assert runs.cli_a.trainer.global_step == STEPS
    check_fit_lowers_eval_loss(runs.cli_a)
    losses = loss_curve(runs.a)
    assert sorted(losses) == list(range(STEPS)) and all(math.isfinite(v) for v in losses.values()), losses


def test_stopped_and_resumed_run_is_exact(runs: Runs) -> None:
    assert runs.cli_b.trainer.global_step == STEPS
    assert_same_run(runs.a, runs.b, after_step=STOP)


def test_exported_files_load_into_a_fresh_pipeline(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import DiffusionPipeline

    from lightning_lora.callbacks import LoraExport

    family, trained = runs.family, runs.cli_a.model.denoiser.eval()
    export = next(cb for cb in runs.cli_a.trainer.callbacks if isinstance(cb, LoraExport))
    files = export.paths(runs.cli_a.trainer, export.name)
    assert sorted(files) == sorted(family.lora_files.formats) and all(f.is_file() for f in files.values())
    inputs = random_inputs(family, trained, 1)
    expected = denoiser_output(trained, inputs)
    side = resolution(family)
    draw = {"prompt": PROMPT, "height": side, "width": side, "num_inference_steps": 2, "output_type": "pt"}

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
        pipe = fresh()
        pipe.load_lora_weights(path)  # as a user does: no .eval() (the run trained with lora dropout 0.1)
        loaded = denoiser_output(getattr(pipe, family.architecture.denoiser_subfolder), inputs)
        torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-4, msg=lambda m, f=fmt: f"{f} file: {m}")
        image = pipe(generator=torch.Generator().manual_seed(0), **draw).images
        assert not torch.allclose(base_image, image, atol=1e-4), f"{fmt}: the LoRA did not change the image"
