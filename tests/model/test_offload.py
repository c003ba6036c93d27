"""Block offloading (model.offload_blocks) on the tiny FLUX and SDXL: same gradients, weights on the device only
while their block runs, recomputation, the planner's figure, and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    build_model,
    build_tiny,
    lora_model,
    on_device,
    precision_for,
    random_inputs,
    run_cli,
    two_step_grads,
    write_config,
)

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions
from lightning_lora.model.offload import BlockOffloader, pick_offloaded, repeated_blocks
from lightning_lora.precision import BF16, FP8, NF4


def _empty(block: torch.nn.Module) -> list[bool]:
    frozen = [p for p in block.parameters() if not p.requires_grad] + list(block.buffers())
    return [t.numel() == 0 for t in frozen]


@pytest.mark.parametrize(("checkpointing", "every", "count"), [(False, 1, 3), (True, 1, 4), (True, 2, 3)])
def test_offloading_trains_the_same_gradients(tiny_flux_dir: Path, checkpointing: bool, every: int, count: int) -> None:
    plain = two_step_grads(build_tiny(tiny_flux_dir, 0, checkpointing, every))
    model = build_tiny(tiny_flux_dir, count, checkpointing, every)
    offloader = model._lora_offloader
    assert isinstance(offloader, BlockOffloader) and len(offloader.blocks) == count
    offloaded = two_step_grads(model)
    for before, after in zip(plain, offloaded, strict=True):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(after[name], grad)  # recomputation may reorder float sums
    # Step 1 loads every block in the forward and all but the last again in the backward; step 2 starts with the
    # first block still loaded from the end of the backward.
    assert offloader.loads == (2 * count - 1) + (2 * count - 2)
    assert len(offloader.resident) <= 2


def _cuda_grads(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """:func:`helpers.two_step_grads` on the GPU: the tiny FLUX's LoRA gradients of two backward passes."""
    grads = []
    for seed in (1, 3):
        model.zero_grad()
        model(**on_device(random_inputs(Flux(), model, seed=seed), "cuda"))[0].square().mean().backward()
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad})
    return grads


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_blocks_stream_in_on_a_side_stream_on_a_gpu(tiny_flux_dir: Path, checkpointing: bool) -> None:
    """On a GPU each offloaded block's tensors come from pinned memory on a side CUDA stream, one block ahead, and the
    compute stream waits for the copy before the block runs: the gradients are those of the model kept whole."""

    def built(count: int) -> torch.nn.Module:  # build_tiny's model, built for the GPU (pinned host copies)
        options = {"gradient_checkpointing": checkpointing, "offload_blocks": count, "device": torch.device("cuda")}
        return lora_model(Flux(), tiny_flux_dir, rank=2, alpha=None, scale=0.1, train=True, **options).cuda()

    plain = _cuda_grads(built(0))
    model = built(3)
    offloader = model._lora_offloader
    assert all(slot.host.is_pinned() for block in offloader.blocks for slot in block.slots)
    offloaded = _cuda_grads(model)
    (stream,) = offloader._streams.values()
    assert stream != torch.cuda.current_stream()  # the copies ran beside the compute
    for before, after in zip(plain, offloaded, strict=True):
        assert before.keys() == after.keys()
        for name, grad in before.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(after[name], grad)
    assert offloader.loads == (2 * 3 - 1) + (2 * 3 - 2) and len(offloader.resident) <= 2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloading_a_unet(tiny_sdxl_dir: Path, checkpointing: bool) -> None:
    """SDXL's repeated blocks are transformer blocks nested in the UNet's down / mid / up blocks."""
    from lightning_lora.families.sdxl import SDXL

    plain = two_step_grads(build_tiny(tiny_sdxl_dir, 0, checkpointing, family=SDXL()), SDXL())
    model = build_tiny(tiny_sdxl_dir, 3, checkpointing, family=SDXL())
    assert len(repeated_blocks(model)) > 3
    offloaded = two_step_grads(model, SDXL())
    for before, after in zip(plain, offloaded, strict=True):
        for name, grad in before.items():
            torch.testing.assert_close(after[name], grad)
    assert model._lora_offloader.loads == (2 * 3 - 1) + (2 * 3 - 2)  # in the order they run: no extra copies
    assert all(all(_empty(b.module)) for b in model._lora_offloader.blocks if b.index not in (0,))


def test_blocks_are_listed_in_the_order_they_run(tiny_sdxl_dir: Path) -> None:
    """diffusers' UNet registers up_blocks before mid_block; offloading must follow the order of execution, or every
    prefetch loads the wrong block."""
    from lightning_lora.families.sdxl import SDXL

    model = build_tiny(tiny_sdxl_dir, 0, family=SDXL())
    blocks = repeated_blocks(model)
    assert any(n.startswith("mid_block") for n, m in model.named_modules() if m in blocks)
    ran: list[int] = []
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: ran.append(i))
    with torch.no_grad():
        model(**random_inputs(SDXL(), model, seed=1))
    assert ran == list(range(len(blocks)))


def test_weights_are_on_the_device_only_while_their_block_runs(tiny_flux_dir: Path) -> None:
    model = build_tiny(tiny_flux_dir, 4)
    blocks = repeated_blocks(model)
    assert len(blocks) == 4  # 2 double + 2 single: all offloaded
    # Before any step every offloaded tensor is an empty placeholder: moving the model moves none of it.
    assert all(all(_empty(b)) for b in blocks)
    assert all(not p.numel() == 0 for b in blocks for p in b.parameters() if p.requires_grad)  # LoRA stays
    seen: list[tuple[int, list[int]]] = []

    def watch(index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            assert not any(_empty(module)), f"block {index} ran without its weights"
            seen.append((index, model._lora_offloader.resident))

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_hook(watch(i))
    with torch.no_grad():
        model(**random_inputs(Flux(), model, seed=1))
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    # While block i runs, block i + 1 is being copied; nothing else is on the device.
    assert [resident for _, resident in seen] == [[0, 1], [1, 2], [2, 3], [3]]
    assert all(_empty(blocks[0])) and all(_empty(blocks[1]))


def test_offloaded_blocks_are_recomputed(tiny_flux_dir: Path) -> None:
    """Without gradient checkpointing, the offloaded blocks are still recomputed: a block that kept its activations
    would keep its weights for the backward too."""
    from lightning_lora.plan.live_bytes import saved_activation_bytes

    model = build_tiny(tiny_flux_dir, 0)
    plain, _, _ = saved_activation_bytes(model, random_inputs(Flux(), model, seed=1))
    model = build_tiny(tiny_flux_dir, 3)
    fewer, _, _ = saved_activation_bytes(model, random_inputs(Flux(), model, seed=1))
    assert fewer < plain


def test_one_or_two_blocks_are_warned_about(tiny_flux_dir: Path) -> None:
    with pytest.warns(UserWarning, match="offload_blocks: 2 saves no weight memory.*3 or more"):
        build_tiny(tiny_flux_dir, 2)


def test_pick_offloaded_spreads_the_blocks() -> None:
    assert pick_offloaded(1, 57) == [28]
    assert pick_offloaded(3, 57) == [9, 28, 47]
    assert pick_offloaded(4, 4) == [0, 1, 2, 3]
    picked = pick_offloaded(12, 57)
    assert len(set(picked)) == 12 and picked == sorted(picked)
    gaps = {b - a for a, b in zip(picked, picked[1:], strict=False)}
    assert gaps <= {4, 5}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offload_blocks": 5}, "more than the model's 4 repeated blocks"),
        ({"offload_blocks": -1}, "must be 0"),
        ({"offload_blocks": 2, "precision": NF4(dtype="fp32")}, "not with NF4"),
        ({"offload_blocks": 3, "compile_blocks": True}, "compile_blocks"),
    ],
)
def test_offload_refusals(tiny_flux_dir: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_model(Flux(), ModelSource(str(tiny_flux_dir), dtype=torch.float32), LoraOptions(rank=2), **kwargs)


def test_the_module_refuses_before_loading(tiny_flux_dir: Path) -> None:
    from lightning_lora.module import LoraModule

    module = LoraModule(str(tiny_flux_dir), offload_blocks=1)
    with pytest.raises(ConfigError, match="model.offload_blocks"):
        module.use_precision(NF4())  # when fit starts, before any weight loads


def test_fp8_storage_base_offloads_its_buffers(tiny_flux_dir: Path) -> None:
    """FP8 storage keeps its weights and scales in buffers: they move out too, and the block still computes."""
    torch.manual_seed(0)
    source = ModelSource(str(tiny_flux_dir), dtype=torch.bfloat16)
    kwargs: dict[str, Any] = {"precision": FP8()}
    reference = build_model(Flux(), source, LoraOptions(rank=2), **kwargs)
    model = build_model(Flux(), source, LoraOptions(rank=2), offload_blocks=3, **kwargs)
    offloaded = model._lora_offloader.blocks
    assert any(not slot.is_param and slot.host.dtype == torch.float8_e4m3fn for b in offloaded for slot in b.slots)
    assert all(all(_empty(b.module)) for b in offloaded)
    inputs = {k: v.bfloat16() if torch.is_tensor(v) else v for k, v in random_inputs(Flux(), model, seed=1).items()}
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs)[0], reference(**inputs)[0], rtol=0, atol=0)


def test_planner_counts_the_weights_left_on_the_device(tiny_flux_dir: Path) -> None:
    """The planner's frozen-weight figure with offloading is the most the real model holds at once in a step."""
    from lightning_lora.module import LoraModule
    from lightning_lora.plan import plan_training
    from lightning_lora.plan.estimate import GIB

    module = LoraModule(str(tiny_flux_dir), lora=LoraOptions(rank=2), offload_blocks=3)
    module.use_precision(BF16(dtype="fp32"))
    model = module.build(torch.device("cpu"))
    offloader = model._lora_offloader

    def frozen_bytes() -> int:
        tensors = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    held: list[int] = []
    turn = offloader._turn

    def measured_turn(*args: Any) -> None:
        turn(*args)
        held.append(frozen_bytes())

    offloader._turn = measured_turn
    model(**random_inputs(Flux(), model, seed=1))[0].square().mean().backward()
    assert len(held) >= 3 + 2  # a turn per block forward, and per output gradient backward
    plan = plan_training(module.recipe, 32, 48, 1, 8)
    without = plan_training(module.recipe.replace(offload_blocks=0), 32, 48, 1, 8)
    assert plan.weights * GIB == pytest.approx(max(held))
    assert plan.weights < without.weights
    assert any("offload_blocks 3" in note for note in plan.notes)


def test_fit_with_offloading_trains_the_same_lora(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    """Through the CLI and Lightning's Trainer (moving the model, sample images without gradients, checkpoints)."""

    loras = []
    for offload in (0, 3):
        folder = tmp_path / f"offload{offload}"
        folder.mkdir()
        config = write_config(folder, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 4})
        cli = run_cli(["fit", "--config", str(config), "--model.offload_blocks", str(offload)])
        assert cli.trainer.global_step == 4
        assert (folder / "run" / "checkpoints" / "last.ckpt").is_file()
        loras.append(cli.model.trainable_state_dict())
    assert loras[0].keys() == loras[1].keys()
    for name, tensor in loras[0].items():
        torch.testing.assert_close(loras[1][name], tensor, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in loras[1].items() if "lora_B" in n)


@pytest.mark.parametrize(("mode", "checkpointing"), [("none", False), ("none", True), ("fp8", False)])
def test_evicted_weights_are_freed(tiny_flux_dir: Path, mode: str, checkpointing: bool) -> None:
    """What a block loads is released when it is evicted: nothing else (autograd's saved tensors, views) keeps the
    storage alive, in the forward and in the backward."""
    from torch.multiprocessing.reductions import StorageWeakRef

    dtype = torch.bfloat16 if mode == "fp8" else torch.float32
    model = build_model(
        Flux(),
        ModelSource(str(tiny_flux_dir), dtype=dtype),
        LoraOptions(rank=2),
        precision=precision_for(mode, dtype),
        gradient_checkpointing=checkpointing,
        offload_blocks=4,
    )
    offloader = model._lora_offloader
    loaded: dict[int, list[StorageWeakRef]] = {}
    load = offloader._load

    def watched(block: Any) -> None:
        was = block.loaded
        load(block)
        if not was:
            loaded.setdefault(block.index, []).extend(
                StorageWeakRef(s.current().untyped_storage()) for s in block.slots
            )

    offloader._load = watched
    inputs = {k: v.to(dtype) if torch.is_tensor(v) else v for k, v in random_inputs(Flux(), model, seed=1).items()}
    model(**inputs)[0].float().square().mean().backward()
    resident = set(offloader.resident)
    assert resident == {0} and set(loaded) == {0, 1, 2, 3}
    for index, refs in loaded.items():
        if index not in resident:
            assert all(ref.expired() for ref in refs), f"block {index}'s weights are still alive after eviction"


def test_inference_mode_leaves_normal_tensors(tiny_flux_dir: Path) -> None:
    """Lightning validates and predicts under torch.inference_mode: blocks loaded there are trained on next."""
    model = build_tiny(tiny_flux_dir, 3)
    with torch.inference_mode():
        model(**random_inputs(Flux(), model, seed=1))
    assert model._lora_offloader.resident  # the last block stays loaded into the training step
    model(**random_inputs(Flux(), model, seed=2))[0].square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_fp8_layers_of_offloaded_blocks_are_quantized_on_the_cpu() -> None:
    """The GPU never holds the offloaded blocks, not even while the base is quantized (here the "GPU" is meta)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.Linear(64, 64)))
    on_cpu = frozenset(id(m) for m in model[1].modules())
    assert FP8().quantize(model, torch.device("meta"), on_cpu) == 2
    assert model[0].weight.device.type == "meta"
    assert model[1][0].weight.device.type == "cpu" and model[1][0].weight.dtype == torch.float8_e4m3fn
