"""The optimizers the configs and README name train through the real command and resume with their state
(checkpoints load with ``weights_only=True``, so every optimizer's state must be plain tensors and numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_cli, write_config

OPTIMIZERS = {
    "bitsandbytes.optim.AdamW8bit": {"lr": 0.001},
    "transformers.optimization.Adafactor": {
        "lr": 0.001,
        "scale_parameter": False,
        "relative_step": False,
        "warmup_init": False,
    },
    "lightning_lora.optimizers.Adafactor": {
        "lr": 0.001,
        "scale_parameter": False,
        "relative_step": False,
        "warmup_init": False,
    },
    "prodigyopt.Prodigy": {"lr": 1.0},
}


@pytest.mark.parametrize("class_path", list(OPTIMIZERS))
def test_optimizer_trains_and_resumes(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, class_path: str) -> None:
    optimizer = {"class_path": class_path, "init_args": OPTIMIZERS[class_path]}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.optimizer": optimizer})
    first = run_cli(["fit", "--config", str(config)])
    assert type(first.trainer.optimizers[0]).__name__ == class_path.rsplit(".", 1)[1]
    lora_b = [p for n, p in first.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)  # B starts at zero: the optimizer moved it
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["optimizer_states"][0]["state"]
    second = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert second.trainer.global_step == 3
    assert _steps_taken(second.trainer.optimizers[0]) == 3  # restored at 2, then one more (a fresh one would say 1)


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's own step counter: per-parameter ``step`` (AdamW8bit, Adafactor) or Prodigy's group ``k``."""
    group = optimizer.param_groups[0]
    if "k" in group:
        return int(group["k"])
    return int(next(iter(optimizer.state.values()))["step"])


# -- lightning_lora.optimizers.Adafactor: transformers' update, many tensors at a time ------------------------------

KOHYA = {"lr": 1e-3, "scale_parameter": False, "relative_step": False, "warmup_init": False}


def _lora_like_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Tensors of a LoRA's shapes: several of one shape (down / up), a conv (LoCon) and a vector (no factoring)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 32)] * 5 + [(32, 4)] * 5 + [(4, 8, 3, 3), (4, 8, 3, 3), (16,), (6, 48)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def _train(optimizer_class: type, params: list[torch.nn.Parameter], steps: int, **kwargs) -> torch.optim.Optimizer:
    optimizer = optimizer_class(params, **kwargs)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return optimizer


def _assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)
        sa, sb = a.state[pa], b.state[pb]
        assert sa["step"] == sb["step"]
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"):
            assert (key in sa) == (key in sb), key
            if key in sa:
                torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("extra", [{}, {"weight_decay": 0.01}, {"beta1": 0.9}], ids=["plain", "decay", "beta1"])
def test_grouped_adafactor_takes_the_steps_of_transformers_adafactor(extra: dict) -> None:
    from transformers.optimization import Adafactor as HFAdafactor

    from lightning_lora.optimizers import Adafactor

    ours = _train(Adafactor, _lora_like_params(), 5, **KOHYA, **extra)
    theirs = _train(HFAdafactor, _lora_like_params(), 5, **KOHYA, **extra)
    assert not torch.equal(ours.param_groups[0]["params"][0], _lora_like_params()[0])  # it moved
    _assert_same_state(ours, theirs)


def test_grouped_adafactor_state_loads_in_either_class() -> None:
    """A checkpoint written with one class continues identically in the other (switching a config loses nothing)."""
    from transformers.optimization import Adafactor as HFAdafactor

    from lightning_lora.optimizers import Adafactor

    def continued(first: type, second: type) -> torch.optim.Optimizer:
        params = _lora_like_params()
        state = _train(first, params, 3, **KOHYA).state_dict()
        resumed = second(params, **KOHYA)
        resumed.load_state_dict(state)
        for step in range(2):
            g = torch.Generator().manual_seed(7 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            resumed.step()
        return resumed

    _assert_same_state(continued(Adafactor, HFAdafactor), continued(HFAdafactor, Adafactor))
    _assert_same_state(continued(Adafactor, Adafactor), continued(HFAdafactor, HFAdafactor))


def test_grouped_adafactor_falls_back_to_transformers_for_relative_steps() -> None:
    from transformers.optimization import Adafactor as HFAdafactor

    from lightning_lora.optimizers import Adafactor

    auto = {"lr": None, "scale_parameter": True, "relative_step": True, "warmup_init": False}
    _assert_same_state(
        _train(Adafactor, _lora_like_params(), 3, **auto), _train(HFAdafactor, _lora_like_params(), 3, **auto)
    )


def test_grouped_adafactor_chunks_give_the_same_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_lora import optimizers

    whole = _train(optimizers.Adafactor, _lora_like_params(), 3, **KOHYA)
    monkeypatch.setattr(optimizers, "MAX_STACKED_ELEMENTS", 200)  # two (4, 32) tensors per chunk
    _assert_same_state(_train(optimizers.Adafactor, _lora_like_params(), 3, **KOHYA), whole)


def test_grouped_adafactor_kernels_do_not_grow_with_the_number_of_tensors() -> None:
    """The point of the class: ten times as many same-shaped tensors, the same number of operations per step
    (transformers' Adafactor: ten times as many)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.optimization import Adafactor as HFAdafactor

    from lightning_lora.optimizers import Adafactor

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops_per_step(optimizer_class: type, n: int) -> int:
        params = [torch.nn.Parameter(torch.randn(4, 32)) for _ in range(n)]
        optimizer = _train(optimizer_class, params, 1, **KOHYA)
        Count.ops = 0
        with Count():
            optimizer.step()
        return Count.ops

    assert ops_per_step(Adafactor, 100) == ops_per_step(Adafactor, 10)
    assert ops_per_step(HFAdafactor, 100) > 5 * ops_per_step(HFAdafactor, 10)
    assert ops_per_step(Adafactor, 100) * 20 < ops_per_step(HFAdafactor, 100)


def test_grouped_adafactor_keeps_scalars_apart_and_runs_hooks_once() -> None:
    """0-d tensors are not stacked (a stack would share one RMS clip); the fallback path runs step hooks once."""
    from transformers.optimization import Adafactor as HFAdafactor

    from lightning_lora.optimizers import Adafactor

    def scalars() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.tensor(v)) for v in (0.5, -2.0, 3.0)]

    _assert_same_state(_train(Adafactor, scalars(), 3, **KOHYA), _train(HFAdafactor, scalars(), 3, **KOHYA))
    calls: list[str] = []
    auto = {"lr": None, "scale_parameter": True, "relative_step": True, "warmup_init": False}
    optimizer = _train(Adafactor, _lora_like_params(), 1, **auto)
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    optimizer.step()
    assert calls == ["pre", "post"]
