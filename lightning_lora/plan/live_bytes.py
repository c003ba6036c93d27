"""What a computation holds, measured on the ``meta`` device: the most bytes its tensors hold at once (its transient
peak), and the bytes autograd keeps from a forward pass for the backward (:func:`saved_activation_bytes`).

The memory planner needs what a forward pass (a denoiser's, a VAE decode's) allocates *beyond* the weights while it
runs: on a GPU, what ``torch.cuda.max_memory_allocated`` rises by. On the ``meta`` device tensors have shapes and
dtypes but no memory, so the whole computation at full size costs a few seconds of CPU and no memory; what it would
have held is counted as it runs:

* :class:`LiveBytes` is a ``TorchDispatchMode``: every aten op's output that is new memory (its schema's returns carry
  no alias annotation, so views, reshapes and in-place ops add nothing) adds its storage's bytes; the bytes are given
  back when the last tensor seen on that storage dies (``weakref.finalize``), as the caching allocator frees a block.
  The most bytes live at once is the peak. Tensors made before the measurement (weights, inputs) are not counted.
* :class:`MetaAutocast` does on the meta device what CUDA autocast does (autocast has no meta kernel): matrix
  multiplications and convolutions cast float32 inputs to the low-precision dtype, normalizations and softmax cast
  low-precision inputs to float32 and return float32. The casts are real ops, so their copies are counted. That is why
  a VAE decode under autocast holds three times its widest bf16 activation at a group norm: the bf16 input, its float32
  copy and the float32 output (``tests/plan/test_live_bytes.py``).
* :class:`MetaOpCache` computes each op's output shapes once per process: on the meta device that computation is most
  of the time (torch's shape functions are Python), and a model's repeated blocks, and the alternatives the planner
  tries, run the same ops on the same shapes again; :func:`module_copy` copies a model to change and run in a fraction
  of ``copy.deepcopy``'s time.

:func:`peak_bytes` runs a function under the first three. Attention should run under :func:`flash_like_attention`
(what the GPU's flash / memory-efficient kernels allocate: no score matrix).

:func:`saved_activation_bytes` counts the tensors autograd saves in a forward pass, as the GPU runs it: attention as
its fused kernels keep it (:func:`flash_like_attention`), ``rms_norm`` as its fused kernel keeps it
(:func:`fused_like_rms_norm`) and, with ``autocast``, under :class:`MetaAutocast` (a torch-function mode, so its casts
are ops autograd records, as CUDA autocast's are).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "LiveBytes",
    "MetaAutocast",
    "MetaOpCache",
    "OPS",
    "module_copy",
    "flash_like_attention",
    "fused_like_rms_norm",
    "peak_bytes",
    "saved_activation_bytes",
]

# CUDA autocast's op lists (torch.amp docs, "CUDA Ops that can autocast to float16 / to float32"), the ones diffusion
# models call. Matched at the torch-function level, where autocast applies: before composite ops (conv2d, linear)
# check that their input and weight dtypes agree.
_LOWER_PRECISION: frozenset[Any] = frozenset(
    {
        torch.conv1d,
        torch.conv2d,
        torch.conv3d,
        torch.conv_transpose1d,
        torch.conv_transpose2d,
        torch.conv_transpose3d,
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.baddbmm,
        torch.addmm,
        torch.addbmm,
    }
)
_FLOAT32: frozenset[Any] = frozenset(
    {
        F.group_norm,
        torch.group_norm,
        F.layer_norm,
        torch.layer_norm,
        F.softmax,
        torch.softmax,
        torch.Tensor.softmax,
        F.log_softmax,
        torch.log_softmax,
        torch.Tensor.log_softmax,
    }
)
_LOW_DTYPES = (torch.float16, torch.bfloat16)


class LiveBytes(TorchDispatchMode):
    """Count the bytes of the tensors a computation creates and holds at once (see the module docstring).

    ``live`` is the bytes held now, ``peak`` the most held at once, ``peak_op`` the op that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._sizes: dict[int, int] = {}  # storage -> bytes, for the storages this mode saw created
        self._refs: dict[int, int] = {}  # storage -> tensors seen on it that are alive

    def _hold(self, t: torch.Tensor, new: bool) -> None:
        key = t.untyped_storage()._cdata
        if key not in self._sizes:
            if not new:  # a view of a weight or an input: not ours
                return
            self._sizes[key] = t.untyped_storage().nbytes()
            self._refs[key] = 0
            self.live += self._sizes[key]
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        new = not any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._hold(t, new)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
        return out


class MetaAutocast(TorchFunctionMode):
    """CUDA autocast to ``dtype`` (float16 or bfloat16), done by casting arguments, so that it works on ``meta``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sources: tuple[torch.dtype, ...]
        if func in _LOWER_PRECISION:
            target, sources = self.dtype, (torch.float32,)
        elif func in _FLOAT32:
            target, sources = torch.float32, _LOW_DTYPES
        else:
            return func(*args, **kwargs)

        def cast(x: Any) -> Any:
            return x.to(target) if isinstance(x, torch.Tensor) and x.dtype in sources else x

        args, kwargs = tree_map(cast, (args, kwargs))
        return func(*args, **kwargs)


class _Uncacheable(Exception):
    """An argument :class:`MetaOpCache` cannot key on (a real tensor, a tensor subclass, an unknown object)."""


_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(x: Any) -> Any:
    """What an op's output shapes can depend on in one argument: a meta tensor's metadata, a plain value."""
    kind = type(x)
    if kind is torch.Tensor or kind is nn.Parameter:
        if not x.is_meta:
            raise _Uncacheable
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if kind is tuple or kind is list:
        return (kind, tuple([_key(i) for i in x]))
    if x is None or kind in _SCALARS:
        return (kind, x)  # 1, 1.0 and True are equal keys otherwise
    raise _Uncacheable  # a tensor subclass, an object


def _fresh(func: Any) -> bool:
    """Whether ``func`` returns only new tensors and writes none of its arguments (no alias annotation in its schema):
    the ops whose outputs :class:`MetaOpCache` may make instead of running them."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    returns_tensors = all(str(r.type) in ("Tensor", "Tensor[]") and r.alias_info is None for r in schema.returns)
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return returns_tensors and not writes


_Made = tuple[torch.Size, tuple[int, ...], torch.dtype]
_OUTPUTS: dict[Any, tuple[TreeSpec | None, list[_Made]] | None] = {}
"""What ops made on the meta device, by op and arguments (:func:`_key`), for the whole process: the output's
structure (None: one tensor) and each tensor's shape, strides and dtype; None for an op whose outputs cannot be made
the same way."""
_FRESH: dict[Any, bool] = {}

OPS: collections.Counter[str] = collections.Counter()
"""Ops on the meta device under :class:`MetaOpCache` in this process: ``computed`` (run) and ``remade``."""


def _made(out: Any, inputs: set[int]) -> tuple[TreeSpec | None, list[_Made]] | None:
    """The outputs of a fresh op as :class:`MetaOpCache` remakes them, or None where an output is not one
    ``torch.empty_strided`` of its shape and strides would make (an offset, a storage larger than its strides span,
    an output sharing a storage with another or with an input)."""
    leaves, structure = tree_flatten(out)
    spec = None if isinstance(out, torch.Tensor) else structure
    made: list[_Made] = []
    storages = set(inputs)
    for t in leaves:
        if type(t) is not torch.Tensor or t.device.type != "meta" or t.storage_offset() != 0:
            return None
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
        storage = t.untyped_storage()
        if storage.nbytes() != span * t.element_size() or storage._cdata in storages:
            return None
        storages.add(storage._cdata)
        made.append((t.shape, t.stride(), t.dtype))
    return spec, made


class MetaOpCache(TorchDispatchMode):
    """Run each meta-device op's shape computation once per process: on the ``meta`` device an op computes only its
    outputs' shapes, strides and dtype, and in torch most of those are Python functions (hundreds of microseconds an
    op, most of a full-size forward pass's time). A model's repeated blocks run the same ops on the same shapes, and
    the planner runs the same model for each alternative it tries: the outputs of an op seen before with the same
    arguments' metadata are made with ``torch.empty_strided``, new storages of the same bytes, as the op would have.

    Only ops that return new tensors and write none of their arguments are remade (views, in-place ops and ops on real
    tensors run as usual), and only those whose outputs ``torch.empty_strided`` makes exactly (:func:`_made`); the key
    holds every argument's metadata and the default dtype. Enter it before :class:`LiveBytes`, which then counts the
    remade outputs under the op's own name."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fresh = _FRESH.get(func)
        if fresh is None:
            fresh = _FRESH[func] = _fresh(func)
        if not fresh:
            return func(*args, **kwargs)
        try:
            key = (func, torch.get_default_dtype(), _key(args), _key(tuple(sorted(kwargs.items()))))
        except _Uncacheable:
            return func(*args, **kwargs)
        known = _OUTPUTS.get(key, ())
        if known:
            OPS["remade"] += 1
            spec, made = known
            outputs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in made]
            return outputs[0] if spec is None else tree_unflatten(outputs, spec)
        out = func(*args, **kwargs)
        if known is None:  # seen: not one to remake
            return out
        OPS["computed"] += 1
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if len(_OUTPUTS) > 100_000:
            _OUTPUTS.clear()
        _OUTPUTS[key] = _made(out, inputs)
        return out


def peak_bytes(run: Callable[[], Any], autocast: torch.dtype | None = None) -> tuple[int, str]:
    """The most bytes the tensors ``run()`` creates hold at once (its output included while it lives), under
    ``torch.no_grad`` and, with ``autocast``, :class:`MetaAutocast`; and the op at the peak. Run it on ``meta``
    tensors to measure a full-size computation without its memory."""
    tracker = LiveBytes()
    casting = MetaAutocast(autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), MetaOpCache(), tracker, casting:
        out = run()
        del out
    return tracker.peak, tracker.peak_op


@contextlib.contextmanager
def flash_like_attention() -> Iterator[None]:
    """Make SDPA keep what flash / memory-efficient attention keeps for its backward: q, k, v, out, log-sum-exp."""

    class _SDPA(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args) :]])[:3]
        return _SDPA.apply(q, k, v)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


class _FusedRMSNorm(torch.autograd.Function):
    """``rms_norm`` keeping what the GPU's fused kernel keeps for its backward: the input, a float32 rstd per row
    (``rows``) and the weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, rows: tuple[int, ...]) -> torch.Tensor:
        ctx.save_for_backward(x, torch.empty(*rows, dtype=torch.float32, device=x.device), weight)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight = ctx.saved_tensors[-1]
        return torch.empty_like(grad), None if weight is None else torch.empty_like(weight), None


@contextlib.contextmanager
def fused_like_rms_norm() -> Iterator[None]:
    """Make ``F.rms_norm`` (``torch.nn.RMSNorm``: FLUX.1's and FLUX.2's q/k norms) keep what it keeps on a CUDA / ROCm
    GPU: the fused kernel's input and float32 rstd (measured on an H200, torch 2.11, with and without autocast:
    ``dev/benchmarks/2026-12-01/norms33e.txt``). On the CPU and the meta device torch decomposes it,
    and autograd keeps float32 copies of the input instead. A weight whose dtype differs from the input's (NF4's float32
    norms) takes the decomposed path on the GPU too, and is left alone here."""
    rms = torch.nn.functional.rms_norm

    def rms_norm(
        input: torch.Tensor,
        normalized_shape: Sequence[int],
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor:
        if weight is not None and weight.dtype != input.dtype:
            return rms(input, normalized_shape, weight, eps)
        n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
        rows = (*input.shape[: input.dim() - n], *[1] * n)
        out: torch.Tensor = _FusedRMSNorm.apply(input, weight, rows)
        return out

    torch.nn.functional.rms_norm = rms_norm
    try:
        yield
    finally:
        torch.nn.functional.rms_norm = rms


_CONTAINERS = (dict, collections.OrderedDict, list, set)  # a module's children, hooks, lists (not its config)


def module_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to change and run, fast: each module a new object with its own attributes and copies of its
    children, parameters and hooks (its forward, checkpointing flags, train mode and children can be set without
    touching ``model``); the parameters, buffers, other objects and empty hook tables shared (what the planner's
    checkpointing and forward passes on the ``meta`` device never change). A fraction of ``copy.deepcopy``'s time."""
    copies: dict[int, nn.Module] = {}

    def copy(module: nn.Module) -> nn.Module:
        if id(module) not in copies:
            clone = copies[id(module)] = type(module).__new__(type(module))
            state = module.__dict__
            clone.__dict__.update({k: v.copy() if type(v) in _CONTAINERS and v else v for k, v in state.items()})
            for name, child in module._modules.items():
                if child is not None:
                    clone._modules[name] = copy(child)
        return copies[id(module)]

    return copy(model)


def _tensors(inputs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a forward's keyword ``inputs``, one level into lists and tuples."""
    found: list[torch.Tensor] = []
    for value in inputs.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


def saved_activation_bytes(
    model: nn.Module,
    inputs: dict[str, Any],
    attention: Literal["flash_like", "as_run"] = "flash_like",
    autocast: torch.dtype | None = None,
    fused_rms_norm: bool = True,
) -> tuple[float, float, float]:
    """Bytes autograd keeps from one forward pass of ``model`` (on the meta device), the largest single tensor, and
    the bytes the model's :class:`~lightning_lora.model.recompute.InputOffloader` (if any) moves off the device.

    ``attention``: ``flash_like`` counts SDPA as the GPU's fused kernels keep it (on the meta device PyTorch would run
    its math backend, which keeps the attention matrix), and ``F.rms_norm`` as the GPU's fused kernel keeps it
    (:func:`fused_like_rms_norm`; ``fused_rms_norm`` false: decomposed, as NF4's float32 norm weights run it);
    ``as_run`` leaves SDPA and ``rms_norm`` alone (real tensors on a device whose kernel is the fused one, as
    ``dev/probes/saved_share.py`` measures compiled blocks on the CPU). ``autocast``: the forward runs under
    :class:`MetaAutocast` to this dtype, as training runs under CUDA autocast: the norms keep
    float32 copies of their inputs and return float32, and each linear layer keeps its own low-precision copy of a
    float32 input (a FLUX.2 klein block at 1024² within 0.4% of what it kept on an H200).

    Parameters and buffers are not counted (they are static memory); tensors sharing storage are counted once, and
    a moved input whose storage something else keeps on the device counts as kept (moving it frees nothing).
    """
    static = {p.untyped_storage()._cdata for p in model.parameters()}
    static |= {b.untyped_storage()._cdata for b in model.buffers()}
    seen: set[int] = set()
    sizes: list[int] = []
    moved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in static and key not in seen:
            seen.add(key)
            sizes.append(t.untyped_storage().nbytes())
        return t

    def pack_moved(t: torch.Tensor) -> torch.Tensor:
        moved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    offloader = getattr(model, "_lora_input_offloader", None)  # its hooks hide the checkpoints' inputs from ours
    observed = offloader.observed(pack, pack_moved) if offloader is not None else contextlib.nullcontext()
    counted_attention = flash_like_attention() if attention == "flash_like" else contextlib.nullcontext()
    fused = attention == "flash_like" and fused_rms_norm
    counted_norm = fused_like_rms_norm() if fused else contextlib.nullcontext()
    casting = MetaAutocast(autocast) if autocast is not None else contextlib.nullcontext()
    # The op cache serves meta tensors only; over real ones (a compiled region measured on a device) it would be a
    # dispatch mode torch.compile refuses to trace under, for nothing.
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), _tensors(inputs)))
    with (
        MetaOpCache() if on_meta else contextlib.nullcontext(),
        observed,
        counted_attention,
        counted_norm,
        casting,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        model(**inputs)
    offloaded = sum(n for key, n in moved.items() if key not in seen)
    return float(sum(sizes)), float(max(sizes, default=0)), float(offloaded)
