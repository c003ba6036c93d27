"""dev/probes/sdpa_probe.py: one SDPA backend at one shape, timed, checked against a reference kernel, or its error
named (on the CPU: the math kernel is the reference; cuDNN has no CPU kernel)."""

from __future__ import annotations

import json

import pytest
import sdpa_probe
import torch

SMALL = ["--device", "cpu", "--batch", "1", "--heads", "2", "--tokens", "64", "--head-dim", "16", "--reps", "1"]


@pytest.mark.parametrize("layout", ["contiguous", "bshd"])
def test_a_backend_is_timed_and_checked(layout: str, tmp_path, capsys) -> None:
    out_file = tmp_path / "probe.jsonl"
    status = sdpa_probe.main(
        [*SMALL, "--backend", "flash", "--layout", layout, "--dtype", "fp32", "--out", str(out_file)]
    )
    line = json.loads(capsys.readouterr().out)
    assert status == 0 and "error" not in line, line
    assert json.loads(out_file.read_text()) == line
    assert line["forward_ms"] > 0 and line["backward_ms"] > 0 and line["forward_tflops"] >= 0
    assert line["max_abs_diff_vs_math"] < 1e-4  # the same attention as the reference kernel
    assert line["query_layout"] == layout.replace("contiguous", "bhsd")
    assert line["output_layout"] in ("bhsd", "bshd")  # which one is the kernel's answer (the CPU's follows q)


def test_the_storage_layout_names_heads_inside_tokens_apart() -> None:
    t = torch.empty(1, 8, 2, 4)  # [B, S, H, D] storage
    assert sdpa_probe.storage_layout(t.transpose(1, 2)) == "bshd"
    assert sdpa_probe.storage_layout(t.transpose(1, 2).contiguous()) == "bhsd"
    assert sdpa_probe.storage_layout(t.transpose(1, 2)[:, :, ::2]) == "other"


def test_the_layouts_are_what_sdpa_receives() -> None:
    args = sdpa_probe.parse_args(SMALL)
    q, _, _ = sdpa_probe.attention_inputs(args, torch.device("cpu"), torch.float32)
    assert q.shape == (1, 2, 64, 16) and not q.is_contiguous()  # [B, S, H, D] storage seen as [B, H, S, D]
    args = sdpa_probe.parse_args([*SMALL, "--layout", "contiguous"])
    q, _, _ = sdpa_probe.attention_inputs(args, torch.device("cpu"), torch.float32)
    assert q.shape == (1, 2, 64, 16) and q.is_contiguous()
    forward, backward = sdpa_probe.attention_flops(sdpa_probe.parse_args([]))  # flux_h100's: 29.7 TFLOP forward
    assert forward == pytest.approx(4 * 2 * 24 * 4608**2 * 128) and backward == 2.5 * forward


def test_a_backend_that_cannot_run_is_an_error_line(capsys) -> None:
    status = sdpa_probe.main([*SMALL, "--backend", "cudnn"])  # no cuDNN kernel on the CPU
    line = json.loads(capsys.readouterr().out)
    assert status == 1 and line["error"].startswith("RuntimeError") and "forward_ms" not in line


def test_the_output_gradient_arrives_in_the_processors_layout() -> None:
    args = sdpa_probe.parse_args(SMALL)
    grad = sdpa_probe.output_gradient(args, torch.device("cpu"), torch.float32)
    assert grad.shape == (1, 2, 64, 16) and grad.transpose(1, 2).is_contiguous()  # [B, S, H, D] storage
    args = sdpa_probe.parse_args([*SMALL, "--grad", "contiguous"])
    assert sdpa_probe.output_gradient(args, torch.device("cpu"), torch.float32).is_contiguous()


def test_the_model_probe_runs_a_real_flux_transformer(capsys) -> None:
    """(``--dispatch cudnn`` is left to the GPU: diffusers' ``set_attention_backend`` also sets its process-wide
    default, which would reach every later test in this process.)"""
    narrow = ["--device", "cpu", "--batch", "1", "--heads", "2", "--head-dim", "32", "--reps", "1", "--dtype", "fp32"]
    args = ["--model", "flux", "--tokens", "16", "--text", "8", "--backend", "math", "--double", "2", "--single", "1"]
    status = sdpa_probe.main([*narrow, *args])
    line = json.loads(capsys.readouterr().out)
    assert status == 0 and line["step_ms"] > 0 and (line["double"], line["single"]) == (2, 1), line
    assert line["dispatch"] == "native" and line["grad_fix"] is False
