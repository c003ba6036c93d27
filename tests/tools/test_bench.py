"""The GPU benchmark tools (tools/bench.py, bench_suite.py) run on the CPU with tiny models (the same code path the GPU
numbers come from)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))

import bench  # noqa: E402
import bench_suite  # noqa: E402

from lightning_lora import families  # noqa: E402


@pytest.mark.parametrize(
    ("family", "loop", "offload", "offload_act", "opt"),
    [
        ("flux", "lightning", 0, 0, "adamw"),
        ("sdxl", "lightning", 0, 1, "adafactor"),
        ("flux", "bare", 0, 0, "adamw"),
        ("flux", "lightning", 2, 0, "adamw"),
        ("zimage", "lightning", 0, 0, "adamw"),
        ("qwenimage", "lightning", 0, 1, "adamw8bit"),
        ("flux2", "lightning", 0, 0, "adamw"),
        ("krea2", "lightning", 0, 0, "adamw"),
        ("chroma", "lightning", 0, 0, "adamw"),
    ],
)
def test_bench_runs_our_module_on_a_tiny_model(
    family: str, loop: str, offload: int, offload_act: int, opt: str
) -> None:
    argv = ["--family", family, "--rank", "4", "--gc", str(offload_act), "--h", "64", "--w", "64", "--tlen", "16"]
    argv += ["--steps", "1", "--warm", "1", "--opt", opt, "--offload", str(offload), "--offload-act", str(offload_act)]
    args = bench.parser().parse_args([*argv, "--tiny", "--loop", loop])
    if offload == 2:  # the tiny FLUX has two blocks: offloading both is what the copy count checks, and saves nothing
        with pytest.warns(UserWarning, match="model.offload_blocks: 2 saves no weight memory"):
            out = bench.run(args)
    else:
        out = bench.run(args)
    assert out["s_per_step"] > 0 and out["lora_params_M"] > 0 and out["loss"] > 0
    if loop == "lightning":  # each timed step's time, and no compile (nothing is compiled here)
        assert len(out["step_s_each"]) == 1 and out["step_s_each"][0] > 0 and out["graphs_compiled_timed"] == 0
        assert out["s_per_step_median"] == out["step_s_each"][0]
        assert out["first_step_compile"] == dict.fromkeys(bench.compile_counts(), 0)  # nothing traced or loaded
        assert out["first_step_compile_s"] == dict.fromkeys(bench.COMPILE_PHASES.values(), 0)
        # where the step went: the training thread's CPU time and the wait at its end fit inside its wall time (on
        # the CPU the step is all host: the wait is nothing)
        (busy,), (wait,) = out["host_cpu_s_each"], out["sync_wait_s_each"]
        assert 0 < busy and 0 <= wait < 0.01 and busy + wait <= out["step_s_each"][0] + 0.002
        assert out["load_1m"] >= 0 and out.get("cpu_stolen_s", 0) >= 0
    assert out["planned_peak_GiB"] >= out["planned"]["overhead"] > 0  # tiny model: little beyond the CUDA context
    assert {"weights", "lora", "activations", "transient"} <= out["planned"].keys()
    assert ("offloaded_inputs_GiB_per_step" in out) == bool(offload_act)  # on the CPU nothing moves
    if offload:  # 1 warm-up + 1 timed step: each block copied in forward and backward, less the one left in place
        assert out["block_copies"] == 2 * (2 * offload - 1) - 1 and out["offloaded_GiB"] >= 0


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_bench_builds_every_registered_family(name: str) -> None:
    """Every family of the registry is a ``--family`` (the benchmark asks the registry, it keeps no table of its own),
    its random-weights class one that Lightning can pickle into the module's hyperparameters."""
    import pickle

    assert bench.parser().parse_args(["--family", name]).family == name
    assert bench.FAMILY_CLASSES[f"lightning_lora.families.{families.FAMILIES[name].__name__}"] == name
    random = bench.random_family(name, bench.denoiser_config(name, tiny=True), "cpu")
    copy = pickle.loads(pickle.dumps(random))
    assert isinstance(copy, families.FAMILIES[name]) and type(copy) is bench.RANDOM[name]
    assert copy.config == random.config != bench.denoiser_config(name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["zimage", "qwenimage", "krea2", "chroma"])
def test_bench_batches_have_the_caches_layout(family: str) -> None:
    """The synthetic batches of the newer families hold what the latent cache stores for them: the tiny pipeline's
    ``encode_images`` / ``encode_prompts`` outputs, key for key and shape for shape (the bench's tiny transformer has
    the tiny pipeline's shapes), captions padded to ``max_sequence_length`` with their mask."""
    import torch

    from lightning_lora.families import FAMILIES
    from lightning_lora.tiny.chroma import build_tiny_chroma
    from lightning_lora.tiny.krea2 import build_tiny_krea2
    from lightning_lora.tiny.qwenimage import build_tiny_qwenimage
    from lightning_lora.tiny.zimage import build_tiny_zimage

    build = {
        "zimage": build_tiny_zimage,
        "qwenimage": build_tiny_qwenimage,
        "krea2": build_tiny_krea2,
        "chroma": build_tiny_chroma,
    }[family]
    pipe: Any = build()
    config = bench.denoiser_config(family, tiny=True)
    assert json.loads(json.dumps({k: pipe.transformer.config[k] for k in config if not k.startswith("_")})) == {
        k: v for k, v in config.items() if not k.startswith("_")
    }
    real = FAMILIES[family](max_sequence_length=512)
    cached = {"latents": real.encode_images(pipe.vae, torch.zeros(1, 3, 64, 96))[0]}
    cached.update({k: v[0] for k, v in real.encode_prompts(pipe, ["a photo of a dog"]).items()})
    random = bench.random_family(family, config, "cpu", **bench.RANDOM[family].text_length_options(24)[0])
    item = bench.Synthetic(family, config, 64, 96, 24, family_obj=random)[0]
    for key, value in cached.items():
        assert item[key].shape == value.shape and item[key].dtype in (value.dtype, torch.bfloat16), key
    mask = next(v for k, v in item.items() if k.endswith("mask"))
    assert mask.dtype == cached[next(k for k in cached if k.endswith("mask"))].dtype and int(mask.sum()) == 24
    assert item["prompt_embeds"][24:].abs().sum() == 0 and item["prompt_embeds"][:24].abs().min() > 0
    assert item["noise"].shape == item["latents"].shape and 0 < float(item["timesteps"]) < 1


def test_bench_suite_commands_pair_ours_with_the_reference() -> None:
    runs = dict(bench_suite.commands("flux-nf4-r4-gc-1024x1024", "ref_recipe.py", steps=8, warm=3))
    assert runs["ours"][2:] == [
        "--family",
        "flux",
        "--quant",
        "nf4",
        "--rank",
        "4",
        "--gc",
        "1",
        "--h",
        "1024",
        "--w",
        "1024",
        "--steps",
        "8",
        "--warm",
        "3",
    ]
    assert runs["ref"][1:3] == ["ref_recipe.py", "flux-nf4"] and "nocudnn" in runs["ref"]
    assert "ref" not in dict(bench_suite.commands("flux-fp8c-r16", "ref_recipe.py", 8, 3))  # no FP8 reference mode
    with pytest.raises(SystemExit, match="bad case"):
        bench_suite.commands("flux-int3-r4", None, 8, 3)


SHIPPED_GPU_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("tiny_"))


@pytest.mark.parametrize("path", SHIPPED_GPU_CONFIGS, ids=lambda p: p.stem)
def test_bench_config_takes_the_shipped_settings(path) -> None:
    """``--config`` reads a shipped YAML as ``fit`` uses it: the values are checked against the file itself."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    model, data, trainer = doc["model"], doc["data"], doc["trainer"]
    a = bench.parse_args(["--config", str(path)])
    family = getattr(families, model["family"]["class_path"].rsplit(".", 1)[-1]).name
    assert a.family == family
    plugin = trainer["plugins"]["class_path"].rsplit(".", 1)[-1]  # every shipped config names its precision plugin
    assert bench.QUANT_PLUGINS[a.quant] == plugin
    assert a.gc == int(model.get("gradient_checkpointing", False))
    assert a.compile == int(model.get("compile_blocks", False))
    assert a.offload_act == int(model.get("offload_activations", False))
    assert (a.rank, a.alpha, a.targets) == (model["lora"]["rank"], model["lora"]["alpha"], model["lora"]["targets"])
    assert bench.OPTIMIZERS[model["optimizer"]["class_path"]] == a.opt
    assert a.h == a.w == data["resolution"] and a.batch == data["batch_size"]
    assert a.accumulate == trainer.get("accumulate_grad_batches", 1)
    assert a.workers == data.get("num_workers", 0)  # the batches come from worker processes, as in fit
    text = model["family"].get("init_args", {}).get("max_sequence_length")
    assert a.tlen == (77 if family in ("sdxl", "sd15") else text)
    assert any(n.startswith("model.scheduler") for n in a.not_reproduced)  # listed, not silently dropped
    assert bench.optimizer_options(a) == model["optimizer"]["init_args"]
    assert a.clip == trainer.get("gradient_clip_val", 0.0)  # run, as fit runs it: not in not_reproduced
    assert not any("gradient_clip" in n for n in a.not_reproduced)
    folders = data["images"] if isinstance(data["images"], list) else [data["images"]]
    assert a.controls == max(len(f.get("controls", [])) if isinstance(f, dict) else 0 for f in folders)


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ("kontext_24gb", "flux_kontext"),
        ("qwenimage_edit_24gb", "qwenimage_edit_plus"),
        ("flux2_klein_reference_24gb", "flux2"),
    ],
)
def test_bench_trains_an_edit_config_on_pairs(config: str, family: str) -> None:
    """An edit config's batches hold its controls' cached latents as the cache serves them (``controls [N, C, h, w]``
    beside the target's ``latents``), ``--controls`` overrides the config's count, and a family takes only the
    controls it can: a parser error naming the flag."""
    path = str(REPO / "configs" / f"{config}.yaml")
    a = bench.parse_args(["--tiny", "--config", path, "--controls", "2" if family == "flux2" else "1"])
    assert a.family == family and a.controls == (2 if family == "flux2" else 1)
    tiny = bench.denoiser_config(family, tiny=True)
    random = bench.random_family(family, tiny, "cpu")
    item = bench.Synthetic(family, tiny, 64, 96, 16, family_obj=random, controls=a.controls)[0]
    assert item["controls"].shape == (a.controls, *item["latents"].shape)
    assert "controls" not in bench.Synthetic(family, tiny, 64, 96, 16, family_obj=random)[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "sd15", "--controls", "1"], "--controls 1: the sd15 family takes no control images"),
        (["--family", "flux_kontext", "--controls", "2"], "--controls 2: flux_kontext takes at most 1"),
        (["--family", "qwenimage_edit"], "--controls 0: every qwenimage_edit sample has a control image"),
    ],
)
def test_bench_refuses_controls_a_family_cannot_take(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--tiny", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_runs_kontext_24gb_with_its_control_on_a_tiny_model(capsys, monkeypatch) -> None:
    """kontext_24gb on the tiny Kontext: the batches carry its one control, the planner counts its tokens, and the
    samples are drawn from a random control image of the samples' size for each of its two prompts (the config's own
    control files are the user's)."""
    import shutil

    from lightning_lora import plan

    planned: list[int] = []
    plan_training = plan.plan_training

    def counting(*args: Any, **kwargs: Any) -> Any:
        planned.append(kwargs["controls"])
        return plan_training(*args, **kwargs)

    seen: list[str] = []
    remove = shutil.rmtree

    def look_then_remove(path, *args, **kwargs):
        seen.extend(sorted(str(f.relative_to(path)) for f in bench.Path(path).rglob("*.png")))
        remove(path, *args, **kwargs)

    monkeypatch.setattr(plan, "plan_training", counting)
    monkeypatch.setattr(shutil, "rmtree", look_then_remove)
    argv = ["--tiny", "--config", str(REPO / "configs" / "kontext_24gb.yaml"), "--steps", "1", "--warm", "0"]
    argv += ["--h", "64", "--w", "64", "--tlen", "16", "--compile", "0", "--quant", "none", "--workers", "0"]
    bench.main(argv)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "error" not in out, out
    assert (out["family"], out["controls"], out["samples"], out["loss"] > 0) == ("flux_kontext", 1, 2, True)
    assert planned == [1]
    assert seen == ["controls/control0.png", "samples/step000001_00.png", "samples/step000001_01.png"]


def test_bench_config_takes_cuda_graphs_as_fit_does(tmp_path) -> None:
    """``model.cuda_graphs`` in a YAML reaches the benchmark's model (``--cuda-graphs``), as ``fit`` would build it;
    absent, it is off."""
    import yaml

    doc = yaml.safe_load((REPO / "configs" / "sdxl_24gb.yaml").read_text())
    assert bench.parse_args(["--config", str(REPO / "configs" / "sdxl_24gb.yaml")]).cuda_graphs == 0
    doc["model"]["cuda_graphs"] = True
    path = tmp_path / "sdxl_graphs.yaml"
    path.write_text(yaml.safe_dump(doc))
    a = bench.parse_args(["--config", str(path)])
    assert a.cuda_graphs == 1 and a.compile == 1


def test_bench_clips_gradients_as_the_config_and_steps_a_fused_adamw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config's ``trainer.gradient_clip_val`` is the Trainer's (every optimizer step clips, the fused AdamW's too);
    ``--opt adamw-fused`` is torch's AdamW with ``fused=True``, planned as AdamW (two float32 moments)."""
    import torch

    clipped: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recorded(parameters, max_norm, *args, **kwargs):  # type: ignore[no-untyped-def]
        clipped.append(max_norm)
        return clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded)
    path = str(REPO / "configs" / "sd15_8gb.yaml")
    argv = ["--config", path, "--tiny", "--h", "64", "--w", "64", "--steps", "1", "--warm", "1", "--callbacks", "0"]
    a = bench.parse_args([*argv, "--compile", "0", "--opt", "adamw-fused", "--workers", "0"])
    assert a.clip == 1.0
    out = bench.run(a)
    assert out["clip"] == 1.0 and out["opt"] == "adamw-fused" and out["s_per_step"] > 0
    assert clipped == [1.0, 1.0]  # the warm-up step and the timed one
    optimizer = bench.make_optimizer("adamw-fused")([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert out["planned"]["optimizer"] == pytest.approx(2 * out["planned"]["lora"])
    assert bench.parse_args([*argv, "--clip", "0"]).clip == 0.0


def test_bench_config_flags_on_the_command_line_win() -> None:
    path = str(REPO / "configs" / "flux_4090.yaml")
    a = bench.parse_args(["--config", path, "--h", "512", "--w", "768", "--opt", "adamw", "--accumulate", "1"])
    assert (a.h, a.w, a.opt, a.accumulate) == (512, 768, "adamw", 1)
    assert a.quant == "fp8_compute" and a.rank == 16  # the rest is still the config's
    assert bench.optimizer_options(a) == {}  # the config's AdamW8bit arguments are not handed to another optimizer


@pytest.mark.parametrize(
    ("choice", "mine", "expected"),
    [
        ("command", None, "expandable_segments:True"),
        ("default", None, "expandable_segments:False"),
        ("default", "garbage_collection_threshold:0.8", "garbage_collection_threshold:0.8"),
        ("command", "expandable_segments:False", "expandable_segments:False"),
    ],
)
def test_bench_allocator_is_the_commands_or_pytorchs_and_a_users_setting_wins(
    choice: str, mine: str | None, expected: str
) -> None:
    """``--allocator default`` measures a row with PyTorch's own allocator beside the command's expandable segments
    (call 37: 8% on sdxl_24gb), in one plan; it is read before ``--config`` (whose class paths import GPU libraries)."""
    environ = {} if mine is None else {"PYTORCH_CUDA_ALLOC_CONF": mine}
    assert bench.parser().parse_known_args(["--allocator", choice, "--config", "x.yaml"])[0].allocator == choice
    bench.set_allocator(choice, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": expected}


def test_bench_takes_the_configs_allocator_as_fit_does(tmp_path) -> None:
    """A shipped config's ``allocator`` is what ``--allocator command`` (the default) measures with."""
    config = tmp_path / "sdxl.yaml"
    config.write_text("allocator: pytorch_default\n")
    environ: dict[str, str] = {}
    bench.set_allocator("command", environ, config=str(config))
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


@pytest.mark.parametrize(
    ("section", "class_path", "option"),
    [
        ("optimizer", "torch.optim.SGD", "model.optimizer.class_path"),
        ("family", "my_package.families.Kandinsky", "model.family.class_path"),
    ],
)
def test_bench_config_it_cannot_build_is_an_error_naming_the_option(
    tmp_path, capsys, section: str, class_path: str, option: str
) -> None:
    import yaml

    doc = yaml.safe_load((REPO / "configs" / "flux_4090.yaml").read_text())
    doc["model"][section]["class_path"] = class_path
    doc["model"]["offload_something_new"] = 3  # a setting this tool does not know: listed, not ignored
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(bench.ConfigMismatch, match=f"{option}: {class_path}"):
        bench.config_defaults(path)
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", str(path)])
    assert option in capsys.readouterr().err
    doc["model"][section]["class_path"] = {"optimizer": "torch.optim.AdamW", "family": "lightning_lora.families.Flux"}[
        section
    ]
    path.write_text(yaml.safe_dump(doc))
    assert "model.offload_something_new: 3" in bench.config_defaults(path)["not_reproduced"]


def test_bench_runs_a_shipped_config_on_a_tiny_model(capsys) -> None:
    """flux_4090 as shipped (FP8 compute, rank 16, no checkpointing, 8-bit AdamW, accumulation 4) on the tiny FLUX,
    small shapes. ``--compile 0``: regional compile works on the CPU but takes about a minute on 2 cores; the CPU has
    no FP8 units, so fp8_compute falls back to FP8 storage with its warning. ``--memory-limit`` is recorded (no effect
    on the CPU). The config's callbacks run after the timed steps: its two sample prompts (with ``--tiny``: 2 steps at
    the training size), one checkpoint save, the LoRA files."""
    argv = ["--tiny", "--config", str(REPO / "configs" / "flux_4090.yaml"), "--steps", "1", "--warm", "1"]
    argv += ["--h", "64", "--w", "64", "--tlen", "16", "--compile", "0", "--memory-limit", "24"]
    with pytest.warns(UserWarning, match="FP8Compute needs FP8 matrix units"):
        bench.main(argv)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "error" not in out, out
    assert out["config"] == "flux_4090.yaml" and out["memory_limit_GiB"] == 24 and "memory_fraction" not in out
    assert (out["quant"], out["rank"], out["gc"], out["opt"], out["accumulate"]) == (
        "fp8_compute",
        16,
        0,
        "adamw8bit",
        4,
    )
    assert (out["h"], out["w"], out["tlen"], out["compile"]) == (64, 64, 16, 0)
    assert out["workers"] == 2  # the config's data.num_workers serve the batches
    assert out["s_per_step"] > 0 and out["loss"] > 0 and out["images_per_s"] > 0
    assert (out["sample_size"], out["sample_steps"], out["samples"]) == ([64, 64], 2, 2)
    # the tiny model's save and export can take under 5 ms (rounded to 0.0): what they wrote is the check
    assert out["sample_s"] > 0 and out["checkpoint_s"] >= 0 and out["export_s"] >= 0
    assert out["checkpoint_tensors"] > 0 and out["checkpoint_MB"] > 0 and out["export_MB"] > 0
    assert out["planned"]["sampling_peak"] > 0 and "sample_peak_GiB" not in out  # a peak on the GPU only
    assert out["not_reproduced"][-1] == "trainer.callbacks: FixedEvalLoss (not run)"


def test_bench_runs_a_configs_samples_checkpoint_and_export(capsys, tmp_path, monkeypatch) -> None:
    """sdxl_24gb's callbacks, on the tiny SDXL: its SampleImages (2 prompts, guidance 7 with the empty prompt as the
    negative, the SDXL scheduler; 1 step at 64 px here), a checkpoint that reads back as ``--ckpt_path`` reads it,
    holding exactly the LoRA's tensors and the random state, and both LoRA files. All of it in a temporary folder that
    is gone afterwards; nothing in the config's own paths (runs/sdxl_24gb)."""
    import shutil

    from safetensors import safe_open

    from lightning_lora.checkpoint import read_checkpoint

    seen: dict[str, object] = {}
    remove = shutil.rmtree

    def look_then_remove(path, *args, **kwargs):  # what the run wrote, read before bench deletes it
        root = bench.Path(path)
        seen["root"] = root
        seen["files"] = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
        seen["checkpoint"] = read_checkpoint(root / "checkpoints" / "last.ckpt")
        with safe_open(str(root / "lora" / "sdxl-lora.safetensors"), "pt") as f:
            seen["lora_keys"] = list(f.keys())
        remove(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", look_then_remove)
    monkeypatch.chdir(tmp_path)
    argv = ["--tiny", "--config", str(REPO / "configs" / "sdxl_24gb.yaml"), "--steps", "1", "--warm", "1"]
    argv += ["--h", "64", "--w", "64", "--compile", "0", "--sample-steps", "1", "--sample-size", "64"]
    bench.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    partial, measured, out = (json.loads(line) for line in lines if line[0] == "{")
    assert "error" not in out, out
    # Before the outputs, the training figures: what a row stopped while sampling still leaves
    assert partial["partial"] and partial["s_per_step"] == out["s_per_step"] > 0 and "samples" not in partial
    # Before the planner's count, everything measured: what a row stopped while planning still leaves
    assert measured.pop("partial") and "planned_peak_GiB" not in measured and measured["samples"] == out["samples"]
    assert measured == {k: v for k, v in out.items() if not k.startswith("planned")}
    assert "partial" not in out and out["sample_compiled"] is False  # the samples' default: the blocks uncompiled
    assert (out["sample_size"], out["sample_steps"], out["sample_prompts"], out["samples"]) == ([64, 64], 1, 2, 2)
    assert out["export_formats"] == ["diffusers", "kohya"] and out["export_MB"] > 0
    files = seen["files"]
    assert [f for f in files if f.startswith("samples/")] == ["samples/step000002_00.png", "samples/step000002_01.png"]
    assert {"checkpoints/last.ckpt", "lora/sdxl-lora.safetensors", "lora/sdxl-lora.kohya.safetensors"} <= set(files)
    checkpoint = seen["checkpoint"]
    state = checkpoint["state_dict"]
    assert len(state) == out["checkpoint_tensors"] > 0 and all("lora_" in k for k in state)  # the LoRA, no base
    assert sum(v.numel() for v in state.values()) / 1e6 == pytest.approx(out["lora_params_M"], abs=1e-3)
    assert checkpoint["global_step"] == 2 and checkpoint["hyper_parameters"]["lora"]["rank"] == 32
    assert checkpoint["rng_states"] and checkpoint["lightning_lora"]["saved_at_ns"] > 0  # fit's RNGState, RunFolder
    assert len(seen["lora_keys"]) == len(state)  # down and up of every LoRA layer
    assert not seen["root"].exists() and list(tmp_path.iterdir()) == []  # deleted; nothing in the config's paths
    assert not any(n.startswith("trainer.callbacks: ModelCheckpoint") for n in out["not_reproduced"])
    assert "trainer.callbacks: FixedEvalLoss (not run)" in out["not_reproduced"]


@pytest.mark.parametrize("phase", ["sample", "checkpoint"])
def test_bench_reports_an_out_of_memory_in_the_outputs_naming_the_phase(capsys, monkeypatch, phase: str) -> None:
    """Out of memory while sampling (SampleImages skips the images and training would go on) or while saving: the
    line keeps the training numbers and says which phase failed; the other phases still run."""
    import torch
    from lightning.pytorch import Trainer

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if phase == "sample":
        monkeypatch.setattr(bench.RANDOM["flux"], "generate", out_of_memory)
    else:
        monkeypatch.setattr(Trainer, "save_checkpoint", out_of_memory)
    argv = ["--tiny", "--config", str(REPO / "configs" / "flux_4090.yaml"), "--steps", "1", "--warm", "1"]
    argv += ["--h", "64", "--w", "64", "--tlen", "16", "--compile", "0", "--quant", "none", "--opt", "adamw"]
    bench.main([*argv, "--accumulate", "1", "--sample-steps", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["error_phase"] == phase and out["error"].startswith(f"{phase}: OutOfMemoryError: ")
    assert "Tried to allocate 2.00 GiB" in out["error"]
    # The training numbers, and the phases after it (the tiny model's save and export can take under 5 ms: their
    # times, rounded to 10 ms, may be 0.0; what they wrote is not).
    assert out["s_per_step"] > 0 and out["export_s"] >= 0 and out["export_MB"] > 0
    if phase == "sample":  # no images, no time: the save after it ran
        assert out["samples"] == 0 and "sample_s" not in out and out["checkpoint_s"] >= 0 and out["checkpoint_tensors"]
    else:
        assert out["samples"] == 2 and out["sample_s"] > 0 and "checkpoint_s" not in out


def test_bench_lists_a_configs_callbacks_it_does_not_run() -> None:
    path = str(REPO / "configs" / "sdxl_24gb.yaml")
    every = "trainer.callbacks: ModelCheckpoint, SampleImages, FixedEvalLoss, LoraExport (not run: --callbacks 0)"
    assert bench.header(bench.parse_args(["--config", path, "--callbacks", "0"]))["not_reproduced"][-1] == every
    bare = bench.header(bench.parse_args(["--config", path, "--loop", "bare"]))["not_reproduced"][-1]
    assert bare == every.replace("--callbacks 0", "--loop bare")
    ran = bench.header(bench.parse_args(["--config", path]))["not_reproduced"][-1]
    assert ran == "trainer.callbacks: FixedEvalLoss (not run)"
    assert bench.parse_args(["--config", path, "--sample-size", "512x768"]).sample_size == (512, 768)
    with pytest.raises(ValueError, match="give --config"):
        bench.run(bench.parse_args(["--tiny", "--callbacks", "1"]))


def test_bench_runs_sd15_on_a_tiny_model() -> None:
    """sd15_8gb, with its samples (the PNDM scheduler, classifier-free guidance) at 1 step of 64 px instead of its
    30 steps of 512 px, eager (compiling its blocks takes minutes on the CPU)."""
    path = str(REPO / "configs" / "sd15_8gb.yaml")
    argv = ["--tiny", "--config", path, "--opt", "adamw", "--sample-steps", "1", "--sample-size=64", "--compile", "0"]
    args = bench.parse_args(argv)
    args.steps, args.warm, args.h, args.w, args.batch = 1, 1, 64, 64, 1
    out = bench.run(args)
    assert out["family"] == "sd15" and out["tlen"] == 77 and out["alpha"] == 8 and out["s_per_step"] > 0
    assert "error" not in out and out["samples"] == 2 and out["sample_s"] > 0


def test_bench_shards_a_bf16_base_with_fsdp() -> None:
    """``--strategy fsdp`` on one CPU process (gloo): the strategy ``trainer.strategy: fsdp`` gives a run
    (LoraFSDPStrategy), with the base sharded over a mesh of one; 2 processes: tests/test_fsdp.py, test_sharding.py."""
    import os

    import torch
    from helpers import DISTRIBUTED_ENV

    from lightning_lora.model.parallel import LoraFSDPStrategy

    argv = ["--family", "flux", "--rank", "4", "--h", "64", "--w", "64", "--tlen", "16", "--steps", "1", "--warm", "1"]
    args = bench.parser().parse_args([*argv, "--opt", "adamw", "--tiny", "--strategy", "fsdp"])
    before = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}  # Lightning sets them in this process
    try:
        out = bench.run(args)
    finally:  # the one-process group would keep its port bound for the rest of the session
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert out["strategy"] == LoraFSDPStrategy.__name__ and out["s_per_step"] > 0 and out["loss"] > 0
    assert out["weights_GiB_per_device"] > 0
    with pytest.raises(ValueError, match="--strategy fsdp shards a bf16 base: give --quant none"):
        bench.run(bench.parser().parse_args([*argv, "--tiny", "--strategy", "fsdp", "--quant", "nf4"]))


def test_bench_builds_the_denoiser_a_config_names() -> None:
    """A config whose ``model.pretrained`` is another known denoiser of its family (FLUX.2 dev, not klein) is measured
    on random weights of that denoiser's config, not the family's default one."""
    from lightning_lora.families import Flux2

    dev = bench.parse_args(["--config", str(REPO / "configs" / "flux2_dev_24gb.yaml")])
    assert dev.denoiser == "black-forest-labs/FLUX.2-dev" and bench.header(dev)["denoiser"] == dev.denoiser
    assert not any(s.startswith("model.pretrained") for s in dev.not_reproduced)
    default = bench.denoiser_config("flux2")
    assert bench.denoiser_config("flux2", denoiser=dev.denoiser) == Flux2.planning.known_denoisers[dev.denoiser]
    assert Flux2.planning.known_denoisers[dev.denoiser] != default  # a different (32 B) transformer
    assert bench.parse_args(["--family", "flux2"]).denoiser is None  # flags alone: the family's default


def test_bench_reports_the_batch_loss_not_the_share_accumulation_backpropagates(monkeypatch, capsys) -> None:
    """Lightning passes on_train_batch_end the loss divided by accumulate_grad_batches; the reported loss is the
    batch's mean (call 35: 1.161 at accumulation 2 against 0.58 at 4 for the same model and data, the recipe 2.32)."""
    from lightning_lora.module import LoraModule

    step = LoraModule.training_step
    monkeypatch.setattr(LoraModule, "training_step", lambda self, b, i: step(self, b, i) * 0 + 3.0)
    argv = ["--tiny", "--family", "flux", "--rank", "2", "--h", "32", "--w", "32", "--tlen", "8", "--opt", "adamw"]
    bench.main([*argv, "--steps", "1", "--warm", "1", "--accumulate", "2", "--callbacks", "0"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["accumulate"] == 2 and out["loss"] == 3.0


def test_bench_teardown_watch_prints_every_threads_stack_until_cancelled(capsys) -> None:
    """Armed at the training's end, the watch writes each thread's stack (the training thread's too, where it waits)
    every interval until bench cancels it once ``Trainer.fit`` returns; 0 arms nothing."""
    import time

    watch = bench.TeardownWatch(0.05)
    watch.on_train_end(None, None)  # type: ignore[arg-type]
    time.sleep(0.3)
    watch.cancel()
    time.sleep(0.1)
    err = capsys.readouterr().err
    assert "has not returned 0.05 s after" in err and "Thread MainThread:" in err
    assert "test_bench_teardown_watch_prints_every_threads_stack_until_cancelled" in err and "time.sleep" in err
    time.sleep(0.2)
    assert capsys.readouterr().err == ""  # cancelled: nothing more
    off = bench.TeardownWatch(0)
    off.on_train_end(None, None)  # type: ignore[arg-type]
    time.sleep(0.2)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("workers", "start", "pin"), [(2, "forkserver", False), (2, None, True), (0, "spawn", None)])
def test_bench_loader_takes_the_workers_start_method_and_pinning(workers: int, start: str | None, pin) -> None:
    """``--worker-start`` and ``--loader-pin`` reach the DataLoader as fit's settings would: the start method only
    where there are workers (torch refuses a context without them), pinning as given or, unset, where CUDA is."""
    import torch

    dataset = bench.Synthetic("flux", bench.denoiser_config("flux", tiny=True), 64, 64, 16, n=4)
    data = bench.SyntheticData(dataset, 1, workers=workers, pin_memory=pin, worker_start=start)
    loader = data.train_dataloader()
    assert loader.num_workers == workers and loader.persistent_workers == (workers > 0)
    assert loader.pin_memory == (torch.cuda.is_available() if pin is None else pin)
    context = loader.multiprocessing_context
    assert (context.get_start_method() if context is not None else None) == (start if workers else None)


def test_bench_buckets_change_the_shape_from_one_batch_to_the_next() -> None:
    """``--buckets``: the batches cycle through the sizes, every batch one size, as the bucket sampler serves them."""
    args = bench.parser().parse_args(["--h", "64", "--w", "64", "--buckets", "64x96,96x64", "--batch", "2"])
    assert args.buckets == [(64, 96), (96, 64)]
    config = bench.denoiser_config("sdxl", tiny=True)
    dataset = bench.Synthetic("sdxl", config, 64, 64, 77, n=12, buckets=args.buckets, batch=2)
    loader = bench.SyntheticData(dataset, 2).train_dataloader()
    shapes = [(tuple(b["latents"].shape[-2:]), b["target_size"].tolist()) for b in loader]
    assert shapes == [((8, 8), [[64, 64]] * 2), ((8, 12), [[64, 96]] * 2), ((12, 8), [[96, 64]] * 2)] * 2
    with pytest.raises(SystemExit):  # a size that is not HxW
        bench.parser().parse_args(["--buckets", "64x96,wide"])


def test_bench_trains_through_bucket_changes_and_reports_them() -> None:
    argv = ["--tiny", "--family", "sd15", "--h", "64", "--w", "64", "--buckets", "64x96", "--tlen", "16"]
    out = bench.run(bench.parser().parse_args([*argv, "--steps", "2", "--warm", "1", "--opt", "adamw"]))
    assert out["buckets"] == [[64, 64], [64, 96]] and out["s_per_step"] > 0 and len(out["step_s_each"]) == 2


def test_bench_compile_seconds_grow_by_phase_when_dynamo_traces() -> None:
    """``first_step_compile_s`` reads torch.compile's own timers: tracing a function adds to Dynamo's total and its
    tracing, by phase names that exist in this torch (a renamed timer would leave them at 0)."""
    import torch

    before = bench.compile_seconds()
    assert set(before) == set(bench.COMPILE_PHASES.values())

    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(50):
            x = torch.sin(x) * 2
        return x

    torch.compile(f, backend="eager")(torch.ones(3))
    after = bench.compile_seconds()
    grew = {k for k in after if after[k] > before[k]}
    assert {"dynamo", "tracing", "backend", "guards"} <= grew
    assert after["dynamo"] - before["dynamo"] >= after["tracing"] - before["tracing"] > 0


@pytest.mark.parametrize(("flag", "extra"), [([], ()), (["--compile-regions", "ResnetBlock2D"], ("ResnetBlock2D",))])
def test_bench_compile_regions_replace_the_familys_extra_compiled_classes(monkeypatch, flag, extra) -> None:
    """``--compile-regions`` (an experiment: SDXL's ResNets compiled beside its transformer blocks) reaches the
    assembly's compile as the family's ``compiling.regions``; without it the family's own. The compile is recorded, not
    run (compiling takes minutes on the CPU)."""
    from lightning_lora.model import assembly

    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        assembly, "compile_repeated_blocks", lambda model, mode, extra, streams, joins: seen.append(extra)
    )
    argv = ["--tiny", "--family", "sdxl", "--h", "64", "--w", "64", "--tlen", "16", "--compile", "1", *flag]
    out = bench.run(bench.parser().parse_args([*argv, "--steps", "1", "--warm", "1", "--opt", "adamw"]))
    assert seen == [extra] and out["s_per_step"] > 0
    assert out.get("compile_regions") == (list(extra) if flag else None)


def test_kernel_launches_count_every_launch_api_and_nothing_else() -> None:
    """Triton's and cuBLAS's kernels go through the driver's ``cuLaunchKernelEx``: a profile that counts only the
    runtime's launches reads a launch-bound step as launching fewer kernels than it does."""
    from types import SimpleNamespace as Event

    events = [
        Event(key="cudaLaunchKernel", count=10),
        Event(key="cuLaunchKernel", count=20),
        Event(key="cuLaunchKernelEx", count=300),
        Event(key="cudaLaunchKernelExC", count=4),
        Event(key="aten::mm", count=5000),
        Event(key="cudaMemsetAsync", count=7),
    ]
    assert bench.kernel_launches(events) == 334
    assert bench.kernel_launches([]) == 0


def test_profile_steps_profile_after_the_timed_steps_and_leave_their_timing_alone(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--profile F --profile-steps N`` trains N more steps after the timed ones and profiles those: one row gives its
    timing and its profile (call 56's separate profiled rows of FLUX with accumulation ran out of time). Without
    ``--profile-steps`` the timed steps are the profiled ones, as before."""
    windows: list[tuple[int, int]] = []
    real = bench.Profile.__init__

    def record(self, warm: int, steps: int, path: str) -> None:
        windows.append((warm, steps))
        real(self, warm, steps, path)

    monkeypatch.setattr(bench.Profile, "__init__", record)
    argv = ["--family", "flux", "--rank", "4", "--gc", "0", "--h", "64", "--w", "64", "--tlen", "16", "--tiny"]
    argv += ["--steps", "2", "--warm", "1", "--opt", "adamw", "--profile", str(tmp_path / "p.txt")]
    out = bench.run(bench.parse_args([*argv, "--profile-steps", "3"]))
    assert windows == [(3, 3)]  # after the warm-up step and the 2 timed ones
    assert len(out["step_s_each"]) == 2 and out["s_per_step"] > 0
    assert (tmp_path / "p.txt").read_text().startswith("wall ")  # the profile was written: its window was reached
    (tmp_path / "p.txt").unlink()
    bench.run(bench.parse_args(argv))
    assert windows[-1] == (1, 2) and (tmp_path / "p.txt").exists()
    for bad in (["--profile-steps", "2"], ["--profile", "p.txt", "--profile-steps", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tiny", *bad])


def test_bench_runs_the_ema_callback_and_takes_it_from_a_config(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config with a ``LoraEMA`` turns ``--ema 1`` on with its options, and it is no longer listed as not run:
    kept as ``fit`` keeps it (the power-function EMAs only with snapshots; none written while timed), its copies in
    the planned peak, the EMA's LoRA files written beside the raw ones; the config's best LoRA is left out (its
    ``FixedEvalLoss`` is not run)."""
    import yaml

    import lightning_lora.plan

    planned: list[Any] = []
    plan_training = lightning_lora.plan.plan_training

    def recorded(*args: Any, **kwargs: Any) -> Any:
        planned.append(plan_training(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(lightning_lora.plan, "plan_training", recorded)
    config = yaml.safe_load((REPO / "configs" / "flux_4090.yaml").read_text())
    ema = {"class_path": "lightning_lora.callbacks.LoraEMA", "init_args": {"decay": 0.95}}
    config["trainer"]["callbacks"].append(ema)
    path = tmp_path / "flux_4090_ema.yaml"
    path.write_text(yaml.safe_dump(config))
    a = bench.parse_args(["--config", str(path)])
    assert a.ema == 1 and a.config_ema == {"decay": 0.95}
    configured = bench.bench_ema(a)  # as fit runs it: the config keeps no snapshots, so no power-function EMAs
    assert configured is not None and configured.decay == 0.95 and configured.copies == 1
    assert "LoraEMA" not in bench.header(a)["not_reproduced"][-1]
    assert bench.parse_args(["--config", str(REPO / "configs" / "flux_4090.yaml")]).ema == 0
    ema["init_args"]["snapshot_every"] = 1  # with snapshots: the power-function EMAs, none written while timed
    path.write_text(yaml.safe_dump(config))
    argv = ["--tiny", "--config", str(path), "--steps", "1", "--warm", "1", "--h", "64", "--w", "64", "--tlen", "16"]
    argv += ["--compile", "0", "--sample-steps", "1"]
    timed = bench.parse_args(argv)
    with_snapshots = bench.bench_ema(timed)
    assert with_snapshots is not None and with_snapshots.copies == 3
    assert with_snapshots.snapshot_every > timed.warm + timed.steps
    with pytest.warns(UserWarning, match="FP8Compute needs FP8 matrix units"):
        out = bench.run(bench.parse_args(argv))
    assert "error" not in out and out["ema"] == 1 and out["s_per_step"] > 0 and "ema" in out["planned"]
    assert planned[-1].ema == pytest.approx(3 * planned[-1].lora) and planned[-1].lora > 0
    assert out["export_files"] == 2 * len(out["export_formats"])  # the raw LoRA's files and the EMA's, as fit writes
    with pytest.raises(ValueError, match="--ema 1 runs the LoraEMA callback in Lightning's loop"):
        bench.run(bench.parse_args([*argv, "--loop", "bare", "--callbacks", "0"]))


def test_bench_dop_and_masks_train_the_module_with_their_batches(tmp_path) -> None:
    """``--dop 1``: every sample a preservation sample, so the step runs DOP's adapter-off forward first; a fresh LoRA
    (a zero update) then predicts what the base does: the loss is exactly 0, masked (``--masks 1``) or not. A config
    with ``model.preservation.mode: dop`` and a folder with masks turns both on; the plan counts DOP's forward."""
    import yaml

    argv = ["--rank", "4", "--h", "64", "--w", "64", "--tlen", "16", "--steps", "1", "--warm", "1", "--opt", "adamw"]
    for loop in ("lightning", "bare"):
        out = bench.run(bench.parser().parse_args([*argv, "--tiny", "--dop", "1", "--masks", "1", "--loop", loop]))
        assert (out["dop"], out["masks"], out["loss"]) == (1, 1, 0.0), out
    assert "preservation" in out["planned"]
    dataset = bench.Synthetic("flux", bench.denoiser_config("flux", tiny=True), 64, 64, 16, masks=True, dop=True)
    item = dataset[0]
    assert item["role"] == "preservation" and item["loss_mask"].shape == (1, *item["latents"].shape[-2:])
    assert item["loss_mask"].sum() == item["loss_mask"].numel() / 2
    doc = yaml.safe_load((REPO / "configs" / "flux_4090.yaml").read_text())
    shipped = bench.parse_args(["--config", str(REPO / "configs" / "flux_4090.yaml")])
    assert (shipped.dop, shipped.masks) == (0, 0)  # commented out there
    doc["model"]["preservation"] = {"mode": "dop", "every_image": True}
    doc["data"]["images"] = [{"path": "data/me", "masks": "data/me_masks"}]
    path = tmp_path / "flux_dop.yaml"
    path.write_text(yaml.safe_dump(doc))
    a = bench.parse_args(["--config", str(path)])
    assert (a.dop, a.masks) == (1, 1) and not any("preservation" in n for n in a.not_reproduced)
