"""Which accelerator this torch build drives, and what it can do.

One torch API covers two GPU vendors. A ROCm build of PyTorch answers ``torch.cuda.is_available()`` and puts
tensors on ``device("cuda")`` exactly like a CUDA build; only ``torch.version.hip`` (a version string instead of
``None``) tells them apart. So "the device type is cuda" does not mean NVIDIA, and every check for a feature that
exists on one vendor only has to look at the build first:

* **CUDA** cards are told apart by compute capability (``torch.cuda.get_device_capability``): 8.0 Ampere (A100),
  8.6 Ampere (RTX 30xx), 8.9 Ada (RTX 40xx, L4), 9.0 Hopper (H100/H200), 10.x/12.x Blackwell.
* **ROCm** cards report a ``gcnArchName`` such as ``gfx942:sramecc+:xnack-`` (``torch.cuda.get_device_properties``):
  ``gfx90a`` MI200, ``gfx942`` MI300X/MI300A, ``gfx950`` MI350, ``gfx110x`` RDNA3 (RX 7900), ``gfx120x`` RDNA4.
  The capability ROCm reports is a made-up number from the arch and means nothing here.

What differs for this trainer, and what happens on ROCm:

* ``model.attention: xformers``: refused (xformers publishes no ROCm kernels); ``auto`` uses PyTorch SDPA, which
  has flash and memory-efficient kernels on ROCm.
* ``model.attention: cudnn``: refused (cuDNN is NVIDIA's library).
* ``lightning_lora.precision.FP8Compute``: FP8 matmuls on gfx94x / gfx95x (MI300, MI350), as on CUDA 8.9+;
  on other cards it falls back to ``fp8`` storage with a warning, the same as on an Ampere card. MI300 multiplies
  ``float8_e4m3fnuz`` (largest value 240), not the OCP ``float8_e4m3fn`` (448) of NVIDIA and MI350: the FP8 weights
  are quantized in the device's format (:func:`fp8_dtype`).
* ``lightning_lora.precision.NF4``: bitsandbytes' ROCm build; if it does not import, the error names the extra.

Everything else (bf16, FP8 storage, SDPA flash / memory-efficient / math, DDP over RCCL) is the same code on both.
The functions here only read torch's answers, so tests can fake a HIP build by patching ``torch.version.hip`` and
``torch.cuda``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_lora.errors import ConfigError

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_SETTINGS",
    "ALLOCATOR_VARIABLES",
    "Allocator",
    "allocator_conflict",
    "Backend",
    "check_attention",
    "detect",
    "expandable_segments",
    "fp8_compute_supported",
    "fp8_dtype",
    "free_memory_gib",
    "HOST_THREADS_ON_GPU",
    "limit_host_threads",
    "set_allocator_defaults",
]

Kind = Literal["cuda", "rocm", "cpu", "mps"]

# AMD archs with FP8 matrix instructions that torch._scaled_mm uses: CDNA3 (MI300) and CDNA4 (MI350).
_ROCM_FP8_ARCHS = ("gfx94", "gfx95")


@dataclass(frozen=True)
class Backend:
    """The accelerator behind a ``torch.device``.

    Attributes:
        kind: ``cuda`` (NVIDIA), ``rocm`` (AMD through HIP), ``cpu`` or ``mps`` (Apple).
        name: the device name torch reports (``NVIDIA H200``, ``AMD Instinct MI300X``, ``cpu``).
        capability: NVIDIA compute capability, e.g. ``(8, 9)``; ``None`` elsewhere.
        arch: AMD GPU arch without feature flags, e.g. ``gfx942``; ``None`` elsewhere.
    """

    kind: Kind
    name: str
    capability: tuple[int, int] | None = None
    arch: str | None = None

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("cuda", "rocm")

    def describe(self) -> str:
        """One line for messages and logs: ``NVIDIA H200 (CUDA, compute capability 9.0)``."""
        if self.kind == "cuda" and self.capability is not None:
            return f"{self.name} (CUDA, compute capability {self.capability[0]}.{self.capability[1]})"
        if self.kind == "rocm":
            return f"{self.name} (ROCm, {self.arch})"
        return self.name


def detect(device: torch.device | str | None = None) -> Backend:
    """The :class:`Backend` of ``device`` (default: the current GPU if there is one, else the CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "mps":
        return Backend("mps", "mps")
    if device.type != "cuda" or not torch.cuda.is_available():
        return Backend("cpu", "cpu")
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = str(getattr(props, "gcnArchName", "") or "unknown").split(":")[0]
        return Backend("rocm", props.name, arch=arch)
    major, minor = torch.cuda.get_device_capability(device)
    return Backend("cuda", props.name, capability=(major, minor))


def fp8_compute_supported(device: torch.device | str | Backend) -> tuple[bool, str]:
    """Whether the device has FP8 matrix units that ``torch._scaled_mm`` drives, and a reason for messages."""
    backend = device if isinstance(device, Backend) else detect(device)
    if backend.kind == "rocm":
        ok = backend.arch is not None and backend.arch.startswith(_ROCM_FP8_ARCHS)
        return ok, f"{backend.describe()}; needs MI300 / gfx94x or newer"
    if backend.kind == "cuda" and backend.capability is not None:
        return backend.capability >= (8, 9), f"{backend.describe()}; needs 8.9 or newer"
    return False, f"device {backend.kind} has none"


def fp8_dtype(device: torch.device | str | Backend) -> torch.dtype:
    """The float8 format the device's FP8 matrix units multiply: ``float8_e4m3fnuz`` on MI300 (gfx94x: AMD's
    pre-OCP variant, largest value 240, no negative zero), the OCP ``float8_e4m3fn`` (largest 448) everywhere else
    (NVIDIA 8.9+, MI350 / gfx95x, and the CPU, where FP8 weights are only stored)."""
    backend = device if isinstance(device, Backend) else detect(device)
    if backend.kind == "rocm" and backend.arch is not None and backend.arch.startswith("gfx94"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def check_attention(backend_name: str, device: torch.device | str | Backend) -> None:
    """Refuse a ``model.attention`` choice that the device's build cannot run, with a :class:`ConfigError`."""
    backend = device if isinstance(device, Backend) else detect(device)
    if backend_name == "xformers":
        if backend.kind == "rocm":
            raise ConfigError(
                f"model.attention: xformers has no ROCm kernels ({backend.describe()}); use auto (PyTorch SDPA, "
                "which has flash and memory-efficient kernels on ROCm)."
            )
        if backend.kind != "cuda":
            raise ConfigError(f"model.attention: xformers has no kernels for {backend.kind}; use auto.")
    if backend_name == "cudnn" and backend.kind == "rocm":
        raise ConfigError(
            f"model.attention: cudnn is NVIDIA's library and ROCm builds have none ({backend.describe()}); "
            "use auto, flash, efficient or math."
        )


def free_memory_gib(device: torch.device | str) -> float | None:
    """GiB this process can still allocate on a GPU ``device`` (other processes' use taken off; ROCm too), or None
    for a device without its own memory (the CPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free / 2**30


Allocator = Literal["expandable_segments", "pytorch_default"]
"""A config's ``allocator``: the GPU memory allocator's settings for the run (:data:`ALLOCATORS`)."""
ALLOCATORS: dict[str, str] = {
    "expandable_segments": "expandable_segments:True",
    "pytorch_default": "expandable_segments:False",
}
"""``allocator`` -> the ``PYTORCH_CUDA_ALLOC_CONF`` the command sets for it."""
ALLOCATOR_SETTINGS = ALLOCATORS["expandable_segments"]
"""The GPU memory allocator's settings a run takes unless its config or its user chose others
(:func:`set_allocator_defaults`)."""
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""The environment variables PyTorch reads its allocator's settings from: a user who set any of them chose their own."""


def set_allocator_defaults(environ: MutableMapping[str, str] | None = None, choice: Allocator | None = None) -> bool:
    """Set the allocator's settings for the run: the config's ``allocator`` (``choice``), or by default let PyTorch's
    caching allocator grow its memory segments in place (``expandable_segments:True``), unless the user configured
    the allocator (any of :data:`ALLOCATOR_VARIABLES` set, to anything: ``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:False`` is PyTorch's default), which wins. Returns whether it set them.

    By default the allocator keeps the blocks it carved for one size of tensor, and a run whose phases allocate in
    other sizes (training steps, then the sample images' decode) can run out of memory with enough free in total
    but none in one piece. On an H200 capped at 7.0 GiB (an 8 GB card that drives a display), ``flux_8gb`` as shipped
    ran out of memory drawing its samples that way (6.95 GiB reserved for 6.65 allocated), and with expandable
    segments trained, sampled (6.84 GiB) and exported at the same speed, 6.64 reserved (BENCHMARKS.md, "What each
    option measured"). With room to spare, PyTorch's default was at times the faster one for the SDXL UNet:
    ``allocator: pytorch_default``.

    The allocator reads the setting when it starts, at the first GPU allocation, and importing a GPU library
    (bitsandbytes asks for the GPU's compute capability) starts it: the command sets it first thing, before it parses
    the config (:func:`lightning_lora.cli.peek.config_allocator` reads the choice from the command line and its files).
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOCATOR_VARIABLES):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[choice or "expandable_segments"]
    return True


def expandable_segments(settings: str) -> bool:
    """Whether allocator settings (``PYTORCH_CUDA_ALLOC_CONF``'s ``key:value,...``) grow segments in place (PyTorch's
    default: no)."""
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def allocator_conflict(choice: Allocator | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """A warning when the config chose an ``allocator`` (``choice``) that an environment variable overrides (the
    variable wins: :func:`set_allocator_defaults`), else None."""
    environ = os.environ if environ is None else environ
    if choice is None:
        return None
    wanted = expandable_segments(ALLOCATORS[choice])
    for name in ALLOCATOR_VARIABLES:
        if name in environ and expandable_segments(environ[name]) != wanted:
            return (
                f"allocator: {choice} is not used: {name}={environ[name]} is set and wins; unset {name} to run "
                "with the config's allocator"
            )
    return None


HOST_THREADS_ON_GPU = 1
"""The CPU threads torch's own CPU operators get in a process that trains on a GPU (:func:`limit_host_threads`)."""


def limit_host_threads(device_type: str, environ: Mapping[str, str] | None = None) -> int | None:
    """Give torch's CPU operators :data:`HOST_THREADS_ON_GPU` thread while a process trains on a GPU (``device_type``
    ``"cuda"``, which a ROCm build reports too), unless the user chose a number (``OMP_NUM_THREADS`` set, to anything:
    theirs wins). Returns the number of threads torch had, to restore after training, or None when it changed nothing.
    :class:`~lightning_lora.module.LoraModule` calls it when training starts (after the weights loaded) and restores
    the number when training ends.

    On a GPU the training process does little CPU work of its own, in small pieces: a sample's noise (65,536 values for
    a 1024-pixel SDXL latent), collating and pinning a batch. Torch splits any operator over 32,768 values across its
    thread pool, and after each the pool's OpenMP threads spin, waiting for more, while the two threads that drive the
    GPU (the training thread, and autograd's, which runs the backward pass) need a core each. On an H200's 16-core
    host ``sdxl_12gb``'s step took 0.70 s with one thread and 0.75 / 1.13 s with one per core, which spent 1.5-2.3 s of
    the process's CPU a step; ``flux_4090``'s 0.576 against 0.705 / 0.838 s (BENCHMARKS.md, "What each option
    measured").
    """
    environ = os.environ if environ is None else environ
    if device_type != "cuda" or "OMP_NUM_THREADS" in environ:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(HOST_THREADS_ON_GPU)
    return before
