"""The sample images are what a user gets at inference: for every family (FLUX, FLUX.2, SDXL, ...), the image the
SampleImages callback draws at the end of a fit equals the image of a *fresh* diffusers pipeline, loaded from the
model folder, with the exported LoRA file loaded through ``load_lora_weights``, for the same prompt, seed and
settings.

This covers the whole chain at once: cached prompt (and empty-prompt) embeddings vs. the pipeline's own text encoding,
the family's sampling pipeline and scheduler vs. the one ``from_pretrained`` builds, classifier-free guidance
(SDXL's zeroed negative, SD1.5's, Z-Image's and Chroma's empty-prompt negative), distilled guidance (FLUX.1-dev's
and FLUX.2 dev's guidance input), and the LoRA export. The images are compared as
the 8-bit PNGs a user sees; float rounding may move a pixel by one level, a wrong LoRA scale or negative prompt moves
many.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from helpers import count_compiled, graph_count, run_cli, write_config
from PIL import Image

PROMPT = "a photo of sks cat"
SIZE, STEPS, SEED = 32, 3, 11

CASES = {
    # family class, init_args, guidance, fresh-pipeline extra arguments
    "flux": ("Flux", {"max_sequence_length": 16}, 3.5, {"max_sequence_length": 16}),
    "sdxl": ("SDXL", {}, 5.0, {}),
    "sd15": ("SD15", {}, 5.0, {}),
    "zimage": ("ZImage", {}, 4.0, {}),  # CFG (the base model's way): the cached empty prompt is the negative
    # Qwen-Image: true CFG with the empty prompt as the negative; cached embeddings cut back from their padded length
    "qwenimage": ("QwenImage", {"max_sequence_length": 64}, 4.0, {"true_cfg_scale": 4.0, "negative_prompt": ""}),
    # FLUX.2 klein base: CFG with the empty prompt (its pipeline's own negative), every padded text position
    "flux2": ("Flux2", {"max_sequence_length": 64}, 4.0, {"max_sequence_length": 64}),
    # FLUX.2 dev: guidance-distilled, the scale is the transformer's guidance input; Mistral3 captions with the system
    # message (32 of the 64 tokens)
    "flux2_dev": ("Flux2", {"variant": "dev", "max_sequence_length": 64}, 4.0, {"max_sequence_length": 64}),
    # Chroma: true CFG with the empty prompt; the padding masked as a boolean mask (the pipeline's own float mask is a
    # bias, diffusers issue #13619: the fresh pipeline gets the boolean one, as diffusers PR #12263 gave it)
    "chroma": ("Chroma", {"max_sequence_length": 64}, 4.0, {"max_sequence_length": 64}),
}


def chroma_masks_as_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChromaPipeline`` with the text mask it builds kept boolean (diffusers PR #12263, undone by PR #12508)."""
    from diffusers import ChromaPipeline

    original = ChromaPipeline._get_t5_prompt_embeds

    def boolean(self: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = original(self, *args, **kwargs)
        return embeds, mask.bool()

    monkeypatch.setattr(ChromaPipeline, "_get_t5_prompt_embeds", boolean)


@pytest.mark.parametrize("family", list(CASES))
def test_callback_image_equals_fresh_pipeline_with_exported_lora(
    family: str, tmp_path: Path, photos_dir: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import DiffusionPipeline

    if family == "chroma":
        chroma_masks_as_booleans(monkeypatch)

    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    cls, init_args, guidance, extra = CASES[family]
    config = write_config(
        tmp_path,
        model_dir,
        photos_dir,
        **{
            "model.family": {"class_path": f"lightning_lora.families.{cls}", "init_args": init_args},
            "model.lora": {"rank": 4, "alpha": 8, "targets": "attention"},
            "model.optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}},
        },
    )
    data = yaml.safe_load(config.read_text())
    samples = data["trainer"]["callbacks"][1]["init_args"]
    samples.update(prompts=[PROMPT], seed=SEED, steps=STEPS, guidance_scale=guidance, height=SIZE, width=SIZE)
    config.write_text(yaml.safe_dump(data))
    cli = run_cli(["fit", "--config", str(config)])
    step = cli.trainer.global_step
    run = tmp_path / "run"
    callback_image = np.asarray(Image.open(run / "samples" / f"step{step:06d}_00.png").convert("RGB"), dtype=np.int16)

    pipe = DiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)

    def draw() -> np.ndarray:
        image = pipe(
            prompt=PROMPT,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(SEED),
            output_type="pil",
            **extra,
        ).images[0]
        return np.asarray(image, dtype=np.int16)

    base = draw()
    pipe.load_lora_weights(run / "lora" / "lora.safetensors")
    with_lora = draw()

    difference = np.abs(with_lora - callback_image)
    assert difference.max() <= 1, f"{family}: callback image differs from inference by up to {difference.max()} levels"
    # Not vacuous: the trained LoRA visibly changes the image, far beyond the tolerance.
    assert np.abs(with_lora - base).max() >= 8, f"{family}: the LoRA barely changes the image"
    # And the step-0 sample (before training) is the base model's image.
    first = np.asarray(Image.open(run / "samples" / "step000000_00.png").convert("RGB"), dtype=np.int16)
    assert np.abs(first - base).max() <= 1


def test_a_sample_that_runs_out_of_memory_does_not_end_the_run(
    tmp_path: Path,
    tiny_flux_dir: Path,
    photos_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lightning_lora.callbacks import SampleImages
    from lightning_lora.families.flux import Flux

    original, calls = Flux.generate, []

    def generate(self: Flux, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:  # the samples before the first step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Flux, "generate", generate)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2})
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 2  # the run went on
    sampler = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SampleImages))
    assert sampler.skipped == [0]
    assert [p.name for p in sampler.written] == ["step000002_00.png"]  # the end samples were drawn
    assert "out of GPU memory while drawing the samples of step 0" in caplog.text
    assert (tmp_path / "run" / "lora" / "lora.safetensors").exists()


def test_prompts_that_do_not_fit_turn_samples_off_not_the_run(
    tmp_path: Path,
    tiny_flux_dir: Path,
    photos_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lightning_lora.callbacks import SampleImages
    from lightning_lora.data.cache import LatentCache

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")

    monkeypatch.setattr(LatentCache, "text_embeddings", out_of_memory)
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 1})
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 1
    assert next(cb for cb in cli.trainer.callbacks if isinstance(cb, SampleImages)).written == []
    assert "data.text_encoder_quantization" in caplog.text


@pytest.mark.parametrize("compiled", [False, True])
def test_the_samples_and_the_eval_loss_run_compiled_blocks_uncompiled_unless_asked(
    compiled: bool, tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``model.compile_blocks`` a fit's samples and eval loss (forwards without gradients, at the start and the
    end) do not call into the compiled blocks, so they compile no graphs of their own; ``SampleImages(compiled=True)``
    draws through them. Counted with a backend that records every call into a compiled region."""
    from lightning_lora.callbacks import FixedEvalLoss
    from lightning_lora.families.flux import Flux

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    graphs, calls = count_compiled(monkeypatch)
    into_compiled: dict[str, list[int]] = {"samples": [], "eval": []}

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = sum(calls.values())
            result = function(*args, **kwargs)
            into_compiled[name].append(sum(calls.values()) - before)
            return result

        return wrapper

    monkeypatch.setattr(Flux, "generate", counted("samples", Flux.generate))
    monkeypatch.setattr(FixedEvalLoss, "_mean_loss", counted("eval", FixedEvalLoss._mean_loss))
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.compile_blocks": True})
    data = yaml.safe_load(config.read_text())
    if compiled:  # otherwise the default
        data["trainer"]["callbacks"][1]["init_args"]["compiled"] = True
    data["trainer"]["callbacks"].append({"class_path": "lightning_lora.callbacks.FixedEvalLoss"})
    config.write_text(yaml.safe_dump(data))
    torch._dynamo.reset()
    try:
        cli = run_cli(["fit", "--config", str(config)])
    finally:
        torch._dynamo.reset()
    assert cli.trainer.global_step == 2
    assert graph_count(graphs) > 0 and sum(calls.values()) > 0  # the training steps ran the compiled blocks
    assert len(into_compiled["eval"]) == 2 and into_compiled["eval"] == [0, 0]  # at the start and the end
    assert len(into_compiled["samples"]) == 2  # at the start and the end
    if compiled:
        assert all(n > 0 for n in into_compiled["samples"]), into_compiled
    else:
        assert into_compiled["samples"] == [0, 0]
