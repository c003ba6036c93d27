"""Block offloading: keep the frozen weights of some repeated blocks in CPU memory and stream them in when needed.

This is how a model whose bf16 weights alone nearly fill the card trains on it (FLUX.1-dev: 22.2 GiB of weights on a
24 GB card; kohya calls it ``blocks_to_swap``). ``offload_blocks: N`` picks N of the model's repeated blocks (FLUX's
double and single blocks, the UNet's transformer blocks), spread evenly so that the blocks computed between two
offloaded ones hide the copy, and:

* keeps their frozen tensors (base weights, norms, biases, FP8 scales) in pinned CPU memory; on the GPU each is an
  empty placeholder, so moving the model to the GPU moves none of it and the optimizer, peft and checkpoints see the
  same parameters as before. LoRA parameters stay on the GPU;
* recomputes them in the backward pass (gradient checkpointing of those blocks, switched on for them if the model's
  own checkpointing is off): a block that kept its activations would also keep its weights for the backward;
* loads a block's tensors on a side CUDA stream one offloaded block ahead (in the forward order in the forward pass
  and in the reverse order in the backward pass, where each block's turn is signalled by the gradient of its output)
  and drops the others: at most two offloaded blocks are on the GPU at a time.

The extra cost is the copy: each offloaded block crosses PCIe twice per step (forward, and the recomputation in the
backward), hidden behind the compute of the blocks in between when the link keeps up. On the CPU the "copy" is the
tensor itself: the same bookkeeping runs and is what the tests check.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.model.recompute import ensure_recomputed

__all__ = [
    "BlockOffloader",
    "check_block_count",
    "offload_blocks",
    "offloaded_blocks",
    "pick_offloaded",
    "repeated_blocks",
]

# Children that run in another order than they are registered: diffusers' UNets register ``up_blocks`` before
# ``mid_block``, which runs between the down and the up blocks.
_RUNS_BEFORE = {"mid_block": "up_blocks"}


def repeated_blocks(denoiser: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (``_repeated_blocks``) in the order they run, outermost only."""
    kinds = set(getattr(denoiser, "_repeated_blocks", None) or ())
    children = dict(denoiser.named_children())
    for child, before in _RUNS_BEFORE.items():
        if child in children and before in children:
            names = [n for n in children if n != child]
            names.insert(names.index(before), child)
            children = {n: children[n] for n in names}
    found: list[nn.Module] = []
    for top in children.values():
        inside: set[int] = set()
        for module in top.modules():  # pre-order: a block comes before what it contains
            if id(module) in inside:
                continue
            if type(module).__name__ in kinds:
                found.append(module)
                inside.update(id(m) for m in module.modules())
    return found


def offloaded_blocks(denoiser: nn.Module, count: int) -> list[nn.Module]:
    """The ``count`` blocks ``offload_blocks`` moves out (checked against the model)."""
    if count == 0:
        return []
    blocks = repeated_blocks(denoiser)
    if not blocks:
        raise ConfigError(
            f"model.offload_blocks: {type(denoiser).__name__} declares no repeated blocks to offload; set "
            "model.offload_blocks: 0."
        )
    check_block_count(count, len(blocks))
    return [blocks[i] for i in pick_offloaded(count, len(blocks))]


def pick_offloaded(count: int, total: int) -> list[int]:
    """``count`` indices among ``total`` blocks, spread evenly (the middle of each of ``count`` equal stretches)."""
    return [(2 * i + 1) * total // (2 * count) for i in range(count)]


def check_block_count(count: int, total: int) -> None:
    """Refuse more offloaded blocks than the model has (the other offloading rules are the recipe's:
    :meth:`lightning_lora.model.recipe.ModelRecipe.check`)."""
    if count > total:
        raise ConfigError(
            f"model.offload_blocks: {count} is more than the model's {total} repeated blocks: use at most {total}."
        )


@dataclass
class _Slot:
    """One frozen tensor of an offloaded block: where it lives on the module, and its CPU copy."""

    module: nn.Module
    name: str
    is_param: bool
    host: torch.Tensor

    def current(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    def assign(self, tensor: torch.Tensor) -> None:
        if self.is_param:
            self.current().data = tensor
        else:
            self.module._buffers[self.name] = tensor


@dataclass
class _Block:
    index: int
    module: nn.Module
    slots: list[_Slot]
    loaded: bool = False
    pending: torch.cuda.Event | None = None  # the copy in flight
    device: torch.device | None = None
    nbytes: int = field(default=0)


class BlockOffloader:
    """Streams the frozen tensors of ``blocks`` between CPU memory and the device the model is on (see module doc)."""

    def __init__(self, blocks: Sequence[nn.Module], pin: bool) -> None:
        self.blocks = [self._offload(i, b, pin) for i, b in enumerate(blocks)]
        self.loads = 0  # number of block copies to the device (tests and diagnosis)
        self._streams: dict[torch.device, Any] = {}
        for block in self.blocks:
            block.module.register_forward_pre_hook(self._make_pre_hook(block))
            block.module.register_forward_hook(self._make_post_hook(block))

    @staticmethod
    def _offload(index: int, module: nn.Module, pin: bool) -> _Block:
        slots: list[_Slot] = []
        for owner in module.modules():
            named: list[tuple[str, torch.Tensor, bool]] = [
                (n, p, True) for n, p in owner._parameters.items() if p is not None and not p.requires_grad
            ]
            named += [(n, b, False) for n, b in owner._buffers.items() if b is not None]
            for name, tensor, is_param in named:
                host = tensor.detach().to("cpu", copy=True)
                slots.append(_Slot(owner, name, is_param, host.pin_memory() if pin else host))
        block = _Block(index, module, slots, nbytes=sum(s.host.nbytes for s in slots))
        BlockOffloader._evict(block)
        return block

    @property
    def offloaded_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def resident(self) -> list[int]:
        """Indices of the offloaded blocks whose tensors are on the device now."""
        return [b.index for b in self.blocks if b.loaded]

    # -- moving tensors ------------------------------------------------------------------------------------------
    def _load(self, block: _Block) -> None:
        if block.loaded:
            return
        device = block.device = block.slots[0].current().device
        # Normal tensors even when the load happens under torch.inference_mode (validation, prediction): an
        # inference tensor left as a parameter's data would break the next training step's backward.
        with torch.inference_mode(False):
            if device.type == "cuda":
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device)
                stream = self._streams[device]
                compute = torch.cuda.current_stream(device)
                # Allocated on the compute stream; the copy waits for the work queued so far, which may still use
                # memory the allocator is handing out again.
                copies = [torch.empty_like(s.host, device=device) for s in block.slots]
                stream.wait_stream(compute)
                with torch.cuda.stream(stream):
                    for dst, slot in zip(copies, block.slots, strict=True):
                        dst.copy_(slot.host, non_blocking=True)
                block.pending = stream.record_event()
            else:  # a real copy on the CPU too, so that eviction frees memory here as it does on a GPU
                copies = [slot.host.to(device, copy=True) for slot in block.slots]
        for dst, slot in zip(copies, block.slots, strict=True):
            slot.assign(dst)
        block.loaded = True
        self.loads += 1

    @staticmethod
    def _wait(block: _Block) -> None:
        if block.pending is not None:
            torch.cuda.current_stream(block.device).wait_event(block.pending)
            block.pending = None

    @staticmethod
    def _evict(block: _Block) -> None:
        BlockOffloader._wait(block)  # never hand back memory a copy is still writing
        with torch.inference_mode(False):
            for slot in block.slots:
                slot.assign(torch.empty(0, dtype=slot.host.dtype, device=slot.current().device))
        block.loaded = False

    def _turn(self, block: _Block, upcoming: _Block | None) -> None:
        """``block`` runs now and ``upcoming`` is the next offloaded block to run: load both, drop the others."""
        for other in self.blocks:
            if other.loaded and other is not block and other is not upcoming:
                self._evict(other)
        self._load(block)
        self._wait(block)
        if upcoming is not None:
            self._load(upcoming)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _make_pre_hook(self, block: _Block) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # recomputation: the output-gradient hook already loaded this block
                self._load(block)
                self._wait(block)
                return
            following = self.blocks[block.index + 1] if block.index + 1 < len(self.blocks) else None
            self._turn(block, following)

        return pre_hook

    def _make_post_hook(self, block: _Block) -> Any:
        previous = self.blocks[block.index - 1] if block.index > 0 else None

        def on_output_grad(grad: torch.Tensor) -> None:
            self._turn(block, previous)

        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or _in_backward():
                return
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(on_output_grad)

        return post_hook


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def offload_blocks(denoiser: nn.Module, chosen: list[nn.Module], device: torch.device) -> BlockOffloader | None:
    """Offload the ``chosen`` blocks of ``denoiser`` (:func:`offloaded_blocks`; none: nothing to do) and make sure
    they are recomputed in backward.

    Call it with the model still on the CPU, before it moves to ``device``: the offloaded tensors never go there.
    """
    if not chosen:
        return None
    count = len(chosen)
    if count < 3:
        warnings.warn(
            f"model.offload_blocks: {count} saves no weight memory: two offloaded blocks are on the GPU at a time "
            "(the one running and the next one, being copied). Use 3 or more.",
            stacklevel=2,
        )
    ensure_recomputed(denoiser, *chosen)
    offloader = BlockOffloader(chosen, pin=device.type == "cuda")
    denoiser._lora_offloader = offloader  # type: ignore[assignment]  # reachable for tests, monitoring, the bench
    return offloader
