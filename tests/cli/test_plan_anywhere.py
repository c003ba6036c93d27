"""``lightning-lora plan`` before renting a GPU or downloading 24 GB: no GPU, no image folder, no weights.

The shipped configs name hub models (FLUX.1-dev, SDXL base, SD1.5) whose architecture ships with lightning-lora, so a
plan of them needs nothing else; a local folder is read for its configs only; an unknown hub id offline gets one line
saying what to download. ``--gpu`` and ``--cards`` speak in cards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import lightning_lora.cli.plan  # noqa: F401  # the verb's imports (torch, Lightning), before any timing below
from lightning_lora.cli import main
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.errors import ConfigError
from lightning_lora.families import SD15, SDXL, Flux
from lightning_lora.families.base import ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan import card_memory, cards_table, plan_for

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.subprocess
def test_plan_needs_no_gpu_no_data_and_no_weights(tmp_path: Path) -> None:
    """As on a laptop: CUDA hidden, the hub offline, run where the config's data folder does not exist."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_lora", "plan", "--config", str(CONFIGS / "flux_4090.yaml")]
    done = subprocess.run([*command, "--gpu", "RTX 4090"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training peak" in done.stdout and "fits in 24 GiB" in done.stdout
    assert "Traceback" not in done.stderr and not (tmp_path / "data").exists()
    assert "args parameter" not in done.stderr and "Seed set" not in done.stderr + done.stdout


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_plans_here_in_seconds(
    config: str, tmp_path: Path, monkeypatch, capsys, tiny_pipeline: Callable[[str], Path]
) -> None:
    """Every shipped config plans on this machine (the tiny ones on the demo's tiny pipelines), in seconds: the
    planning takes under 10 s of this process's CPU time (a few seconds on the 2-core CI machine; measured as CPU time,
    which other processes on the machine do not lengthen much). The command adds its imports (torch, Lightning: ~6 s
    here). What makes it fast is counted, not timed, in tests/plan/test_plan.py
    (``test_the_planner_builds_the_model_once_and_computes_each_op_once``)."""
    monkeypatch.chdir(tmp_path)  # no data/my_subject here
    pretrained = str(yaml.safe_load((CONFIGS / config).read_text())["model"]["pretrained"])
    if pretrained.startswith(".demo/tiny-"):  # what `make demo` writes: the same tiny pipelines
        (tmp_path / ".demo").mkdir()
        (tmp_path / pretrained).symlink_to(tiny_pipeline(pretrained.removeprefix(".demo/tiny-")))
    start = time.process_time()
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(CONFIGS / config)])
    seconds = time.process_time() - start
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "training peak" in out and "sample images peak" in out
    assert seconds < 10, f"plan --config {config}: {seconds:.1f} s of CPU time"


def _plan_rows(out: str) -> dict[str, float]:
    """The GiB of each component row of ``plan``'s report."""
    rows = {}
    for line in out.splitlines():
        name, _, value = line.strip().rpartition("  ")
        if value.endswith(" GiB") and name:
            rows[name.strip()] = float(value.split()[0])
    return rows


def test_the_plan_counts_the_optimizer_state_the_config_names(tmp_path: Path, monkeypatch, capsys) -> None:
    """``sdxl_12gb`` as shipped (bitsandbytes' 8-bit AdamW: two 8-bit moments, about half the LoRA's own float32
    bytes) and with torch's fused AdamW (two float32 moments: twice the LoRA's bytes)."""
    import yaml

    monkeypatch.chdir(tmp_path)
    shipped = yaml.safe_load((CONFIGS / "sdxl_12gb.yaml").read_text())
    assert shipped["model"]["optimizer"]["class_path"] == "bitsandbytes.optim.AdamW8bit"
    fused = dict(shipped, model={**shipped["model"], "optimizer": {"class_path": "torch.optim.AdamW"}})
    fused["model"]["optimizer"]["init_args"] = {"lr": 1e-4, "fused": True}
    rows = {}
    for name, config in (("8bit", shipped), ("fused", fused)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--config", str(path)])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0, out
        rows[name] = _plan_rows(out)
    lora = rows["fused"]["LoRA parameters (fp32)"]
    assert lora == rows["8bit"]["LoRA parameters (fp32)"] > 0.05
    assert rows["fused"]["optimizer state"] == pytest.approx(2 * lora, abs=0.015)
    assert rows["8bit"]["optimizer state"] == pytest.approx(2.05 / 4 * lora, abs=0.015)
    assert rows["fused"]["training peak"] > rows["8bit"]["training peak"]


def _local_copy(tmp_path: Path, family: type, hub_id: str) -> Path:
    """A local pipeline folder that holds only the configs of ``hub_id``'s architecture (no weights)."""
    folder = tmp_path / "local"
    (folder / family.architecture.denoiser_subfolder).mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": family.architecture.pipeline_classes[0]}))
    config = family.planning.known_denoisers[hub_id]
    (folder / family.architecture.denoiser_subfolder / "config.json").write_text(json.dumps(config))
    for component, encoder in family.planning.known_text_encoders[hub_id].items():
        (folder / component).mkdir()
        config = {"architectures": [encoder["_class"]], **{k: v for k, v in encoder.items() if k != "_class"}}
        (folder / component / "config.json").write_text(json.dumps(config))
    if family is not Flux:  # a UNet family reads its noise schedule from the folder when it is checked
        (folder / "scheduler").mkdir()
        schedule = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(schedule))
    return folder


@pytest.mark.parametrize(
    ("family", "hub_id"),
    [
        (Flux, "black-forest-labs/FLUX.1-dev"),
        (SDXL, "stabilityai/stable-diffusion-xl-base-1.0"),
        (SD15, "stable-diffusion-v1-5/stable-diffusion-v1-5"),
    ],
)
def test_the_shipped_architecture_plans_like_a_local_folder(tmp_path: Path, family: type, hub_id: str) -> None:
    data = DataRecipe(resolutions=(256,), batch_size=1)
    lora = LoraOptions(rank=8)
    from_hub = plan_for(ModelRecipe(family(), ModelSource(hub_id), lora), data)
    from_folder = plan_for(ModelRecipe(family(), ModelSource(str(_local_copy(tmp_path, family, hub_id))), lora), data)
    assert from_hub == from_folder
    # And it is the real model: FLUX.1 has 11.9 B parameters, SDXL's UNet 2.6 B, SD1.5's 860 M (bf16: 2 bytes each).
    expected = {Flux: 11.90e9, SDXL: 2.567e9, SD15: 0.8595e9}[family]
    assert from_hub.weights * 2**30 / 2 == pytest.approx(expected, rel=2e-3)


def test_an_unknown_hub_model_offline_says_what_to_download() -> None:
    with pytest.raises(ConfigError, match=r"hf download someone/my-flux --include '\*\.json'"):
        Flux().denoiser_skeleton(ModelSource("someone/my-flux"))


@pytest.mark.parametrize(
    ("name", "gib"),
    [
        ("RTX 4090", 24),
        ("4090", 24),
        ("NVIDIA H100", 80),
        ("GeForce RTX 3060", 12),
        ("RTX 3060 12GB", 12),
        ("mi300x", 192),
    ],
)
def test_cards_by_name(name: str, gib: float) -> None:
    assert card_memory(name) == gib


def test_an_unknown_card_is_named() -> None:
    with pytest.raises(ConfigError, match=r"--gpu: 'Voodoo 5' is not a card .*RTX 4090"):
        card_memory("Voodoo 5")


def test_the_cards_table_gives_the_fastest_fit_per_size(tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fastest first: as configured where it fits, then checkpointing, quantization; a smaller batch or image only when
    nothing that keeps the training the same fits."""
    from lightning_lora.plan import search

    def fake_plan(
        recipe: ModelRecipe, datamodule, optimizer: str = "AdamW", shards: int = 1, ema_copies: int = 0
    ) -> SimpleNamespace:
        peak = 40.0 if datamodule.batch_size == 2 else 28.0
        if recipe.gradient_checkpointing:
            peak -= 10.0
        peak -= {"BF16": 0.0, "FP8": 8.0, "NF4": 20.0}[type(recipe.precision).__name__]
        peak -= 2.0 if recipe.offload_activations else 0.0
        peak -= 0.5 * recipe.offload_blocks
        return SimpleNamespace(run_peak=peak)

    monkeypatch.setattr(search, "plan_for", fake_plan)
    recipe = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir)))
    rows = dict(cards_table(recipe, DataRecipe(resolutions=(1024,), batch_size=2), sizes=(8, 12, 24, 48)))
    assert rows[48] is not None and rows[48].flags == "" and rows[48].peak_gib == 40.0  # as configured
    fp8, nf4 = ("--trainer.plugins lightning_lora.precision." + name for name in ("FP8", "NF4"))
    assert rows[24] is not None and rows[24].flags == f"{fp8} --model.gradient_checkpointing true"
    assert rows[12] is not None and rows[12].flags == f"{nf4} --model.gradient_checkpointing true"
    # 8 GiB: nf4 + checkpointing + offloaded inputs is 8 > 7.6, offloading blocks does not reach it: a smaller batch.
    assert rows[8] is not None and rows[8].flags.endswith("--data.batch_size 1") and rows[8].peak_gib == -4.0


def test_a_larger_card_is_told_to_checkpoint_less(tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A config that saves memory (every block checkpointed, its inputs in CPU memory) on a card with room to spare:
    the cards table, ``model.memory: auto`` and ``plan --vram`` choose less recomputation and fewer copies, fastest
    first (no checkpointing, then one block in 3, in 2), and the configured settings only where nothing faster fits."""
    from lightning_lora.plan import choose_for_memory, search

    def fake_plan(
        recipe: ModelRecipe, datamodule, optimizer: str = "AdamW", shards: int = 1, ema_copies: int = 0
    ) -> SimpleNamespace:
        if not recipe.gradient_checkpointing:
            peak = 30.0
        else:
            peak = {1: 12.0, 2: 21.0, 3: 24.0}[recipe.checkpoint_every]
        return SimpleNamespace(run_peak=peak - (1.0 if recipe.offload_activations else 0.0))

    monkeypatch.setattr(search, "plan_for", fake_plan)
    saving = ModelRecipe(Flux(), ModelSource(str(tiny_flux_dir))).replace(
        gradient_checkpointing=True, offload_activations=True
    )
    data = DataRecipe(resolutions=(512,), batch_size=1)
    rows = dict(cards_table(saving, data, sizes=(12, 16, 24, 48)))
    copies = " --model.offload_activations false"
    assert rows[48] is not None and rows[48].flags == "--model.gradient_checkpointing false" + copies
    assert rows[24] is not None and rows[24].flags == "--model.checkpoint_every 2" + copies  # 24: every 3 does not fit
    assert rows[16] is not None and rows[16].flags == copies.strip() and rows[16].peak_gib == 12.0
    assert rows[12] is not None and rows[12].flags == "" and rows[12].peak_gib == 11.0  # 11.4 usable: as configured
    chosen = choose_for_memory(saving, data, 48)
    assert chosen is not None and saving.replace(**chosen.changes).gradient_checkpointing is False
    assert saving.replace(**chosen.changes).offload_activations is False  # a valid recipe: no inputs to offload


def test_plan_says_what_is_faster_when_the_run_fits(tmp_path: Path, monkeypatch, capsys) -> None:
    """SD1.5 at 512x512 with every block checkpointed fits 8 GiB with room to spare: `plan --vram 8` says so and names
    the faster settings that still fit (no checkpointing)."""
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--config", str(CONFIGS / "sd15_8gb.yaml"), "--vram", "8", "--model.gradient_checkpointing", "true"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "fits in 8 GiB" in out and "faster, and it still fits: --model.gradient_checkpointing false   (~" in out, out
    with pytest.raises(SystemExit):  # 3.3 GiB usable: the run fits (2.9 GiB while sampling), without checkpointing not
        main([*argv[:4], "3.5", *argv[5:]])
    out = capsys.readouterr().out
    assert "fits in 3.5 GiB" in out and "faster" not in out, out


def test_plan_by_card_name(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(CONFIGS / "sd15_8gb.yaml"), "--gpu", "RTX 3070"])
    assert exit_info.value.code == 0
    assert "fits in 8 GiB" in capsys.readouterr().out


def test_vram_auto_without_a_gpu_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(CONFIGS / "sd15_8gb.yaml"), "--vram", "auto"])
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and not out.out  # the error alone, on stderr
    assert out.err.count("\n") == 1 and "no GPU is visible" in out.err, out
    assert "--vram 24" in out.err and '--gpu "RTX 4090"' in out.err and "Traceback" not in out.err


def test_vram_auto_plans_for_the_memory_free_on_the_visible_card(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--vram auto``: what is free on the GPU this machine shows (``torch.cuda``: CUDA or ROCm), as ``model.memory:
    auto`` reads it; faked here (no GPU on this machine)."""
    from lightning_lora import hardware

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "free_memory_gib", lambda device: 23.47)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(CONFIGS / "sd15_8gb.yaml"), "--vram", "auto"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "--vram auto: 23.4 GiB free on NVIDIA GeForce RTX 4090" in out and "fits in 23.4 GiB" in out, out


def test_the_caching_phase_is_planned_too() -> None:
    """Captions are encoded once, before training, with the text encoders: FLUX's T5-XXL alone is ~8.9 GiB in bf16.
    Calibrated on the H200 measurement of BENCHMARKS.md (11.01 GiB for 8 captions x 512 tokens in bf16)."""
    from lightning_lora.plan import caching_peaks

    recipe = ModelRecipe(Flux(), ModelSource("black-forest-labs/FLUX.1-dev"))
    text = {mode: caching_peaks(recipe, mode, 8, 1024)[0] for mode in ("none", "fp8", "nf4")}
    assert text["none"] == pytest.approx(11.01, rel=0.05)
    # NF4 / FP8 store the linear layers in 4 / 8 bits; T5's wo (a fifth of T5-XXL) stays bf16, as transformers keeps it.
    assert text["nf4"] < text["fp8"] < text["none"] and text["nf4"] < 0.6 * text["none"]
    images_1, images_8 = caching_peaks(recipe, "none", 1, 1024)[1], caching_peaks(recipe, "none", 8, 1024)[1]
    assert images_8 == pytest.approx(10.36, rel=0.05) and images_1 < images_8  # 8 images of 1024x1024 at a time
    host = caching_peaks(recipe, "none", 8, 1024)[2]
    assert host == pytest.approx((123.06e6 + 4762.3e6) * 2 / 2**30, rel=1e-3)  # the encoders load through CPU memory
    unknown = ModelRecipe(Flux(), ModelSource("someone/my-flux"))
    assert (
        caching_peaks(unknown, "none", 4, 512)[0] == 0.0 and "not known" in caching_peaks(unknown, "none", 4, 512)[3][0]
    )


def test_plan_names_larger_batches_where_a_card_has_room_for_them(tmp_path: Path, monkeypatch, capsys) -> None:
    """flux_8gb trains 4 images a step as 4 batches of 1; 2 of 2 took 1.10 s instead of 2.02 on an H200 at 7.34 GiB,
    which ran out of memory under a 7.5 GiB cap (call 35). `plan` names them for a 12 GB card, not for an 8 GB one:
    the 0.67 GiB the process holds outside PyTorch's allocator is kept, and 5% of the rest."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", str(CONFIGS / "flux_8gb.yaml"), "--vram", "12"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "the same 4 images a step in larger batches" in out, out
    assert "--data.batch_size 2 --trainer.accumulate_grad_batches 2   (~7.3 GiB)" in out, out  # fused AdamW's state

    from lightning_lora.plan import search

    monkeypatch.setattr(
        search,
        "plan_for",
        lambda recipe, data, optimizer="AdamW", shards=1, ema_copies=0: SimpleNamespace(
            run_peak=7.26 if data.batch_size == 2 else 6.68
        ),
    )
    recipe = ModelRecipe(Flux(), ModelSource("black-forest-labs/FLUX.1-dev"))
    data = DataRecipe(resolutions=(512,), batch_size=1)
    assert search.larger_batches(recipe, data, 8, 4) is None  # (8 - 0.67) x 0.95 = 6.96 < 7.26
    fit = search.larger_batches(recipe, data, 8.5, 4)  # 7.44
    assert fit is not None and fit.data == {"batch_size": 2} and fit.peak_gib == 7.26
    assert search.larger_batches(recipe, data, 48, 1) is None  # no accumulation: nothing to merge


@pytest.mark.parametrize(
    ("batch", "accumulate", "merged"), [(1, 4, (2, 2)), (2, 2, (4, 1)), (1, 3, (3, 1)), (1, 6, (2, 3)), (2, 1, None)]
)
def test_merged_batches_keep_the_images_per_step(batch: int, accumulate: int, merged: tuple | None) -> None:
    from lightning_lora.plan import merged_batches

    assert merged_batches(batch, accumulate) == merged
