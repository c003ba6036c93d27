"""Learning-rate schedules sized in steps: linear warmup, cosine decay, a total filled in later, and a resume that
continues the curve."""

from __future__ import annotations

import pytest
import torch

from lightning_lora.schedules import ConstantWithWarmup, CosineWithWarmup, warmup_cosine_factor


def test_warmup_is_linear_and_reaches_one() -> None:
    factors = [warmup_cosine_factor(s, 10, 100) for s in range(10)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[-1] == pytest.approx(1.0)
    assert all(b - a == pytest.approx(0.1) for a, b in zip(factors, factors[1:], strict=False))
    assert warmup_cosine_factor(10, 10, 100) == pytest.approx(1.0)


def test_cosine_decay() -> None:
    f = [warmup_cosine_factor(s, 10, 110, min_factor=0.1) for s in range(10, 111)]
    assert f[0] == pytest.approx(1.0)
    assert f[50] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f[-1] == pytest.approx(0.1)
    assert all(b <= a for a, b in zip(f, f[1:], strict=False))
    assert warmup_cosine_factor(500, 10, 110, min_factor=0.1) == pytest.approx(0.1)  # past the end: stays at min


def test_constant_after_warmup_when_total_is_none() -> None:
    assert warmup_cosine_factor(0, 4, None) == pytest.approx(0.25)
    assert [warmup_cosine_factor(s, 4, None) for s in (4, 50, 10_000)] == [1.0, 1.0, 1.0]
    assert warmup_cosine_factor(0, 0, None) == 1.0


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)


def test_cosine_with_warmup_total_steps_filled_later() -> None:
    sched = CosineWithWarmup(_sgd(), total_steps=None, warmup_steps=2)
    assert sched.total_steps is None
    sched.total_steps = 10  # what LoraModule.configure_optimizers does from trainer.max_steps
    lrs = _lrs(sched, 11)
    expected = [2.0 * warmup_cosine_factor(s, 2, 10) for s in range(11)]
    assert lrs == pytest.approx(expected)
    assert lrs[1] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_cosine_with_warmup_state_dict_resumes_the_curve() -> None:
    a = CosineWithWarmup(_sgd(), total_steps=8)
    _lrs(a, 3)
    b = CosineWithWarmup(_sgd(), total_steps=8)
    # As Lightning restores a checkpoint: the optimizer (holding the current lr), then the scheduler.
    b.optimizer.load_state_dict(a.optimizer.state_dict())
    b.load_state_dict(a.state_dict())
    assert _lrs(b, 5) == pytest.approx(_lrs(a, 5))


def test_constant_with_warmup() -> None:
    lrs = _lrs(ConstantWithWarmup(_sgd(), warmup_steps=4), 8)
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0])
