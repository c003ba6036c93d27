"""Several machines, simulated on this one: one ``lightning-lora fit`` process per "node", started with the environment
a cluster launcher gives each process, joined over gloo on localhost.

Lightning reads the layout from that environment (its ``TorchElasticEnvironment`` for torchrun, ``SLURMEnvironment``
for ``srun``) and from ``trainer.num_nodes`` / ``trainer.devices``; nothing in the processes knows that the "nodes"
share a machine, a file system and a port range, as the nodes of a cluster share a network file system.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from helpers.cli import command_env, fit_command

Launcher = Literal["torchrun", "slurm"]


@dataclass(frozen=True)
class NodeRun:
    """What one process (one node) of :func:`fit_on_nodes` left: its exit status and its output."""

    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous port of the main node)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_env(launcher: Launcher, node: int, nodes: int, port: int) -> dict[str, str]:
    """The variables ``launcher`` sets for the one process of node ``node`` out of ``nodes`` (one process per node).

    torchrun (``torchrun --nnodes N --nproc-per-node 1 --node-rank R --master-addr ... --master-port ...``) sets the
    rendezvous address, the global and local ranks and sizes, ``GROUP_RANK`` (the node) and ``TORCHELASTIC_RUN_ID``,
    by which Lightning recognizes it. ``srun --nodes N --ntasks-per-node 1`` sets ``SLURM_*`` (Lightning reads the
    ranks from them and takes the address from ``MASTER_ADDR`` when it is set, as a job script sets it).
    """
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if launcher == "torchrun":
        return common | {
            "WORLD_SIZE": str(nodes),
            "RANK": str(node),
            "GROUP_RANK": str(node),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "TORCHELASTIC_RUN_ID": "lightning-lora-test",
        }
    return common | {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lightning-lora-test",  # not "bash" / "interactive": Lightning would not take SLURM's ranks
        "SLURM_NTASKS": str(nodes),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": str(nodes),
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
    }


def fit_on_nodes(
    config: Path, *extra: str, nodes: int = 2, launcher: Launcher = "torchrun", timeout: float = 300
) -> list[NodeRun]:
    """``lightning-lora fit --config CONFIG --trainer.num_nodes NODES --trainer.devices 1 [EXTRA...]`` as ``nodes``
    processes, one per simulated node, each with the environment ``launcher`` would give it; returns each process's
    result, node 0 first. A process still running after ``timeout`` seconds (a rank left waiting in a collective) is
    killed, and so are the others.

    Each process writes its output to a file beside the config (``node<R>.out`` / ``.err``): a pipe that nobody reads
    while another process is waited for could fill up and stall a rank, and the other rank with it.
    """
    port = free_port()
    command = fit_command(config, "--trainer.num_nodes", str(nodes), "--trainer.devices", "1", *extra)
    started: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    try:
        for node in range(nodes):
            out, err = config.parent / f"node{node}.out", config.parent / f"node{node}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                env = command_env(**node_env(launcher, node, nodes, port))
                started.append((subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr), out, err))
        runs = []
        for process, out, err in started:
            process.wait(timeout=timeout)
            runs.append(NodeRun(process.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")))
        return runs
    finally:
        for process, _, _ in started:
            if process.poll() is None:
                process.kill()
                process.wait()
