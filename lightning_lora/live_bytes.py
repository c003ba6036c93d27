"""The transient peak of a computation, measured on the ``meta`` device: the most bytes its tensors hold at once.

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
  copy and the float32 output (``tests/test_live_bytes.py``).

:func:`peak_bytes` runs a function under both. Attention should run under ``plan._flash_like_attention`` (what the
GPU's flash / memory-efficient kernels allocate: no score matrix).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LiveBytes", "MetaAutocast", "peak_bytes"]

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


def peak_bytes(run: Callable[[], Any], autocast: torch.dtype | None = None) -> tuple[int, str]:
    """The most bytes the tensors ``run()`` creates hold at once (its output included while it lives), under
    ``torch.no_grad`` and, with ``autocast``, :class:`MetaAutocast`; and the op at the peak. Run it on ``meta``
    tensors to measure a full-size computation without its memory."""
    tracker = LiveBytes()
    casting = MetaAutocast(autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), tracker, casting:
        out = run()
        del out
    return tracker.peak, tracker.peak_op
