"""build_lora_model on a saved tiny FLUX folder: what is trainable, in which dtype, how many parameters, validation."""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from helpers import (
    build_model,
    build_tiny,
    count_compiled,
    count_compiled_graphs,
    graph_count,
    lora_model,
    nonzero_lora_b,
    random_inputs,
)

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.lora import LoraOptions, resolve_targets, trainable_parameters
from lightning_lora.model.assembly import apply_gradient_checkpointing, compile_repeated_blocks
from lightning_lora.model.offload import repeated_blocks

ATTENTION_SUFFIXES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")


def _build(folder: Path, dtype: torch.dtype = torch.float32, **lora: object) -> torch.nn.Module:
    return build_model(Flux(), ModelSource(pretrained=str(folder), dtype=dtype), LoraOptions(**lora))  # type: ignore[arg-type]


def _base_linears(folder: Path) -> dict[str, torch.nn.Linear]:
    base = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    return {n: m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}


def test_only_lora_params_train(tiny_flux_dir: Path) -> None:
    model = _build(tiny_flux_dir, rank=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n for n in (n for n, _ in model.named_parameters()) if "lora_" in n} == trainable
    assert model.training
    assert [id(p) for p in trainable_parameters(model)] == [id(p) for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("rank", [2, 4])
def test_trainable_count_matches_attention_preset(tiny_flux_dir: Path, rank: int) -> None:
    linears = _base_linears(tiny_flux_dir)
    targeted = {n: m for n, m in linears.items() if "transformer_blocks." in n and n.endswith(ATTENTION_SUFFIXES)}
    # Double blocks: 4 projections each; single blocks: to_q/k/v (they have no to_out).
    assert len(targeted) == 2 * 4 + 2 * 3
    expected = sum(rank * (m.in_features + m.out_features) for m in targeted.values())
    model = _build(tiny_flux_dir, rank=rank, targets="attention")
    assert sum(p.numel() for p in trainable_parameters(model)) == expected
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    assert wrapped == set(targeted)


def test_trainable_count_with_suffix_list(tiny_flux_dir: Path) -> None:
    linears = _base_linears(tiny_flux_dir)
    targeted = [m for n, m in linears.items() if n.endswith((".proj_mlp", ".ff.net.2"))]
    assert len(targeted) == 4
    model = _build(tiny_flux_dir, rank=3, targets=["proj_mlp", "ff.net.2"])
    assert sum(p.numel() for p in trainable_parameters(model)) == sum(
        3 * (m.in_features + m.out_features) for m in targeted
    )


def test_lora_params_are_float32_on_a_bf16_base(tiny_flux_dir: Path) -> None:
    model = _build(tiny_flux_dir, dtype=torch.bfloat16, rank=4)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())
    assert all(p.dtype == torch.bfloat16 for p in base.values() if p.is_floating_point())
    # Gaussian init (the default): B starts at zero, A does not.
    assert all(p.abs().sum() == 0 for n, p in lora.items() if "lora_B" in n)
    assert all(p.abs().sum() > 0 for n, p in lora.items() if "lora_A" in n)


@pytest.mark.parametrize(("rank", "alpha", "scale"), [(4, 8.0, 2.0), (4, None, 1.0), (8, 4.0, 0.5)])
def test_alpha_is_passed_through(tiny_flux_dir: Path, rank: int, alpha: float | None, scale: float) -> None:
    model = _build(tiny_flux_dir, rank=rank, alpha=alpha)
    layers = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "lora_A")]
    assert layers
    for layer in layers:
        assert layer.r["default"] == rank
        assert layer.scaling["default"] == pytest.approx(scale)
    assert model.peft_config["default"].lora_alpha == (alpha if alpha is not None else rank)


def test_dropout_is_passed_through(tiny_flux_dir: Path) -> None:
    model = _build(tiny_flux_dir, rank=2, dropout=0.25)
    drops = [m.lora_dropout["default"] for m in model.modules() if hasattr(m, "lora_dropout") and hasattr(m, "lora_A")]
    assert drops and all(isinstance(d, torch.nn.Dropout) and d.p == 0.25 for d in drops)


def test_gradient_checkpointing_flag(tiny_flux_dir: Path) -> None:
    assert _build(tiny_flux_dir, rank=2).gradient_checkpointing is False
    assert (
        build_model(
            Flux(),
            ModelSource(str(tiny_flux_dir), dtype=torch.float32),
            LoraOptions(rank=2),
            gradient_checkpointing=True,
        ).gradient_checkpointing
        is True
    )


def test_suffix_list_with_a_typo(tiny_flux_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.lora\.targets.*to_kk") as e:
        _build(tiny_flux_dir, targets=["to_q", "to_kk"])
    assert "['to_kk'] match no" in str(e.value)  # only the unmatched entry is named


def test_regex_and_preset_targets() -> None:
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.to_q = torch.nn.Linear(4, 4)
    model.block.other = torch.nn.LayerNorm(4)
    family = Flux()
    assert resolve_targets("attention", family, _TinyAttn()) == Flux.architecture.lora_presets["attention"]
    assert resolve_targets(r".*to_q", family, model) == r".*to_q"
    with pytest.raises(ConfigError, match=r"model\.lora\.targets.*matches no linear or convolution layer"):
        resolve_targets(r".*other", family, model)  # a norm is neither
    with pytest.raises(ConfigError, match=r"model\.lora\.targets.*neither a preset.*regular expression"):
        resolve_targets("to_q(", family, model)
    with pytest.raises(ConfigError, match=r"model\.lora\.targets"):
        resolve_targets([], family, model)


class _TinyAttn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.transformer_blocks[0].attn = torch.nn.Module()
        self.transformer_blocks[0].attn.to_q = torch.nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"rank": 0}, "model.lora.rank"),
        ({"rank": -3}, "model.lora.rank"),
        ({"alpha": -1.0}, "model.lora.alpha"),
        ({"alpha": 0.0}, "model.lora.alpha"),
        ({"dropout": 1.0}, "model.lora.dropout"),
        ({"dropout": -0.1}, "model.lora.dropout"),
    ],
)
def test_lora_options_validation(kwargs: dict[str, float], option: str) -> None:
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        LoraOptions(**kwargs)  # type: ignore[arg-type]


def test_lora_options_defaults() -> None:
    opts = LoraOptions(rank=8)
    assert opts.scale_alpha == 8.0
    assert LoraOptions(rank=8, alpha=16).scale_alpha == 16.0
    LoraOptions(dropout=0.0)
    LoraOptions(dropout=0.99)


def _grads_and_saved(folder: Path, checkpointing: bool, every: int) -> tuple[dict[str, torch.Tensor], float, set[str]]:
    from lightning_lora.plan.live_bytes import saved_activation_bytes

    model = build_tiny(folder, 0, checkpointing, every)
    inputs = random_inputs(Flux(), model, seed=1)
    saved, _, _ = saved_activation_bytes(model, inputs)
    model(**inputs)[0].square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, saved, {n for n, _ in model.named_parameters()}


def test_checkpoint_every_n_blocks(tiny_flux_dir: Path) -> None:
    """Checkpointing one block in N saves fewer activations than none and more than all, with the same gradients
    and the same parameter names (LoRA keys)."""
    plain, saved_plain, names = _grads_and_saved(tiny_flux_dir, False, 1)
    every, saved_every, names_every = _grads_and_saved(tiny_flux_dir, True, 1)
    half, saved_half, names_half = _grads_and_saved(tiny_flux_dir, True, 2)
    assert saved_every < saved_half < saved_plain
    assert names == names_every == names_half
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(every[name], grad)
        torch.testing.assert_close(half[name], grad)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        _grads_and_saved(tiny_flux_dir, True, 0)


def test_checkpointing_inside_each_block_is_diffusers_checkpointing(tiny_flux_dir: Path) -> None:
    """``in_blocks``: each repeated block's forward under the checkpoint instead of diffusers' wrapping of its call:
    the same loss and gradients bit for bit, the same tensors kept for the backward (the blocks' inputs), and the
    block's own ``forward`` marked as recomputed (what offloading asks, ``ensure_recomputed``)."""
    from lightning_lora.plan.live_bytes import saved_activation_bytes

    outside, inside = build_tiny(tiny_flux_dir, 0), build_tiny(tiny_flux_dir, 0)  # the same seed: the same model
    assert apply_gradient_checkpointing(outside, 1) == 0 and outside.is_gradient_checkpointing
    blocks = repeated_blocks(inside)
    assert apply_gradient_checkpointing(inside, 1, in_blocks=True) == len(blocks) >= 2
    assert not inside.is_gradient_checkpointing and all(getattr(b.forward, "recomputed", False) for b in blocks)
    inputs = random_inputs(Flux(), inside, seed=1)
    assert saved_activation_bytes(inside, inputs)[0] == saved_activation_bytes(outside, inputs)[0]
    plain = build_tiny(tiny_flux_dir, 0)
    assert saved_activation_bytes(inside, inputs)[0] < saved_activation_bytes(plain, inputs)[0] / 2
    losses, grads = [], []
    for model in (outside, inside):
        loss = model(**inputs)[0].square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert torch.equal(*losses) and grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    # offloading keeps diffusers' checkpointing: its saved-tensor hooks go around the (compiled) block's call
    offloaded = build_tiny(tiny_flux_dir, 0)
    assert apply_gradient_checkpointing(offloaded, 1, offload_inputs=True, in_blocks=True) == 0
    assert offloaded.is_gradient_checkpointing


def test_compiled_blocks_are_checkpointed_inside_and_run_once_a_step_not_twice(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``compile_blocks`` and every block checkpointed, a family whose checkpointing is its repeated blocks
    (``checkpoints_only_repeated_blocks``) has the checkpoint traced inside each compiled block: a training step calls
    each compiled block once, where diffusers' wrapping calls it again to recompute it in the backward (each call
    several milliseconds of host time on a GPU, dev/LOG.md, call 36). The same gradients both ways. Counted with a
    backend that runs the traced graphs (no code generation)."""
    graphs, calls = count_compiled(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tiny_flux_dir.parent / "compile-cache"))
    family = Flux(max_sequence_length=8)
    per_step, grads, blocks = {}, {}, 0
    for inside in (True, False):
        monkeypatch.setattr(Flux, "compiling", replace(Flux.compiling, checkpoints_only_repeated_blocks=inside))
        torch._dynamo.reset()
        try:
            torch.manual_seed(0)
            model = build_model(
                family,
                ModelSource(str(tiny_flux_dir), dtype=torch.float32),
                LoraOptions(rank=2),
                gradient_checkpointing=True,
                compile_blocks=True,
            )
            nonzero_lora_b(model)
            assert model.is_gradient_checkpointing is not inside
            inputs = random_inputs(family, model, 1, size=(32, 32))
            model.train()(**inputs)[0].square().mean().backward()  # the first step compiles
            model.zero_grad()
            calls.clear()
            model(**inputs)[0].square().mean().backward()
            per_step[inside] = sum(calls.values())
            grads[inside] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            blocks = len(repeated_blocks(model))
        finally:
            torch._dynamo.reset()
    assert graphs and blocks >= 2
    assert per_step == {True: blocks, False: 2 * blocks}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad)


def _bf16_step(folder: Path, skip_casts: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, LoRA gradients and the number of dtype copies of one autocast step on a bf16 base."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_lora.lora import set_lora_input_casts

    class CountCopies(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCopies.copies += func.overloadpacket is torch.ops.aten._to_copy
            return func(*args, **(kwargs or {}))

    # B starts at zero: make it non-zero so that A gets gradients too
    model = lora_model(Flux(), folder, rank=2, alpha=None, scale=0.1, dtype=torch.bfloat16, train=True)
    if skip_casts:
        assert set_lora_input_casts(model, enabled=False) == 14  # the attention preset's layers
    inputs = {
        k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in random_inputs(Flux(), model, seed=1).items()
    }
    with CountCopies(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs)[0].float().square().mean()
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, CountCopies.copies


def test_lora_input_casts_skipped_under_autocast_change_nothing_but_the_copies(tiny_flux_dir: Path) -> None:
    """peft's float32 cast of each LoRA layer's input is undone by autocast: without it, the same loss and the same
    gradients, bit for bit, with fewer copies."""
    loss, grads, copies = _bf16_step(tiny_flux_dir, skip_casts=False)
    loss_skipped, grads_skipped, copies_skipped = _bf16_step(tiny_flux_dir, skip_casts=True)
    assert torch.equal(loss, loss_skipped)
    assert grads.keys() == grads_skipped.keys()
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        assert torch.equal(grad, grads_skipped[name]), name
    # Two per layer in the forward, two in the backward where the input needs a gradient (not the first block's
    # q/k/v: nothing before them trains).
    assert copies - copies_skipped == 2 * 14 + 2 * (14 - 3)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_input_casts_are_skipped_only_under_mixed_precision(tiny_flux_dir: Path, precision: str) -> None:
    """Without autocast an input of another dtype could meet float32 adapter weights: the cast stays. A Trainer made
    in Python with a plain ``precision`` gives the module the base format it means (bf16-mixed: a bf16 base)."""
    from lightning.pytorch import Trainer

    from lightning_lora.module import LoraModule

    module = LoraModule(pretrained=str(tiny_flux_dir), lora=LoraOptions(rank=2))
    module.trainer = Trainer(accelerator="cpu", precision=precision, logger=False)
    module.setup("fit")
    module.configure_model()
    assert module.recipe.source.dtype == {"bf16-mixed": torch.bfloat16, "32-true": torch.float32}[precision]
    layers = [m for m in module.denoiser.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(layers) == 14
    assert all(m.cast_input_dtype_enabled is (precision == "32-true") for m in layers)


@pytest.mark.parametrize("family_name", ["flux", "sdxl", "sd15"])
def test_compile_blocks_compiles_the_repeated_blocks_and_the_family_regions(
    tiny_flux_dir: Path,
    tiny_sdxl_dir: Path,
    tiny_sd15_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    family_name: str,
) -> None:
    """FLUX: its double and single blocks. The UNets (SDXL, SD1.5): their transformer blocks alone (the ResNets
    compiled made the step no faster and every start longer: calls 52g and 53f). Each once, nothing else
    (``nn.Module.compile`` is recorded, not run)."""
    from lightning_lora.families.sd15 import SD15
    from lightning_lora.families.sdxl import SDXL

    compiled: list[str] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compiled.append(type(self).__name__))
    family, folder = {
        "flux": (Flux(), tiny_flux_dir),
        "sdxl": (SDXL(), tiny_sdxl_dir),
        "sd15": (SD15(), tiny_sd15_dir),
    }[family_name]
    with torch._dynamo.config.patch(recompile_limit=1):  # restored afterwards
        model = build_model(
            family, ModelSource(str(folder), dtype=torch.float32), LoraOptions(rank=2), compile_blocks=True
        )
        kinds = {
            "flux": {"FluxTransformerBlock", "FluxSingleTransformerBlock"},
            "sdxl": {"BasicTransformerBlock"},
            "sd15": {"BasicTransformerBlock"},
        }
        expected = sorted(type(m).__name__ for m in model.modules() if type(m).__name__ in kinds[family_name])
        assert len(set(expected)) == len(kinds[family_name])
        assert sorted(compiled) == expected
        # dynamo keeps a graph per parameter layout: the limit leaves room for every layout.
        layouts = {
            (type(m).__name__, tuple(p.shape for p in m.parameters()))
            for m in model.modules()
            if type(m).__name__ in kinds[family_name]
        }
        most = max(sum(1 for kind, _ in layouts if kind == k) for k in kinds[family_name])
        assert "ResnetBlock2D" not in compiled
        assert torch._dynamo.config.recompile_limit >= 4 * most


def test_cuda_graphs_compile_every_block_in_reduce_overhead_mode(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.cuda_graphs`` hands ``torch.compile`` the ``reduce-overhead`` mode for every compiled block (and the
    default mode without it); on a CPU it says the graphs need a GPU. It needs ``compile_blocks``."""
    modes: list[str | None] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: modes.append(kwargs.get("mode")))
    source = ModelSource(str(tiny_flux_dir), dtype=torch.float32)
    blocks = {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    for graphs, expected in [(True, "reduce-overhead"), (False, None)]:
        modes.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build_model(Flux(), source, LoraOptions(rank=2), compile_blocks=True, cuda_graphs=graphs)
        assert len(modes) == sum(type(m).__name__ in blocks for m in model.modules()) > 0
        assert set(modes) == {expected}
        said = [str(w.message) for w in caught if "model.cuda_graphs" in str(w.message)]
        assert len(said) == graphs and all("built on cpu" in text for text in said)
    with pytest.raises(ConfigError, match=r"model.cuda_graphs: true .*needs model.compile_blocks: true"):
        build_model(Flux(), source, LoraOptions(rank=2), cuda_graphs=True)


@pytest.mark.gpu
def test_cuda_graphed_blocks_train_as_the_default_compiled_blocks(tiny_flux_dir: Path) -> None:
    """On a GPU: a few optimizer steps through CUDA-graphed blocks, with an image size that changes in between (a
    graph recorded per size), end at the same LoRA weights as the default compiled blocks. The graphs read the
    weights where they were recorded, so the optimizer's in-place updates must reach every replay."""
    family = Flux(max_sequence_length=8)
    source = ModelSource(str(tiny_flux_dir), dtype=torch.float32)
    start: list[torch.Tensor] = []
    trained: dict[bool, list[torch.Tensor]] = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        try:
            torch.manual_seed(0)
            model = build_model(
                family, source, LoraOptions(rank=2), torch.device("cuda"), compile_blocks=True, cuda_graphs=graphs
            )
            model = nonzero_lora_b(model).cuda()
            params = list(trainable_parameters(model))
            start = [p.detach().clone() for p in params]
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            for step, size in enumerate([(32, 32), (32, 32), (32, 48), (32, 32), (32, 48), (32, 48)]):
                inputs = random_inputs(family, model, 1, seed=step, size=size)
                inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
                model(**inputs)[0].square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            trained[graphs] = [p.detach().clone() for p in params]
        finally:
            torch._dynamo.reset()
    assert all(not torch.equal(a, b) for a, b in zip(start, trained[True], strict=True))  # every tensor trained
    for a, b in zip(trained[False], trained[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _graphs_fit(
    folder: Path, model_dir: Path, photos: Path, graphs: bool, **options: object
) -> dict[str, torch.Tensor]:
    """A tiny fit with compiled blocks, with or without ``model.cuda_graphs``, and ``options`` (dotted config keys); no
    callbacks (samples, checkpoints). Returns the trained LoRA."""
    from helpers import run_cli, write_config

    overrides = {"model.compile_blocks": True, "model.cuda_graphs": graphs, "trainer.callbacks": [], **options}
    (folder / f"graphs{int(graphs)}").mkdir()
    config = write_config(folder / f"graphs{int(graphs)}", model_dir, photos, **overrides)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "model.cuda_graphs: true, but the model is built on cpu", UserWarning)
        cli = run_cli(["fit", "--config", str(config)])
    return {k: v.detach().cpu().clone() for k, v in cli.model.trainable_state_dict().items()}


def test_cuda_graphs_training_marks_each_micro_batch_and_keeps_its_gradients(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``model.cuda_graphs`` each micro-batch is one generation of the graphs' memory (torch's own rule starts one
    at the second micro-batch of an accumulated step, and at a block recomputed in the backward pass, and overwrites
    what is still in use), and the LoRA's gradients are tensors of their own, added into in place and zeroed between
    optimizer steps, never a graph's output. On the CPU (no graphs: the blocks compiled with a recording backend) the
    run trains the same LoRA, bit for bit, as without the option."""
    from lightning_lora.module import LoraModule

    count_compiled_graphs(monkeypatch)
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    seen: list[list[torch.Tensor]] = []

    def record(self: LoraModule, optimizer: torch.optim.Optimizer) -> None:
        seen.append([p.grad for p in trainable_parameters(self._require_model())])  # type: ignore[misc]

    monkeypatch.setattr(LoraModule, "on_before_optimizer_step", record, raising=False)
    options = {"trainer.accumulate_grad_batches": 2, "trainer.max_steps": 3}
    trained = {}
    for graphs in (True, False):
        marks.clear()
        seen.clear()
        trained[graphs] = _graphs_fit(tmp_path, tiny_flux_dir, photos_dir, graphs, **options)
        assert len(marks) == (6 if graphs else 0)  # 3 steps of 2 micro-batches
        assert len(seen) == 3 and all(g is not None for grads in seen for g in grads)
        kept = [all(a is b for a, b in zip(seen[0], later, strict=True)) for later in seen[1:]]
        assert kept == [graphs, graphs]  # the same tensors every step only with graphs
    for name, value in trained[True].items():
        assert torch.equal(value, trained[False][name]), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout",
    [
        "flux-nf4-checkpointed-inside-accumulate-2",  # flux_8gb's: NF4, every block checkpointed inside its region
        "sd15-checkpointed-outside",  # a UNet's checkpointing wraps the compiled block: recomputed in the backward
    ],
)
def test_cuda_graphed_blocks_train_through_fit_as_the_default_compiled_blocks(
    tmp_path: Path, tiny_sd15_dir: Path, photos_dir: Path, layout: str
) -> None:
    """On a GPU, through ``fit``: the layouts that failed in their first step with CUDA graphs (an accumulated step's
    second micro-batch, a block recomputed in the backward pass, each starting a new generation of the graphs' memory
    while the last one's tensors were in use) train the same LoRA as the default compiled blocks."""
    from lightning_lora.tiny.flux import save_tiny_flux

    options: dict[str, object] = {
        "trainer.accelerator": "gpu",
        "trainer.max_steps": 4,
        "model.gradient_checkpointing": True,
    }
    if layout.startswith("flux"):
        model_dir = save_tiny_flux(tmp_path / "tiny-flux64", seed=0, dim64=True)  # bitsandbytes' blocks of 64
        options |= {
            "trainer.precision": None,
            "trainer.plugins": {"class_path": "lightning_lora.precision.NF4"},
            "trainer.accumulate_grad_batches": 2,
        }
    else:
        model_dir = tiny_sd15_dir
        options["model.family"] = {"class_path": "lightning_lora.families.SD15", "init_args": {}}
    trained = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        try:
            trained[graphs] = _graphs_fit(tmp_path, model_dir, photos_dir, graphs, **options)
        finally:
            torch._dynamo.reset()
    assert trained[True].keys() == trained[False].keys()
    for name, value in trained[True].items():
        torch.testing.assert_close(value, trained[False][name], rtol=1e-3, atol=1e-4, msg=name)


def test_compiled_code_is_cached_where_a_reboot_keeps_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch's default compile cache is under /tmp (emptied by a reboot or a fresh container): ours is in the user's
    cache folder, unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    from lightning_lora.model.assembly import compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir() == tmp_path / "xdg" / "lightning-lora" / "torch-compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "lightning-lora" / "torch-compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"


def test_a_new_bucket_shape_compiles_once_not_every_step(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Buckets alternate image sizes from batch to batch. The compiled blocks compile for the first size, once more
    for the second (dynamo then makes the changing dimensions dynamic), and never again, whatever comes after.
    Counted with a backend that records each graph it is given (no code generation)."""
    graphs = count_compiled_graphs(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tiny_flux_dir.parent / "compile-cache"))
    torch._dynamo.reset()
    try:
        family = Flux(max_sequence_length=8)
        model = build_model(family, ModelSource(str(tiny_flux_dir), dtype=torch.float32), LoraOptions(rank=2))
        compile_repeated_blocks(model, extra=family.compiling.regions, streams=family.compiling.stream_sources)
        caplog.set_level("WARNING", logger="torch._dynamo")
        counts = []
        for size in [(32, 32), (32, 32), (32, 48), (32, 48), (48, 32), (32, 32), (48, 48), (32, 48)]:
            inputs = random_inputs(family, model, 1, size=size)
            model(**inputs)[0].square().mean().backward()
            counts.append(graph_count(graphs))
        assert counts[0] > 0 and counts[1] == counts[0]  # the same size again: nothing new
        assert counts[2] > counts[1]  # the second size: once more (now with dynamic sizes)
        assert counts[-1] == counts[3], counts  # then never again, for any size
        assert "recompile_limit" not in caplog.text  # compiled, not fallen back to eager at the limit
    finally:
        torch._dynamo.reset()


def test_identical_blocks_are_traced_once_per_class_not_once_per_block(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block is compiled in place, but dynamo keeps its graphs on the code of the class's ``forward``, and with
    torch's inlined nn modules its guards do not name the instance: 6 double and 10 single blocks trace as often as 1
    and 1 would (per class, once more where the first block's inputs differ: another stride into the first single
    one; and no gradient into the first double block, unless the family's ``stream_sources`` hooks give its inputs
    one, which saves that graph), so FLUX's 57 blocks are not 57 traces. The first single block's inputs had another
    stride (the double blocks' separate tensors, not the single blocks' slices of one) and compiled a graph of their
    own until the family's ``joined_streams`` hook laid them out as the single blocks do. The LoRA gradients are the
    same either way. Counted with a backend that records each graph (no code generation)."""
    graphs = count_compiled_graphs(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tiny_flux_dir.parent / "compile-cache"))
    family = Flux(max_sequence_length=8)
    traced: dict[tuple[int, bool], int] = {}
    grads: dict[tuple[int, bool], list[torch.Tensor]] = {}
    for double, single, hooked in [(2, 2, True), (6, 10, True), (2, 2, False)]:
        torch._dynamo.reset()
        try:
            torch.manual_seed(0)
            model = build_model(family, ModelSource(str(tiny_flux_dir), dtype=torch.float32), LoraOptions(rank=2))
            for name, count in [("transformer_blocks", double), ("single_transformer_blocks", single)]:
                blocks: torch.nn.ModuleList = getattr(model, name)  # more: copies of the tiny model's two blocks
                blocks.extend(copy.deepcopy(blocks[i % 2]) for i in range(len(blocks), count))
            streams, joins = (family.compiling.stream_sources, family.compiling.joined_streams) if hooked else ((), ())
            compile_repeated_blocks(model, extra=family.compiling.regions, streams=streams, joins=joins)
            graphs.clear()
            model.train()(**random_inputs(family, model, 1, size=(32, 32)))[0].square().mean().backward()
            traced[double + single, hooked] = graph_count(graphs)
            grads[double + single, hooked] = [p.grad for p in trainable_parameters(model)]
        finally:
            torch._dynamo.reset()
    assert traced == {(4, True): 2, (16, True): 2, (4, False): 4}
    for a, b in zip(grads[4, True], grads[4, False], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family_name", ["sdxl", "sd15"])
def test_the_unets_first_transformer_block_shares_the_graph_of_the_others(
    family_name: str, tiny_sdxl_dir: Path, tiny_sd15_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the ``attention`` preset (sdxl_24gb, sdxl_12gb) nothing before the UNet's first transformer block is
    trained: its input is the only one without a gradient, and dynamo, which guards on ``requires_grad``, compiled a
    graph for that one block (3 graphs in call 56's ``sdxl_24gb`` rows, traced again at each start). The family's
    ``stream_sources`` (the first attention's ``proj_in``) give it one, and the block shares the others' graph.
    Counted with a backend that records each graph (no code generation)."""
    from lightning_lora.families.sd15 import SD15
    from lightning_lora.families.sdxl import SDXL

    family, folder = {"sdxl": (SDXL(), tiny_sdxl_dir), "sd15": (SD15(), tiny_sd15_dir)}[family_name]
    graphs = count_compiled_graphs(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder.parent / "compile-cache"))
    traced: dict[bool, int] = {}
    grads: dict[bool, list[torch.Tensor]] = {}
    for hooked in (True, False):
        torch._dynamo.reset()
        try:
            torch.manual_seed(0)
            model = build_model(family, ModelSource(str(folder), dtype=torch.float32), LoraOptions(rank=2))
            compile_repeated_blocks(model, streams=family.compiling.stream_sources if hooked else ())
            graphs.clear()
            model.train()(**random_inputs(family, model, 1))[0].square().mean().backward()
            traced[hooked] = graph_count(graphs)
            grads[hooked] = [p.grad for p in trainable_parameters(model)]
        finally:
            torch._dynamo.reset()
    assert traced[True] == traced[False] - 1 >= 1, traced
    for a, b in zip(grads[True], grads[False], strict=True):  # the same training: only the input's gradient is new
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family_name", ["sdxl", "sd15"])
def test_the_unets_stream_sources_name_modules_of_their_real_architectures(family_name: str) -> None:
    """The names resolve in the full-size UNet of each family's known checkpoint (built on the meta device), where the
    first transformer block sits: SDXL's first level has no attention, SD1.5's has."""
    from diffusers import UNet2DConditionModel

    from lightning_lora.families.sd15 import SD15
    from lightning_lora.families.sdxl import SDXL

    family = {"sdxl": SDXL(), "sd15": SD15()}[family_name]
    for config in family.planning.known_denoisers.values():
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(config)
        first = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
        owner = next(m for m in unet.modules() if first in m.modules() and hasattr(m, "proj_in"))  # Transformer2DModel
        assert [unet.get_submodule(name) for name in family.compiling.stream_sources] == [owner.proj_in]
