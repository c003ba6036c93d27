"""Quantized bases on CPU: FP8 storage and compute math, NF4 (bitsandbytes) on a tiny FLUX with 64-multiple dims,
and short fits through the CLI with each backend. Speed and memory are measured on the GPU (tools/bench.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_lora, build_model, precision_for, resume_config, run_cli
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.families import Flux, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.model.assembly import configure_attention
from lightning_lora.precision import FP8, FP8Compute
from lightning_lora.precision.fp8 import FP8Linear, _ScaledMatmul, quantize_rowwise


@pytest.fixture(scope="module")
def tiny_flux64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny FLUX whose linear layers all have in_features % 64 == 0 (bitsandbytes' block size)."""
    from lightning_lora.tiny.flux import save_tiny_flux

    return save_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux64", seed=0, dim64=True)


def _linear(seed: int = 0, n_in: int = 128, n_out: int = 96) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out)
    layer.requires_grad_(False)
    return layer


def test_rowwise_quantization_error_is_small() -> None:
    w = torch.randn(64, 256)
    w8, scale = quantize_rowwise(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    relative = ((w8.float() * scale - w).norm() / w.norm()).item()
    assert relative < 0.05  # e4m3 keeps 3 mantissa bits: a few percent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_storage_forward_and_input_gradient(dtype: torch.dtype) -> None:
    ref = _linear()
    fp8 = FP8Linear(ref)
    assert fp8.weight.dtype == torch.float8_e4m3fn and [n for n, _ in fp8.named_parameters()] == ["bias"]
    x = torch.randn(5, 7, 128, dtype=dtype, requires_grad=True)
    y = fp8(x)
    y_ref = ref.to(dtype)(x)
    assert y.dtype == dtype
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 0.06
    (gx,) = torch.autograd.grad(y.float().sum(), x)
    (gx_ref,) = torch.autograd.grad(y_ref.float().sum(), x)
    assert ((gx - gx_ref).norm() / gx_ref.norm()).item() < 0.06


def test_fp8_storage_keeps_no_dequantized_weight_for_backward() -> None:
    """The backward keeps the 1-byte weight, not a dequantized copy (which would cost the bf16 model again)."""
    fp8 = FP8Linear(_linear(n_in=256, n_out=512))
    saved: list[torch.Tensor] = []
    x = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8(x).sum().backward()
    big = [t for t in saved if t.numel() >= 256 * 512]
    assert big and all(t.dtype == torch.float8_e4m3fn for t in big), [(t.dtype, t.shape) for t in big]


def test_fp8_compute_matmul_matches_reference_on_cpu() -> None:
    """torch._scaled_mm with row-wise scales also runs on the CPU: the math of the GPU path, checked here."""
    ref = _linear(n_in=128, n_out=64)
    fp8 = FP8Linear(ref, compute=True)
    x = torch.randn(32, 128, requires_grad=True)
    y = _ScaledMatmul.apply(x, fp8.weight, fp8.weight_scale, torch.bfloat16)
    y_ref = x @ ref.weight.t()
    assert ((y.float() - y_ref).norm() / y_ref.norm()).item() < 0.08
    g = torch.randn_like(y_ref)
    (gx,) = torch.autograd.grad(y, x, g.to(y.dtype))
    gx_ref = g @ ref.weight
    assert ((gx.float() - gx_ref).norm() / gx_ref.norm()).item() < 0.08


@pytest.mark.gpu
def test_fp8_compute_kernels_match_bf16_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with FP8 units (the FP8Compute configs' cards): the forward and the input gradient through
    ``torch._scaled_mm``, with the quantizers as their own compiled kernels (eager) and fused into a compiled region
    (``model.compile_blocks``), within e4m3's error of the bf16 layer (REFERENCE.md: 3.75% on FLUX's shapes)."""
    from lightning_lora.hardware import fp8_compute_supported, fp8_dtype

    device = torch.device("cuda")
    supported, reason = fp8_compute_supported(device)
    if not supported:
        pytest.skip(f"no FP8 matrix units: {reason}")
    torch.manual_seed(0)
    ref = nn.Linear(512, 1024, device=device).requires_grad_(False)
    fp8 = FP8Linear(ref, compute=True, dtype=fp8_dtype(device))
    x = torch.randn(2, 256, 512, device=device, requires_grad=True)
    g = torch.randn(2, 256, 1024, device=device)

    def run(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        (gx,) = torch.autograd.grad(y, x, g.to(y.dtype))
        return y.float(), gx.float()

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    y_ref, gx_ref = run(ref)
    real, calls = torch._scaled_mm, []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y, gx = run(fp8)
    assert len(calls) == 2  # the FP8 units ran, forward and input gradient
    monkeypatch.undo()
    assert error(y, y_ref) < 0.06 and error(gx, gx_ref) < 0.06, (error(y, y_ref), error(gx, gx_ref))
    torch._dynamo.reset()
    try:
        y_compiled, gx_compiled = run(torch.compile(fp8))
    finally:
        torch._dynamo.reset()
    assert error(y_compiled, y_ref) < 0.06 and error(gx_compiled, gx_ref) < 0.06
    assert error(y_compiled, y) < 0.01  # the same quantization, fused or not


def test_fp8_compute_gives_cublaslt_the_layouts_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLASLt multiplies a row-major ``a`` by a column-major ``b`` only. SDXL's ``proj_in`` gets a column-major view
    (``permute(0, 2, 3, 1).reshape(...)`` of the feature map) and the output gradient can be one too: the quantized
    operands must be row-major whatever the input's layout (the H200 failed with "Only multiplication of row-major and
    column-major matrices is supported by cuBLASLt", dev/LOG.md, call 18)."""
    real = torch._scaled_mm
    seen: list[bool] = []

    def like_cublaslt(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        ok = a.stride(1) == 1 and b.stride(0) == 1
        seen.append(ok)
        if not ok:
            raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", like_cublaslt)
    ref = _linear(n_in=128, n_out=64)
    fp8 = FP8Linear(ref, compute=True)
    feature_map = torch.randn(1, 128, 4, 8, requires_grad=True)  # [B, C, H, W]
    x = feature_map.permute(0, 2, 3, 1).reshape(1, 32, 128)  # a column-major view, as in diffusers' Transformer2D
    assert not x.is_contiguous()
    y = _ScaledMatmul.apply(x, fp8.weight, fp8.weight_scale, torch.bfloat16)
    y_ref = x.detach() @ ref.weight.t()
    assert ((y.float() - y_ref).norm() / y_ref.norm()).item() < 0.08
    g = torch.randn(1, 64, 32).transpose(1, 2)  # a column-major output gradient
    (gx,) = torch.autograd.grad(y, feature_map, g.to(y.dtype))
    gx_ref = (g @ ref.weight).reshape(1, 4, 8, 128).permute(0, 3, 1, 2)
    assert ((gx.float() - gx_ref).norm() / gx_ref.norm()).item() < 0.08
    assert seen == [True, True]


def test_fp8_quantizers_are_inlined_into_a_compiled_region() -> None:
    """In eager mode the quantizers run as their own compiled kernels on CUDA; inside a compiled region
    (``model.compile_blocks``) they must be the plain functions, which the region's compiler fuses with their
    neighbours (a nested compiled function made FP8 compute 3.7x slower: dev/LOG.md, call 16)."""
    from lightning_lora.precision import fp8

    assert fp8._fused(fp8.quantize_rowwise, "cuda") is not fp8.quantize_rowwise
    assert fp8._fused(fp8.quantize_rowwise, "cpu") is fp8.quantize_rowwise
    seen: list[bool] = []

    @torch.compile(backend="eager", fullgraph=True)
    def region(x: torch.Tensor) -> torch.Tensor:
        seen.append(fp8._fused(fp8.quantize_rowwise, "cuda") is fp8.quantize_rowwise)
        return x * 2

    region(torch.ones(2))
    assert seen == [True]


def test_fp8_compute_falls_back_to_storage_without_fp8_units() -> None:
    model = nn.Sequential(_linear(), nn.ReLU(), _linear(n_in=96, n_out=32))
    with pytest.warns(UserWarning, match="FP8Compute needs FP8 matrix units"):
        n = FP8Compute().quantize(model, torch.device("cpu"))
    assert n == 2 and all(isinstance(m, FP8Linear) and not m.compute for m in model if isinstance(m, nn.Linear))


def test_skip_patterns_leave_layers_unquantized() -> None:
    model = nn.Sequential()
    model.add_module("keep", _linear())
    model.add_module("quant", _linear(n_in=96, n_out=64))
    FP8(skip=["keep"]).quantize(model, torch.device("cpu"))
    assert type(model.keep) is nn.Linear and isinstance(model.quant, FP8Linear)
    # An invalid pattern is refused when the plugin is made (the config is read), before any weight loads.
    with pytest.raises(ConfigError, match=r"trainer.plugins: FP8\(skip=\['\('\]\) is not a regular expression"):
        FP8(skip=["("])


@pytest.mark.parametrize("mode", ["nf4", "fp8"])
def test_lora_on_a_quantized_tiny_flux(tiny_flux64_dir: Path, mode: str) -> None:
    import bitsandbytes as bnb

    model = build_model(
        Flux(max_sequence_length=8),
        ModelSource(str(tiny_flux64_dir), dtype=torch.bfloat16),
        LoraOptions(rank=4, targets="all_linear"),
        precision=precision_for(mode),
    )
    quantized = bnb.nn.Linear4bit if mode == "nf4" else FP8Linear
    base_layers = [m.base_layer for n, m in model.named_modules() if hasattr(m, "base_layer") and "lora" not in n]
    assert base_layers and all(isinstance(b, quantized) for b in base_layers)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable)
    # A training step: finite loss, gradients reach the LoRA.
    c = model.config
    batch = {
        "latents": torch.randn(2, c.in_channels // 4, 8, 8),
        "prompt_embeds": torch.randn(2, 8, c.joint_attention_dim),
        "pooled_prompt_embeds": torch.randn(2, c.pooled_projection_dim),
    }
    family = Flux()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = family.loss(model, batch, torch.randn_like(batch["latents"]), torch.tensor([0.3, 0.8])).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for _, p in trainable)
    assert any(p.grad.abs().sum() > 0 for n, p in trainable if "lora_B" in n)
    # The step changed no parameter's dtype. (bitsandbytes rewrites a bias that is not in the compute dtype on the
    # first call; a compiled, checkpointed block then recomputed another graph and the backward failed on the GPU.)
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes


@pytest.mark.parametrize("plugin", ["BF16", "FP8", "FP8Compute", "NF4"])
def test_each_plugin_fits_resumes_exactly_and_exports(
    tmp_path: Path, tiny_flux64_dir: Path, photos_dir: Path, plugin: str
) -> None:
    """Each plugin through the command, named in ``trainer.plugins`` (a bf16 base under CPU autocast; FP8Compute stores
    FP8 here, the CPU having no FP8 units): 4 steps in one go and 2 + 2 with a resume in between train the same LoRA,
    bit for bit (exported files compared), and the checkpoint holds only the LoRA."""
    options: dict[str, Any] = {
        "trainer.precision": None,
        "trainer.plugins": {"class_path": f"lightning_lora.precision.{plugin}"},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*FP8Compute needs FP8 matrix units", UserWarning)  # the CPU: FP8 storage
        a = resume_config(tmp_path, tiny_flux64_dir, photos_dir, "a", steps=4, **options)
        cli = run_cli(["fit", "--config", str(a)])
        assert type(cli.model.recipe.precision).__name__ == plugin
        assert cli.trainer.precision_plugin is cli.model.recipe.precision  # one object: autocast and the base format
        assert cli.model.recipe.source.dtype == torch.bfloat16 and cli.trainer.global_step == 4
        b = resume_config(tmp_path, tiny_flux64_dir, photos_dir, "b", steps=4, **options)
        run_cli(["fit", "--config", str(b), "--trainer.max_steps", "2"])
        ckpt = torch.load(b.parent / "run" / "checkpoints" / "last.ckpt", weights_only=True)
        assert ckpt["state_dict"] and all(".lora_" in k for k in ckpt["state_dict"])  # no quantized base inside
        assert run_cli(["fit", "--config", str(b), "--ckpt_path", "last"]).trainer.global_step == 4
    lora = assert_same_lora(a, b)
    assert lora and all(v.dtype == torch.float32 for v in lora.values())


def test_xformers_on_cpu_is_refused_with_the_option_name() -> None:
    with pytest.raises(ConfigError, match="model.attention: xformers"):
        configure_attention(nn.Linear(2, 2), "xformers", torch.device("cpu"))
