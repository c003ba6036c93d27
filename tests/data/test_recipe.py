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


REGULARIZATION = ImageFolder("class", role="regularization", loss_weight=0.5)


@pytest.mark.parametrize(
    ("folders", "trigger", "preservation", "message"),
    [
        ((ImageFolder("me"), REGULARIZATION), None, {}, r"data.images\[1\] \('class'\) has role: regularization"),
        ((ImageFolder("me"),), None, {"mode": "prior"}, r"mode: prior trains regularization images .* but no data"),
        ((ImageFolder("me"),), "sks", {"mode": "dop"}, r"mode: dop has nothing to preserve: no data.images entry has"),
        ((ImageFolder("me"), REGULARIZATION), None, {"mode": "dop", "every_image": True}, r"no trigger is set"),
    ],
)
def test_preservation_is_refused_where_the_folders_give_it_nothing_in_one_line(
    folders: tuple, trigger: str | None, preservation: dict, message: str
) -> None:
    """``model.preservation`` against the folders, where the model is known (``spec``, which ``fit`` checks before
    anything loads): a regularization folder nothing uses, a mode without what it preserves, DOP on every image
    without a trigger to take out (a trigger of a regularization folder does not count)."""
    from lightning_lora.objectives import Preservation

    recipe = DataRecipe(folders=folders, trigger=trigger)
    with pytest.raises(ConfigError, match=message) as refused:
        recipe.spec(Flux(), Preservation(**preservation))
    assert "\n" not in str(refused.value)
    ok = DataRecipe(folders=(ImageFolder("me", trigger="sks"), REGULARIZATION))
    spec = ok.spec(Flux(), Preservation(mode="dop", every_image=True, class_word="person"))
    assert spec.preservation.class_word == "person" and ok.spec(Flux(), Preservation(mode="prior")).preservation.mode
    assert DataRecipe(folders=(ImageFolder("me"),)).spec(Flux()).preservation.mode == "none"


def test_folders_only_for_regularization_and_weighted_validation_folders_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.images: every folder is a regularization folder; add the folder of"):
        DataRecipe(folders=(REGULARIZATION,))
    with pytest.raises(ConfigError, match=r"data.val_images\[0\] \('class'\): a validation folder is evaluated as"):
        DataRecipe(folders=(ImageFolder("me"),), val_folders=(REGULARIZATION,))
    assert DataRecipe(val_folders=(ImageFolder("held", masks="alpha"),)).val_folders[0].masks == "alpha"
