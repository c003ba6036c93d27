"""Every name in lightning_lora.__all__ resolves, and importing the package alone loads none of the heavy stack."""

import subprocess
import sys

import pytest

import lightning_lora


def test_every_public_name_resolves() -> None:
    for name in lightning_lora.__all__:
        assert getattr(lightning_lora, name) is not None, name


@pytest.mark.subprocess
def test_import_is_lazy() -> None:
    code = "import sys, lightning_lora; print(any(m in sys.modules for m in ('diffusers', 'lightning', 'peft')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
