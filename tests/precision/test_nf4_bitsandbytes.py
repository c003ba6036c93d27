"""What NF4 relies on in bitsandbytes beyond its documented API, checked against the installed release.

:mod:`lightning_lora.precision.nf4` reads and sets, on bitsandbytes' 4-bit layers:

* the quant state of a ``Params4bit`` (``weight.quant_state``): ``absmax``, ``code``, ``shape``, ``blocksize``,
  ``nested``, and with double quantization ``offset`` and ``state2.absmax`` / ``code`` / ``blocksize``, and the packed
  layout of ``weight.data`` (two 4-bit indices per byte, the first in the high nibble), which :func:`nf4_weight`
  dequantizes with torch operations inside compiled blocks;
* ``Params4bit(..., module=layer)._quantize(device)``, the private method that quantizes on a device and links the
  state to the layer (``layer.quant_state``), on a ``Linear4bit`` built on the meta device;
* ``Linear4bit.support_avx512bf16_for_cpu``, switched off so that an eval forward on the CPU does not repack the
  weight into another layout.

pyproject.toml keeps bitsandbytes below the next minor release; these tests tell whether a new release still has all
of it (on the CPU, with dimensions that are multiples of 64: bitsandbytes' CPU path needs them).
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb  # the dev extras install it: not skipped, a release that fails to import fails here
import pytest
import torch
from torch import nn

from lightning_lora.precision.nf4 import nf4_weight, quantize_nf4

CHANGED = f"bitsandbytes {bnb.__version__} changed what lightning_lora/precision/nf4.py reads"

# 320 x 192: 960 blocks of 64, so the double-quantized absmaxes end with a partial block of 256
OUT, IN = 320, 192


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def _theirs(linear: nn.Linear, double_quant: bool) -> Any:
    """``linear`` quantized by bitsandbytes' documented route: a ``Linear4bit`` loaded with its weights, then moved."""
    layer = bnb.nn.Linear4bit(IN, OUT, compute_dtype=torch.bfloat16, compress_statistics=double_quant, quant_type="nf4")
    layer.load_state_dict(linear.state_dict())
    return layer.to("cpu")


def _ours(linear: nn.Linear, double_quant: bool) -> Any:
    model = nn.Sequential(linear)
    assert quantize_nf4(model, [], torch.device("cpu"), torch.bfloat16, double_quant, False, False) == 1
    return model[0]


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_quant_state_we_read_is_bitsandbytes_own_dequantization(double_quant: bool) -> None:
    layer = _theirs(_linear(), double_quant)
    state = layer.weight.quant_state
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == OUT * IN // 2, CHANGED
    assert tuple(state.shape) == (OUT, IN) and state.blocksize == 64 and state.nested is double_quant, CHANGED
    assert state.code.numel() == 16 and state.absmax.numel() == OUT * IN // 64, CHANGED
    if double_quant:
        assert state.state2.code.numel() == 256 and int(state.state2.blocksize) == 256, CHANGED
        assert state.state2.absmax.numel() == -(-OUT * IN // 64 // 256) and torch.as_tensor(state.offset).numel() == 1
    theirs = bnb.functional.dequantize_4bit(layer.weight.data, state)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(nf4_weight(layer.weight, dtype), theirs.to(dtype)), CHANGED


@pytest.mark.parametrize("double_quant", [True, False])
def test_our_quantization_through_the_private_method_is_bitsandbytes_own(double_quant: bool) -> None:
    """``quantize_nf4`` (meta-device layer, ``Params4bit(module=...)._quantize``) stores what bitsandbytes' own
    route stores, links the state to the layer, and computes the same output."""
    linear = _linear()
    ours, theirs = _ours(linear, double_quant), _theirs(linear, double_quant)
    assert issubclass(type(ours), bnb.nn.Linear4bit) and ours.weight.bnb_quantized, CHANGED
    assert ours.quant_state is ours.weight.quant_state, CHANGED
    assert torch.equal(ours.weight.data, theirs.weight.data), CHANGED
    assert torch.equal(ours.weight.quant_state.absmax, theirs.weight.quant_state.absmax), CHANGED
    assert torch.equal(nf4_weight(ours.weight, torch.float32), nf4_weight(theirs.weight, torch.float32))
    x = torch.randn(3, IN)
    assert torch.allclose(ours(x), theirs(x), rtol=0, atol=1e-2), CHANGED


def test_the_cpu_repacking_is_switched_off_by_the_attribute_we_set() -> None:
    """bitsandbytes reads ``support_avx512bf16_for_cpu`` in an eval forward on the CPU without gradients, and repacks
    the weight when it is on (forced on here: this CPU may lack AVX512-BF16): then :func:`nf4_weight` would read a
    layout it does not know. Our layers have it off, so the weight stays as quantized and the output is the
    dequantized weight's."""
    assert "support_avx512bf16_for_cpu" in vars(bnb.nn.Linear4bit(64, 64, quant_type="nf4")), CHANGED
    layer = _ours(_linear(), double_quant=True).eval()
    assert layer.support_avx512bf16_for_cpu is False
    dense = nf4_weight(layer.weight, torch.bfloat16)
    x = torch.randn(3, IN, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(nf4_weight(layer.weight, torch.bfloat16), dense)
        assert torch.allclose(y, nn.functional.linear(x, dense, layer.bias), rtol=0, atol=1e-2)
        layer.support_avx512bf16_for_cpu = True
        layer(x)
    assert layer.weight.shape != (OUT * IN // 2, 1), f"{CHANGED}: the switch no longer controls the CPU repacking"
