"""Several machines through Lightning's own multi-node support, simulated on the CPU: two "nodes" of one process each
(gloo on localhost, ``trainer.num_nodes: 2``, the environment torchrun or SLURM gives each process) train the LoRA that
one node with two processes trains, bit for bit, and a run stopped on the 2-node layout resumes exactly.

Why bit for bit, and not within a tolerance: the global rank of a process decides everything it computes (its slice of
every global batch, the per-sample noise and timesteps, its seed: base + global rank), and the layout decides only
where the processes run. Both layouts run the same two processes with the same inputs; DDP averages their gradients
with one all-reduce over gloo, and a sum of two numbers does not depend on their order. Any difference is a bug: a
rank that reads the local rank where it should read the global one, a per-node step that ran twice or not at all.

The two "nodes" share the run folder and the cache, as the nodes of a cluster share a network file system (the README
says the run folder must be shared: checkpoints are written by global rank 0 and read by every rank on resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import NodeRun, assert_same_run, fit_on_nodes, resume_config
from helpers.resume import DDP_RUN_LAYOUT, DDP_RUN_STEPS

pytestmark = pytest.mark.subprocess

STEPS, STOP = DDP_RUN_STEPS, 3
"""The shared 1-node run's 5 steps of a global batch of 2 out of 4 images: the stop at step 3 is inside the second
epoch."""
LAYOUT: dict[str, Any] = {k: v for k, v in DDP_RUN_LAYOUT.items() if k != "trainer.devices"}  # 1 process a node


def check(runs: list[NodeRun]) -> None:
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.stderr[-3000:]}"


def trained_state(config: Path, step: int) -> dict[str, Any]:
    """The LoRA tensors and the optimizer state of the step-``step`` checkpoint of the run of ``config``."""
    ckpt = torch.load(config.parent / "run" / "checkpoints" / f"step{step:04d}.ckpt", weights_only=True)
    assert ckpt["global_step"] == step
    return {"lora": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"], "rng": ckpt["rng_states"]}


def assert_equal_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["lora"].keys() == b["lora"].keys() and a["lora"]
    differing = [k for k in a["lora"] if not torch.equal(a["lora"][k], b["lora"][k])]
    assert not differing, f"{len(differing)} LoRA tensors differ, e.g. {differing[:2]}"
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0)
    # Both ranks' generators, in global-rank order: rank r of one layout is rank r of the other.
    assert len(a["rng"]) == len(b["rng"]) == 2
    for state_a, state_b in zip(a["rng"], b["rng"], strict=True):
        assert torch.equal(state_a["torch"], state_b["torch"])


@pytest.mark.xdist_group("ddp_run")  # the 1-node run is the shared one (tests/conftest.py), made once per process
def test_two_nodes_train_what_one_node_trains_and_resume_exactly(
    ddp_run: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """2 nodes x 1 process, started with SLURM's environment (``srun --nodes 2 --ntasks-per-node 1``: Lightning's
    SLURMEnvironment takes the ranks), stopped at step 3, and resumed with ``--ckpt_path last`` under torchrun's (a
    requeued job may well come back under another launcher): both launchers in one run, each checked against the
    1-node run."""
    one_node = ddp_run
    config = resume_config(one_node.parent.parent, tiny_flux_dir, photos_dir, "two_nodes", steps=STEPS, **LAYOUT)
    check(fit_on_nodes(config, "--trainer.max_steps", str(STOP), launcher="slurm"))
    assert_equal_state(trained_state(one_node, STOP), trained_state(config, STOP))
    resumed = fit_on_nodes(config, "--ckpt_path", "last", launcher="torchrun")
    check(resumed)
    assert f"(step {STEPS})" in resumed[0].stdout  # global rank 0 prints the summary; node 1 prints none
    assert "Run folder" not in resumed[1].stdout
    assert_equal_state(trained_state(one_node, STEPS), trained_state(config, STEPS))
    assert_same_run(one_node, config, after_step=1)  # the exported LoRA and the loss at every step


def test_memory_auto_takes_rank_zeros_choice_on_every_node(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path
) -> None:
    """``model.memory: auto`` with processes a cluster launcher starts (torchrun): each measures its own GPU before
    the process group exists, and node 1, with less memory free, chooses gradient checkpointing; every rank must build
    rank 0's choice (as configured) all the same (helpers.fake_memory fakes the free memory and the planner's
    choice)."""
    import json

    fake = {
        "class_path": "helpers.fake_memory.FakeMemoryChoice",
        "init_args": {"gib": [80.0, 10.0], "changes": [{}, {"gradient_checkpointing": True}]},
    }
    config = resume_config(
        tmp_path, tiny_flux_dir, photos_dir, "auto", steps=1, callbacks=[fake], **LAYOUT, **{"model.memory": "auto"}
    )
    check(fit_on_nodes(config))
    built = [json.loads((config.parent / "run" / f"memory-rank{r}.json").read_text()) for r in range(2)]
    assert built[0]["recipe"]["gradient_checkpointing"] is False
    assert built[1] == built[0]
