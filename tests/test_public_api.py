"""Every name in lightning_lora.__all__ resolves, and importing the package alone loads none of the heavy stack."""

import subprocess
import sys

import pytest

import lightning_lora


def test_every_public_name_resolves() -> None:
    for name in lightning_lora.__all__:
        assert getattr(lightning_lora, name) is not None, name


def test_every_registered_family_is_public_by_its_class_name() -> None:
    """The families come from their registry: a new family is public without an entry in ``lightning_lora``."""
    from lightning_lora.families import FAMILIES

    for cls in FAMILIES.values():
        assert cls.__name__ in lightning_lora.__all__ and getattr(lightning_lora, cls.__name__) is cls
    assert {"LoraModule", "export_lora"} <= set(lightning_lora.__all__)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchFamily'"):
        lightning_lora.NoSuchFamily  # noqa: B018


@pytest.mark.subprocess
def test_import_is_lazy() -> None:
    code = "import sys, lightning_lora; print(any(m in sys.modules for m in ('diffusers', 'lightning', 'peft')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
