"""Build the trainable model a :class:`~lightning_lora.model.recipe.ModelRecipe` describes: load the frozen backbone,
inject LoRA with peft, prepare it for training.

The order matters and is fixed here, once:

1. load the denoiser (transformer / UNet) in the base dtype, frozen (``requires_grad_(False)``), and merge the training
   adapter into it, if there is one (:mod:`lightning_lora.model.training_adapter`);
2. quantize the base, when the precision plugin is a quantized format: before LoRA, so peft wraps the quantized
   layers and the adapters themselves stay unquantized;
3. inject LoRA with peft (``add_adapter``): only ``lora_A`` / ``lora_B`` require gradients;
4. keep the LoRA parameters in float32 even when the base is bf16: the updates of a rank-16 adapter are tiny and
   would be rounded away in bf16 (diffusers' ``cast_training_params`` does the same); autocast runs the matmuls in
   bf16 anyway;
5. gradient checkpointing, if asked: recompute each block's activations in the backward pass instead of storing them;
6. block offloading, if asked: some blocks' frozen tensors stay in CPU memory and stream in when they run
   (:mod:`lightning_lora.model.offload`; before Lightning moves the model to the GPU, so they never all land there);
7. the attention backend, and regional compilation of the repeated blocks, if asked.

The adapter itself (its options, targets, peft config, which parameters are its own) is :mod:`lightning_lora.lora`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusersModel
from lightning_lora.hardware import check_attention
from lightning_lora.lora import inject_lora, trainable_parameters
from lightning_lora.model.attention import hand_sdpa_matching_gradients
from lightning_lora.model.offload import offload_blocks, offloaded_blocks, repeated_blocks
from lightning_lora.model.recipe import AttentionBackend, ModelRecipe
from lightning_lora.model.recompute import InputOffloader, checkpoint_function, recomputed
from lightning_lora.model.training_adapter import merge_training_adapter

__all__ = [
    "CUDA_GRAPHS_MODE",
    "apply_gradient_checkpointing",
    "build_lora_model",
    "compile_repeated_blocks",
    "configure_attention",
    "gradients_outside_graphs",
    "uncompiled",
]

CUDA_GRAPHS_MODE = "reduce-overhead"
"""The ``torch.compile`` mode of the blocks with ``model.cuda_graphs``: inductor records each compiled block's kernels
as a CUDA graph (one per input shape, in one memory pool) and replays it, so a block costs the host one launch
instead of a few hundred. For steps the host's CPU bounds: ``sdxl_24gb`` on an H100 took 0.154 s a step against 0.431
with the default mode in the same command, at 10.52 against 10.39 GiB reserved; a step the GPU bounds gains nothing
(``flux_h100``: 0.698 against 0.702 s; FLUX bf16 512x768: 0.184 against 0.187; BENCHMARKS.md, "CUDA graphs"). On a
CPU inductor runs the blocks without graphs.

The graphs' outputs live in one memory pool that torch's CUDA graph trees hand out again at each new *generation*;
a tensor of an earlier generation still in use is then overwritten ("accessing tensor output of CUDAGraphs that has
been overwritten by a subsequent run"). By itself torch starts a generation at any compiled call made after a backward
pass, and a training step makes two such calls: the second micro-batch of gradient accumulation, whose backward adds
into gradients the first one's backward left in the pool (``flux_8gb``, NF4 with accumulation 4, failed so in its first
step: dev/LOG.md, 2026-12-02), and a block that checkpointing outside its compiled region recomputes in the
backward pass. So a training step with graphs marks its own generation
(:func:`~torch.compiler.cudagraph_mark_step_begin` at each micro-batch: ``LoraModule.training_step``) and keeps the
LoRA's gradients out of the pool (:func:`gradients_outside_graphs`, zeroed instead of freed between steps)."""


def gradients_outside_graphs(params: Iterable[nn.Parameter]) -> int:
    """Give each of ``params`` without a gradient a zero one, allocated outside any CUDA graph pool; returns how many
    it gave. Kept (zeroed, not set to ``None``, between optimizer steps), the gradient is where autograd adds each
    backward's result in place, so no gradient is a graph's output that the next micro-batch's graphs overwrite
    (:data:`CUDA_GRAPHS_MODE`)."""
    given = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            given += 1
    return given


def build_lora_model(recipe: ModelRecipe, device: torch.device | None = None) -> nn.Module:
    """Load, freeze, quantize, inject LoRA, upcast LoRA to float32, checkpointing, offloading, attention, compile:
    the model ``recipe`` describes (its options were checked when it was made).

    ``device`` is where quantized layers are created (the training device); the rest of the model is moved there by
    Lightning afterwards. Returns the denoiser in train mode.
    """
    device = device or torch.device("cpu")
    family, source = recipe.family, recipe.source
    denoiser = family.load_denoiser(source)
    denoiser.requires_grad_(False)
    if source.training_adapter is not None:  # into the base weights, before they are quantized
        merge_training_adapter(denoiser, family, source.training_adapter)
    offloaded = offloaded_blocks(denoiser, recipe.offload_blocks)  # the same modules after quantization and LoRA
    # The blocks to offload are quantized on the CPU, where they will stay: the GPU never holds them all.
    on_cpu = frozenset(id(m) for block in offloaded for m in block.modules())
    recipe.precision.quantize(denoiser, device, on_cpu)
    inject_lora(denoiser, family, recipe.lora)
    for p in trainable_parameters(denoiser):
        p.data = p.data.to(torch.float32)
    if recipe.gradient_checkpointing:
        compiling = family.compiling
        in_blocks = (
            recipe.compile_blocks or compiling.checkpoints_in_blocks
        ) and compiling.checkpoints_only_repeated_blocks
        every, offload = recipe.checkpoint_every, recipe.offload_activations
        apply_gradient_checkpointing(
            denoiser, every, offload, in_blocks, only_in_blocks=compiling.checkpoints_in_blocks
        )
    offload_blocks(denoiser, offloaded, device)
    configure_attention(denoiser, recipe.attention, device, family.compiling.cudnn_attention_in_auto)
    if recipe.cuda_graphs and device.type != "cuda":
        warnings.warn(
            f"model.cuda_graphs: true, but the model is built on {device.type}: CUDA graphs need a CUDA (or ROCm) GPU, "
            "so the compiled blocks run without them.",
            stacklevel=2,
        )
    if recipe.compile_blocks:
        compile_repeated_blocks(
            denoiser,
            mode=CUDA_GRAPHS_MODE if recipe.cuda_graphs else None,
            extra=family.compiling.regions,
            streams=family.compiling.stream_sources,
            joins=family.compiling.joined_streams,
        )
    return denoiser.train()


def apply_gradient_checkpointing(
    denoiser: DiffusersModel,
    every: int = 1,
    offload_inputs: bool = False,
    in_blocks: bool = False,
    *,
    only_in_blocks: bool = False,
) -> int:
    """Recompute block activations in the backward pass instead of keeping them.

    ``every=1`` is the model's own checkpointing (diffusers' ``enable_gradient_checkpointing``: every block, and the
    UNet's ResNets too). ``every=N`` checkpoints one in N of the model's repeated blocks (``_repeated_blocks``: FLUX's
    double and single blocks, the UNet's transformer blocks) and keeps the others' activations: memory and recompute
    time in between. Block forwards are wrapped in place, so parameter names (and LoRA keys) do not change.
    ``offload_inputs``: the inputs checkpointed blocks keep wait in CPU memory (:class:`InputOffloader`, kept as
    ``denoiser._lora_input_offloader``).

    ``in_blocks``: ``every=1`` done as ``every=N`` does it, each repeated block's ``forward`` under the checkpoint,
    for a model whose own checkpointing recomputes exactly those blocks (the family's
    ``checkpoints_only_repeated_blocks``): the same gradients, and what compiled blocks need. Diffusers checkpoints a
    block by wrapping its call, so a compiled block runs twice in the forward direction (the forward, then the
    recomputation in the backward) besides its backward; with the checkpoint inside the block, dynamo traces it and
    the recomputation is part of the block's compiled backward: one call fewer per block and step, which counts on a
    host-bound step (``flux_8gb`` on an H200: 1.14 against 1.75-2.15 s per step at the same peak; ``qwenimage_24gb``
    2.37 against 3.31, BENCHMARKS.md, "What each option measured"). Not with ``offload_inputs``, whose
    saved-tensor hooks stay around the compiled call. ``only_in_blocks``: in each block with ``offload_inputs`` too, for
    a model whose own checkpointing is not its forward (the family's ``checkpoints_in_blocks``). Returns how many
    blocks were wrapped (0: diffusers' own).
    """
    if every < 1:
        raise ConfigError(f"model.checkpoint_every: {every} must be at least 1 (1: every block).")
    offloader = InputOffloader() if offload_inputs else None
    denoiser._lora_input_offloader = offloader
    blocks = repeated_blocks(denoiser)
    if every == 1 and not only_in_blocks and (offload_inputs or not in_blocks or not blocks):
        denoiser.enable_gradient_checkpointing(checkpoint_function(offloader))
        return 0
    if not blocks:
        raise ConfigError(
            f"model.checkpoint_every: {type(denoiser).__name__} declares no repeated blocks; use checkpoint_every: 1."
        )
    chosen = blocks[::every]
    for block in chosen:
        block.forward = recomputed(block.forward, offloader)  # type: ignore[method-assign]
    return len(chosen)


def configure_attention(
    denoiser: DiffusersModel, backend: AttentionBackend, device: torch.device, cudnn_in_auto: bool = False
) -> None:
    """Choose the attention kernel.

    ``auto`` lets PyTorch's SDPA pick among its backends, with cuDNN's switched off unless ``cudnn_in_auto`` (the
    family's ``compiling.cudnn_attention_in_auto``). ``sdpa`` is PyTorch's own choice among all its backends. ``flash``
    / ``efficient`` / ``cudnn`` / ``math`` allow only that SDPA backend (the process-wide ``torch.backends.cuda``
    switches); ``xformers`` uses diffusers' xformers processors (CUDA only). Wherever cuDNN's SDPA is allowed, its
    backward is handed the output's gradient in the output's strides (:mod:`lightning_lora.model.attention`: without it,
    cuDNN's backward read out of bounds in full-size FLUX on an H200).
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
    cudnn = backend in ("sdpa", "cudnn") or (backend == "auto" and cudnn_in_auto and nvidia)
    cuda.enable_cudnn_sdp(cudnn)
    cuda.enable_math_sdp(every or backend == "math")
    hand_sdpa_matching_gradients(cudnn)


def compile_repeated_blocks(
    denoiser: DiffusersModel,
    mode: str | None = None,
    extra: tuple[str, ...] = (),
    streams: tuple[str, ...] = (),
    dynamic: bool | None = None,
    joins: tuple[str, ...] = (),
) -> None:
    """Regional compilation: compile each repeated transformer block in place (diffusers' ``compile_repeated_blocks``),
    and each module of the ``extra`` classes (the family's ``compiling.regions``); the outputs of the ``streams``
    modules (the family's ``compiling.stream_sources``) require gradients while training
    (:func:`stream_needs_gradients`), and the two streams out of the last module of each ``joins`` container (the
    family's ``compiling.joined_streams``) come as slices of one tensor (:func:`slices_of_one_tensor`).

    Compiling the whole 12B model did not finish in 150 s on an H200; the blocks compile once and are reused by
    every layer, and parameter names stay unchanged (no ``_orig_mod.`` prefix in checkpoints).

    ``dynamic`` is ``torch.compile``'s: ``None`` (what ``fit`` uses) lets dynamo make a size symbolic once it has seen
    it change. Dynamo keeps a class's graphs on its ``forward``, so in a UNet the second layout of a class (other
    channels, another resolution) already counts as a change and most of its graphs come out symbolic; ``False``
    compiles each layout, and each bucket, static (not measured on a GPU yet: BENCHMARKS.md, "Not measured yet").
    """
    compile_fn = getattr(denoiser, "compile_repeated_blocks", None)
    if compile_fn is None or not getattr(denoiser, "_repeated_blocks", None):
        raise ConfigError(f"model.compile_blocks: {type(denoiser).__name__} declares no repeated blocks to compile.")
    compile_cache_dir()
    cache_custom_autograd_functions()
    compile_fn(fullgraph=False, mode=mode, dynamic=dynamic)
    for name in streams:
        source = denoiser.get_submodule(name)
        for module in source.children() if isinstance(source, nn.ModuleDict | nn.ModuleList) else (source,):
            module.register_forward_hook(stream_needs_gradients)
    for name in joins:
        blocks = denoiser.get_submodule(name)
        last = blocks[-1] if isinstance(blocks, nn.ModuleList) else blocks
        last.register_forward_hook(slices_of_one_tensor)
    for module in denoiser.modules():
        if type(module).__name__ in extra:
            module.compile(fullgraph=False, mode=mode, dynamic=dynamic)
    raise_recompile_limit(denoiser, (*denoiser._repeated_blocks, *extra))


def uncompiled(enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """Inside, the compiled regions run as the plain modules they wrap (``torch.compiler.set_stance("force_eager")``):
    for the forwards without gradients that a run makes besides its training steps, the eval loss and the sample
    images. Compiled, each would compile a second graph of every block layout (no gradients, and the samples' own
    batch and size): SDXL's samples compiled 15 graphs in 54 s on an H200, and SD1.5's were still compiling when
    their benchmark row was stopped at 220 s, the training steps done. In ``fit`` that comes before the
    first training step, since the samples and the eval loss also run at the start. ``enabled=False``: compiled as
    usual. On torch before 2.6 (no ``set_stance``) this changes nothing."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if enabled and set_stance is not None else contextlib.nullcontext()


@torch.compiler.disable  # run as it is: traced, this hook was a graph of its own
def slices_of_one_tensor(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: a block's two streams ``(text, image)``, ``[B, T, D]`` and ``[B, S, D]``, returned as the two
    slices of one ``[B, T + S, D]`` tensor, the layout in which FLUX's single-stream blocks hand them to each other.
    Dynamo guards on strides: without this the first single-stream block, fed the double-stream blocks' separate
    tensors, compiled a graph of its own (a third of FLUX's). The cost is one concatenation a step, which the block
    then makes again as each of them does. Anything else passes unchanged."""
    if not (isinstance(output, tuple) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output)):
        return None
    text, image = output
    if text.dim() != 3 or image.dim() != 3 or text.shape[0] != image.shape[0] or text.shape[2] != image.shape[2]:
        return None
    joined = torch.cat([text, image], dim=1)
    return joined[:, : text.shape[1]], joined[:, text.shape[1] :]


def stream_needs_gradients(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: while gradients are on, a floating-point output that does not require them (a frozen module fed
    the batch) is replaced by a view of it that does, as every later block's inputs do (a view, not the leaf itself:
    dynamo guards leaves differently). Dynamo, which guards on ``requires_grad``, then reuses one graph for the first
    compiled block and the rest instead of compiling a second for the first."""
    if (
        torch.is_grad_enabled()
        and isinstance(output, torch.Tensor)
        and output.is_floating_point()
        and not output.requires_grad
    ):
        return output.requires_grad_().view_as(output)
    return None


def compile_cache_dir() -> Path:
    """Where ``torch.compile`` keeps what it compiled, so that the next run with the same model and settings loads it
    instead of compiling again (inductor's FX graph and AOTAutograd caches, keyed by torch on the graphs, the shapes,
    the torch version and the device).

    ``TORCHINDUCTOR_CACHE_DIR`` when the user set it; otherwise ``<XDG_CACHE_HOME or ~/.cache>/lightning-lora/
    torch-compile`` (set for this process), not torch's default under ``/tmp``, which a reboot or a fresh container
    empties.
    """
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "lightning-lora", "torch-compile")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return Path(chosen)


def cache_custom_autograd_functions() -> bool:
    """Let AOTAutograd's cache keep the compiled graphs that hold a custom ``torch.autograd.Function``; returns
    whether it now does.

    Ours are in every attention block of a CUDA run
    (:class:`lightning_lora.model.attention.OutputGradientInOutputLayout`, wherever cuDNN's attention is allowed) and in
    the FP8 bases' matmuls (:mod:`lightning_lora.precision.fp8`). torch refuses such graphs by default
    (``autograd_cache_allow_custom_autograd_functions``, off while torch tests it; Dynamo traces the function's forward
    and backward into the graph that keys the cache, which is why torch's authors call it safe, PR 149751). Refused,
    every start traced and partitioned those graphs again: on an H100, 0 AOTAutograd hits of SD1.5's 3 attention graphs
    at a second start. A user's ``TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0`` still wins (torch reads it over
    this setting)."""
    config = torch._functorch.config
    if not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):  # torch without the setting
        return False
    config.autograd_cache_allow_custom_autograd_functions = True
    return bool(config.autograd_cache_allow_custom_autograd_functions)


def raise_recompile_limit(denoiser: nn.Module, classes: tuple[str, ...]) -> int:
    """Let dynamo keep a graph for every shape variant of the compiled classes; returns the limit set.

    dynamo keeps at most ``recompile_limit`` (8) graphs per function and runs the rest eagerly, with a warning; it
    treats parameter shapes as static, so each distinct layout of a class needs its own graph: SDXL's and SD1.5's
    ResNets come in 12 (channel counts, with or without a shortcut conv). Each layout then compiles again for each
    variant a run meets: new input shapes (aspect-ratio buckets, text lengths: once or twice, before dynamo makes those
    dimensions dynamic), forwards without gradients (``SampleImages(compiled=True)``; the eval loss and the samples
    otherwise run :func:`uncompiled`), the first block's inputs that need
    no gradient (unless the family's ``stream_sources`` give them one), a batch's text mask present or absent,
    Z-Image's refiners called without a timestep. A Z-Image run with buckets, masked batches and samples meets 15 for
    its two layouts (tests/test_compile_text_lengths.py; 21 without ``stream_sources``): room for sixteen each.
    """
    layouts: dict[str, set[tuple[Any, ...]]] = {}
    for module in denoiser.modules():
        if type(module).__name__ in classes:
            shapes = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
            layouts.setdefault(type(module).__name__, set()).add(shapes)
    most = max((len(v) for v in layouts.values()), default=0)
    limit = max(torch._dynamo.config.recompile_limit, 16 * most)
    torch._dynamo.config.recompile_limit = limit
    return limit
