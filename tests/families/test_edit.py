"""The edit families' objective is their pipeline's: FLUX.1 Kontext (``FluxKontextPipeline``), FLUX.2 with a reference
(``Flux2KleinPipeline``), Qwen-Image-Edit and Edit-Plus (``QwenImageEdit(Plus)Pipeline``), on their tiny pipelines.

The independent witness is the pipeline itself, drawing from a prompt and a control image: its first denoising step
(sigma 1, where the noisy latents are the noise) hands the transformer the noise's tokens and the control's, their
positions (``img_ids`` / ``img_shapes``) and the prompt's embeddings, which the pipeline encodes itself (Qwen-Image-Edit
reads the control with the prompt). The family's loss at sigma 1, for the same noise, the control's cached latents
and the cached prompt, must hand the transformer the same inputs, and its loss is that prediction's distance to the
velocity ``noise - x0``, the target's tokens only. The contract test (test_contract.py) covers fitting, exact resume
with controls and the LoRA files in the edit pipelines; test_samples.py the sample images.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import qwen_processor_without_torchvision, small_edit_images
from PIL import Image

from lightning_lora.families import Flux2, FluxKontext, QwenImageEdit, QwenImageEditPlus
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.families.flux import pack_latents

PROMPT = "make the cat red"
SIDE = 64  # FLUX.2's pipelines take references of 64 pixels and more

# The family, its tiny pipeline's registry name, how the pipeline takes the noise as its ``latents``, the pipeline's
# arguments that match the family's options (the text length; Kontext's guidance input as trained, no CFG).
CASES: dict[str, tuple[DiffusionFamily, str, Callable[[torch.Tensor], torch.Tensor], dict[str, Any]]] = {
    "kontext": (
        FluxKontext(max_sequence_length=16, guidance=1.0),
        "flux_kontext",
        pack_latents,
        {"max_sequence_length": 16, "guidance_scale": 1.0},
    ),
    "flux2": (  # the noise patchified, packed by the pipeline; klein base without CFG
        Flux2(max_sequence_length=32),
        "flux2",
        lambda noise: noise,
        {"max_sequence_length": 32, "guidance_scale": 1.0},
    ),
    "qwenimage_edit": (QwenImageEdit(), "qwenimage_edit", pack_latents, {}),  # no negative: no CFG
    "qwenimage_edit_plus": (QwenImageEditPlus(), "qwenimage_edit_plus", pack_latents, {}),
}


def _pixels(image: Image.Image) -> torch.Tensor:
    return torch.tensor(np.asarray(image)).permute(2, 0, 1)[None].float() / 127.5 - 1.0


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_feeds_the_transformer_what_the_pipeline_feeds_it(
    case: str, tiny_pipeline: Callable[[str], Path], photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import DiffusionPipeline

    family, name, as_pipeline_latents, options = CASES[case]
    qwen_processor_without_torchvision(monkeypatch)
    small_edit_images(monkeypatch)  # Qwen-Image-Edit's control at 64² instead of 1024² (SIDE: the same here)
    folder = tiny_pipeline(name)
    pipe: Any = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    photos = sorted(photos_dir.glob("*.png"))
    control = Image.open(photos[0]).convert("RGB").resize((SIDE, SIDE))
    target = Image.open(photos[1]).convert("RGB").resize((SIDE, SIDE))

    calls: list[tuple[dict[str, Any], torch.Tensor]] = []
    transformer = pipe.transformer
    transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True)
    with torch.no_grad():
        x0 = family.encode_images(pipe.vae, _pixels(target))
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
        pipe(
            prompt=PROMPT,
            height=SIDE,
            width=SIDE,
            num_inference_steps=2,  # its first step is at sigma 1: the noisy latents are the noise
            latents=as_pipeline_latents(noise),
            output_type="latent",
            **options,
            **family.control_inputs([control]),
        )
        (theirs, prediction), *_ = calls
        calls.clear()
        controls = family.encode_images(pipe.vae, _pixels(control))[:, None]
        if family.editing.prompt_sees_controls:
            text = family.encode_prompts_with_controls(pipe, [PROMPT], [[control]])
        else:
            text = family.encode_prompts(pipe, [PROMPT])
        batch = {"latents": x0, "controls": controls, **text}
        loss = family.loss(transformer, batch, noise, torch.ones(1))
        (ours, _), *_ = calls

    for key in ("hidden_states", "encoder_hidden_states", "timestep"):
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5, msg=f"{key} differs")
    n = pack_latents(x0).shape[1] if case != "flux2" else x0.shape[2] * x0.shape[3]
    assert ours["hidden_states"].shape[1] == 2 * n  # the control's tokens after the target's
    if "img_ids" in theirs:
        ids = theirs["img_ids"][0] if theirs["img_ids"].dim() == 3 else theirs["img_ids"]
        torch.testing.assert_close(ours["img_ids"].to(ids), ids)
        assert not torch.equal(ids[:n], ids[n:])  # the control has positions of its own
    else:
        assert ours["img_shapes"] == theirs["img_shapes"] and len(theirs["img_shapes"][0]) == 2
    target_tokens = pack_latents(noise - x0) if case != "flux2" else (noise - x0).flatten(2).transpose(1, 2)
    expected = (prediction[:, :n] - target_tokens).pow(2).mean(dim=(1, 2))
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    without = family.loss(transformer, {k: v for k, v in batch.items() if k != "controls"}, noise, torch.ones(1))
    assert not torch.allclose(without, loss)  # the control changes the prediction


def test_qwen_image_edit_reads_one_prompt_with_its_controls(
    tiny_pipeline: Callable[[str], Path], photos_dir: Path
) -> None:
    """Edit-Plus reads several controls in order ("Picture 1", "Picture 2") and a prompt without any; Qwen-Image-Edit
    refuses a prompt without its control (its template holds one image)."""
    family = QwenImageEditPlus()
    encoders = family.load_text_encoders(ModelSource(str(tiny_pipeline("qwenimage_edit_plus")), dtype=torch.float32))
    a, b = (Image.open(p).convert("RGB").resize((SIDE, SIDE)) for p in sorted(photos_dir.glob("*.png"))[:2])
    one = family.encode_prompts_with_controls(encoders, [PROMPT], [[a]])
    two = family.encode_prompts_with_controls(encoders, [PROMPT], [[a, b]])
    swapped = family.encode_prompts_with_controls(encoders, [PROMPT], [[b, a]])
    alone = family.encode_prompts(encoders, [PROMPT])
    lengths = [int(t["prompt_embeds_mask"].sum()) for t in (alone, one, two)]
    assert lengths[0] < lengths[1] < lengths[2]  # each control adds its vision tokens
    assert not torch.allclose(two["prompt_embeds"], swapped["prompt_embeds"])  # the order is read
    with pytest.raises(Exception, match="only with its control image"):
        QwenImageEdit().encode_prompts(encoders, [PROMPT])
