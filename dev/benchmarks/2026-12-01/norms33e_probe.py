"""Call 33's probe (benchmarks/2026-12-01/norms33e.txt): what F.rms_norm and F.layer_norm keep for their backward on
the GPU, without and under bf16 autocast, and what FLUX.2 klein base 4B's full-width blocks keep (models of 1 + 1, 2 + 1
and 1 + 2 blocks, random weights, rank-16 LoRA on `attention`; cuDNN attention off, so flash). From the repository root:

    python benchmarks/2026-12-01/norms33e_probe.py 1024 1024 512 cuda     # H, W, text length, device

The first three lines list (shape, dtype) of each saved tensor; the last is the per-model saved MiB, and the
difference of a model with one more block of a kind ("double", "single"), without ("plain") and with autocast.
"""

import contextlib
import json
import sys
from typing import Any

import torch

sys.path.insert(0, ".")
from lightning_lora.families import FAMILIES, ModelSource  # noqa: E402
from lightning_lora.families.base import build_from_config  # noqa: E402
from lightning_lora.live_bytes import saved_activation_bytes  # noqa: E402
from lightning_lora.lora import LoraOptions  # noqa: E402
from lightning_lora.plan import add_counted_lora  # noqa: E402

H, W, TEXT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
DEV = sys.argv[4] if len(sys.argv) > 4 else "cuda"
print(torch.__version__, DEV, torch.cuda.get_device_name() if DEV == "cuda" else "")


def autocast() -> Any:
    return torch.autocast(DEV, dtype=torch.bfloat16)


def saved_of(fn: Any) -> tuple[list[tuple[tuple[int, ...], str]], Any]:
    kept: list[tuple[tuple[int, ...], str]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), str(t.dtype).replace("torch.", "")))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    return kept, y.dtype


x = torch.randn(1, 4608, 24, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
w = torch.nn.Parameter(torch.ones(128, device=DEV, dtype=torch.bfloat16), requires_grad=False)
wide = torch.randn(1, 4608, 3072, device=DEV, dtype=torch.bfloat16, requires_grad=True)
print("rms_norm plain", saved_of(lambda: torch.nn.functional.rms_norm(x, (128,), w, 1e-6)))
with autocast():
    print("rms_norm autocast", saved_of(lambda: torch.nn.functional.rms_norm(x, (128,), w, 1e-6)))
    print("layer_norm autocast", saved_of(lambda: torch.nn.functional.layer_norm(wide, (3072,), None, None, 1e-6)))

family = FAMILIES["flux2"]()
source = ModelSource("black-forest-labs/FLUX.2-klein-base-4B", dtype=torch.bfloat16)
real = family.denoiser_config(source, family.denoiser_cls().load_config)
if DEV == "cuda":
    torch.backends.cuda.enable_cudnn_sdp(False)
result = {}
for mode in ("plain", "autocast"):
    mib = {}
    for name, (double, single) in {"one_each": (1, 1), "plus_double": (2, 1), "plus_single": (1, 2)}.items():
        torch.manual_seed(0)
        config = {**real, "num_layers": double, "num_single_layers": single}
        model = build_from_config(family.denoiser_cls(), config, torch.bfloat16, device=DEV)
        model.requires_grad_(False)
        lora_dtype = torch.bfloat16 if mode == "plain" else torch.float32  # training's fp32 LoRA under autocast
        add_counted_lora(model, family, LoraOptions(rank=16, targets="attention"), lora_dtype)
        model.train()
        inputs = family.example_inputs(model, 1, H, W, TEXT, device=DEV, dtype=torch.bfloat16)
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                inputs[key] = torch.rand_like(value) if key in ("timestep", "guidance") else torch.randn_like(value)
        with autocast() if mode == "autocast" else contextlib.nullcontext():
            mib[name] = round(saved_activation_bytes(model, inputs, attention="as_run")[0] / 2**20, 1)
        del model
        if DEV == "cuda":
            torch.cuda.empty_cache()
    double_mib = round(mib["plus_double"] - mib["one_each"], 1)
    single_mib = round(mib["plus_single"] - mib["one_each"], 1)
    result[mode] = {**mib, "double": double_mib, "single": single_mib}
print(json.dumps(result))
