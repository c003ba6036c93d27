"""GPU benchmark: lightning-lora's own training step on a randomly initialised model of the real size.

Runs the real thing, not a copy: ``LoraModule`` (assembly, quantization, attention, compile options) inside a Lightning
``Trainer`` with the bf16 precision plugin ``--quant`` names (``lightning_lora.precision``), on synthetic cached-latent
batches of the right shapes. Random weights have the real compute and memory. Prints one JSON line per run: seconds
per step (mean over ``--steps`` after ``--warm`` warm-up steps), peak allocated / reserved GiB over the timed steps,
the static footprint after set-up, and the memory planner's prediction for the same settings.

Compare with the plain diffusers + peft reference recipe (``ref_recipe.py``, BENCHMARKS.md) run in the same GPU call on
the same shapes: a time on a shared machine is only meaningful as a ratio.

    python tools/bench.py --quant nf4 --rank 4 --gc 1          # FLUX.1-dev, 512x768, T5 length 512
    python tools/bench.py --family qwenimage --quant nf4 --gc 1 --h 1024 --w 1024 --tlen 512   # Qwen-Image, 20.4 B
    python tools/bench.py --tiny --steps 2 --warm 1             # a CPU smoke run of the same code

Several GPUs: ``--devices N`` with ``--strategy ddp`` (ours, every GPU a whole base) or ``--strategy fsdp`` (a bf16
base sharded with FSDP2 over the N GPUs: ``trainer.strategy: fsdp``,
:class:`lightning_lora.model.parallel.LoraFSDPStrategy`); ``weights_GiB_per_device`` is rank 0's share of the weights,
``peak_*`` the largest over the ranks:

    python tools/bench.py --quant none --opt adamw --devices 2 --strategy fsdp

``--ema 1`` adds the ``LoraEMA`` callback (the EMA of the LoRA and its two power-function EMAs, updated after every
optimizer step; the config's options when it has one, as ``fit`` runs it): the cost of EMA against the same run without
it, and the planner's count of its copies of the LoRA.

Families (``--family``): every family of the registry (``lightning_lora.families.FAMILIES``), each the real family class
(:func:`random_family`) with its denoiser built at the size of the released model its ``random_models()`` names
(FLUX.1-dev for ``flux``, Qwen-Image-Edit-2511 for ``qwenimage_edit_plus``: :func:`denoiser_config`), or a tiny config
with ``--tiny``; the batches have exactly the keys and shapes its ``loss`` reads from the cache, as the family describes
them (:func:`cached_item`). ``--controls N``: N control / reference images of the target's size per sample (an edit
config's ``data.images[].controls`` by default; FLUX.2 takes references too), their cached latents in the batch as the
cache serves them, the planner counting their tokens, and the samples drawn from N random control images of the samples'
size.

Preservation and masks (their cost against the same row without them): ``--dop 1`` trains with
``model.preservation.mode: dop`` and every sample a preservation sample, so every step runs DOP's forward without
gradients (the adapter off) before the training pass: the worst case; ``--masks 1`` gives every sample a mask (its
latents' left half), as a data folder with ``masks`` serves them (``loss_mask``, the masked loss). A ``--config``
with ``model.preservation.mode: dop`` or a ``data.images`` entry with ``masks`` turns them on:

    python tools/bench.py --config configs/flux_4090.yaml --dop 1 --steps 6 --warm 3

A shipped config, as ``fit`` would use it (:func:`config_defaults`): ``--config configs/flux_4090.yaml`` takes every
setting this tool has a flag for from the YAML (family, quantization, checkpointing, compile, offloading, attention,
LoRA, optimizer, resolution, batch, text length, gradient accumulation, gradient clipping); flags on the command line
override it. What the YAML's model section sets that this tool cannot reproduce is listed in the output's
``not_reproduced``.
``--memory-limit GIB`` caps this process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``) to a card's
size from the first training step (:class:`MemoryLimit`: the random-weight build is not a real load), so a config that
does not fit its card ends as an out-of-memory error row:

    python tools/bench.py --config configs/flux_4090.yaml --memory-limit 24 --steps 6 --warm 3

A ``--config`` run also writes what the config's callbacks write during a run (``--callbacks 1``, the default with
``--config``; :class:`Outputs`), once, after the timed steps and under the same memory limit: the config's
``SampleImages`` (its prompts, size and steps; ``--sample-steps`` / ``--sample-size`` replace them, and ``--tiny`` draws
2 steps at the training size), one checkpoint save (``trainer.save_checkpoint``, as its ``ModelCheckpoint`` calls it,
through ``fit``'s atomic writer) and its ``LoraExport``, each built from the YAML with the callbacks' own code. The
prompts' embeddings are random, of the text cache's shapes; the VAE has random weights of the family's real config
(:func:`vae_config`) and the pipeline the released scheduler (:func:`write_sampling_files`). Each reports its seconds
and, on a GPU, its peak allocated memory (``sample_s`` / ``sample_peak_GiB`` beside ``planned["sampling_peak"]``,
planned at the samples' size; ``checkpoint_s`` / ``checkpoint_peak_GiB``, with ``checkpoint_MB`` and
``checkpoint_tensors`` read back as ``--ckpt_path`` reads it; ``export_s`` / ``export_peak_GiB``); ``wall_s`` includes
them. An error there (out of memory) is the line's ``error``, naming the phase (``error_phase``), beside the training
numbers. Everything goes to a temporary folder that is deleted afterwards, never to the config's paths; the config's
other callbacks (``FixedEvalLoss``) stay in ``not_reproduced``:

    python tools/bench.py --config configs/sdxl_24gb.yaml --memory-limit 24 --steps 6 --warm 3 --sample-steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_lora import objectives
from lightning_lora.callbacks import LoraEMA, LoraExport, RNGState, RunFolder, SampleImages
from lightning_lora.checkpoint import AtomicCheckpointIO
from lightning_lora.cli.fit import default_checkpoint
from lightning_lora.cli.peek import config_allocator
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.data.sources import as_folders
from lightning_lora.errors import ConfigError
from lightning_lora.families import FAMILIES, DiffusionFamily
from lightning_lora.families.base import ModelSource, build_from_config
from lightning_lora.families.unet import NoiseSchedule, UNetFamily
from lightning_lora.hardware import ALLOCATOR_VARIABLES, limit_host_threads, set_allocator_defaults
from lightning_lora.hardware import ALLOCATORS as ALLOCATOR_CHOICES
from lightning_lora.lora import LoraOptions, set_lora_input_casts
from lightning_lora.model.parallel import resolve_strategy, shard_count
from lightning_lora.model.sharding import local_parameter_bytes
from lightning_lora.module import LoraModule
from lightning_lora.objectives import Preservation
from lightning_lora.precision import FP8, PRECISIONS, BasePrecision
from lightning_lora.precision.layers import linear_layers


def denoiser_config(family: str, tiny: bool = False, denoiser: str | None = None) -> dict[str, Any]:
    """The denoiser config the benchmark builds for ``family`` (its ``random_models()``,
    :class:`~lightning_lora.families.facts.RandomModels`): the default hub id's ``known_denoisers`` config, another
    known ``denoiser``'s (a shipped config's ``model.pretrained``), or with ``tiny`` the tiny one for CPU runs."""
    cls = FAMILIES[family]
    models = cls.random_models()
    config = dict(cls.planning.known_denoisers[denoiser if denoiser and not tiny else models.denoiser])
    return dict(config, **models.tiny_denoiser) if tiny else config


def vae_config(family: str, tiny: bool = False) -> dict[str, Any]:
    """The VAE config the benchmark builds for ``family``'s samples: its ``planning.vae_architecture``, or with
    ``tiny`` the tiny one of the tiny denoiser's latent channels. Only the decoder runs while sampling."""
    cls = FAMILIES[family]
    config = dict(cls.planning.vae_architecture or {})
    return dict(config, **cls.random_models().tiny_vae) if tiny else config


class RandomWeights:
    """Mixed in before a family class: the family's denoiser is ``config`` built with random weights straight on
    ``device`` (no download, no files). Everything else is the family's own -- loss, noise and timestep sampling, LoRA
    presets, and the memory planner's skeleton, which reads the same config (:meth:`denoiser_config`)."""

    config: dict[str, Any]
    device: str
    vae_config: dict[str, Any] | None = None
    sampling_folder: str | None = None
    """A local model folder: what the family's ``pipeline`` reads besides weights (:func:`write_sampling_files`)."""

    def check_source(self, source: ModelSource) -> None:  # nothing to check: no files
        pass

    def denoiser_config(self, source: ModelSource, load_config: Any) -> dict[str, Any]:
        return dict(self.config)

    def load_denoiser(self, source: ModelSource) -> torch.nn.Module:
        import diffusers

        cls = getattr(diffusers, self.config["_class_name"])
        model: Any = build_from_config(cls, dict(self.config), source.dtype, self.device)
        if isinstance(self, UNetFamily):  # what UNetFamily.load_denoiser attaches: SDXL's / SD1.5's training schedule
            betas = objectives.beta_schedule("scaled_linear", 1000, 0.00085, 0.012)
            prediction = self.prediction_type or "epsilon"
            model.noise_schedule = NoiseSchedule(objectives.alphas_cumprod(betas), prediction)
        return model.requires_grad_(False).eval()

    def load_vae(self, source: ModelSource) -> torch.nn.Module:
        """:attr:`vae_config` with random weights, drawn on ``device`` and left on the CPU, where ``from_pretrained``
        leaves a real one (:class:`~lightning_lora.callbacks.SampleImages` moves it to the GPU for each draw)."""
        import diffusers

        if self.vae_config is None:
            raise ValueError(f"no VAE config for the random {type(self).__name__}")
        cls = getattr(diffusers, self.vae_config["_class_name"])
        vae: Any = build_from_config(cls, dict(self.vae_config), source.dtype, self.device)
        return vae.to("cpu").requires_grad_(False).eval()

    def pipeline(self, denoiser: Any, vae: Any, source: ModelSource) -> Any:
        """The family's own pipeline, its scheduler (and ``model_index.json``) read from :attr:`sampling_folder`
        instead of ``source`` (no hub)."""
        if self.sampling_folder is None:
            raise ValueError(f"no sampling files for the random {type(self).__name__}")
        return super().pipeline(denoiser, vae, ModelSource(self.sampling_folder, dtype=source.dtype))  # type: ignore[misc]


# Module-level classes, one per registered family, so that Lightning can pickle the family into the module's
# hyperparameters: RandomFlux, RandomSDXL, ...
RANDOM: dict[str, type[DiffusionFamily]] = {
    name: type(f"Random{cls.__name__}", (RandomWeights, cls), {"__module__": __name__})
    for name, cls in FAMILIES.items()
}
"""``--family`` -> its family class with :class:`RandomWeights` mixed in."""
globals().update({cls.__name__: cls for cls in RANDOM.values()})


def random_family(name: str, config: dict[str, Any], device: str, **options: Any) -> DiffusionFamily:
    """The family ``name`` built with ``options``, its denoiser ``config`` with random weights on ``device``
    (:class:`RandomWeights`)."""
    family: Any = RANDOM[name](**options)
    family.config, family.device = dict(config), device
    return family


def cached_item(
    family: DiffusionFamily,
    config: dict[str, Any],
    height: int,
    width: int,
    tlen: int,
    g: torch.Generator,
    controls: int = 0,
) -> dict[str, torch.Tensor]:
    """One training sample as the latent cache serves it: the family's example batch of one
    (:meth:`~lightning_lora.families.base.DiffusionFamily.example_batch`: latents, size conditioning, cached text, and
    ``controls`` control latents of the target's size, ``[N, C, h, w]``)."""
    return {k: v[0] for k, v in family.example_batch(config, 1, height, width, tlen, g, controls=controls).items()}


class Synthetic(Dataset):
    """Cached-latent batches of the family's shapes (what the latent cache serves): four distinct samples, repeated.

    ``buckets``: more image sizes; then batch ``k`` (``batch`` samples in order) has size ``k`` of ``[(height, width),
    *buckets]``, cycling, as aspect-ratio buckets change the shape from one batch to the next (``--buckets``).
    ``controls``: each sample's control images, in its bucket (``--controls``)."""

    def __init__(
        self,
        family: str,
        config: dict[str, Any],
        height: int,
        width: int,
        tlen: int,
        n: int = 256,
        family_obj: Any = None,
        buckets: Sequence[tuple[int, int]] = (),
        batch: int = 1,
        dop: bool = False,
        masks: bool = False,
        controls: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.dop, self.masks = dop, masks
        described = family_obj if family_obj is not None else RANDOM[family]()  # the family describes its batches
        self.family = family_obj
        self.sizes = [(height, width), *buckets]
        self.by_size = [
            [cached_item(described, config, h, w, tlen, g, controls) for _ in range(4)] for h, w in self.sizes
        ]
        self.batch = batch
        self.n = n
        self._text = (described, config, tlen)

    def text_embeddings(
        self, prompts: list[str], device: Any = None, controls: Any = None, background: Any = None
    ) -> list[dict[str, torch.Tensor]]:
        """What the text cache's ``text_embeddings`` returns for ``prompts`` (random embeddings of the cached shapes,
        a batch of 1 each, on the CPU): the sample prompts of :class:`~lightning_lora.callbacks.SampleImages`, with
        their ``controls`` for an edit family whose prompt sees them (the same shapes here)."""
        g = torch.Generator().manual_seed(1)
        family, config, tlen = self._text
        return [family.example_text(config, 1, tlen, g) for _ in prompts]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        items = self.by_size[(i // self.batch) % len(self.by_size)]
        item: dict[str, Any] = dict(items[i % len(items)])
        if self.masks:  # a mask over the latents' left half, as the cache serves a masked image's loss weights
            mask = torch.zeros(1, *item["latents"].shape[-2:])
            mask[..., : mask.shape[-1] // 2] = 1.0
            item["loss_mask"] = mask
        if self.dop:  # every sample a preservation sample (the adapter-off forward in every step), of weight 1
            item["loss_weight"], item["role"] = torch.tensor(1.0), "preservation"
        if self.family is not None:  # per-sample noise and timestep, as the latent cache's dataset serves them
            g = torch.Generator().manual_seed(i)
            latents = item["latents"][None]
            item["noise"] = self.family.sample_noise(latents, g)[0]
            item["timesteps"] = self.family.sample_timesteps(latents, g)[0]
        return item


class SyntheticData(LightningDataModule):
    """The synthetic batches as the data module of ``fit`` serves them, with what the callbacks ask of it: the
    ``recipe`` (its resolution: samples without a size of their own are drawn at it) and ``cache()`` (the prompts'
    embeddings: :meth:`Synthetic.text_embeddings`)."""

    def __init__(
        self,
        dataset: Synthetic,
        batch_size: int,
        resolution: int = 512,
        workers: int = 0,
        pin_memory: bool | None = None,
        worker_start: str | None = None,
    ) -> None:
        super().__init__()
        self.dataset, self.batch_size, self.workers = dataset, batch_size, workers
        self.recipe = DataRecipe(resolutions=(resolution,), batch_size=batch_size, num_workers=workers)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.worker_start = worker_start  # the workers' multiprocessing start method (None: torch's, fork on Linux)

    def train_dataloader(self) -> DataLoader:
        # As fit's loader: the config's worker processes (each draws its samples' noise), kept between epochs.
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=False,
            pin_memory=self.pin_memory,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
            multiprocessing_context=self.worker_start if self.workers > 0 else None,
        )

    def cache(self) -> Synthetic:
        return self.dataset


def process_age() -> float | None:
    """Seconds since this process started (Linux: from /proc; None elsewhere), imports included."""
    import os

    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")


def cpu_stolen_s() -> float | None:
    """Seconds of CPU time the hypervisor gave other guests, summed over this machine's CPUs since boot (Linux: the
    ``steal`` column of /proc/stat; None elsewhere). Its growth over the timed steps says whether a virtual machine's
    neighbours took the host's cores while a launch-bound step waited for them."""
    from bench_suite import cpu_times  # beside this file: /proc/stat read in one place

    ticks = cpu_times().get("cpu")
    return None if ticks is None else ticks[7] / os.sysconf("SC_CLK_TCK")  # the steal column


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (Dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_counts() -> dict[str, int]:
    """torch.compile's work so far in this process: the graphs Dynamo traced, and inductor's and AOTAutograd's cache
    hits and misses (a miss compiled; a second start with everything cached has misses 0)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": compiled_graphs(),
        "fxgraph_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


COMPILE_PHASES = {  # dynamo_timed names (torch.compile's own timers) -> our names for them
    "_compile.compile_inner": "dynamo",  # all of Dynamo's work on a frame, the backend's included
    "bytecode_tracing": "tracing",  # Dynamo tracing the Python code into a graph
    "OutputGraph.call_user_compiler": "backend",  # AOTAutograd and inductor: compiling, or loading from the caches
    "AOTAutogradCache.inductor_load": "cache_load",  # a cache hit: loading the compiled forward and backward
    "build_guards": "guards",
    "compile_fx.<locals>.bw_compiler": "backward_compile",  # a cache miss compiling a backward graph
}


def compile_seconds() -> dict[str, float]:
    """Seconds torch.compile has spent so far in this process, by phase (:data:`COMPILE_PHASES`; 0 for a phase that
    has not run), from its own timers (``torch._dynamo.utils.compile_times``): what a second start's first step
    spends tracing against loading the compiled code."""
    from torch._dynamo.utils import compile_times

    names, totals = compile_times(repr="csv", aggregate=True)
    spent = dict(zip(names, totals, strict=True))
    return {ours: float(spent.get(name, 0.0)) for name, ours in COMPILE_PHASES.items()}  # type: ignore[arg-type]


def sync() -> None:
    """Wait for the GPU's queued work, where there is a GPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(Callback):
    """Times the optimizer steps after the warm-up; peak memory over the same window. Also the start: the first
    optimizer step's time from the start of training (``first_step_s``: compiling, or loading compiled code from the
    cache) and from the start of the process (``to_first_step_s``: what a user waits for the first step), and what
    torch.compile did from the start of training to then (``first_step_compile``: :func:`compile_counts`) and the
    seconds it spent on it by phase (``first_step_compile_s``: :func:`compile_seconds`).

    Where each timed step's time went, to tell a host-bound step from a GPU-bound one: ``host_cpu_s_each`` is the CPU
    time of this process during the step (``time.process_time``: the training thread and autograd's device thread,
    which runs the backward pass of CUDA tensors while the training thread waits) up to the synchronization at its
    end, and ``sync_wait_s_each`` the wait in that synchronization (the GPU still working after the host launched the
    step). A step whose wall time is mostly host CPU is launch-bound; mostly the wait, GPU-bound; neither, the threads
    were off their cores (``cpu_stolen_s``: steal time over the timed steps, all CPUs; ``load_1m``: the load average
    after). ``--stacks`` says which thread and which line."""

    def __init__(self, warm: int, steps: int) -> None:
        self.warm, self.steps = warm, steps
        self.result: dict[str, Any] = {}
        self._t0 = 0.0
        self._train_start = 0.0
        self._ends: list[float] = []
        self._cpu = 0.0  # process CPU time at the start of the timed steps, then after each one's synchronization
        self._busy: list[float] = []  # process CPU time of each timed step before its synchronization
        self._waits: list[float] = []
        self._stolen: float | None = None
        self._graphs = 0
        self._compiled_before: dict[str, int] = {}
        self._compile_s_before: dict[str, float] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            self.result["static_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        self._train_start = time.perf_counter()
        self._compiled_before = compile_counts()
        self._compile_s_before = compile_seconds()

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warm and not self._t0:
            sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self._t0 = time.perf_counter()
            self._cpu = time.process_time()
            self._stolen = cpu_stolen_s()
            self._graphs = compiled_graphs()
            self.result["host_threads"] = torch.get_num_threads()  # torch's CPU threads while training

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 1 and "first_step_s" not in self.result:
            sync()
            self.result["first_step_s"] = round(time.perf_counter() - self._train_start, 2)
            counts = compile_counts()
            self.result["first_step_compile"] = {k: n - self._compiled_before[k] for k, n in counts.items()}
            spent = compile_seconds()
            self.result["first_step_compile_s"] = {k: round(t - self._compile_s_before[k], 3) for k, t in spent.items()}
            age = process_age()
            if age is not None:
                self.result["to_first_step_s"] = round(age, 2)
        if (
            self._t0
            and self.warm < trainer.global_step <= self.warm + self.steps
            and len(self._ends) < (trainer.global_step - self.warm)
        ):
            launched, cpu = time.perf_counter(), time.process_time()
            sync()  # each timed step's own time: a one-off cost (a recompile) shows as one slow step
            self._ends.append(time.perf_counter())
            self._busy.append(cpu - self._cpu)
            self._waits.append(self._ends[-1] - launched)
            self._cpu = time.process_time()
        if trainer.global_step == self.warm + self.steps:
            seconds = (self._ends[-1] - self._t0) / self.steps
            self.result["s_per_step"] = round(seconds, 4)
            starts = [self._t0, *self._ends[:-1]]
            each = [b - a for a, b in zip(starts, self._ends, strict=True)]
            self.result["step_s_each"] = [round(t, 4) for t in each]
            self.result["s_per_step_median"] = round(statistics.median(each), 4)  # robust to one slow step
            self.result["host_cpu_s_each"] = [round(t, 4) for t in self._busy]
            self.result["sync_wait_s_each"] = [round(t, 4) for t in self._waits]
            stolen = cpu_stolen_s()
            if stolen is not None and self._stolen is not None:
                self.result["cpu_stolen_s"] = round(stolen - self._stolen, 2)
            self.result["load_1m"] = round(os.getloadavg()[0], 2)
            self.result["graphs_compiled_timed"] = compiled_graphs() - self._graphs
            self.result["cudnn_sdpa"] = torch.backends.cuda.cudnn_sdp_enabled()  # what model.attention chose
            images = len(batch["latents"]) * trainer.world_size * trainer.accumulate_grad_batches
            self.result["images_per_s"] = round(images / seconds, 3)
            # Lightning hands on_train_batch_end the loss divided by accumulate_grad_batches (what backward sees):
            # the batch's own mean, comparable with the recipe's, is that times the accumulation.
            self.result["loss"] = round(float(outputs["loss"]) * trainer.accumulate_grad_batches, 4)
            if torch.cuda.is_available():
                peaks = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=pl_module.device)
                self.result["peak_alloc_GiB"] = round(float(peaks[0]), 2)
                self.result["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
                if trainer.world_size > 1:
                    gathered = trainer.strategy.all_gather(peaks).flatten().tolist()
                    self.result["peak_alloc_GiB_per_rank"] = [round(v, 2) for v in gathered]


class Profile(Callback):
    """torch.profiler over ``steps`` optimizer steps after ``warm``: the top operators by host and by GPU time, and
    how busy the GPU was (sum of kernel time / wall time), written to ``path``. ``--profile-steps N`` puts them after
    the timed steps (``warm`` is then warm-up plus timed steps), so one row gives both its timing and its profile."""

    def __init__(self, warm: int, steps: int, path: str) -> None:
        self.warm, self.steps, self.path = warm, steps, path
        self.prof: Any = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warm and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            gpu = torch.cuda.is_available()
            sync()
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
            self.prof = profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.prof is not None and trainer.global_step == self.warm + self.steps:
            sync()
            wall = time.perf_counter() - self._t0
            self.prof.__exit__(None, None, None)
            write_profile(self.prof, wall, self.steps, self.path)
            self.prof = None


class TeardownWatch(Callback):
    """Every thread's Python stack on stderr when ``Trainer.fit`` has not returned ``seconds`` after the training
    ended (its teardown: the callbacks' ``on_train_end``, the data loader's workers shutting down), and again each
    ``seconds`` until :meth:`cancel`; 0: off. A Python thread that takes the GIL and reads ``sys._current_frames``:
    faulthandler's watchdog reads the other threads' frames without it, and a GPU row (sdxl_12gb still sampling
    20 s after its last step) died of a segmentation fault in the middle of its dump."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._stop = threading.Event()

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self.seconds > 0:
            threading.Thread(target=self._watch, name="teardown-watch", daemon=True).start()

    def _watch(self) -> None:
        waited = 0.0
        while not self._stop.wait(self.seconds):
            waited += self.seconds
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"-- Trainer.fit has not returned {waited:g} s after the training ended; every thread's stack:"]
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    lines += [f"Thread {names.get(ident, ident)}:", *traceback.format_stack(frame)]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def cancel(self) -> None:
        self._stop.set()


class Stacks(Callback):
    """:class:`tools.offcpu.OffCpuSampler` over the training thread during ``steps`` optimizer steps after ``warm``:
    where the step's wall time went, on the thread's core and off it, by Python stack, written to ``path``."""

    def __init__(self, warm: int, steps: int, path: str) -> None:
        self.warm, self.steps, self.path = warm, steps, path
        self.sampler: Any = None

    def begin(self) -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        from offcpu import OffCpuSampler

        sync()
        self.sampler = OffCpuSampler()
        self.sampler.start()

    def end(self) -> None:
        sync()
        self.sampler.stop()
        self.sampler.report(self.path, per=self.steps)
        self.sampler = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warm and self.sampler is None:
            self.begin()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.sampler is not None and trainer.global_step == self.warm + self.steps:
            self.end()


# The host calls that launch a kernel: the runtime's, and the driver's that Triton's and cuBLAS's kernels use (an H100
# profile of the bf16 512x768 row spent 58 ms in ``cuLaunchKernelEx`` alone, left out of its count before).
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})


def kernel_launches(events: Any) -> int:
    """How many kernels the profiled steps launched: the calls of every launch API in ``key_averages()``."""
    return sum(e.count for e in events if e.key in LAUNCH_CALLS)


def extra_steps(a: argparse.Namespace) -> int:
    """Optimizer steps a row trains after its timed ones: ``--profile-steps`` with ``--profile``, else none."""
    return a.profile_steps if a.profile else 0


def write_profile(prof: Any, wall: float, steps: int, path: str) -> None:
    events = prof.key_averages()
    # User annotations (``Optimizer.step#...``) also carry device time, spanning their kernels: not counted twice.
    kernel_us = sum(
        e.self_device_time_total
        for e in prof.events()
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
    )
    launches = kernel_launches(events)
    with open(path, "w") as f:
        f.write(
            f"wall {wall / steps * 1e3:.1f} ms/step, GPU kernels {kernel_us / steps / 1e3:.1f} ms/step "
            f"(busy {kernel_us / 1e6 / wall:.0%}), kernel launches {launches / steps:.0f}/step\n\n"
        )
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        f.write("\n\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))


OPTIMIZERS = {
    "bitsandbytes.optim.AdamW8bit": "adamw8bit",
    "bitsandbytes.optim.adamw.AdamW8bit": "adamw8bit",
    "torch.optim.AdamW": "adamw",
    "torch.optim.adamw.AdamW": "adamw",
    "lightning_lora.optimizers.Adafactor": "adafactor",
    "transformers.optimization.Adafactor": "adafactor-hf",
    "transformers.Adafactor": "adafactor-hf",
}
"""``model.optimizer.class_path`` -> ``--opt``: the optimizers this tool builds."""


def make_optimizer(name: str, options: dict[str, Any] | None = None):
    """The optimizer ``name`` (``--opt``) with lr 1e-4, or with ``options`` (a config's ``init_args``) over that;
    ``adamw-fused`` is torch's AdamW with ``fused=True`` (one kernel for every LoRA tensor)."""
    kwargs = {"lr": 1e-4, **(options or {})}

    def build(params: Any) -> torch.optim.Optimizer:
        if name == "adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, **kwargs)
        if name in ("adafactor", "adafactor-hf"):  # ours (grouped) or transformers' (one tensor at a time)
            if name == "adafactor":
                from lightning_lora.optimizers import Adafactor
            else:
                from transformers.optimization import Adafactor  # type: ignore[assignment]

            fixed = {"scale_parameter": False, "relative_step": False, "warmup_init": False}
            return Adafactor(params, **{**fixed, **kwargs})
        if name == "adamw-fused":
            return torch.optim.AdamW(params, **{"fused": True, **kwargs})
        return torch.optim.AdamW(params, **kwargs)

    return build


def bare_loop(module: LoraModule, dataset: Dataset, a: argparse.Namespace, device: str) -> dict[str, Any]:
    """The same model and loss in a plain PyTorch loop (no Trainer): separates Lightning's overhead from ours."""
    denoiser = module.build(torch.device(device))
    MemoryLimit(a.memory_limit, {}).on_fit_start(None, module)  # type: ignore[arg-type]  # after the build, as there
    set_lora_input_casts(denoiser, enabled=False)  # as LoraModule under bf16-mixed: this loop runs under autocast
    optimizer = make_optimizer(a.opt, optimizer_options(a))([p for p in denoiser.parameters() if p.requires_grad])
    loader = DataLoader(dataset, batch_size=a.batch, pin_memory=device == "cuda", num_workers=a.workers)
    stacks = Stacks(a.warm, a.steps, a.stacks) if a.stacks else None
    for step, batch in enumerate(loader):
        if step == a.warm + a.steps:
            break
        if step == a.warm:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if stacks is not None:
                stacks.begin()
        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast(device, dtype=torch.bfloat16):
            reference = module.preservation_reference(batch, batch["noise"], batch["timesteps"])
            losses = module.family.loss(denoiser, batch, batch["noise"], batch["timesteps"], reference)
            loss = objectives.weighted_mean(losses, batch.get("loss_weight"))
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_([p for p in denoiser.parameters() if p.requires_grad], a.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / a.steps
    if stacks is not None:
        stacks.end()
    result: dict[str, Any] = {"s_per_step": round(seconds, 4), "loss": round(float(loss.detach()), 4)}
    if device == "cuda":
        result["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def optimizer_options(a: argparse.Namespace) -> dict[str, Any]:
    """The config's ``model.optimizer.init_args``, when ``--opt`` is still the config's optimizer."""
    name, options = getattr(a, "config_optimizer", (None, {}))
    return dict(options) if name == a.opt else {}


def apply_memory_limit(gib: float | None) -> float | None:
    """Cap this process's CUDA caching allocator at ``gib`` GiB on every visible GPU (the fraction of the total that
    is); nothing on the CPU. Returns the fraction set."""
    if not gib or not torch.cuda.is_available():
        return None
    fraction = 1.0
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


class MemoryLimit(Callback):
    """``--memory-limit``, applied once the model is built and on its device (``on_fit_start``): the random weights
    are drawn in bf16 on the GPU and quantized there, which a real load does not do (it quantizes layer by layer from
    the CPU), so the build is not what a card must hold; training, from its first step, is."""

    def __init__(self, gib: float | None, out: dict[str, Any]) -> None:
        self.gib, self.out = gib, out

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        fraction = apply_memory_limit(self.gib)
        if fraction is not None:
            self.out["memory_fraction"] = round(fraction, 4)


def write_sampling_files(family: DiffusionFamily, denoiser: str | None, folder: Path) -> str:
    """A local model folder of what the family's ``pipeline`` reads besides weights, written into ``folder``:
    ``scheduler/`` (the released model's scheduler config: the family's ``random_models()``) and ``model_index.json``
    (SDXL base's ``force_zeros_for_empty_prompt``; ``is_distilled``, of the ``denoiser`` hub id, where the pipeline
    records it: FLUX.2 klein's, Krea 2's). Returns its path."""
    import inspect

    import diffusers

    models = family.random_models()
    records = "is_distilled" in inspect.signature(getattr(diffusers, family.pipeline_class).__init__).parameters
    getattr(diffusers, models.scheduler)(**models.scheduler_config).save_pretrained(folder / "scheduler")
    index = {
        "_class_name": family.pipeline_class,
        "force_zeros_for_empty_prompt": True,
        # a step-distilled id (a known hub id: answered without the hub); a pipeline that records none: not distilled
        "is_distilled": bool(records and denoiser and family.is_distilled(ModelSource(denoiser))),
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return str(folder)


REPRODUCED_CALLBACKS = {
    "lightning.pytorch.callbacks.ModelCheckpoint": ModelCheckpoint,
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint": ModelCheckpoint,
    "lightning_lora.callbacks.SampleImages": SampleImages,
    "lightning_lora.callbacks.samples.SampleImages": SampleImages,
    "lightning_lora.callbacks.LoraExport": LoraExport,
    "lightning_lora.callbacks.lora_export.LoraExport": LoraExport,
}
"""``trainer.callbacks`` class paths that ``--callbacks 1`` builds (:func:`output_callbacks`); the others are listed
in ``not_reproduced``."""


def runs_callbacks(a: argparse.Namespace) -> bool:
    """``--callbacks``: given, or on for a ``--config`` run in Lightning's loop."""
    if a.callbacks is None:
        return bool(a.config) and a.loop == "lightning"
    return bool(a.callbacks)


def output_callbacks(
    a: argparse.Namespace, root: Path
) -> tuple[SampleImages | None, ModelCheckpoint | None, LoraExport]:
    """The config's callbacks that write a run's outputs, built from its class paths and ``init_args`` as ``fit``
    builds them (the first of each kind), with ``fit``'s defaults where the config has none (a ``ModelCheckpoint``
    unless ``trainer.enable_checkpointing: false``, a ``LoraExport``; its ``best`` files are left out: the
    ``FixedEvalLoss`` that judges them is not run). Every file goes under ``root``, never the config's paths;
    ``--sample-steps`` / ``--sample-size`` replace the samples' steps and size (with ``--tiny``, a CPU smoke run, they
    default to 2 steps at the training size: a tiny model's 30 steps at 1024 px take minutes)."""
    built: dict[type, Any] = {}
    for path, init_args in getattr(a, "config_callbacks", []):
        cls = REPRODUCED_CALLBACKS.get(path)
        if cls is not None and cls not in built:
            built[cls] = cls(**init_args)
    sampler: SampleImages | None = built.get(SampleImages)
    if sampler is not None:
        sampler.dirname = "samples"
        steps, size = a.sample_steps, a.sample_size
        if a.tiny:
            steps, size = steps or 2, size or (a.h, a.w)
        if steps:
            sampler.steps = steps
        if size:
            sampler.height, sampler.width = size
        if getattr(a, "sample_compiled", None) is not None:
            sampler.compiled = bool(a.sample_compiled)
    checkpoint: ModelCheckpoint | None = built.get(ModelCheckpoint)
    if checkpoint is None and getattr(a, "config_checkpointing", True):
        checkpoint = default_checkpoint()
    if checkpoint is not None:
        checkpoint.dirpath = str(root / "checkpoints")
    exporter: LoraExport = built.get(LoraExport) or LoraExport()
    exporter.dirname, exporter.best = "lora", False
    return sampler, checkpoint, exporter


def sample_controls(sampler: SampleImages, controls: int, size: tuple[int, int], folder: Path) -> list[list[str]]:
    """Each sample prompt's control images, as ``SampleImages(controls=...)`` takes them: ``controls`` random images of
    the samples' ``size`` (PNG files written into ``folder``) for every prompt, in place of the config's files (which
    are the user's, not here). None for a text-to-image run."""
    from PIL import Image

    if not controls:
        return [[] for _ in sampler.prompts]
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(2)
    paths = []
    for i in range(controls):
        pixels = torch.randint(0, 256, (*size, 3), dtype=torch.uint8, generator=g).numpy()
        path = folder / f"control{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(str(path))
    return [list(paths) for _ in sampler.prompts]


class MetricsKept(Logger):
    """A logger that keeps the last value of each metric logged to it (for the length of one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "bench"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class WarningsKept(logging.Handler):
    """The messages of the warnings a logger emits (for the length of one call)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Outputs(Callback):
    """What the config's callbacks write during a run (:func:`output_callbacks`), once, after the timed steps
    (``on_train_end``), with their own code: ``SampleImages.sample`` (every prompt of the config, its size and steps),
    ``trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls, through ``fit``'s :class:`AtomicCheckpointIO`, with
    fit's :class:`RNGState` and :class:`RunFolder` state) and ``LoraExport.export``. ``fit`` writes them every N steps
    and at the end; their set-up runs as in ``fit`` (``setup``: the prompts' embeddings and the VAE, before the model
    is built; ``on_fit_start``: the export formats tried on the LoRA's shapes).

    Each phase reports its seconds (``sample_s``, ``checkpoint_s``, ``export_s``) and, on a GPU, its peak allocated
    memory from a reset at its start (``checkpoint_peak_GiB``, ``export_peak_GiB``; ``sample_peak_GiB`` is the
    callback's own ``vram/sample_peak_GiB``). The checkpoint is read back as ``--ckpt_path`` reads it
    (``checkpoint_MB``, ``checkpoint_tensors``: the trainable tensors it holds). An error in a phase (out of memory
    under ``--memory-limit``; ``SampleImages`` catches its own and skips the images) is the line's ``error``, naming the
    phase (``error_phase``); the other phases still run.

    Before the phases, rank 0 prints the line so far, marked ``"partial"`` (with ``training``, the figures
    :class:`StepTimer` keeps in its ``result``): a row stopped while its samples compile or draw still leaves them
    (``tools/bench_suite.py`` keeps the last line, which is the whole one when the run ends)."""

    def __init__(
        self,
        out: dict[str, Any],
        sampler: SampleImages | None,
        checkpoint: ModelCheckpoint | None,
        exporter: LoraExport,
        training: dict[str, Any],
    ) -> None:
        self.out, self.sampler, self.checkpoint, self.exporter = out, sampler, checkpoint, exporter
        self.training = training

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        for callback in (self.sampler, self.exporter):
            if callback is not None:
                callback.setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.exporter.on_fit_start(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            print(json.dumps({**self.out, **self.training, "partial": "training; outputs follow"}), flush=True)
        if self.sampler is not None:
            self._phase("sample", trainer, pl_module, self._sample)
        if self.checkpoint is not None:
            self._phase("checkpoint", trainer, pl_module, self._save, self._read_back)
        self._phase("export", trainer, pl_module, self._export, self._exported)

    def _phase(self, name: str, trainer: Trainer, pl_module: Any, action: Any, after: Any = None) -> None:
        cuda = pl_module.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            action(trainer, pl_module)
            if cuda:
                torch.cuda.synchronize()
            self.out[f"{name}_s"] = round(time.perf_counter() - t0, 2)
            if cuda and name != "sample":  # the samples' peak: the callback's own (it resets the peak after drawing)
                self.out[f"{name}_peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if after is not None:
                after(trainer)
        except Exception as e:  # noqa: BLE001 - one JSON line per configuration: the error, naming the phase
            traceback.print_exc()
            self.out.setdefault("error", f"{name}: {type(e).__name__}: {str(e)[:300]}")
            self.out.setdefault("error_phase", name)
            if cuda:
                torch.cuda.empty_cache()

    def _sample(self, trainer: Trainer, pl_module: Any) -> None:
        assert self.sampler is not None
        kept, warnings = MetricsKept(), WarningsKept()
        loggers, source = trainer.loggers, logging.getLogger(SampleImages.__module__)
        trainer.loggers = [kept]
        source.addHandler(warnings)
        graphs = compiled_graphs()
        try:
            self.sampler.sample(trainer, pl_module)
        finally:
            trainer.loggers = loggers
            source.removeHandler(warnings)
        if "vram/sample_peak_GiB" in kept.metrics:
            self.out["sample_peak_GiB"] = round(kept.metrics["vram/sample_peak_GiB"], 2)
        self.out["samples"] = len(self.sampler.written)
        self.out["sample_graphs_compiled"] = compiled_graphs() - graphs
        if self.sampler.skipped:  # SampleImages went on without the images, as fit does: the line says why
            raise torch.OutOfMemoryError(warnings.messages[-1] if warnings.messages else "the samples were skipped")

    def _checkpoint_path(self) -> Path:
        assert self.checkpoint is not None and self.checkpoint.dirpath is not None
        last = self.checkpoint.CHECKPOINT_NAME_LAST + self.checkpoint.FILE_EXTENSION
        return Path(self.checkpoint.dirpath) / last

    def _save(self, trainer: Trainer, pl_module: Any) -> None:
        assert self.checkpoint is not None
        trainer.save_checkpoint(self._checkpoint_path(), weights_only=self.checkpoint.save_weights_only)

    def _read_back(self, trainer: Trainer) -> None:
        from lightning_lora.checkpoint import load_checkpoint, read_checkpoint

        assert self.checkpoint is not None
        if not trainer.is_global_zero:  # rank 0 writes
            return
        path = self._checkpoint_path()
        checkpoint = load_checkpoint(path) if self.checkpoint.save_weights_only else read_checkpoint(path)
        self.out["checkpoint_MB"] = round(path.stat().st_size / 2**20, 2)
        self.out["checkpoint_tensors"] = len(checkpoint["state_dict"])

    def _export(self, trainer: Trainer, pl_module: Any) -> None:
        # as at the end of fit: the raw LoRA's files and, with --ema 1, the EMA's (LoraExport.weights)
        self.exporter.final = self.exporter.export_weights(trainer, pl_module, self.exporter.name)

    def _exported(self, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            files = [path for _, path in self.exporter.last_files()]
            self.out["export_formats"] = list(self.exporter.formats)
            self.out["export_files"] = len(files)
            self.out["export_MB"] = round(sum(path.stat().st_size for path in files) / 2**20, 2)


def bench_strategy(name: str, devices: int) -> Any:
    """``--strategy`` as ``fit`` resolves ``trainer.strategy`` (``auto`` / ``ddp``: LoraDDPStrategy; ``fsdp``:
    LoraFSDPStrategy, every device 1/N of the base), or Lightning's own DDP (``lightning-ddp``)."""
    if name == "lightning-ddp":
        return "ddp"
    return resolve_strategy(name, devices)


class TorchaoFP8(FP8):
    """torchao's frozen-weight FP8 in place of ours (``--quant torchao_fp8``), for the row that compares the two: the
    layers :class:`~lightning_lora.precision.FP8` would replace get ``torchao.quantization.quantize_`` with
    ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (e4m3 weights with a scale per output channel,
    as ours; each matmul quantizes its activation per row and multiplies with ``torch._scaled_mm``), then peft's LoRA
    goes on top (peft wraps torchao's weights in its ``TorchaoLoraLinear``). The planner counts it as ours (one byte
    per weight and a float32 scale per row). REFERENCE.md found torchao 0.17's path unable to backpropagate (no
    derivative for ``aten::_scaled_mm``): the row then records that error."""

    @override
    def quantize(self, model: torch.nn.Module, device: torch.device, on_cpu: frozenset[int] = frozenset()) -> int:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        if on_cpu:
            raise ValueError("--quant torchao_fp8 quantizes the base on the GPU: give --offload 0")
        layers = {id(layer) for *_, layer in linear_layers(model, self.skip)}
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        quantize_(model.to(device), config, filter_fn=lambda module, name: id(module) in layers)
        return len(layers)


QUANT_PLUGINS = {"none": "BF16", "nf4": "NF4", "fp8": "FP8", "fp8_compute": "FP8Compute", "torchao_fp8": "TorchaoFP8"}
"""``--quant`` values and the precision plugins (``lightning_lora.precision``, and :class:`TorchaoFP8`) they name."""


def bench_precision(quant: str, options: dict[str, Any]) -> BasePrecision:
    """The bf16 precision plugin of ``--quant`` with a config's other init_args (``options``)."""
    plugins: dict[str, type[BasePrecision]] = {**PRECISIONS, "TorchaoFP8": TorchaoFP8}
    return plugins[QUANT_PLUGINS[quant]](**{**options, "dtype": "bf16"})


def quant_options(items: list[str]) -> dict[str, Any]:
    """``--quant-option KEY=VALUE`` (repeatable): the precision plugin's init_args, each value read as JSON when it
    parses (``true``, ``2``) and as a string otherwise."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--quant-option {item!r}: expected KEY=VALUE, e.g. compiled_dequantize=true")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def config_precision(trainer: dict[str, Any]) -> tuple[str, dict[str, Any], list[str]]:
    """``--quant``, the plugin's other init_args and what is not reproduced, from a config's trainer section (its
    ``lightning_lora.precision`` plugin, or a plain ``trainer.precision``: the bf16 base)."""
    plugins = trainer.get("plugins") or []
    plugins = plugins if isinstance(plugins, list) else [plugins]
    ours = [p for p in plugins if _class_name(p, "trainer.plugins").startswith("lightning_lora.precision.")]
    if not ours:
        precision = str(trainer.get("precision") or "bf16-mixed")
        return "none", {}, [] if precision == "bf16-mixed" else [f"trainer.precision: {precision} (this tool: bf16)"]
    name = _class_name(ours[0], "trainer.plugins").rsplit(".", 1)[-1]
    quant = {plugin: q for q, plugin in QUANT_PLUGINS.items()}[name]
    options = dict((ours[0].get("init_args") if isinstance(ours[0], dict) else None) or {})
    dtype = options.pop("dtype", "bf16")
    return quant, options, [] if dtype == "bf16" else [f"trainer.plugins: {name} dtype {dtype} (this tool: bf16)"]


def run(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration's result line (:func:`measure`); with ``--callbacks 1``, its outputs (samples, checkpoint,
    LoRA files) go to a temporary folder that is deleted afterwards, also when the run fails."""
    if not runs_callbacks(a):
        return measure(a, None)
    if not a.config:
        raise ValueError("--callbacks 1 runs the callbacks of a config: give --config")
    if a.loop != "lightning":
        raise ValueError("--callbacks 1 runs the config's callbacks in Lightning's loop: give --loop lightning")
    outputs = Path(tempfile.mkdtemp(prefix="lightning-lora-bench-"))
    try:
        return measure(a, outputs)
    finally:
        shutil.rmtree(outputs, ignore_errors=True)


def measure(a: argparse.Namespace, outputs: Path | None) -> dict[str, Any]:
    """The timed steps of ``a``'s settings; with an ``outputs`` folder, then the config's outputs (:class:`Outputs`)
    written there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = denoiser_config(a.family, a.tiny, a.denoiser)
    config_family, config_family_args = getattr(a, "config_family", (None, {}))
    family_args = dict(config_family_args) if config_family == a.family else {}
    text_options, _ = RANDOM[a.family].text_length_options(a.tlen)  # the family's options for prompts of a.tlen tokens
    family = random_family(a.family, config, device, **{**family_args, **text_options})
    out: dict[str, Any] = {
        "tool": "lightning-lora",
        **header(a),
    }
    family_any: Any = family  # the attributes the experiments and the samples set on it
    if getattr(a, "compile_regions", None) is not None:  # experiment: fewer (or more) module classes compiled
        regions = tuple(name for name in a.compile_regions.split(",") if name)
        family_any.compiling = dataclasses.replace(family.compiling, regions=regions)
        out["compile_regions"] = list(family.compiling.regions)
    out.update(
        {
            "family": a.family,
            "quant": a.quant,
            "rank": a.rank,
            "alpha": a.alpha,
            "gc": a.gc,
            "every": a.every,
            "h": a.h,
            "w": a.w,
            "tlen": a.tlen,
            "batch": a.batch,
            "opt": a.opt,
            "compile": a.compile,
            "cuda_graphs": a.cuda_graphs,
            "attention": a.attention,
            "targets": a.targets,
            "offload": a.offload,
            "offload_act": a.offload_act,
            "variant": a.variant,
            "accumulate": a.accumulate,
            "clip": a.clip,
            "ema": a.ema,
            "dop": a.dop,
            "masks": a.masks,
        }
    )
    given = quant_options(a.quant_option or [])
    if given:
        out["quant_options"] = given
    precision = bench_precision(a.quant, {**getattr(a, "config_quantization", {}), **given})
    if a.ema and a.loop == "bare":
        raise ValueError("--ema 1 runs the LoraEMA callback in Lightning's loop: give --loop lightning")
    if a.strategy == "fsdp" and (a.quant != "none" or a.offload or a.loop == "bare"):
        raise ValueError("--strategy fsdp shards a bf16 base: give --quant none, --offload 0 and --loop lightning")
    module = LoraModule(
        pretrained="random-init",
        family=family,
        lora=LoraOptions(
            rank=a.rank, alpha=a.rank if a.alpha is None else a.alpha, targets=a.targets, variant=a.variant
        ),
        gradient_checkpointing=bool(a.gc),
        checkpoint_every=a.every,
        attention=a.attention,
        compile_blocks=bool(a.compile),
        cuda_graphs=bool(a.cuda_graphs),
        offload_blocks=a.offload,
        offload_activations=bool(a.offload_act),
        preservation=Preservation(mode="dop" if a.dop else "none"),
        optimizer=make_optimizer(a.opt, optimizer_options(a)),
    )
    module.use_precision(precision)
    dataset = Synthetic(
        a.family,
        config,
        a.h,
        a.w,
        a.tlen,
        family_obj=family,
        buckets=a.buckets,
        batch=a.batch,
        dop=bool(a.dop),
        masks=bool(a.masks),
        controls=a.controls,
    )
    if a.buckets:
        out["buckets"] = [list(size) for size in dataset.sizes]
    if a.controls:
        out["controls"] = a.controls
    pin = None if a.loader_pin is None else bool(a.loader_pin)
    data = SyntheticData(dataset, a.batch, max(a.h, a.w), a.workers, pin_memory=pin, worker_start=a.worker_start)
    out.update(workers=a.workers, loader_pin=data.pin_memory)
    if a.worker_start:
        out["worker_start"] = a.worker_start
    sample_size = None
    if outputs is not None:  # the config's samples, checkpoint and LoRA files (Outputs), under outputs
        sampler, checkpoint, exporter = output_callbacks(a, outputs)
        family_any.vae_config = vae_config(a.family, a.tiny)
        family_any.sampling_folder = write_sampling_files(family, a.denoiser, outputs / "model")
        if sampler is not None:
            sample_size = (sampler.height or data.recipe.resolution, sampler.width or data.recipe.resolution)
            sampler.controls = sample_controls(sampler, a.controls, sample_size, outputs / "controls")
            out.update(sample_size=list(sample_size), sample_steps=sampler.steps, sample_prompts=len(sampler.prompts))
            out["sample_compiled"] = sampler.compiled
    if getattr(a, "cpp_wrapper", 0):  # experiment: inductor's C++ wrapper launches kernels without Python
        from torch._inductor import config as inductor_config

        inductor_config.cpp_wrapper = True
        out["cpp_wrapper"] = 1
    compile_options: dict[str, Any] = {}  # experiment: torch.compile's dynamic= for the blocks
    if getattr(a, "compile_dynamic", "auto") != "auto":  # every block layout's graph static (or dynamic)
        out["compile_dynamic"] = a.compile_dynamic
        compile_options["dynamic"] = a.compile_dynamic == "dynamic"
    if compile_options:
        import functools

        from lightning_lora import assembly

        assembly.compile_repeated_blocks = functools.partial(assembly.compile_repeated_blocks, **compile_options)
    if a.host_threads == "all":  # torch's own: a user's OMP_NUM_THREADS, which LoraModule.on_train_start leaves alone
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    elif a.loop == "bare":  # as LoraModule.on_train_start does in fit
        limit_host_threads(device)
    ema = bench_ema(a)
    t0 = time.perf_counter()
    if a.loop == "bare":
        if a.accumulate != 1:
            raise ValueError("--loop bare steps the optimizer every batch: give --accumulate 1")
        out["loop"] = "bare"
        out.update(bare_loop(module, dataset, a, device), host_threads=torch.get_num_threads())
    else:
        timer = StepTimer(a.warm, a.steps)
        watch = TeardownWatch(a.teardown_watch)
        callbacks: list[Callback] = [MemoryLimit(a.memory_limit, out), timer, watch]
        if a.profile:
            after = a.profile_steps > 0  # extra steps after the timed ones, or the timed ones themselves
            callbacks.append(Profile(a.warm + a.steps if after else a.warm, a.profile_steps or a.steps, a.profile))
        if a.stacks:
            callbacks.append(Stacks(a.warm, a.steps, a.stacks))
        if ema is not None:
            callbacks.append(ema)
        plugins: list[Any] = [precision]
        if outputs is not None:  # as fit: atomic checkpoint writes, the random state and the save time in each
            callbacks += [Outputs(out, sampler, checkpoint, exporter, timer.result), RNGState(), RunFolder()]
            plugins.append(AtomicCheckpointIO())
        trainer = Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=a.devices,
            strategy=bench_strategy(a.strategy, a.devices),
            plugins=plugins,
            default_root_dir=None if outputs is None else str(outputs),
            max_steps=a.warm + a.steps + extra_steps(a),
            accumulate_grad_batches=a.accumulate,
            gradient_clip_val=a.clip or None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        out["devices"] = a.devices
        out["strategy"] = type(trainer.strategy).__name__
        try:
            trainer.fit(module, datamodule=data)
        finally:
            watch.cancel()
        if trainer.global_rank != 0:
            raise SystemExit(0)  # rank 0 prints the result
        out.update(timer.result)
        weights = local_parameter_bytes(module._require_model())  # rank 0's share
        out["weights_GiB_per_device"] = round(weights / 2**30, 3)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    assert module.denoiser is not None
    offloader = getattr(module.denoiser, "_lora_offloader", None)
    input_offloader = getattr(module.denoiser, "_lora_input_offloader", None)
    if input_offloader is not None:
        steps = a.warm + a.steps + extra_steps(a)
        out["offloaded_inputs_GiB_per_step"] = round(input_offloader.moved_bytes / steps / 2**30, 3)
    if offloader is not None:
        out["offloaded_GiB"] = round(offloader.offloaded_bytes / 2**30, 2)
        out["block_copies"] = offloader.loads
    out["lora_params_M"] = round(sum(p.numel() for p in module.denoiser.parameters() if p.requires_grad) / 1e6, 3)
    if a.plan:
        # The planner's count of the full-size model takes seconds on the host: a row stopped then keeps what it
        # measured (a checkpointed flux_4090 row once finished training and lost its line at its time limit).
        print(json.dumps({**out, "partial": "measured; the plan follows"}), flush=True)
        from lightning_lora.plan import plan_training

        names = {"adamw8bit": "AdamW8bit", "adafactor": "Adafactor", "adafactor-hf": "Adafactor", "adamw": "AdamW"}
        names["adamw-fused"] = "AdamW"
        text_len, optimizer = family.text_length_options(a.tlen)[1], names[a.opt]
        shards = shard_count(a.strategy, a.devices)  # --strategy fsdp: each GPU's share of the sharded base
        height, width = max(dataset.sizes, key=lambda size: size[0] * size[1])  # --buckets: the largest batch
        plan = plan_training(
            module.recipe,
            height,
            width,
            a.batch,
            text_len,
            optimizer=optimizer,
            sample_size=sample_size,
            shards=shards,
            controls=a.controls,
            ema_copies=ema.copies if ema is not None else 0,
        )
        out["planned_peak_GiB"] = round(plan.peak_gib, 2)
        out["planned"] = {k: round(v, 3) for k, v in vars(plan).items() if isinstance(v, float)}
    return out


def bench_ema(a: argparse.Namespace) -> LoraEMA | None:
    """``--ema 1``: the ``LoraEMA`` a run keeps, with the config's options (``--config``: its power-function EMAs only
    where it keeps snapshots; without one in the config, the defaults and the two power-function EMAs), every average
    updated after each optimizer step as in ``fit``; no snapshot is written while the steps are timed (they are disk
    writes, not step time)."""
    if not a.ema:
        return None
    configured = getattr(a, "config_ema", None)
    options = dict(configured) if configured is not None else {"snapshot_every": 1}
    steps = a.warm + a.steps + extra_steps(a)
    if options.get("snapshot_every", 0):  # keep the power-function EMAs, write none
        options["snapshot_every"] = steps + 1
    return LoraEMA(**options)


FAMILY_CLASSES = {f"lightning_lora.families.{cls.__name__}": name for name, cls in FAMILIES.items()}
"""``model.family.class_path`` -> ``--family`` (also the classes' module paths, e.g. ``...families.flux.Flux``)."""

MODEL_FLAGS = {  # model.<key> -> (bench option, conversion)
    "gradient_checkpointing": ("gc", int),
    "checkpoint_every": ("every", int),
    "compile_blocks": ("compile", int),
    "cuda_graphs": ("cuda_graphs", int),
    "offload_blocks": ("offload", int),
    "offload_activations": ("offload_act", int),
    "attention": ("attention", str),
}


class ConfigMismatch(ValueError):
    """A shipped config asks for something this tool cannot build (an unknown family or optimizer)."""


def _class_name(section: Any, where: str) -> str:
    path = section.get("class_path") if isinstance(section, dict) else section
    if not isinstance(path, str):
        raise ConfigMismatch(f"{where}: expected a class_path, got {section!r}")
    return path


def config_defaults(path: str | Path) -> dict[str, Any]:
    """The options a shipped YAML sets, as ``fit`` would use them, by ``parser()`` destination (read with
    ``yaml.safe_load``: nothing in it runs). Besides the flags: ``config_family`` and
    ``config_optimizer`` (the family's and the optimizer's ``init_args``, used while ``--family`` / ``--opt`` stay the
    config's), ``config_quantization`` (the precision plugin's ``init_args`` but ``dtype``) and ``not_reproduced``:
    what the model section (and the trainer) set that this tool does not do, as ``key: value`` strings."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    model, data, trainer = (doc.get(k) or {} for k in ("model", "data", "trainer"))
    out: dict[str, Any] = {}
    skipped: list[str] = []

    family_section = model.get("family") or {"class_path": "lightning_lora.families.Flux"}  # LoraModule's default
    class_path = _class_name(family_section, "model.family.class_path")
    short = f"lightning_lora.families.{class_path.rsplit('.', 1)[-1]}"
    family = FAMILY_CLASSES.get(class_path) or FAMILY_CLASSES.get(
        short if class_path.startswith("lightning_lora.") else ""
    )
    if family is None:
        raise ConfigMismatch(
            f"model.family.class_path: {class_path} is not a family this benchmark builds ({', '.join(FAMILY_CLASSES)})"
        )
    family_args = dict(family_section.get("init_args") or {}) if isinstance(family_section, dict) else {}
    out["family"] = family
    out["config_family"] = (family, {k: v for k, v in family_args.items() if k != "max_sequence_length"})
    if issubclass(FAMILIES[family], UNetFamily):  # CLIP's 77 tokens
        out["tlen"] = 77
    else:  # the family's own default when the config leaves it out (512 for all three)
        default = getattr(RANDOM[family], "max_sequence_length", 512)
        out["tlen"] = int(family_args.get("max_sequence_length") or default)

    pretrained = model.get("pretrained")
    if pretrained in RANDOM[family].planning.known_denoisers:
        out["denoiser"] = pretrained  # random weights of its config (FLUX.2 dev, klein 9B...)
    elif pretrained is not None:
        skipped.append(f"model.pretrained: {pretrained} (not a known {family} denoiser: the default one's config)")
    for key in ("denoiser_file", "revision"):
        if model.get(key) is not None:
            skipped.append(f"model.{key}: {model[key]}")
    if model.get("memory", "as_configured") != "as_configured":
        skipped.append(f"model.memory: {model['memory']} (the settings as written are measured)")

    out["quant"], out["config_quantization"], note = config_precision(trainer)
    skipped += note
    for key, (dest, convert) in MODEL_FLAGS.items():
        if key in model:
            out[dest] = convert(model[key])

    lora = dict(model.get("lora") or {})
    for key in ("rank", "alpha", "targets", "variant"):
        if key in lora:
            out[key] = lora.pop(key)
    defaults = {f.name: f.default for f in dataclasses.fields(LoraOptions)}
    skipped += [f"model.lora.{k}: {v}" for k, v in lora.items() if defaults.get(k, object()) != v]

    if "optimizer" in model:
        class_path = _class_name(model["optimizer"], "model.optimizer.class_path")
        if class_path not in OPTIMIZERS:
            raise ConfigMismatch(
                f"model.optimizer.class_path: {class_path} is not an optimizer this benchmark builds "
                f"({', '.join(OPTIMIZERS)})"
            )
        out["opt"] = OPTIMIZERS[class_path]
        options = model["optimizer"].get("init_args") if isinstance(model["optimizer"], dict) else None
        out["config_optimizer"] = (out["opt"], dict(options or {}))
    else:  # LoraModule's default optimizer is AdamW
        out["opt"] = "adamw"
    if model.get("scheduler") is not None:
        skipped.append(
            f"model.scheduler: {_class_name(model['scheduler'], 'model.scheduler')} (no effect on step time)"
        )
    preservation = model.get("preservation") or {}
    mode = preservation.get("mode", "none") if isinstance(preservation, dict) else "none"
    out["dop"] = int(mode == "dop")
    if mode == "prior":  # regularization images against their own target: a plain step
        skipped.append("model.preservation.mode: prior (a plain step: the regularization images are more samples)")
    handled = {"pretrained", "denoiser_file", "revision", "family", "memory", "lora", "preservation"}
    handled |= {"optimizer", "scheduler", *MODEL_FLAGS}
    skipped += [f"model.{k}: {v}" for k, v in model.items() if k not in handled]

    try:  # the folder entries as fit reads them
        images, held_out = (as_folders(data[k], f"data.{k}") if data.get(k) else [] for k in ("images", "val_images"))
    except ConfigError as e:
        raise ConfigMismatch(str(e)) from None
    out["masks"] = int(any(f.masks for f in images))
    out["controls"] = max((len(f.controls) for f in (*images, *held_out)), default=0)  # as DataRecipe.controls
    if "resolution" in data:
        out["h"] = out["w"] = int(data["resolution"])
    if "batch_size" in data:
        out["batch"] = int(data["batch_size"])
    if "num_workers" in data:
        out["workers"] = int(data["num_workers"])
    out["accumulate"] = int(trainer.get("accumulate_grad_batches") or 1)
    out["clip"] = float(trainer.get("gradient_clip_val") or 0.0)
    if out["clip"] and trainer.get("gradient_clip_algorithm", "norm") != "norm":
        skipped.append(f"trainer.gradient_clip_algorithm: {trainer['gradient_clip_algorithm']} (this tool: norm)")
    sections = trainer.get("callbacks") or []
    out["config_callbacks"] = [
        (_class_name(c, "trainer.callbacks"), dict((c.get("init_args") if isinstance(c, dict) else None) or {}))
        for c in (sections if isinstance(sections, list) else [sections])
    ]
    out["config_checkpointing"] = trainer.get("enable_checkpointing") is not False
    emas = [options for path, options in out["config_callbacks"] if path.rsplit(".", 1)[-1] == "LoraEMA"]
    if emas:  # --ema 1 runs it
        out["ema"], out["config_ema"] = 1, emas[0]
    out["not_reproduced"] = skipped
    return out


def not_reproduced(a: argparse.Namespace) -> list[str]:
    """What the config sets that this run does not do (:func:`config_defaults`), and the config's callbacks that it
    does not run: with ``--callbacks 1`` those :data:`REPRODUCED_CALLBACKS` does not build, else all of them."""
    notes = list(getattr(a, "not_reproduced", []))
    paths = [path for path, _ in getattr(a, "config_callbacks", [])]
    if a.ema:  # run as --ema 1
        paths = [path for path in paths if path.rsplit(".", 1)[-1] != "LoraEMA"]
    if runs_callbacks(a):
        names = [path.rsplit(".", 1)[-1] for path in paths if path not in REPRODUCED_CALLBACKS]
        why = "not run"
    else:
        names = [path.rsplit(".", 1)[-1] for path in paths]
        why = "not run: --callbacks 0" if a.loop == "lightning" else f"not run: --loop {a.loop}"
    if names:
        notes.append(f"trainer.callbacks: {', '.join(names)} ({why})")
    return notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--config``'s settings (:func:`config_defaults`) as the defaults: a flag given on the
    command line overrides the YAML. A config this tool cannot build is a parser error naming the option."""
    p = parser()
    a = p.parse_args(argv)
    if a.config:
        try:
            p.set_defaults(**config_defaults(a.config))
        except ConfigMismatch as e:
            p.error(f"--config {a.config}: {e}")
        a = p.parse_args(argv)
    if a.profile_steps < 0 or (a.profile_steps and not a.profile):
        p.error(f"--profile-steps {a.profile_steps}: give a count >= 1 with --profile FILE (0: the timed steps)")
    editing = RANDOM[a.family].editing
    if a.controls < 0 or (a.controls and not editing.takes_controls):
        p.error(f"--controls {a.controls}: the {a.family} family takes no control images; give --controls 0")
    if editing.max_controls is not None and a.controls > editing.max_controls:
        p.error(f"--controls {a.controls}: {a.family} takes at most {editing.max_controls}; give --controls 1")
    if editing.needs_controls and not a.controls:
        p.error(f"--controls 0: every {a.family} sample has a control image; give --controls 1")
    return a


def header(a: argparse.Namespace) -> dict[str, Any]:
    """What every output line carries about the run's origin: the config's name, the memory limit and what the
    config sets that this tool does not reproduce."""
    out: dict[str, Any] = {}
    if a.config:
        out["config"] = Path(a.config).name
        out["not_reproduced"] = not_reproduced(a)
    if a.memory_limit:
        out["memory_limit_GiB"] = a.memory_limit
    if a.denoiser:
        out["denoiser"] = a.denoiser
    out["allocator"] = next((f"{v}={os.environ[v]}" for v in ALLOCATOR_VARIABLES if v in os.environ), "default")
    return out


def bucket_sizes(text: str) -> list[tuple[int, int]]:
    """``--buckets``: comma-separated ``HxW`` sizes in pixels, e.g. ``832x1216,1216x832``."""
    return [sample_size(size) for size in text.split(",") if size]


def sample_size(text: str) -> tuple[int, int]:
    """``--sample-size``: ``H`` (square) or ``HxW`` in pixels."""
    try:
        sides = [int(side) for side in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give H or HxW in pixels, e.g. 512 or 512x768")
    return sides[0], sides[-1]


def parser() -> argparse.ArgumentParser:
    """The command line; ``parser().parse_args([...])`` gives every option its default."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="flux", choices=list(FAMILIES))
    p.add_argument(
        "--denoiser", default=None, help="a hub id the family knows the config of (default: the family's first row)"
    )
    p.add_argument(
        "--quant",
        default="none",
        choices=list(QUANT_PLUGINS),
        help="the base's format (a precision plugin); torchao_fp8: torchao's FP8 weights and activations (TorchaoFP8)",
    )
    p.add_argument(
        "--quant-option",
        action="append",
        metavar="KEY=VALUE",
        help="an init_arg of the --quant plugin, over the config's (repeatable): compiled_dequantize=true",
    )
    p.add_argument(
        "--config", default=None, help="a shipped YAML (configs/*.yaml): its settings are the defaults of every flag"
    )
    p.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="cap CUDA memory at this many GiB (torch.cuda.set_per_process_memory_fraction): a card's size",
    )
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="model.lora.alpha (default: the rank)")
    p.add_argument("--targets", default="attention")
    p.add_argument("--variant", default="lora", choices=["lora", "dora", "lokr", "loha"], help="model.lora.variant")
    p.add_argument("--gc", type=int, default=0)
    p.add_argument("--every", type=int, default=1, help="with --gc 1: checkpoint one block in N")
    p.add_argument("--h", type=int, default=512)
    p.add_argument("--w", type=int, default=768)
    p.add_argument(
        "--tlen",
        type=int,
        default=512,
        help="text tokens the denoiser sees: FLUX's T5 length; Z-Image / Qwen-Image: the caption's tokens (cached "
        "padded to max(512, tlen) with a mask); SDXL: always 77",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--controls",
        type=int,
        default=0,
        help="control / reference images of the target's size per sample (edit families and FLUX.2; a --config's "
        "most data.images[].controls by default): their tokens join the image's",
    )
    p.add_argument(
        "--buckets",
        type=bucket_sizes,
        default=[],
        metavar="HxW,...",
        help="more image sizes: the batches cycle through --h x --w and these, one size a batch, as aspect-ratio "
        "buckets do (give --warm enough steps to meet each twice: compiling finishes before the timed steps)",
    )
    p.add_argument("--accumulate", type=int, default=1, help="trainer.accumulate_grad_batches (a step: N batches)")
    p.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="trainer.gradient_clip_val: the gradients' norm clipped to this before each optimizer step (a --config's "
        "value by default; 0: off)",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument(
        "--opt",
        default="adamw8bit",
        choices=["adamw8bit", "adamw", "adamw-fused", "adafactor", "adafactor-hf"],
        help="the optimizer (a --config's model.optimizer by default); adamw-fused: torch's AdamW with fused=True",
    )
    p.add_argument("--compile", type=int, default=0)
    p.add_argument(
        "--cuda-graphs", type=int, default=0, help="model.cuda_graphs: the compiled blocks as CUDA graphs (--compile 1)"
    )
    p.add_argument(
        "--compile-dynamic",
        default="auto",
        choices=["auto", "static", "dynamic"],
        help="experiment: torch.compile(dynamic=) of the blocks (auto: dynamo's automatic dynamic shapes, as shipped)",
    )
    p.add_argument(
        "--compile-regions",
        default=None,
        metavar="CLASS,...",
        help="experiment: the module classes compiled besides the repeated blocks (the family's compiling.regions, "
        "empty for every family; e.g. ResnetBlock2D: the UNets' ResNets too)",
    )
    p.add_argument("--offload", type=int, default=0, help="model.offload_blocks")
    p.add_argument(
        "--dop",
        type=int,
        choices=[0, 1],
        default=0,
        help="model.preservation.mode: dop with every sample a preservation sample: DOP's forward without gradients "
        "(the adapter off) in every step (a --config's mode dop: 1)",
    )
    p.add_argument(
        "--masks",
        type=int,
        choices=[0, 1],
        default=0,
        help="every sample with a mask (its latents' left half): the masked loss (a --config whose data.images have "
        "masks: 1)",
    )
    p.add_argument("--cpp-wrapper", type=int, default=0, help="experiment: torch._inductor.config.cpp_wrapper")
    p.add_argument("--offload-act", type=int, default=0, help="model.offload_activations (0/1; needs --gc 1)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--plan", type=int, default=1)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--devices", type=int, default=1, help="GPUs (DDP when more than one)")
    p.add_argument(
        "--strategy",
        default="auto",
        help="auto / ddp: ours (LoraDDPStrategy); lightning-ddp: Lightning's own DDP; fsdp: the bf16 base sharded "
        "over --devices GPUs (LoraFSDPStrategy, as trainer.strategy: fsdp)",
    )
    p.add_argument("--loop", default="lightning", choices=["lightning", "bare"], help="bare: no Trainer (diagnosis)")
    p.add_argument(
        "--callbacks",
        type=int,
        choices=[0, 1],
        default=None,
        help="after the timed steps, the config's sample images, checkpoint and LoRA export, each timed with its peak "
        "(default: 1 with --config)",
    )
    p.add_argument(
        "--sample-steps",
        type=int,
        default=None,
        help="the samples' denoising steps (default: the config's; --tiny: 2). Qwen-Image needs 2: its scheduler's "
        "terminal stretch divides by zero at 1, and the images are NaN",
    )
    p.add_argument(
        "--sample-size",
        type=sample_size,
        default=None,
        metavar="H[xW]",
        help="the samples' size in pixels (default: the config's; --tiny: --h x --w)",
    )
    p.add_argument(
        "--sample-compiled",
        type=int,
        choices=[0, 1],
        default=None,
        help="SampleImages(compiled=...): 1 draws through the compiled blocks (default: the config's, else 0)",
    )
    p.add_argument(
        "--ema",
        type=int,
        choices=[0, 1],
        default=0,
        help="a LoraEMA callback, updated after every optimizer step: the EMA of the LoRA and its two power-function "
        "EMAs (default: 1 when the config has one, with its options: power-function EMAs only with snapshot_every)",
    )
    p.add_argument("--profile", default="", help="write a torch.profiler summary of the timed steps to this file")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="with --profile: profile this many steps after the timed ones instead (their timing left untouched)",
    )
    p.add_argument(
        "--stacks",
        default="",
        help="write where the training thread's time went, on and off its core (tools/offcpu.py)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="data loader worker processes serving the synthetic batches (a --config's data.num_workers); 0: the "
        "training process serves them, as every row before 2026-12-04 did",
    )
    p.add_argument(
        "--loader-pin",
        type=int,
        choices=[0, 1],
        default=None,
        help="1: the data loader pins its batches (with workers: in a thread of the training process), as fit's does "
        "on a GPU (the default there); 0: not",
    )
    p.add_argument(
        "--worker-start",
        choices=["fork", "spawn", "forkserver"],
        default=None,
        help="how the data loader's worker processes start (default: torch's, fork on Linux, as fit's)",
    )
    p.add_argument(
        "--teardown-watch",
        type=float,
        default=60.0,
        help="seconds after the training ended before every thread's stack is written to stderr (and again each "
        "such interval) while Trainer.fit has not returned; 0: off",
    )
    p.add_argument(
        "--host-threads",
        default="command",
        choices=["command", "all"],
        help="command: the CPU threads the lightning-lora command gives torch's operators (one on a GPU, unless "
        "OMP_NUM_THREADS is set); all: torch's own (one per core)",
    )
    p.add_argument(
        "--allocator",
        default="command",
        choices=list(ALLOCATORS),
        help="command: the allocator settings the lightning-lora command starts with (the --config's allocator, "
        "else expandable segments, unless PYTORCH_CUDA_ALLOC_CONF is set); default: PyTorch's own "
        "(expandable_segments:False)",
    )
    return p


ALLOCATORS: dict[str, str | None] = {"command": None, "default": ALLOCATOR_CHOICES["pytorch_default"]}
"""``--allocator`` -> the ``PYTORCH_CUDA_ALLOC_CONF`` it sets before anything touches the GPU (None: the command's)."""


def set_allocator(choice: str, environ: MutableMapping[str, str] | None = None, config: str | None = None) -> None:
    """``--allocator``: PyTorch's default settings (``default``) or the command's (``command``,
    :func:`set_allocator_defaults`: ``config``'s ``allocator``, as ``fit`` takes it); either way a variable the user
    set wins. Before anything touches the GPU."""
    environ = os.environ if environ is None else environ
    settings = ALLOCATORS[choice]
    if settings is not None and not any(name in environ for name in ALLOCATOR_VARIABLES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
    chosen = config_allocator(["--config", config]) if config else None
    set_allocator_defaults(environ, choice=chosen)


def main(argv: list[str] | None = None) -> None:
    # Before anything touches the GPU, so before --config is read: its class paths import GPU libraries.
    early = parser().parse_known_args(argv)[0]
    set_allocator(early.allocator, config=early.config)
    a = parse_args(argv)
    try:
        out = run(a)
    except Exception as e:  # one JSON line per configuration, also when it fails (out of memory under --memory-limit)
        traceback.print_exc()
        out = {**header(a), "family": a.family, "quant": a.quant, "rank": a.rank, "gc": a.gc}
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    # The result is printed: skip the interpreter's teardown. Shutting down inductor's compile workers took 15-20 s
    # a row on the H200, which a suite's row timeout counts and which killed rows after their result.
    sys.stderr.flush()
    os._exit(0)
