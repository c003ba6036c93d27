"""The planner counts an edit run's control images: their tokens join the image's (a 1024² target with one 1024²
reference is twice the image tokens, for FLUX.1 Kontext, FLUX.2 and Qwen-Image-Edit alike), Qwen-Image-Edit's prompt
grows by the controls' vision tokens, and the plan of a run reads the number of controls from its data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_lora.data.recipe import DataRecipe
from lightning_lora.data.sources import ImageFolder
from lightning_lora.errors import ConfigError
from lightning_lora.families import FAMILIES, Flux, FluxKontext, QwenImageEdit
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan import plan_for

EDIT_FAMILIES = sorted(name for name, cls in FAMILIES.items() if cls.editing.takes_controls)


def _hub_id(family: DiffusionFamily) -> str:
    return next(iter(family.planning.known_denoisers))


@pytest.mark.parametrize("name", EDIT_FAMILIES)
def test_one_control_of_the_targets_size_doubles_the_image_tokens(name: str) -> None:
    family = FAMILIES[name]()
    model = family.denoiser_skeleton(ModelSource(_hub_id(family)))
    args = (model, 1, 1024, 1024, 512)
    plain = family.example_inputs(*args, device="meta", dtype=torch.bfloat16)
    edit = family.example_inputs_with_controls(*args, 1, device="meta", dtype=torch.bfloat16)
    assert edit["hidden_states"].shape[1] == 2 * plain["hidden_states"].shape[1] == 2 * 4096
    if "img_ids" in plain:  # one position per token
        assert len(edit["img_ids"]) == 2 * len(plain["img_ids"])
    else:  # Qwen-Image: one shape per image
        assert edit["img_shapes"][0] == plain["img_shapes"][0] * 2
    text = edit["encoder_hidden_states"].shape[1] - plain["encoder_hidden_states"].shape[1]
    if isinstance(family, QwenImageEdit):
        assert text == family.control_text_tokens() > 100  # the control's vision tokens in the prompt
    else:
        assert text == 0


def test_the_plan_of_an_edit_run_counts_its_controls(tiny_pipeline: Callable[[str], Path]) -> None:
    """``plan_for`` plans the data's most controls per target: more saved activations than the same run without, a
    note saying so; a text-to-image family refuses controls."""
    family = FluxKontext(max_sequence_length=16)  # the image's tokens, not the text's, dominate
    recipe = ModelRecipe(family, ModelSource(str(tiny_pipeline("flux_kontext"))), LoraOptions(rank=4))
    plain = DataRecipe(resolutions=(256,))
    edit = plain.replace(folders=(ImageFolder("after", controls=["before"]),))
    without, with_controls = plan_for(recipe, plain), plan_for(recipe, edit)
    assert edit.controls == 1 and with_controls.activations > 1.5 * without.activations
    assert any("1 control image(s) per target" in note for note in with_controls.notes)
    assert not any("control" in note for note in without.notes)
    flux = recipe.replace(family=Flux(), source=ModelSource(str(tiny_pipeline("flux"))))
    with pytest.raises(ConfigError, match=r"the flux family takes no control images"):
        plan_for(flux, edit)


@pytest.mark.parametrize("name", EDIT_FAMILIES)
def test_the_benchmarks_example_batch_holds_the_tokens_the_planner_counts(name: str) -> None:
    """``example_batch`` with controls (what ``tools/bench.py`` trains on) holds what the planner counts: each
    control's latents of the target's size, and for Qwen-Image-Edit a prompt longer by the controls' vision tokens (an
    edit prompt is cached at its own length, past ``max_sequence_length``)."""
    cls: Any = FAMILIES[name]
    family = cls(max_sequence_length=16)  # every edit family's option
    config = family.planning.known_denoisers[_hub_id(family)]
    plain = family.example_batch(config, 2, 64, 96, 16)
    edit = family.example_batch(config, 2, 64, 96, 16, controls=2 if family.editing.max_controls is None else 1)
    controls = edit["controls"].shape[1]
    assert "controls" not in plain and edit["controls"].shape == (2, controls, *edit["latents"].shape[1:])
    mask = next((k for k in edit if k.endswith("mask")), None)
    if isinstance(family, QwenImageEdit):
        assert mask is not None and edit[mask].sum(1).tolist() == [16 + controls * family.control_text_tokens()] * 2
        assert plain[mask].sum(1).tolist() == [16, 16] and edit["prompt_embeds"].shape[1] > 16 > 0
    else:
        assert all(edit[k].shape == plain[k].shape for k in plain)  # the prompt is the same
