"""NF4 layers inside compiled regions (``NF4(compiled_dequantize=True)``): the weights dequantized with torch operations
are bitsandbytes' own, the compiled graph calls no bitsandbytes kernel, and the backward does not keep a dense copy of
the weights (dev/LOG.md, call 33: bitsandbytes' host time per matmul made ``flux_8gb``'s compiled step host-bound)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_lora.plan.live_bytes import saved_activation_bytes
from lightning_lora.precision import NF4
from lightning_lora.precision.nf4 import nf4_weight

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""The CPU, and a CUDA GPU (bitsandbytes' CUDA kernels, inductor's Triton code) where there is one."""


def _quantized(
    *shapes: tuple[int, int], double_quant: bool = True, compiled_dequantize: bool = True, device: str = "cpu"
) -> nn.Module:
    """Linear layers of these ``(out, in)`` shapes with GELUs between them, quantized to NF4 on ``device``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for out_features, in_features in shapes:
        layers += [nn.Linear(in_features, out_features), nn.GELU()]
    model = nn.Sequential(*layers[:-1])
    NF4(double_quant=double_quant, compiled_dequantize=compiled_dequantize).quantize(model, torch.device(device))
    return model.requires_grad_(False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_weight_is_bitsandbytes_dequantization_bit_for_bit(double_quant: bool, device: str) -> None:
    import bitsandbytes as bnb

    # 96 and 900 blocks of 64: with double quantization the absmaxes' last block of 256 is a partial one.
    model = _quantized((96, 64), (300, 192), (64, 128), double_quant=double_quant, device=device)
    layers = [m for m in model if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 3 and all(layer.weight.quant_state.nested is double_quant for layer in layers)
    for layer in layers:
        assert layer.weight.device.type == device
        expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        if device == "cpu":
            assert torch.equal(nf4_weight(layer.weight, torch.bfloat16), expected.to(torch.bfloat16))
        else:  # CUDA's kernel may fuse the absmax's multiply and add: a float32 rounding at most
            torch.testing.assert_close(nf4_weight(layer.weight, torch.float32), expected.float(), rtol=1e-6, atol=0)


def _calls(model: nn.Module, x: torch.Tensor) -> list[str]:
    """What the graphs Dynamo captures from ``model(x)`` call (functions, methods, modules)."""
    calls: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.extend(str(node.target) for node in gm.graph.nodes if node.op.startswith("call"))
        return gm.forward

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=backend, fullgraph=True)(x)
    return calls


def test_compiled_nf4_layers_call_no_bitsandbytes_kernel_only_when_asked() -> None:
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ours = _calls(_quantized((128, 64), (64, 128)), x)
    theirs = _calls(_quantized((128, 64), (64, 128), compiled_dequantize=False), x)
    assert ours and not any("bitsandbytes" in call for call in ours)
    assert any("bitsandbytes" in call for call in theirs)


def test_the_plugin_dequantizes_with_torch_in_compiled_blocks_by_default() -> None:
    """On since call 34 (BENCHMARKS.md: flux_8gb 1.81-1.91 s per step against 2.21-2.81 with bitsandbytes' kernels, at
    the same peak): ``NF4()``, as the shipped configs name it (``init_args: double_quant: true``), gets it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    NF4(double_quant=True).quantize(model, torch.device("cpu"))
    calls = _calls(model.requires_grad_(False), torch.randn(2, 5, 64, dtype=torch.bfloat16))
    assert calls and not any("bitsandbytes" in call for call in calls)
    assert NF4().options()["compiled_dequantize"] is True


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_nf4_layers_compute_bitsandbytes_result_and_keep_no_dense_weight(device: str) -> None:
    """Inductor on the CPU and on a GPU: the output and the input's gradient are the eager bitsandbytes layers', and
    what the compiled region keeps for its backward is about what the eager one keeps; without the checkpoint around
    the dequantization it kept both dense bf16 weights (675,840 bytes here against 151,552)."""
    model = _quantized((512, 256), (256, 512), device=device)
    x = torch.randn(4, 37, 256, dtype=torch.bfloat16, device=device, requires_grad=True)

    def run(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
        with torch.autocast(device, dtype=torch.bfloat16):
            y = module(x)
            kept, _, _ = saved_activation_bytes(module, {"input": x}, attention="as_run")
        (grad,) = torch.autograd.grad(y.float().square().sum(), x)
        return y, grad, kept

    torch._dynamo.reset()
    y_eager, grad_eager, kept_eager = run(model)
    y_compiled, grad_compiled, kept_compiled = run(torch.compile(model, fullgraph=True))
    if device == "cpu":
        assert torch.equal(y_compiled, y_eager)
    else:  # bitsandbytes' GEMM against inductor's: the same weights, summed in another order
        torch.testing.assert_close(y_compiled, y_eager, rtol=2e-2, atol=2e-2 * y_eager.abs().max().item())
    assert torch.allclose(grad_compiled, grad_eager, rtol=0, atol=1e-2 * grad_eager.abs().max().item())
    dense = 512 * 256 * 2  # one layer's weight in bf16
    assert kept_compiled < kept_eager + dense / 4, (kept_compiled, kept_eager)
