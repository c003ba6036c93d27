"""Counting what dynamo compiles: ``nn.Module.compile`` made to use a backend that records each graph it is given
(its node count) and runs it as traced, with no code generation (a few seconds, not inductor's minutes).

One backend per compiled module class, so that dynamo shares its cache entries among every block of a class as it does
with inductor, and a test can count per class.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def count_compiled_graphs(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Patch ``nn.Module.compile`` (for the test) to record each graph under the compiled module's class name; returns
    that record, ``{class name: [node count of each graph]}``, which fills as the compiled modules run."""
    return count_compiled(monkeypatch)[0]


def count_compiled(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[int]], dict[str, int]]:
    """:func:`count_compiled_graphs`' record, and ``{class name: calls}``: how often the compiled graphs of each class
    were run (each call into a compiled region; the backward of a graph is not a call)."""
    graphs: dict[str, list[int]] = {}
    calls: dict[str, int] = {}
    backends: dict[str, Any] = {}
    original = torch.nn.Module.compile

    def backend_for(name: str) -> Any:
        if name not in backends:

            def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
                graphs.setdefault(name, []).append(len(gm.graph.nodes))

                def run(*args: Any) -> Any:
                    calls[name] = calls.get(name, 0) + 1
                    return gm.forward(*args)

                return run

            backends[name] = counting_backend
        return backends[name]

    def compile_with_counter(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("mode", None)
        original(self, backend=backend_for(type(self).__name__), **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_with_counter)
    return graphs, calls


def graph_count(graphs: dict[str, list[int]]) -> int:
    """Graphs compiled so far, every class together."""
    return sum(len(sizes) for sizes in graphs.values())
