"""The data recipe: one frozen object made from the ``data:`` options, checked when it is made (and when it is changed),
and what the planner and the callbacks read instead of the data module's attributes."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_lora.data.datamodule import DataOptions, LatentDataModule
from lightning_lora.data.recipe import DataRecipe, data_recipe
from lightning_lora.data.sources import ImageFolder
from lightning_lora.errors import ConfigError
from lightning_lora.families.flux import Flux

RENAMED = {"images": "folders", "resolution": "resolutions", "val_images": "val_folders"}
"""The options whose recipe field holds them in another shape (folders, sizes)."""


def test_every_data_option_is_a_field_of_the_recipe() -> None:
    """An option added to the data module without a recipe field (or the other way round) fails here."""
    options = [p for p in inspect.signature(LatentDataModule.__init__).parameters if p != "self"]
    fields = [f.name for f in dataclasses.fields(DataRecipe)]
    assert sorted(RENAMED.get(o, o) for o in options) == sorted(fields)


def test_the_options_become_one_frozen_recipe(tmp_path: Path) -> None:
    options = DataOptions(images=[str(tmp_path), ImageFolder("b", repeats=2)], resolution=[512, 1024, 512], seed=3)
    recipe = options.recipe
    assert recipe.resolutions == (1024, 512) and recipe.resolution == 1024  # largest first, each once
    assert recipe.folders == (ImageFolder(str(tmp_path)), ImageFolder("b", repeats=2)) and recipe.seed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.batch_size = 4  # type: ignore[misc]
    assert DataRecipe().resolution == 512 and DataRecipe().batch_size == 1  # the options' defaults, no folder
    assert DataRecipe(caption_variants=3).cached_variants == 1 and DataRecipe(shuffle_tags=True).cached_variants == 4
    assert DataRecipe(alpha_background="#102030").background == (16, 32, 48)


@pytest.mark.parametrize(
    ("change", "option"),
    [
        ({"batch_size": 0}, "data.batch_size"),
        ({"resolutions": (0,)}, "data.resolution: 0 "),
        ({"resolutions": ()}, "data.resolution"),
        ({"caption_dropout": 1.0}, "data.caption_dropout"),
        ({"alpha_background": "nope"}, "data.alpha_background"),
        ({"encode_batch_size": 0}, "data.encode_batch_size"),
    ],
)
def test_a_changed_recipe_is_checked_like_a_new_one(change: dict, option: str) -> None:
    """``replace`` (how the planner tries smaller batches and images) refuses what the options refuse."""
    with pytest.raises(ConfigError, match=option):
        DataRecipe().replace(**change)


def test_the_family_checks_run_in_spec() -> None:
    recipe = DataRecipe(resolutions=(1024, 512))
    spec = recipe.spec(Flux())
    assert spec.buckets.resolutions == (1024, 512) and spec.buckets.step == 64 and spec.caption_variants == 1
    with pytest.raises(ConfigError, match="data.resolution"):
        DataRecipe(resolutions=(520,)).spec(Flux())


def test_callbacks_read_the_recipe_of_the_trainers_data(tmp_path: Path) -> None:
    recipe = DataRecipe(resolutions=(768,))
    assert data_recipe(SimpleNamespace(datamodule=SimpleNamespace(recipe=recipe))) is recipe  # type: ignore[arg-type]
    assert data_recipe(SimpleNamespace(datamodule=None)) is None  # type: ignore[arg-type]  # plain data loaders


def test_the_data_module_needs_a_trainer_with_a_model_for_its_cache(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="LoraModule attached"):
        DataOptions(images=str(tmp_path)).cache()
