"""model.offload_activations: the inputs checkpointed blocks keep for their recomputation wait in CPU memory.

On the GPU they are copied to pinned memory on a side stream; these CPU tests run the same hooks with a plain copy
(``copy_devices=("cpu",)``), so that what the forward keeps, and the gradients, can be checked.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_model, build_tiny, on_device, random_inputs, two_step_grads

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions
from lightning_lora.model.recompute import InputOffloader
from lightning_lora.precision import BF16


def _build(folder: Path, offload_activations: bool, every: int = 1, family: Any = None) -> torch.nn.Module:
    model = build_tiny(folder, 0, True, every, family, offload_activations)
    offloader = model._lora_input_offloader
    assert (offloader is not None) == offload_activations
    if offloader is not None:  # move CPU tensors too, however small: the GPU path, observable here
        offloader.copy_devices, offloader.min_bytes = ("cpu",), 0
    return model


@pytest.mark.parametrize("every", [1, 2])
def test_offloaded_inputs_give_the_same_gradients(tiny_flux_dir: Path, every: int) -> None:
    plain = two_step_grads(_build(tiny_flux_dir, False, every))
    model = _build(tiny_flux_dir, True, every)
    offloaded = two_step_grads(model)
    assert model._lora_input_offloader.moved_bytes > 0
    for before, after in zip(plain, offloaded, strict=True):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(after[name], grad, rtol=0, atol=0)


@pytest.mark.gpu
def test_offloaded_inputs_go_through_pinned_memory_on_a_side_stream_on_a_gpu(tiny_flux_dir: Path) -> None:
    """On a GPU the checkpointed blocks' inputs are copied to pinned CPU memory on a side CUDA stream as the forward
    saves them, and back when the backward recomputes each block: the gradients are those kept on the device."""
    grads = {}
    for offload in (False, True):
        model = build_tiny(tiny_flux_dir, 0, True, 1, None, offload).cuda()
        offloader = model._lora_input_offloader
        if offloader is not None:
            offloader.min_bytes = 0  # the tiny model's inputs are small: move them all
        model.zero_grad()
        model(**on_device(random_inputs(Flux(), model, seed=1), "cuda"))[0].square().mean().backward()
        grads[offload] = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
    assert offloader is not None and offloader.moved_bytes > 0
    (stream,) = offloader._streams.values()
    assert stream != torch.cuda.current_stream()
    for name, grad in grads[False].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads[True][name], grad)


def test_with_offloaded_blocks_too(tiny_flux_dir: Path) -> None:
    """Offloaded blocks that checkpoint_every leaves out are recomputed anyway: their inputs move as well."""
    plain = two_step_grads(_build(tiny_flux_dir, False, 2))
    model = build_tiny(tiny_flux_dir, 3, True, 2, offload_activations=True)
    offloader = model._lora_input_offloader
    offloader.copy_devices, offloader.min_bytes = ("cpu",), 0
    moved: list[int] = []
    pack = offloader.pack
    offloader.pack = lambda t: moved.append(t.numel()) or pack(t)
    offloaded = two_step_grads(model)
    # Blocks 0 and 2 (every 2nd) plus the offloaded block 1 or 3: more checkpointed blocks than checkpoint_every's.
    plain_model = _build(tiny_flux_dir, True, 2)
    plain_moved: list[int] = []
    plain_pack = plain_model._lora_input_offloader.pack
    plain_model._lora_input_offloader.pack = lambda t: plain_moved.append(t.numel()) or plain_pack(t)
    two_step_grads(plain_model)
    assert len(moved) > len(plain_moved)
    for before, after in zip(plain, offloaded, strict=True):
        for name, grad in before.items():
            torch.testing.assert_close(after[name], grad)  # recomputing more blocks: rounding


def test_offloaded_inputs_of_a_unet(tiny_sdxl_dir: Path) -> None:
    """The UNet's checkpointing wraps ResNets and transformer blocks: their inputs go the same way."""
    from lightning_lora.families.sdxl import SDXL

    plain = two_step_grads(_build(tiny_sdxl_dir, False, family=SDXL()), SDXL())
    model = _build(tiny_sdxl_dir, True, family=SDXL())
    offloaded = two_step_grads(model, SDXL())
    assert model._lora_input_offloader.moved_bytes > 0
    for before, after in zip(plain, offloaded, strict=True):
        for name, grad in before.items():
            torch.testing.assert_close(after[name], grad, rtol=0, atol=0)


def test_the_forward_keeps_no_block_input(tiny_flux_dir: Path) -> None:
    """After the forward, every block input that was moved is gone from its device (nothing else holds it), and
    each checkpointed block moved its hidden states: the memory is really given back."""
    model = _build(tiny_flux_dir, True)
    offloader = model._lora_input_offloader
    originals: list[weakref.ref] = []
    pack = offloader.pack

    def recording_pack(t: torch.Tensor) -> Any:
        originals.append(weakref.ref(t))
        return pack(t)

    offloader.pack = recording_pack
    output = model(**random_inputs(Flux(), model, seed=1))[0]
    gc.collect()
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    hidden = [r for r in originals if r() is None or r().dim() == 3]
    assert len(hidden) >= blocks  # each block's hidden states (and the double blocks' text states)
    alive = [r() for r in originals if r() is not None and r().dim() == 3]
    assert not alive, [t.shape for t in alive]
    output.square().mean().backward()  # and the backward still finds them
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_small_inputs_and_other_devices_stay_where_they_are() -> None:
    offloader = InputOffloader(min_bytes=1024)
    small, cpu = torch.zeros(8), torch.zeros(1024)
    assert offloader.pack(small) is small and offloader.pack(cpu) is cpu  # CPU training: nothing to move
    assert offloader.moved_bytes == 0
    meta = torch.empty(1024, device="meta")
    assert offloader.pack(meta) is meta and offloader.moved_bytes == 4096  # the planner: counted, not copied


def test_an_input_shared_by_several_blocks_moves_once() -> None:
    """SDXL hands the same text embeddings to every transformer block: alive elsewhere, moving them again frees
    nothing and each copy would come back in the backward."""
    offloader = InputOffloader(copy_devices=("cpu",), min_bytes=0)
    shared, other = torch.randn(64), torch.randn(64)
    first = offloader.pack(shared)
    assert first is not shared and torch.equal(offloader.unpack(first), shared)  # moved (a copy)
    assert offloader.pack(shared) is shared  # the second block's: kept as it is
    assert offloader.pack(other) is not other
    assert offloader.moved_bytes == 2 * 64 * 4


def test_offload_activations_needs_checkpointing(tiny_flux_dir: Path) -> None:
    from lightning_lora.module import LoraModule

    with pytest.raises(ConfigError, match="model.offload_activations.*gradient_checkpointing: true"):
        LoraModule(str(tiny_flux_dir), offload_activations=True)
    with pytest.raises(ConfigError, match="gradient_checkpointing: true"):
        build_model(Flux(), ModelSource(str(tiny_flux_dir)), LoraOptions(rank=2), offload_activations=True)


def test_planner_counts_the_inputs_off_the_device(tiny_flux_dir: Path) -> None:
    """The planned activations drop by exactly what the offloader moves on the meta device; the rest is unchanged."""
    from lightning_lora.module import LoraModule
    from lightning_lora.plan import plan_training

    def plan(offload: bool) -> Any:
        module = LoraModule(
            str(tiny_flux_dir),
            lora=LoraOptions(rank=2),
            gradient_checkpointing=True,
            offload_activations=offload,
        )
        module.use_precision(BF16(dtype="fp32"))
        return plan_training(module.recipe, 2048, 2048, 1, 64)  # block inputs of 2 MiB: above MIN_OFFLOAD_BYTES

    kept, moved = plan(False), plan(True)
    assert moved.activations < kept.activations
    assert any("offload_activations" in note for note in moved.notes)
    gib = float(moved.notes[-1].split(": ")[1].split(" GiB")[0])
    assert moved.activations == pytest.approx(kept.activations - gib, abs=0.006)
    assert moved.transient == pytest.approx(kept.transient)
    assert moved.weights == kept.weights
