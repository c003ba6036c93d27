"""Where FP8 compute stands against bf16, compiled: one frozen linear layer and one FLUX.1 block pair, forward +
input gradient (the frozen base's two matmuls), bf16 vs lightning-lora's FP8 compute vs torchao's float8 training
layers. Prints one JSON line per measurement (``--out`` also appends them to a file).

    python dev/probes/fp8_probe.py [--tokens 2048] [--out fp8_probe.jsonl] [--profile profile.txt]

Modes:

* ``bf16``: ``nn.Linear`` in bf16;
* ``ours``: :class:`lightning_lora.precision.fp8.FP8Linear` with ``compute=True`` (float8 weight + row scale,
  activations and output gradients quantized per row, ``torch._scaled_mm``);
* ``ours_nested``: the same with the quantizers compiled as their own functions even inside a compiled region (what
  lightning-lora did before; measures what inlining them into the region is worth);
* ``ao_rowwise`` / ``ao_tensorwise``: torchao's ``convert_to_float8_training`` (bf16 weights, cast to float8 on the
  fly each call) with a frozen weight: does the compiler drop the weight-gradient matmul, and how fast is the rest.

Each mode runs eager and with ``torch.compile`` (a layer; the blocks as regional compile does). Graph and graph-break
counts come from dynamo's counters.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_lora.families.base import build_from_config
from lightning_lora.families.flux import FLUX1_TRANSFORMER
from lightning_lora.precision import fp8 as fp8_module
from lightning_lora.precision.fp8 import FP8Linear

SHAPES = {"qkv": (3072, 3072), "mlp_up": (3072, 12288), "mlp_down": (12288, 3072), "single_out": (15360, 3072)}
MODES = ("bf16", "ours", "ours_nested", "ao_rowwise", "ao_tensorwise")


def timed(fn: Callable[[], None], reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def convert(module: nn.Module, mode: str, inside: Callable[[str], bool] = lambda name: True) -> nn.Module:
    """``module`` with its linear layers (those whose name ``inside`` accepts) in ``mode``; every weight frozen."""
    module.requires_grad_(False)
    if mode.startswith("ao_"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(mode.removeprefix("ao_"))
        return convert_to_float8_training(module, config=config, module_filter_fn=lambda m, name: inside(name))
    if mode.startswith("ours"):
        for name, child in list(module.named_modules()):
            for child_name, layer in list(child.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if type(layer) is nn.Linear and inside(full):
                    setattr(child, child_name, FP8Linear(layer, compute=True))
    return module


def use_nested(nested: bool) -> None:
    """``ours_nested``: the quantizers as separately compiled functions even inside a compiled region."""
    if nested:
        fp8_module._fused = lambda fn, device_type: fp8_module._compiled(fn)  # type: ignore[assignment]
    else:
        fp8_module._fused = ORIGINAL_FUSED  # type: ignore[assignment]


ORIGINAL_FUSED = fp8_module._fused


def graph_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def reset_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def layer_rows(tokens: int) -> list[dict[str, Any]]:
    rows = []
    for shape, (n_in, n_out) in SHAPES.items():
        base = nn.Linear(n_in, n_out, bias=True, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
        for mode in MODES:
            for compiled in (False, True):
                if mode == "ours_nested" and not compiled:
                    continue
                use_nested(mode == "ours_nested")
                reset_dynamo()
                layer = convert(nn.Sequential(_copy(base)), mode)

                def forward(x: torch.Tensor, layer: nn.Module = layer) -> torch.Tensor:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        return layer(x)

                fn = torch.compile(forward) if compiled else forward

                def step(
                    fn: Callable[[torch.Tensor], torch.Tensor] = fn, x: torch.Tensor = x, g: torch.Tensor = g
                ) -> None:
                    fn(x).backward(g)

                try:
                    ms = timed(step)
                    row = {"what": "layer", "shape": shape, "tokens": tokens, "mode": mode, "compiled": compiled}
                    row |= {"ms": round(ms, 4), **(graph_counts() if compiled else {})}
                except Exception as e:  # one mode failing must not lose the others
                    row = {"what": "layer", "shape": shape, "mode": mode, "compiled": compiled, "error": repr(e)[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    use_nested(False)
    return rows


def _copy(layer: nn.Linear) -> nn.Linear:
    new = nn.Linear(layer.in_features, layer.out_features, bias=True, device="cuda", dtype=torch.bfloat16)
    new.load_state_dict(layer.state_dict())
    return new


def block_model() -> nn.Module:
    """FLUX.1-dev's transformer with one double and one single block, real widths, random bf16 weights on the GPU."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    config = {**FLUX1_TRANSFORMER, "num_layers": 1, "num_single_layers": 1}
    return build_from_config(FluxTransformer2DModel, config, torch.bfloat16, "cuda").eval()


def block_inputs(height: int, width: int, text_tokens: int) -> dict[str, torch.Tensor]:
    """The transformer's inputs for one ``height x width`` image (2x2-packed 16-channel latents: one token per 16x16
    pixels) and ``text_tokens`` T5 tokens."""
    rows, cols = height // 16, width // 16
    image_tokens = rows * cols
    grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    img_ids = torch.cat([torch.zeros(image_tokens, 1), grid.float()], dim=1).cuda()
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    return {
        "hidden_states": torch.randn(1, image_tokens, 64, **kw, requires_grad=True),
        "encoder_hidden_states": torch.randn(1, text_tokens, 4096, **kw),
        "pooled_projections": torch.randn(1, 768, **kw),
        "timestep": torch.tensor([0.5], device="cuda"),
        "guidance": torch.tensor([1.0], device="cuda"),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_tokens, 3, device="cuda"),
    }


def block_rows(height: int, width: int, text_tokens: int, profile: str | None) -> list[dict[str, Any]]:
    rows = []
    inputs = block_inputs(height, width, text_tokens)
    image_tokens = inputs["img_ids"].shape[0]
    for mode in ("bf16", "ours", "ao_rowwise", "ao_tensorwise"):
        use_nested(mode == "ours_nested")
        reset_dynamo()
        model = convert(block_model(), mode, inside=lambda name: "transformer_blocks." in name)
        for i, block in enumerate(model.transformer_blocks):
            model.transformer_blocks[i] = torch.compile(block)
        for i, block in enumerate(model.single_transformer_blocks):
            model.single_transformer_blocks[i] = torch.compile(block)

        def step(model: nn.Module = model) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**inputs, return_dict=False)[0]
            out.float().square().mean().backward()

        t0 = time.perf_counter()
        try:
            step()
            first = time.perf_counter() - t0
            ms = timed(step, reps=10, warm=2)
            row = {"what": "blocks", "tokens": image_tokens + text_tokens, "mode": mode, "ms": round(ms, 3)}
            row |= {"first_step_s": round(first, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            row |= graph_counts()
            if profile and mode == "ours":
                _profile(step, f"{profile}", mode)
        except Exception as e:
            row = {"what": "blocks", "mode": mode, "error": repr(e)[:400]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    use_nested(False)
    return rows


def _profile(step: Callable[[], None], path: str, mode: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"# mode {mode}: 3 steps of the compiled FLUX block pair\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        f.write("\n")


def transpose_rows() -> list[dict[str, Any]]:
    """What the backward's per-call transposed copy of the float8 weight costs, per shape."""
    rows = []
    for shape, (n_in, n_out) in SHAPES.items():
        w8 = torch.randn(n_out, n_in, device="cuda").to(torch.float8_e4m3fn)
        ms = timed(lambda w8=w8: w8.t().contiguous())
        row = {"what": "transpose_fp8_weight", "shape": shape, "ms": round(ms, 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048, help="tokens per layer call (FLUX 512x768: 1536 + 512 text)")
    p.add_argument("--h", type=int, default=512, help="image height of the block inputs")
    p.add_argument("--w", type=int, default=768, help="image width of the block inputs")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--skip-layers", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="write the profile of the compiled FP8 blocks here")
    a = p.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # crashes in FLUX's backward on an H200 (ENVIRONMENT.md)
    versions = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        import torchao

        versions["torchao"] = torchao.__version__
    except ImportError:
        versions["torchao"] = "missing"
    print(json.dumps({"what": "versions", **versions}), flush=True)
    rows = transpose_rows()
    if not a.skip_layers:
        rows += layer_rows(a.tokens)
    rows += block_rows(a.h, a.w, a.text_tokens, a.profile)
    if a.out:
        with open(a.out, "a") as f:
            for row in [{"what": "versions", **versions}, *rows]:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
