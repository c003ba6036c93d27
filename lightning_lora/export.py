"""Export the trained LoRA as a safetensors file that diffusers, ComfyUI, Forge or kohya's sd-scripts load.

A LoRA file is the adapter's tensors in one of the layouts of :mod:`lightning_lora.formats` (``diffusers``: peft keys
with the scale folded into ``lora_B`` and ``lora_adapter_metadata``; ``kohya``: ``lora_unet_<module>`` keys with one
``alpha`` per module, LyCORIS tensors for DoRA, LoKr and LoHa), plus metadata (safetensors metadata values are
strings):

* ModelSpec (``modelspec.architecture``, ``.implementation``, ``.title``, ``.resolution``, ``.date``,
  ``.trigger_phrase``), which UIs and model sites show, in both layouts;
* kohya's ``ss_*`` keys in kohya files (``ss_network_module``, ``ss_network_dim``, ``ss_network_alpha``,
  ``ss_network_args``, ``ss_output_name``...: :func:`lightning_lora.formats.kohya.kohya_metadata`);
* our own ``lightning_lora.*`` keys: version, format, rank, alpha, variant, targets, ``loads_in`` (the tools that apply
  every layer of the file exactly, :mod:`lightning_lora.formats.clients`), and what the caller passes as ``info``
  (base model, family, steps, resolution, trigger...).

The file is written atomically, so an interrupted export never leaves a half file.

Who decides what
----------------
The *family* decides which layouts it writes and how its modules are named in each (``lora_files.layouts`` of
:class:`~lightning_lora.families.base.DiffusionFamily`: each a :class:`~lightning_lora.formats.LoraLayout`, a layout
module's code bound to the family's names), what each loader makes of its files
(:meth:`~lightning_lora.families.base.DiffusionFamily.lora_coverage`) and whether a file made elsewhere is its own
(:meth:`~lightning_lora.families.base.DiffusionFamily.claims_lora_metadata`, ``claims_lora_keys``); the *format*
decides which adapter variants a file can hold (:data:`lightning_lora.formats.VARIANTS`). This module names neither a
family nor a family's names. A request outside either is refused with the reason (a family without a kohya layout, a
LoKr adapter for the diffusers format, a LoKr on FLUX's fused q/k/v), never answered with a file that holds less than
was trained. :func:`check_export` asks the same question before training starts, on shapes alone.

Three ways in, one way out
--------------------------
:func:`save_lora` writes from the live peft model (the end-of-training callback). :func:`export_lora` writes from a
plain peft-style state dict (``<module>.lora_A.weight``, no prefix, no adapter name). :func:`checkpoint_lora` gets that
state dict, the LoRA options, the family and the step from a Lightning checkpoint without loading the base model, so
``lightning-lora export`` takes seconds, not a 24 GB load. :func:`convert_lora_file` rewrites a LoRA file made
elsewhere (or by an older version) in another layout: a diffusers file is read by its own config, a kohya file by
diffusers' own converter (``lora_state_dict``), and both are written by the same code as a trained LoRA.
"""

from __future__ import annotations

import datetime
import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_lora import __version__
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.families import FAMILIES, DiffusionFamily
from lightning_lora.formats import FORMATS, VARIANTS, FileFacts, LoraFormat
from lightning_lora.formats.adapters import adapters_from_peft, common_rank, variants_of
from lightning_lora.formats.clients import Coverage
from lightning_lora.formats.comfyui import is_comfy_file
from lightning_lora.formats.diffusers import is_diffusers_file
from lightning_lora.formats.kohya import is_kohya_file
from lightning_lora.io import save_safetensors
from lightning_lora.lora import LoraOptions, adapter_state

__all__ = [
    "FORMATS",
    "CheckpointLora",
    "LoraFile",
    "check_export",
    "checkpoint_ema",
    "checkpoint_lora",
    "convert_lora_file",
    "export_lora",
    "file_coverage",
    "read_lora_file",
    "read_metadata",
    "save_lora",
    "training_precision",
    "write_lora",
]


def save_lora(
    denoiser: nn.Module,
    path: str | Path,
    *,
    family: DiffusionFamily,
    lora: LoraOptions,
    info: Mapping[str, Any],
    format: LoraFormat = "diffusers",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA of a live peft model (adapter ``default``) to ``path``; see :func:`export_lora`."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser, unwrap_compiled=True)
    return export_lora(state, path, format=format, lora=lora, family=family, info=info, dtype=dtype)


def training_precision(spec: Mapping[str, Any] | None) -> str:
    """The base format a LoRA trained on, as its files record it (``lightning_lora.training_precision``), from its
    precision plugin's spec (``{"class_path": "lightning_lora.precision.NF4", "init_args": {...}}``, what checkpoints
    keep as ``hyper_parameters["precision"]``): ``nf4``, ``fp8`` (FP8 and FP8Compute store the same float8 weights), or
    the dtype of an unquantized base (``bf16``, ``fp16``, ``fp32``); empty when unknown."""
    if not isinstance(spec, Mapping):
        return ""
    name = str(spec.get("class_path", "")).rsplit(".", 1)[-1]
    init_args = spec.get("init_args")
    dtype = str(init_args.get("dtype", "bf16")) if isinstance(init_args, Mapping) else "bf16"
    return {"NF4": "nf4", "FP8": "fp8", "FP8Compute": "fp8", "BF16": dtype}.get(name, "")


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a LoRA file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# --------------------------------------------------------------------------------------------- from a state dict


def export_lora(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    format: LoraFormat,
    lora: LoraOptions,
    family: DiffusionFamily,
    info: Mapping[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a trained LoRA given as a peft-style state dict to ``path`` (safetensors, atomically) in ``format``.

    Args:
        state: ``{"<module>.lora_A.weight": [r, in], "<module>.lora_B.weight": [out, r]}`` (DoRA's
            ``<module>.lora_magnitude_vector``, LoKr's ``<module>.lokr_w1``..., LoHa's ``<module>.hada_w1_a``...),
            module names of the denoiser without prefix or adapter name (what :func:`checkpoint_lora` returns).
        path: the ``.safetensors`` file to write (replaced atomically if it exists: callers decide about overwriting).
        format: ``diffusers`` (:mod:`lightning_lora.formats.diffusers`) or ``kohya``
            (:mod:`lightning_lora.formats.kohya`). It must be one of the family's ``lora_files.formats``.
        lora: the LoRA options the state was trained with (rank, alpha, targets, init, variant); every update is
            scaled by ``alpha / rank`` as peft did in training.
        family: the model family the LoRA belongs to; it names the modules in its formats.
        info: our metadata (base model, steps, resolution, trigger, title...), stored as ``lightning_lora.<key>``
            strings; ``resolution``, ``trigger`` and ``title`` also fill ModelSpec's fields.
        dtype: cast the weights (bf16 halves the file); default keeps them as given. ``alpha`` stays float32.

    Raises:
        ConfigError: a format the family does not write, an adapter variant the format cannot hold, an empty state,
            a rank other than the options'. ``ValueError``: a module the format has no name or exact form for, a
            malformed state.
    """
    _check_format(state, format, family)
    adapters = adapters_from_peft(state)
    if not adapters:
        raise ConfigError("the LoRA state dict is empty: nothing to export")
    rank, alpha = int(lora.rank), lora.scale_alpha
    wrong = [m for m, a in adapters.items() if a.rank is not None and a.variant != "LoKr" and a.rank != rank]
    if wrong:
        raise ConfigError(f"{wrong[0]}: rank {adapters[wrong[0]].rank} but the LoRA options say rank {rank}")
    return write_lora(
        state,
        path,
        format=format,
        family=family,
        scale=alpha / rank,
        rank=rank,
        alpha=alpha,
        info=info,
        targets=lora.targets,
        init=lora.init,
        dtype=dtype,
    )


def write_lora(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    format: str,
    family: DiffusionFamily,
    scale: float,
    rank: int,
    alpha: float,
    info: Mapping[str, Any],
    targets: str | list[str] | None = None,
    init: str = "gaussian",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``state`` (a peft state dict) in ``format`` with every update scaled by ``scale``; ``rank`` and ``alpha``
    are what the metadata reports as trained. :func:`export_lora` (a trained LoRA) and :func:`convert_lora_file` (a
    file made elsewhere, scale already folded: ``scale=1``) both write through here."""
    _check_format(state, format, family)
    title = str(info.get("title") or Path(path).name.removesuffix(".safetensors"))
    adapters = adapters_from_peft(state)
    kinds = sorted({a.variant for a in adapters.values()}, key=["LoRA", "DoRA", "LoKr", "LoHa"].index)
    metadata = {
        "format": "pt",
        "lightning_lora.version": __version__,
        "lightning_lora.format": format,
        "lightning_lora.rank": str(rank),
        "lightning_lora.alpha": str(float(alpha)),
        "lightning_lora.variant": ",".join(kinds),
    }
    if targets is not None:
        metadata["lightning_lora.targets"] = json.dumps(targets)
    layout = family.lora_layout(format)  # the layout's code with the family's names
    tensors, header = layout.write(state, FileFacts(scale, rank, alpha, title, init, dtype))
    metadata.update(header)
    metadata.update(modelspec(family, title, info))
    metadata["lightning_lora.loads_in"] = json.dumps(family.file_coverage(format, adapters).loads_in)
    metadata.update({f"lightning_lora.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in info.items()})
    return save_safetensors(tensors, path, metadata=metadata)


def modelspec(family: DiffusionFamily, title: str, info: Mapping[str, Any]) -> dict[str, str]:
    """The ModelSpec entries of a LoRA file of ``family`` (Stability AI's spec, as kohya's sd-scripts writes it,
    ``library/sai_model_spec.py``): architecture and implementation from the family, the title, the training
    resolution (``info["resolution"]``: a side or ``(height, width)``), today's date, the trigger phrase."""
    if not family.lora_files.modelspec:
        return {}
    meta = {"modelspec.sai_model_spec": "1.0.1"}
    meta.update({f"modelspec.{k}": v for k, v in family.lora_files.modelspec.items()})
    meta["modelspec.title"] = title
    resolution = info.get("resolution")
    if isinstance(resolution, int | float) and resolution > 0:
        meta["modelspec.resolution"] = f"{int(resolution)}x{int(resolution)}"
    elif isinstance(resolution, list | tuple) and len(resolution) == 2:
        meta["modelspec.resolution"] = f"{int(resolution[1])}x{int(resolution[0])}"  # width x height
    meta["modelspec.date"] = datetime.datetime.now().replace(microsecond=0).isoformat()
    if info.get("trigger"):
        meta["modelspec.trigger_phrase"] = str(info["trigger"])
    return meta


def file_coverage(state: Mapping[str, torch.Tensor], family: DiffusionFamily, format: str) -> Coverage:
    """What diffusers, ComfyUI and kohya's sd-scripts make of a ``format`` file of ``state``
    (:meth:`~lightning_lora.families.base.DiffusionFamily.file_coverage`)."""
    return family.file_coverage(format, adapters_from_peft(state))


def check_export(state: Mapping[str, torch.Tensor], family: DiffusionFamily, format: str) -> None:
    """Raise what :func:`export_lora` would raise for ``state`` in ``format`` (as :class:`ConfigError`), without
    computing or writing anything: the conversion runs on tensors of the same shapes on the ``meta`` device."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    _check_format(meta, format, family)
    try:
        family.lora_layout(format).write(meta, FileFacts(scale=0.5, rank=1, alpha=1.0))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"--format {format}: {first_line(e)}") from None


def _check_format(state: Mapping[str, torch.Tensor], format: str, family: DiffusionFamily) -> None:
    """Refuse a format the family does not write, or an adapter variant (DoRA, LoKr...) that files of ``format``
    cannot hold, naming it and the format."""
    if format not in FORMATS:
        raise ConfigError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    if format not in family.lora_files.formats:
        raise family.format_refused(format)
    for variant in sorted(variants_of(state)):
        if variant in VARIANTS[format]:
            continue
        holds = [f for f in family.lora_files.formats if variant in VARIANTS[f]]
        instead = (
            f"Export it with --format {holds[0]}." if holds else f"No format lightning-lora writes holds {variant} yet."
        )
        key = next(k for k in state if _variant_key(k, variant))
        raise ConfigError(
            f"--format {format}: the LoRA is a {variant} adapter ({key!r}), and a {format} file holds "
            f"{' and '.join(VARIANTS[format])} only: writing it would drop the {variant} tensors and change what the "
            f"adapter does. {instead}"
        )


def _variant_key(key: str, variant: str) -> bool:
    from lightning_lora.lora import parse_key

    parsed = parse_key(key)
    return parsed is not None and parsed.variant == variant


# --------------------------------------------------------------------------------------------- files made elsewhere


class LoraFile(NamedTuple):
    """A LoRA file read back by :func:`read_lora_file`."""

    state: dict[str, torch.Tensor]
    """peft keys without prefix, every module's scale folded into its weights (write it with ``scale=1``)."""
    family: DiffusionFamily
    """The family the file is for (from ``--family``, its metadata or its keys)."""
    layout: str
    """The layout it was in: ``diffusers`` or ``kohya``."""
    metadata: dict[str, str]
    """Its safetensors metadata."""


def read_lora_file(path: str | Path, family: DiffusionFamily | None = None) -> LoraFile:
    """Read a diffusers- or kohya-layout LoRA file into a peft state dict with the scale folded in.

    The family is ``family`` when given, else the one the file names (``lightning_lora.family``, or each family asked
    whether kohya's ``ss_base_model_version`` or ModelSpec's architecture name it), else the one its keys can only
    belong to (each family asked). The file's keys say its layout, which the family's layout of that name reads: a
    diffusers file by its own config (:func:`~lightning_lora.formats.diffusers.from_diffusers`), a kohya file by
    diffusers' own converter for the family (:class:`~lightning_lora.formats.kohya.KohyaLayout`). Raises
    :class:`ConfigError` naming the file and the fix.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: does not exist.")
    try:
        tensors = load_file(str(path))
        metadata = read_metadata(path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path}: is not a readable safetensors file ({first_line(e)}).") from None
    claims = {cls.name: cls.claims_lora_keys(tensors) for cls in FAMILIES.values()}
    best = max(claims.values(), default=0)
    if family is not None and type(family).claims_lora_keys(tensors) < best:  # the keys are another family's
        named = " or ".join(name for name, claim in claims.items() if claim == best)
        raise ConfigError(
            f"--family {family.name}: {path} holds a {named} LoRA (by its module names); pass --family "
            f"{named.split(' or ')[0]} or leave it out."
        )
    family = family or _family_of(tensors, metadata, path)
    format = next((f for f, holds in _HOLDS.items() if holds(tensors)), None)
    if format is None:
        raise ConfigError(
            f"{path}: is neither a diffusers LoRA file (transformer.* / unet.* keys) nor a kohya one (lora_unet_* "
            "keys) nor a ComfyUI one (diffusion_model.* keys); its keys start with "
            f"{sorted({k.split('.')[0] for k in tensors})[:3]}. Text-encoder LoRAs are not "
            "converted."
        )
    layout = family.lora_layout(format)  # a family without this layout refuses it, naming the ones it has
    try:
        state = layout.read(tensors, metadata)
    except ValueError as e:
        raise ConfigError(f"{path}: {first_line(e)}") from None
    return LoraFile(state, family, format, metadata)


_HOLDS: dict[str, Callable[[Mapping[str, torch.Tensor]], bool]] = {
    "diffusers": is_diffusers_file,
    "kohya": is_kohya_file,
    "comfyui": is_comfy_file,
}
"""Each layout (:data:`lightning_lora.formats.FORMATS`) -> whether a file's keys are of that layout."""


def convert_lora_file(
    source: str | Path,
    out: str | Path,
    *,
    format: str,
    family: DiffusionFamily | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Rewrite the LoRA file ``source`` in ``format`` to ``out`` (see :func:`read_lora_file`); the metadata says which
    file it came from. Returns the written path."""
    lora = read_lora_file(source, family)
    adapters = adapters_from_peft(lora.state)
    rank = common_rank(adapters)
    meta = lora.metadata
    info: dict[str, Any] = {"converted_from": Path(source).name, "converted_from_layout": lora.layout}
    for key in ("resolution", "trigger", "base_model", "family", "steps"):
        if f"lightning_lora.{key}" in meta:
            info[key] = _json_or_text(meta[f"lightning_lora.{key}"])
    if "trigger" not in info and meta.get("modelspec.trigger_phrase"):
        info["trigger"] = meta["modelspec.trigger_phrase"]
    info.setdefault("family", lora.family.name)
    return write_lora(
        lora.state,
        out,
        format=format,
        family=lora.family,
        scale=1.0,
        rank=rank,
        alpha=float(rank),
        info=info,
        dtype=dtype,
    )


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _family_of(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], path: Path) -> DiffusionFamily:
    """The family a LoRA file names in its metadata, or the only one its keys fit: each registered family is asked."""
    named = metadata.get("lightning_lora.family")
    if named in FAMILIES:
        return FAMILIES[named]()
    family = _claimed({cls: cls.claims_lora_metadata(metadata) for cls in FAMILIES.values()})
    family = family or _family_from_keys(tensors)
    if family is None:
        raise ConfigError(
            f"{path}: cannot tell which model family it is for; pass --family ({', '.join(sorted(FAMILIES))})."
        )
    return family()


def _family_from_keys(tensors: Mapping[str, torch.Tensor]) -> type[DiffusionFamily] | None:
    """The family whose module names (or widths) the file's tensors have, by each family's
    :meth:`~lightning_lora.families.base.DiffusionFamily.claims_lora_keys`; None when no family, or more than one,
    claims them most surely."""
    return _claimed({cls: cls.claims_lora_keys(tensors) for cls in FAMILIES.values()})


def _claimed(claims: Mapping[type[DiffusionFamily], int]) -> type[DiffusionFamily] | None:
    """The one family with the highest claim above 0, or None (no claim, or a tie)."""
    best = max(claims.values(), default=0)
    winners = [cls for cls, claim in claims.items() if claim == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


# --------------------------------------------------------------------------------------------- from a checkpoint


class CheckpointLora(NamedTuple):
    """What :func:`checkpoint_lora` reads from a training checkpoint: everything :func:`export_lora` needs."""

    state: dict[str, torch.Tensor]
    """The adapter tensors in peft keys without prefix or adapter name
    (``transformer_blocks.0.attn.to_q.lora_A.weight``); a variant's tensors (DoRA's
    ``<module>.lora_magnitude_vector``) included, for the format to accept or refuse."""
    lora: LoraOptions
    """The LoRA options the run trained with."""
    family: DiffusionFamily
    """The run's model family, built with its saved options."""
    info: dict[str, Any]
    """What :func:`export_lora` stores as metadata: ``family`` (its name), ``base_model``, ``denoiser_file``,
    ``steps``, ``checkpoint``."""


def checkpoint_lora(path: str | Path, ema: bool = False, sigma_rel: float | None = None) -> CheckpointLora:
    """The LoRA in a Lightning checkpoint of ``lightning-lora fit``, without loading the base model: the trained
    weights, or with ``ema`` their EMA (a run with :class:`~lightning_lora.callbacks.ema.LoraEMA`), or with
    ``sigma_rel`` the power-function EMA of that width reconstructed from the run's snapshots (:func:`checkpoint_ema`).

    The file is read by :func:`lightning_lora.checkpoint.read_checkpoint` (``weights_only=True``: a checkpoint cannot
    run code). Raises :class:`ConfigError` naming the file for a missing, corrupt or foreign one.
    """
    from lightning_lora.checkpoint import read_checkpoint

    path = Path(path)
    checkpoint = read_checkpoint(
        path,
        option="checkpoint",
        fix="Pass a .ckpt written by `lightning-lora fit`, e.g. runs/lora/checkpoints/last.ckpt.",
    )
    averaged = ""
    if ema or sigma_rel is not None:
        weights, averaged = checkpoint_ema(checkpoint, path, sigma_rel)
        checkpoint["state_dict"] = {f"denoiser.{name}": tensor for name, tensor in weights.items()}
    state = adapter_state(checkpoint.get("state_dict") or {})  # every adapter tensor: the format accepts or refuses
    if not state:
        raise ConfigError(
            f"{path}: holds no LoRA tensors (keys denoiser.<module>.lora_A.default.weight); it is not a checkpoint of "
            "`lightning-lora fit`."
        )
    hparams = checkpoint.get("hyper_parameters") or {}
    try:
        trained_rank = common_rank(adapters_from_peft(state))
    except ValueError as e:
        raise ConfigError(f"{path}: its LoRA tensors are malformed ({first_line(e)}).") from None
    lora = LoraOptions.from_saved(hparams.get("lora"), trained_rank)
    family = _family(hparams.get("family"), path)
    denoiser_file = hparams.get("denoiser_file")
    info = {
        "family": family.name,
        "base_model": str(hparams.get("pretrained") or ""),
        "denoiser_file": Path(denoiser_file).name if denoiser_file else "",
        "steps": int(checkpoint.get("global_step", 0)),
        "checkpoint": path.name,
    }
    precision = training_precision(hparams.get("precision"))
    if precision:
        info["training_precision"] = precision
    if averaged:
        info["ema"] = averaged
    return CheckpointLora(state, lora, family, info)


def checkpoint_ema(
    checkpoint: Mapping[str, Any], path: Path, sigma_rel: float | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """The EMA of the LoRA a checkpoint of a run with a :class:`~lightning_lora.callbacks.ema.LoraEMA` holds (by the
    training model's parameter names), or with ``sigma_rel`` the power-function EMA of that width at the checkpoint's
    step, reconstructed from the run's snapshot files (written until that step) and the averages in the checkpoint
    (:func:`lightning_lora.ema.reconstruct`); and one line saying which. The snapshots are looked for where the run
    wrote them, else in the folder of that name beside the checkpoint's folder (a run folder that moved)."""
    from lightning_lora import ema
    from lightning_lora.callbacks.ema import STATE_KEY

    saved = (checkpoint.get("callbacks") or {}).get(STATE_KEY)
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{path}: holds no EMA of the LoRA (its run had no LoraEMA callback); export it without --ema and "
            "--ema-sigma-rel."
        )
    step, updates = int(saved["step"]), int(saved["step"]) - int(saved["start"])
    if sigma_rel is None:
        return dict(saved["average"]), f"EMA of decay {saved['decay']} at step {step}"
    ema.check_sigma_rel(sigma_rel, "--ema-sigma-rel")
    widths = [float(s) for s in saved["sigma_rels"]]
    if not widths or updates < 1:
        raise ConfigError(
            f"{path}: its run kept no power-function EMAs (LoraEMA.snapshot_every: 0) to reconstruct sigma_rel "
            f"{sigma_rel:g} from; export its EMA with --ema instead."
        )
    profiles = [ema.Profile(updates, s, state) for s, state in zip(widths, saved["power"], strict=True)]
    written = Path(str(saved["folder"]))
    folder = written if written.is_dir() else path.parent.parent / written.name
    for snapshot in (int(s) for s in saved["snapshots"]):
        if snapshot >= step:  # the checkpoint holds that step's averages
            continue
        file = folder / ema.snapshot_name(snapshot)
        if not file.is_file():
            raise ConfigError(
                f"--ema-sigma-rel: the run's EMA snapshot {file.name} is missing from {folder} (neither there nor "
                f"in {written}); the reconstruction needs every snapshot up to step {step}."
            )
        try:
            profiles += ema.read_snapshot(file)
        except ValueError as e:
            raise ConfigError(f"--ema-sigma-rel: {first_line(e)}") from None
    state, line = ema.reconstruct(profiles, updates, sigma_rel)
    return state, f"post-hoc EMA: {line}"


_UNSAVED_FAMILY = "flux"
"""The family of a checkpoint that saved none: ``LoraModule``'s default family (the only one of the first versions)."""


def _family(saved: Any, path: Path) -> DiffusionFamily:
    """The family saved as ``{"class_path": ..., "init_args": ...}`` (none saved: :data:`_UNSAVED_FAMILY`), looked up in
    the registry by its class path and built with its saved options when they are plain values and still valid, else
    with defaults: export needs the family's identity and layouts, which its training options do not change."""
    class_path = saved.get("class_path") if isinstance(saved, dict) else None
    if not class_path:
        return FAMILIES[_UNSAVED_FAMILY]()
    qualname = str(class_path).rsplit(".", 1)[-1]
    exact = [c for c in FAMILIES.values() if f"{c.__module__}.{c.__qualname__}" == class_path]
    matches = exact or [c for c in FAMILIES.values() if c.__qualname__ == qualname]
    if not matches:
        raise ConfigError(
            f"{path}: was trained with the model family {class_path!r}, which this version does not know "
            f"(it knows {', '.join(sorted(FAMILIES))})."
        )
    cls = matches[0]
    init_args = saved.get("init_args")
    parameters = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in init_args.items() if k in parameters} if isinstance(init_args, dict) else {}
    if all(_plain(v) for v in kwargs.values()):
        try:
            return cls(**kwargs)
        except (TypeError, ValueError):  # options of another version (ConfigError is a ValueError)
            pass
    return cls()


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
