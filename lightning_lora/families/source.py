"""Where the model comes from: :class:`ModelSource` (a hub id or a local diffusers folder, optionally with the denoiser
replaced by a single ``.safetensors`` file), its checks before any heavy work (:func:`check_source`), its loaders with
one-line errors (:func:`load_component`, :func:`load_weights`, :func:`source_problem`), and a model's identity by
content (:func:`content_digest`).

**What a model is, not how its path is spelled.** :meth:`ModelSource.component_digest` is the one home of a model's
identity: a digest of a component folder's files (:func:`content_digest`: small files whole, weight files by their
size, header and evenly spaced slices), never of the folder's path. The latent cache keys on it
(:meth:`ModelSource.identity`, with the load dtype), and a resume compares it (:meth:`ModelSource.model_identity`,
over every component with weights), so a model folder that moved to another disk, or is named by a relative path from
another working directory, is the same model, and another model copied to the same path is not. A hub id is its id
(and revision).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lightning_lora.errors import ConfigError, first_line

__all__ = [
    "PICKLE_SUFFIXES",
    "ModelSource",
    "build_from_config",
    "check_source",
    "compute_dtype",
    "content_digest",
    "load_component",
    "load_weights",
    "looks_local",
    "source_problem",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files in Python's pickle format, which can run code when loaded: never read from a user's folder."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSource:
    """Where the model's weights come from.

    Args:
        pretrained: a hub id (``black-forest-labs/FLUX.1-dev``) or a local diffusers folder (with ``model_index.json``).
        denoiser_file: optional single ``.safetensors`` file that replaces the denoiser (transformer or UNet) of
            ``pretrained``; the other components still come from ``pretrained``.
        revision: hub revision (branch, tag or commit); ignored for local folders.
        dtype: the dtype the frozen weights are loaded in.
        training_adapter: optional LoRA file merged into the denoiser for training only
            (:mod:`lightning_lora.model.training_adapter`): part of what the model is.
    """

    pretrained: str
    denoiser_file: str | None = None
    revision: str | None = None
    dtype: torch.dtype = torch.bfloat16
    training_adapter: str | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.pretrained).expanduser().is_dir()

    @property
    def local_path(self) -> str:
        return str(Path(self.pretrained).expanduser()) if self.is_local else self.pretrained

    def component_digest(self, component: str) -> str:
        """What the subfolder ``component`` holds (see the module docstring): for a local folder a digest of its files'
        names and contents (:func:`content_digest`; hidden files left out), wherever the folder is and however its
        path is spelled; for a hub id, the id and revision."""
        if not self.is_local:
            return _digest(self.pretrained, self.revision or "")
        folder = Path(self.local_path) / component
        listed = sorted(folder.iterdir()) if folder.is_dir() else []
        files = [f for f in listed if f.is_file() and not f.name.startswith(".")]
        return _digest(*(f"{f.name}:{content_digest(f)}" for f in files))

    def identity(self, component: str) -> str:
        """A string that changes when the weights of ``component`` or their load dtype change; cache keys are built
        from it."""
        return _digest(self.component_digest(component), str(self.dtype))

    def model_identity(self) -> dict[str, str | None]:
        """What the model is, for a resume to compare with the run's (:func:`lightning_lora.checkpoint.
        check_compatible`): ``pretrained``, a digest of a local folder's ``model_index.json`` and of every component
        that holds weights (its configs and weight files), or a hub id as it is written; ``denoiser_file``, the
        :func:`content_digest` of that file (None without one); ``training_adapter``, the digest of the training adapter
        merged into it (None without one)."""
        pretrained: str | None = self.pretrained
        if self.is_local:
            root = Path(self.local_path)
            index = root / "model_index.json"
            parts = [content_digest(index)] if index.is_file() else []
            weighted = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.safetensors")))
            parts += [f"{name}:{self.component_digest(name)}" for name in weighted]
            pretrained = "files:" + _digest(*parts)
        denoiser = Path(self.denoiser_file).expanduser() if self.denoiser_file else None
        adapter = Path(self.training_adapter).expanduser() if self.training_adapter else None
        return {
            "pretrained": pretrained,
            "denoiser_file": content_digest(denoiser) if denoiser else None,
            "training_adapter": content_digest(adapter) if adapter else None,
        }


_WHOLE = 4 << 20
"""Files up to this size (configs, tokenizers, tiny models) are digested whole."""
_HEAD, _SLICE, _SLICES = 1 << 20, 64 << 10, 16


def content_digest(path: Path) -> str:
    """A digest of what ``path`` holds, cheap for weight files of many gigabytes (about 2 MiB read): the whole file up
    to 4 MiB; a larger one by its size, its first MiB (a safetensors header: every tensor's name, dtype, shape and
    offset) and 16 evenly spaced 64 KiB slices (other weights of the same shapes differ there: a fine-tune changes
    every value). A copy, on any disk, has the same digest."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= _WHOLE:
            h.update(f.read())
        else:
            h.update(f.read(_HEAD))
            for k in range(_SLICES):
                f.seek(_HEAD + k * (size - _HEAD - _SLICE) // (_SLICES - 1))
                h.update(f.read(_SLICE))
    return h.hexdigest()[:32]


def _digest(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def check_source(source: ModelSource, pipeline_classes: tuple[str, ...]) -> None:
    """Validate a :class:`ModelSource` cheaply (no weights are read); raise :class:`ConfigError` with the fix."""
    path = Path(source.pretrained).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(
                f"model.pretrained: {source.pretrained!r} is a file, not a diffusers folder. Put a folder with "
                "model_index.json (or a hub id) in model.pretrained; a single .safetensors denoiser goes in "
                "model.denoiser_file."
            )
        index = path / "model_index.json"
        if not index.is_file():
            raise ConfigError(
                f"model.pretrained: {str(path)!r} is not a diffusers pipeline folder (no model_index.json). Point it "
                "at the folder that holds model_index.json, transformer/, vae/, text_encoder/..., or use a hub id."
            )
        try:
            class_name = json.loads(index.read_text()).get("_class_name", "")
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"model.pretrained: cannot read {index}: {e}") from e
        if class_name not in pipeline_classes:
            raise ConfigError(
                f"model.pretrained: {str(path)!r} holds a {class_name or 'unknown'} pipeline, but model.family "
                f"expects one of {', '.join(pipeline_classes)}. Choose the matching model.family or another folder."
            )
    elif looks_local(source.pretrained):
        from lightning_lora.cli.demo import DEMO_DIR

        demo = Path(source.pretrained).parts[:1] == DEMO_DIR.parts
        raise ConfigError(
            f"model.pretrained: folder {source.pretrained} does not exist (in {Path.cwd()}). "
            + (
                "The demo's tiny models are written by make demo (or python -m lightning_lora.cli.demo), from the "
                "repository's folder."
                if demo
                else "Check the path: a local model is a diffusers folder with model_index.json; a hub id looks like "
                "black-forest-labs/FLUX.1-dev."
            )
        )
    elif not _HUB_ID.match(source.pretrained):
        raise ConfigError(
            f"model.pretrained: {source.pretrained!r} does not exist as a local folder and is not a hub id "
            "(like black-forest-labs/FLUX.1-dev). Check the path."
        )
    if source.denoiser_file is not None:
        f = Path(source.denoiser_file).expanduser()
        if not f.is_file():
            raise ConfigError(f"model.denoiser_file: {source.denoiser_file!r} does not exist. Check the path.")
        if f.suffix.lower() != ".safetensors":
            raise ConfigError(
                f"model.denoiser_file: {source.denoiser_file!r} is not a .safetensors file. Only safetensors weights "
                "are loaded (pickled .ckpt/.pt/.bin files can run code); convert it or download the safetensors file."
            )
        try:  # the header only (a few KB): a truncated download or another format fails here, not after minutes
            with safe_open(f, framework="pt") as header:
                header.keys()
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"model.denoiser_file: {source.denoiser_file!r} is not a readable safetensors file ({first_line(e)}). "
                "A download cut short is the usual cause: download it again (its size should match the source's)."
            ) from None
    adapter = source.training_adapter
    if adapter is not None and not (Path(adapter).expanduser().is_file() and adapter.lower().endswith(".safetensors")):
        raise ConfigError(
            f"model.training_adapter: {adapter!r} is not a .safetensors file here. Give the path of the training "
            "adapter's LoRA file (a de-distillation LoRA for model.pretrained), or leave the option out."
        )


def looks_local(pretrained: str) -> bool:
    """Whether ``model.pretrained`` names a local folder rather than a hub id (``owner/name``), whether or not it
    exists: a path from the root, the working folder or home (``/``, ``./``, ``../``, ``~``), one whose parent folder
    exists (``models/flux-dev`` beside a ``models/`` folder), or a path with more than one separator."""
    text = pretrained.strip()
    if text.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(text).is_absolute():
        return True
    path = Path(text).expanduser()
    if path.exists() or (path.parent != Path(".") and path.parent.is_dir()):
        return True
    return (os.sep in text or "/" in text) and not _HUB_ID.match(text)


def _hub_offline() -> str | None:
    """The variables that keep huggingface_hub offline (``HF_HUB_OFFLINE``, or ``TRANSFORMERS_OFFLINE``, which it also
    reads), as the message names them; ``None`` when it may download."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return None
    names = [
        n
        for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        if os.environ.get(n, "").upper() in constants.ENV_VARS_TRUE_VALUES
    ]
    return " and ".join(names or ["HF_HUB_OFFLINE"])


def _causes(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


_UNREACHABLE = re.compile(
    r"Name or service not known|Failed to resolve|Connection ?(refused|Error)|timed out|offline", re.I
)


def source_problem(source: ModelSource, subfolder: str, error: BaseException) -> str:
    """The one line for a component of ``source`` that failed to load (``error``): a local folder's file problem; for a
    hub id, why it is not here (offline: ``HF_HUB_OFFLINE`` set, or no network; a gated model; another error) and how
    to download it (``hf download``) or log in (``hf auth login``)."""
    if source.is_local:
        return f"model.pretrained: could not load {subfolder!r} from the local folder {source.pretrained}: {error}"
    repo = source.pretrained
    chain = _causes(error)
    download = (
        f"Download it where there is a network: hf download {repo} (and point HF_HOME there, or give "
        "model.pretrained the downloaded folder)"
    )
    if any(type(e).__name__ == "GatedRepoError" or "gated" in str(e).lower() for e in chain):
        return (
            f"model.pretrained: {repo} is a gated model on the Hugging Face hub: accept its license on "
            f"https://huggingface.co/{repo}, log in with hf auth login (or set HF_TOKEN), then run again."
        )
    gated = " A gated model (FLUX.1-dev is one) also needs its license accepted and hf auth login."
    if offline := _hub_offline():
        return (
            f"model.pretrained: {repo} is not in the local Hugging Face cache, and the hub is offline ({offline} set: "
            f"nothing is downloaded). {download}, or unset {offline} to download it now.{gated}"
        )
    if any(_UNREACHABLE.search(f"{type(e).__name__} {e}") for e in chain):
        return (
            f"model.pretrained: {repo} is not in the local Hugging Face cache, and the hub could not be reached (no "
            f"network?). {download}.{gated}"
        )
    return f"model.pretrained: could not load {subfolder!r} of the hub model {repo}: {first_line(error)}.{gated}"


def load_component(load: Callable[..., T], source: ModelSource, subfolder: str, **kwargs: Any) -> T:
    """Call a diffusers/transformers ``from_pretrained`` for one component and turn failures into a clear error
    (:func:`source_problem`)."""
    try:
        return load(source.local_path, subfolder=subfolder, revision=source.revision, **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError(source_problem(source, subfolder, e)) from e


def load_weights(load: Callable[..., T], source: ModelSource, subfolder: str, **kwargs: Any) -> T:
    """:func:`load_component` for a component with weights: safetensors files only. A local folder that holds only
    pickled weights (``pytorch_model.bin``...) is refused naming the file (pickle can run code when loaded; diffusers
    and transformers would load it); a hub repository without safetensors fails to load."""
    if source.is_local:
        folder = Path(source.local_path) / subfolder
        files = sorted(folder.iterdir()) if folder.is_dir() else []
        pickled = [f for f in files if f.suffix.lower() in PICKLE_SUFFIXES]
        if pickled and not any(f.name.endswith(".safetensors") for f in files):
            raise ConfigError(
                f"model.pretrained: {pickled[0]} holds the {subfolder!r} weights in Python's pickle format, which can "
                "run code when loaded; lightning-lora reads only safetensors weights. Download the safetensors version "
                "of the model, or convert the file with a tool you trust (torch.load + safetensors.torch.save_file)."
            )
    return load_component(load, source, subfolder, use_safetensors=True, **kwargs)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the frozen base computes in: that of its first floating-point parameter that is not the adapter's."""
    from lightning_lora.lora import is_adapter_param

    for name, p in module.named_parameters():
        if p.is_floating_point() and not is_adapter_param(name):
            return p.dtype
    return torch.float32


def build_from_config(cls: Any, config: dict[str, Any], dtype: torch.dtype, device: str = "meta") -> nn.Module:
    """``cls(**config)`` built directly on ``device`` in ``dtype``: on ``meta`` for the memory planner (shapes only),
    on ``cuda`` for the benchmark (random weights of the real size, no download, no CPU copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
