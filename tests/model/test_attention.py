"""lightning_lora.model.attention: SDPA's backward is handed the output's gradient in the output's strides (the layout
cuDNN's backward needs; its own copy for mismatched strides read out of bounds in full-size FLUX on an H200,
BENCHMARKS.md call 31). On the CPU: which strides arrive, that nothing else changes, and that compiled blocks trace as
before."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model, count_compiled_graphs, graph_count, nonzero_lora_b, on_device, random_inputs

from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions, trainable_parameters
from lightning_lora.model import attention
from lightning_lora.model.assembly import compile_repeated_blocks


@pytest.fixture
def matching() -> Iterator[None]:
    before = F.scaled_dot_product_attention
    attention.hand_sdpa_matching_gradients(True)
    try:
        yield
    finally:
        # What was there before, not hand_sdpa_matching_gradients(False): a test that replaced PLAIN_SDPA (undone
        # after this teardown) would leave its recording SDPA installed for every later test of the process.
        F.scaled_dot_product_attention = before


def recording_sdpa() -> tuple[Any, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The plain SDPA, recording for each call (its output's strides, the strides of the gradient its backward
    receives)."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    plain = attention.PLAIN_SDPA

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = plain(*args, **kwargs)
        out.register_hook(lambda grad: seen.append((out.stride(), grad.stride())))
        return out

    return recording, seen


def single_stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    """FLUX's single-stream block around its attention: ``[B, S, H, D]`` in, SDPA on ``[B, H, S, D]`` views, the output
    flattened and concatenated with the MLP branch (so its gradient is a slice of a wider one)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return torch.cat([out.transpose(1, 2).flatten(2), mlp], dim=2)


def leaves(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 16, 2, 8)] * 3 + [(2, 16, 32)]
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in shapes]


def gradients(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    single_stream_attention(*inputs).square().sum().backward()
    return [t.grad for t in inputs if t.grad is not None]


def test_the_gradient_reaches_sdpa_in_its_outputs_strides(monkeypatch, matching) -> None:
    recording, seen = recording_sdpa()
    monkeypatch.setattr(attention, "PLAIN_SDPA", recording)  # what the installed wrapper calls
    gradients(leaves())
    [(out_stride, grad_stride)] = seen
    assert grad_stride == out_stride


def test_without_it_the_gradient_arrives_in_another_layout(monkeypatch) -> None:
    """What the fix is for: the concatenation hands SDPA's backward a slice of a wider gradient."""
    recording, seen = recording_sdpa()
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)  # plain SDPA, as called by name
    gradients(leaves())
    [(out_stride, grad_stride)] = seen
    assert grad_stride != out_stride


def test_the_gradients_are_the_same(matching) -> None:
    fixed = gradients(leaves())
    attention.hand_sdpa_matching_gradients(False)
    plain = gradients(leaves())
    assert len(fixed) == len(plain) == 4
    for a, b in zip(fixed, plain, strict=True):
        assert torch.equal(a, b)


def test_a_gradient_already_in_the_layout_is_handed_on_as_it_is() -> None:
    out = torch.randn(2, 3, 4).requires_grad_()
    grad = torch.randn(2, 3, 4)
    passed = attention.OutputGradientInOutputLayout.backward(type("Ctx", (), {"stride": out.stride()})(), grad)
    assert passed is grad
    wide = torch.randn(2, 3, 8)[..., :4]  # a slice: other strides
    copied = attention.OutputGradientInOutputLayout.backward(type("Ctx", (), {"stride": out.stride()})(), wide)
    assert copied.stride() == out.stride() and torch.equal(copied, wide)


def test_without_gradients_sdpa_is_called_as_it_is(matching) -> None:
    q = torch.randn(1, 2, 4, 8)
    assert attention.sdpa_hands_matching_gradients()
    out = F.scaled_dot_product_attention(q, q, q)
    assert out.grad_fn is None and torch.equal(out, attention.PLAIN_SDPA(q, q, q))


def test_compiled_it_traces_in_one_graph_with_the_same_gradients(matching) -> None:
    torch._dynamo.reset()
    counted: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counted.append(len(gm.graph.nodes))
        return gm.forward

    try:
        compiled = torch.compile(single_stream_attention, backend=counting)
        inputs = leaves()
        compiled(*inputs).square().sum().backward()
        assert len(counted) == 1  # no graph break at the wrapper or its autograd function
        expected = leaves()
        single_stream_attention(*expected).square().sum().backward()
        for a, b in zip(inputs, expected, strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad)
    finally:
        torch._dynamo.reset()


def test_flux_blocks_compile_to_as_many_graphs_with_it(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, matching
) -> None:
    """FLUX's 3 block graphs (tests/model/test_assembly.py) stay 3 with the wrapper in every attention."""
    graphs = count_compiled_graphs(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tiny_flux_dir.parent / "compile-cache"))
    family = Flux(max_sequence_length=8)
    torch._dynamo.reset()
    try:
        model = build_model(family, ModelSource(str(tiny_flux_dir), dtype=torch.float32), LoraOptions(rank=2))
        for name in ("transformer_blocks", "single_transformer_blocks"):
            blocks: torch.nn.ModuleList = getattr(model, name)
            blocks.append(copy.deepcopy(blocks[0]))
        compile_repeated_blocks(model, extra=family.compiling.regions, streams=family.compiling.stream_sources)
        model.train()(**random_inputs(family, model, 1, size=(32, 32)))[0].square().mean().backward()
        assert graph_count(graphs) == 3
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_xformers_attention_trains_as_sdpa_on_a_gpu(tiny_sdxl_dir: Path) -> None:
    """``model.attention: xformers`` (diffusers' xformers processors, an optional extra with CUDA kernels only): the
    tiny SDXL's LoRA gradients are SDPA's."""
    pytest.importorskip("xformers", reason="xformers is not installed (lightning-lora[xformers]: a large wheel)")
    from lightning_lora.families.sdxl import SDXL

    family, grads = SDXL(), {}
    for backend in ("sdpa", "xformers"):
        torch.manual_seed(0)
        source = ModelSource(str(tiny_sdxl_dir), dtype=torch.float32)
        model = build_model(family, source, LoraOptions(rank=2), torch.device("cuda"), attention=backend)
        model = nonzero_lora_b(model).cuda().train()
        inputs = on_device(random_inputs(family, model, 1, seed=1), "cuda")
        model(**inputs)[0].square().mean().backward()
        grads[backend] = [p.grad.cpu() for p in trainable_parameters(model) if p.grad is not None]
    assert len(grads["xformers"]) == len(grads["sdpa"]) > 0
    for a, b in zip(grads["xformers"], grads["sdpa"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
