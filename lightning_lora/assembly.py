"""Build the trainable model: load the frozen backbone, inject LoRA with peft, prepare it for training.

The order matters and is fixed here, once:

1. load the denoiser (transformer / UNet) in the base dtype, frozen (``requires_grad_(False)``);
2. (quantize the base, when a quantized precision is chosen: before LoRA, so peft wraps the quantized layers and the
   adapters themselves stay unquantized);
3. inject LoRA with peft (``add_adapter``): only ``lora_A`` / ``lora_B`` require gradients;
4. keep the LoRA parameters in float32 even when the base is bf16: the updates of a rank-16 adapter are tiny and
   would be rounded away in bf16 (diffusers' ``cast_training_params`` does the same); autocast runs the matmuls in
   bf16 anyway;
5. gradient checkpointing, if asked: recompute each block's activations in the backward pass instead of storing them;
6. block offloading, if asked: some blocks' frozen tensors stay in CPU memory and stream in when they run
   (:mod:`lightning_lora.offload`; before Lightning moves the model to the GPU, so they never all land there);
7. the attention backend, and regional compilation of the repeated blocks, if asked.

Target modules are given as a preset name of the family (``attention``, ``attention_all``, ``all_linear``), a regular
expression over module names, or a list of module-name suffixes (``to_q``, ``attn.to_out.0``). A list entry that
matches nothing is an error: peft would silently ignore it, and the user would train fewer layers than they think.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.hardware import check_attention
from lightning_lora.offload import check_offload_blocks, offload_blocks, offloaded_blocks, repeated_blocks
from lightning_lora.quant import QuantOptions, quantize_base
from lightning_lora.recompute import InputOffloader, checkpoint_function, recomputed

__all__ = [
    "AttentionBackend",
    "LoraOptions",
    "apply_gradient_checkpointing",
    "build_lora_model",
    "check_checkpoint_every",
    "compile_repeated_blocks",
    "configure_attention",
    "resolve_targets",
    "trainable_parameters",
]


@dataclass
class LoraOptions:
    """LoRA adapter settings.

    Args:
        rank: the rank r of the update ``B @ A`` (A: r x in, B: out x r).
        alpha: the update is scaled by ``alpha / rank``; null means alpha = rank (scale 1).
        targets: a family preset (``attention``, ``attention_all``, ``all_linear``), a regular expression over module
            names, or a list of module-name suffixes.
        dropout: dropout on the LoRA input during training.
        init: ``gaussian`` (A ~ N(0, 1/r), B = 0, as the diffusers scripts) or ``kaiming`` (peft's default).
    """

    rank: int = 16
    alpha: float | None = None
    targets: str | list[str] = "attention"
    dropout: float = 0.0
    init: Literal["gaussian", "kaiming"] = "gaussian"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"model.lora.rank: {self.rank} must be a positive integer (typical: 4 to 64).")
        if self.alpha is not None and self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha: {self.alpha} must be positive, or null for alpha = rank.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: {self.dropout} must be in [0, 1).")

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)


def resolve_targets(targets: str | list[str], family: DiffusionFamily, model: nn.Module) -> str | list[str]:
    """Turn the user's ``targets`` into a peft ``target_modules`` value, checking that each part matches a layer."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d) or _is_quantized_linear(m)]
    if isinstance(targets, str):
        pattern = family.lora_presets.get(targets, targets)
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ConfigError(
                f"model.lora.targets: {targets!r} is neither a preset ({', '.join(family.lora_presets)}) nor a valid "
                f"regular expression ({e})."
            ) from e
        if not any(regex.fullmatch(n) for n in names):
            raise ConfigError(
                f"model.lora.targets: {targets!r} matches no linear or convolution layer of the {family.name} "
                f"model. Use a preset ({', '.join(family.lora_presets)}) or a module-name pattern such as "
                f"{names[len(names) // 2]!r}."
            )
        return pattern
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched or not targets:
        example = sorted({n.rsplit(".", 1)[-1] for n in names})[:12]
        raise ConfigError(
            f"model.lora.targets: {unmatched or targets} match no linear or convolution layer of the "
            f"{family.name} model. Layer names end in e.g. {example}; or use a preset "
            f"({', '.join(family.lora_presets)})."
        )
    return list(targets)


def _is_quantized_linear(module: nn.Module) -> bool:
    return type(module).__name__ in ("Linear4bit", "Linear8bitLt", "FP8Linear")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_lora_model(
    family: DiffusionFamily,
    source: ModelSource,
    lora: LoraOptions,
    gradient_checkpointing: bool = False,
    quantization: QuantOptions | None = None,
    device: torch.device | None = None,
    attention: AttentionBackend = "auto",
    compile_blocks: bool = False,
    checkpoint_every: int = 1,
    offload: int = 0,
    offload_activations: bool = False,
) -> nn.Module:
    """Load, freeze, quantize, inject LoRA, upcast LoRA to float32, checkpointing, offloading, attention, compile.

    ``device`` is where quantized layers are created (the training device); the rest of the model is moved there by
    Lightning afterwards. Returns the denoiser in train mode.
    """
    from peft import LoraConfig

    check_offload_blocks(offload, None, quantization.mode if quantization else "none", compile_blocks)
    check_offload_activations(offload_activations, gradient_checkpointing)
    denoiser = family.load_denoiser(source)
    denoiser.requires_grad_(False)
    target_modules = resolve_targets(lora.targets, family, denoiser)
    offloaded = offloaded_blocks(denoiser, offload)  # the same modules after quantization and LoRA injection
    if quantization is not None:
        # The blocks to offload are quantized on the CPU, where they will stay: the GPU never holds them all.
        on_cpu = frozenset(id(m) for block in offloaded for m in block.modules())
        quantize_base(denoiser, quantization, device or torch.device("cpu"), source.dtype, on_cpu)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.scale_alpha,
        lora_dropout=lora.dropout,
        init_lora_weights="gaussian" if lora.init == "gaussian" else True,
        target_modules=target_modules,
    )
    denoiser.add_adapter(config)
    for p in trainable_parameters(denoiser):
        p.data = p.data.to(torch.float32)
    if gradient_checkpointing:
        apply_gradient_checkpointing(denoiser, checkpoint_every, offload_activations)
    offload_blocks(denoiser, offloaded, device or torch.device("cpu"))
    configure_attention(denoiser, attention, device or torch.device("cpu"), family.cudnn_attention_in_auto)
    if compile_blocks:
        compile_repeated_blocks(denoiser, extra=family.compiled_regions)
    return denoiser.train()


def set_lora_input_casts(denoiser: nn.Module, enabled: bool) -> int:
    """Whether the LoRA layers cast their input to the adapter's float32; off only where every forward runs under
    autocast.

    peft casts each LoRA layer's input to the adapter's float32 (``cast_input_dtype_enabled``), and autocast casts
    it straight back to bf16 for the matmul: two copies of the activation per layer in the forward and two in the
    backward, the same values (~2,800 of a FLUX step's ~9,800 kernels). Without autocast the cast is needed (a bf16
    input would meet float32 adapter weights), so :class:`~lightning_lora.module.LoraModule` turns it off under a
    mixed-precision plugin and on under any other, each time it is fitted. Returns how many layers were set.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in denoiser.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = enabled
    return len(layers)


def check_checkpoint_every(every: int) -> None:
    if every < 1:
        raise ConfigError(f"model.checkpoint_every: {every} must be at least 1 (1: every block).")


def check_offload_activations(offload_activations: bool, gradient_checkpointing: bool) -> None:
    if offload_activations and not gradient_checkpointing:
        raise ConfigError(
            "model.offload_activations: true moves the inputs that checkpointed blocks keep for the backward to CPU "
            "memory; it needs model.gradient_checkpointing: true."
        )


def apply_gradient_checkpointing(denoiser: nn.Module, every: int = 1, offload_inputs: bool = False) -> int:
    """Recompute block activations in the backward pass instead of keeping them.

    ``every=1`` is the model's own checkpointing (diffusers' ``enable_gradient_checkpointing``: every block, and the
    UNet's ResNets too). ``every=N`` checkpoints one in N of the model's repeated blocks (``_repeated_blocks``: FLUX's
    double and single blocks, the UNet's transformer blocks) and keeps the others' activations: memory and recompute
    time in between. Block forwards are wrapped in place, so parameter names (and LoRA keys) do not change.
    ``offload_inputs``: the inputs checkpointed blocks keep wait in CPU memory (:class:`InputOffloader`, kept as
    ``denoiser._lora_input_offloader``). Returns how many blocks were wrapped (0 for ``every=1``).
    """
    check_checkpoint_every(every)
    offloader = InputOffloader() if offload_inputs else None
    denoiser._lora_input_offloader = offloader
    if every == 1:
        denoiser.enable_gradient_checkpointing(checkpoint_function(offloader))
        return 0
    blocks = repeated_blocks(denoiser)
    if not blocks:
        raise ConfigError(
            f"model.checkpoint_every: {type(denoiser).__name__} declares no repeated blocks; use checkpoint_every: 1."
        )
    chosen = blocks[::every]
    for block in chosen:
        block.forward = recomputed(block.forward, offloader)  # type: ignore[method-assign]
    return len(chosen)


AttentionBackend = Literal["auto", "sdpa", "flash", "efficient", "cudnn", "math", "xformers"]


def configure_attention(
    denoiser: nn.Module, backend: AttentionBackend, device: torch.device, cudnn_in_auto: bool = False
) -> None:
    """Choose the attention kernel.

    ``auto`` lets PyTorch's SDPA pick among its backends, with cuDNN's switched off unless ``cudnn_in_auto`` (the
    family's ``cudnn_attention_in_auto``): it crashed in the backward pass of full-size FLUX in bf16 on an H200 with
    torch 2.11 (illegal memory access in ``mha_graph.execute``), while the SDXL reference ran with it, faster
    (REFERENCE.md). ``sdpa`` is PyTorch's own choice among all its backends. ``flash`` / ``efficient`` / ``cudnn`` /
    ``math`` allow only that SDPA backend (the process-wide ``torch.backends.cuda`` switches); ``xformers`` uses
    diffusers' xformers processors (CUDA only).
    """
    check_attention(backend, device)  # xformers / cudnn on a build that has none (CPU, ROCm)
    if backend == "xformers":
        try:
            import xformers  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "model.attention: xformers is not installed: pip install 'lightning-lora[xformers]'"
            ) from e
        denoiser.enable_xformers_memory_efficient_attention()
        return
    if not torch.cuda.is_available():
        return
    cuda = torch.backends.cuda
    every = backend in ("auto", "sdpa")
    cuda.enable_flash_sdp(every or backend == "flash")
    cuda.enable_mem_efficient_sdp(every or backend == "efficient")
    nvidia = torch.version.hip is None  # ROCm builds have no cuDNN
    cuda.enable_cudnn_sdp(backend in ("sdpa", "cudnn") or (backend == "auto" and cudnn_in_auto and nvidia))
    cuda.enable_math_sdp(every or backend == "math")


def compile_repeated_blocks(denoiser: nn.Module, mode: str | None = None, extra: tuple[str, ...] = ()) -> None:
    """Regional compilation: compile each repeated transformer block in place (diffusers' ``compile_repeated_blocks``),
    and each module of the ``extra`` classes (the family's ``compiled_regions``).

    Compiling the whole 12B model did not finish in 150 s on an H200; the blocks compile once and are reused by
    every layer, and parameter names stay unchanged (no ``_orig_mod.`` prefix in checkpoints).
    """
    compile_fn = getattr(denoiser, "compile_repeated_blocks", None)
    if compile_fn is None or not getattr(denoiser, "_repeated_blocks", None):
        raise ConfigError(f"model.compile_blocks: {type(denoiser).__name__} declares no repeated blocks to compile.")
    compile_fn(fullgraph=False, mode=mode)
    for module in denoiser.modules():
        if type(module).__name__ in extra:
            module.compile(fullgraph=False, mode=mode)
    raise_recompile_limit(denoiser, (*denoiser._repeated_blocks, *extra))


def raise_recompile_limit(denoiser: nn.Module, classes: tuple[str, ...]) -> int:
    """Let dynamo keep a graph for every shape variant of the compiled classes; returns the limit set.

    dynamo keeps at most ``recompile_limit`` (8) graphs per function and runs the rest eagerly, with a warning; it
    treats parameter shapes as static, so each distinct layout of a class needs its own graph: SDXL's and SD1.5's
    ResNets come in 12 (channel counts, with or without a shortcut conv). Each layout may recompile once or twice more
    for new input shapes (aspect-ratio buckets) before dynamo makes those dimensions dynamic: room for four each.
    """
    layouts: dict[str, set[tuple[Any, ...]]] = {}
    for module in denoiser.modules():
        if type(module).__name__ in classes:
            shapes = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
            layouts.setdefault(type(module).__name__, set()).add(shapes)
    most = max((len(v) for v in layouts.values()), default=0)
    limit = max(torch._dynamo.config.recompile_limit, 4 * most)
    torch._dynamo.config.recompile_limit = limit
    return limit
