"""Helpers the tests share; the fixtures (tiny pipelines saved to disk, photos) are in tests/conftest.py.

No test module imports another test module: what two of them need lives here, one concept per file.

* :mod:`helpers.cli`: a tiny-run config, the command in-process (:func:`run_cli`) and as a user runs it
  (:func:`fit_in_subprocess`), the fixed evaluation loss of a fit, a digest of a folder (to prove it was not modified);
* :mod:`helpers.models`: the trainable model of a recipe, tiny LoRA models whose ``lora_B`` are not zero (a fresh LoRA
  is a no-op), random denoiser inputs for any family (:func:`random_inputs`), the gradients of two steps, and another
  model of the same shapes in a saved pipeline (:func:`other_weights`);
* :mod:`helpers.resume`: run configs that checkpoint every step, and the bit-for-bit comparison of two runs; folders
  and options for runs with preservation and masks (:func:`preservation_layout`, :func:`preservation_options`);
* :mod:`helpers.nodes`: a run on several simulated nodes (one process each, with the environment torchrun or SLURM
  gives it: :func:`fit_on_nodes`);
* :mod:`helpers.crash`: callbacks that kill or interrupt a run, loaded by class path (``helpers.crash.KillAt``) in a
  config, in-process or in a subprocess (:func:`fit_in_subprocess` puts tests/ on its ``PYTHONPATH``);
* :mod:`helpers.counted`: an optimizer and a callback that count their instances (what a verb builds);
* :mod:`helpers.graphs`: what dynamo compiles, counted per module class with a recording backend (no code
  generation);
* :mod:`helpers.diffusers_quirks`: the two places where diffusers' converters hard-code FLUX.1's widths, made to read
  the tiny model's instead.

Import from the package (``from helpers import write_config``); tests/conftest.py puts tests/ on ``sys.path``, so this
works from every test folder and from a subprocess started by :func:`fit_in_subprocess`.
"""

from __future__ import annotations

from helpers.cli import (
    DISTRIBUTED_ENV,
    REPO,
    TESTS,
    check_fit_lowers_eval_loss,
    command_env,
    eval_history,
    family_class_path,
    family_config,
    fit_command,
    fit_in_subprocess,
    run_cli,
    tree_digest,
    write_config,
)
from helpers.diffusers_quirks import allow_any_flux_width, diffusers_kohya_reads_flux_widths
from helpers.graphs import count_compiled, count_compiled_graphs, graph_count
from helpers.models import (
    ALPHA,
    RANK,
    build_model,
    build_tiny,
    denoiser_output,
    lora_layers,
    lora_model,
    nonzero_lora_b,
    on_device,
    other_weights,
    precision_for,
    random_inputs,
    two_step_grads,
)
from helpers.nodes import NodeRun, fit_on_nodes, free_port, node_env
from helpers.resume import (
    assert_same_lora,
    assert_same_run,
    check_exact_resume,
    check_same_run_after_resume,
    final_lora,
    loss_curve,
    preservation_layout,
    preservation_options,
    resume_config,
)

__all__ = [
    "count_compiled",
    "count_compiled_graphs",
    "graph_count",
    "ALPHA",
    "RANK",
    "DISTRIBUTED_ENV",
    "NodeRun",
    "REPO",
    "TESTS",
    "allow_any_flux_width",
    "assert_same_lora",
    "assert_same_run",
    "build_model",
    "build_tiny",
    "check_exact_resume",
    "check_fit_lowers_eval_loss",
    "check_same_run_after_resume",
    "command_env",
    "denoiser_output",
    "diffusers_kohya_reads_flux_widths",
    "eval_history",
    "family_class_path",
    "family_config",
    "final_lora",
    "fit_command",
    "fit_in_subprocess",
    "fit_on_nodes",
    "free_port",
    "lora_layers",
    "lora_model",
    "loss_curve",
    "node_env",
    "nonzero_lora_b",
    "on_device",
    "other_weights",
    "precision_for",
    "preservation_layout",
    "preservation_options",
    "random_inputs",
    "resume_config",
    "run_cli",
    "tree_digest",
    "two_step_grads",
    "write_config",
]
