"""Families own their interop: which LoRA file formats they write (kohya through the family object, never by name),
export takes the options and the family, a checkpoint gives them back, and a variant a format cannot hold is refused.

Everything here runs on small random tensors and crafted checkpoints: no model is loaded.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.cli.export import main as export_main
from lightning_lora.errors import ConfigError
from lightning_lora.export import checkpoint_lora, export_lora, read_metadata
from lightning_lora.families import FAMILIES, SD15, SDXL, DiffusionFamily, Flux
from lightning_lora.formats import FORMATS, VARIANTS, kohya
from lightning_lora.formats.bfl import flux_lora_slices
from lightning_lora.formats.diffusers import DiffusersLayout
from lightning_lora.formats.ldm import SDXL_LAYOUT
from lightning_lora.lora import LoraOptions, peft_config

RANK = 4


def _state(modules: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """A peft state dict: ``{module: (in, out)}`` -> rank-4 ``lora_A`` / ``lora_B`` of random values."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (fan_in, fan_out) in modules.items():
        state[f"{module}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g)
        state[f"{module}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g)
    return state


FLUX_STATE = {"transformer_blocks.0.attn.to_q": (8, 8), "transformer_blocks.0.attn.to_v": (8, 8)}
UNET_STATE = {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": (16, 16)}


class NoKohya(Flux):
    """A family with no kohya layout: FLUX's diffusers layout alone (not registered: ``name`` is set after the class is
    made)."""

    lora_files = replace(Flux.lora_files, layouts=(DiffusersLayout("transformer"),))


NoKohya.name = "nokohya"


# ------------------------------------------------------------------------------------------------ the families


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_declares_its_formats_and_text_encoders(name: str) -> None:
    cls = FAMILIES[name]
    formats = cls.lora_files.formats
    assert "diffusers" in formats and set(formats) <= set(FORMATS) and len(set(formats)) == len(formats)
    family = cls()
    assert all(family.lora_layout(f) is layout for f, layout in zip(formats, cls.lora_files.layouts, strict=True))
    assert family.lora_layout("diffusers").prefix == cls.architecture.denoiser_subfolder  # type: ignore[attr-defined]
    assert cls.lora_files.modelspec and set(cls.lora_files.modelspec) == {"architecture", "implementation"}
    assert cls.architecture.text_encoders and all(e.startswith("text_encoder") for e in cls.architecture.text_encoders)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_recognised_by_the_header_it_writes(name: str) -> None:
    """A LoRA file made elsewhere is read as the family whose markers its header holds: the ModelSpec architecture
    every family writes, and the ``ss_base_model_version`` of its kohya files, pick that family and no other (each
    family is asked, :func:`export._family_of`)."""
    from lightning_lora.export import _claimed

    cls = FAMILIES[name]
    headers = [{"modelspec.architecture": cls.lora_files.modelspec["architecture"]}]
    headers += [{"ss_base_model_version": layout.network.base_model_version} for layout in cls.lora_files.layouts
                if isinstance(layout, kohya.KohyaLayout)]  # fmt: skip
    for header in headers:
        assert _claimed({c: c.claims_lora_metadata(header) for c in FAMILIES.values()}) is cls, header
    assert cls.claims_lora_metadata({"modelspec.architecture": "some-other-model/lora"}) == 0


FLUX_KOHYA = functools.partial(kohya.fused_to_kohya, slices=flux_lora_slices)
SDXL_KOHYA = functools.partial(kohya.unet_to_kohya, layout=SDXL_LAYOUT)


@pytest.mark.parametrize(
    ("family", "modules", "convert", "network"),
    [
        (Flux(), FLUX_STATE, FLUX_KOHYA, kohya.KohyaNetwork("networks.lora_flux", "flux1")),
        (SDXL(), UNET_STATE, SDXL_KOHYA, kohya.KohyaNetwork("networks.lora", "sdxl_base_v1-0")),
        (SD15(), UNET_STATE, kohya.unet_to_kohya, kohya.KohyaNetwork("networks.lora", "sd_v1")),
    ],
    ids=["flux", "sdxl", "sd15"],
)
def test_kohya_export_is_the_family_layout(
    tmp_path: Path, family: DiffusionFamily, modules: dict, convert: object, network: kohya.KohyaNetwork
) -> None:
    state = _state(modules)
    path = export_lora(
        state,
        tmp_path / "k.safetensors",
        format="kohya",
        lora=LoraOptions(rank=RANK, alpha=2.0),
        family=family,
        info={},
    )
    expected = convert(state, 2.0 / RANK)  # type: ignore[operator]  # the scale alpha / rank
    written = load_file(path)
    assert written.keys() == expected.keys() and all(torch.equal(written[k], v) for k, v in expected.items())
    meta = read_metadata(path)
    summary = kohya.NetworkSummary(
        RANK, 2.0, output_name="k", module_ranks=json.loads(meta.get("lightning_lora.module_ranks", "{}"))
    )
    assert kohya.kohya_metadata(summary, network).items() <= meta.items()
    assert meta["ss_network_module"] == network.network_module and meta["ss_output_name"] == "k"
    assert "lora_adapter_metadata" not in meta


def test_export_asks_the_family_object_not_its_name(tmp_path: Path) -> None:
    """An SD1.5-named family whose kohya layout is SDXL's: the file follows the object (a name lookup would not)."""

    class SD15WithSGMNames(SD15):
        sgm = replace(SD15.lora_files.layouts[1], to_kohya=SDXL_KOHYA)  # type: ignore[type-var]
        lora_files = replace(SD15.lora_files, layouts=(SD15.lora_files.layouts[0], sgm))

    assert SD15WithSGMNames.name == "sd15" and FAMILIES["sd15"] is SD15  # not registered over SD1.5
    state = _state(UNET_STATE)
    lora = LoraOptions(rank=RANK)
    names = {}
    for family in (SD15(), SD15WithSGMNames()):
        path = export_lora(state, tmp_path / "k.safetensors", format="kohya", lora=lora, family=family, info={})
        names[type(family).__name__] = {k.split(".")[0] for k in load_file(path)}
    assert names["SD15"] == {"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"}
    assert names["SD15WithSGMNames"] == {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"}


def test_a_family_without_a_kohya_layout_refuses_clearly(tmp_path: Path) -> None:
    family, state = NoKohya(), _state(FLUX_STATE)
    message = "--format kohya: there is no kohya layout for the 'nokohya' family yet; use --format diffusers."
    path = tmp_path / "k.safetensors"
    with pytest.raises(ConfigError) as refused:
        export_lora(state, path, format="kohya", lora=LoraOptions(rank=RANK), family=family, info={})
    assert str(refused.value) == message
    assert not path.exists()
    # Asked for the layout directly, the family refuses the same way.
    with pytest.raises(ConfigError, match="use --format diffusers"):
        family.lora_layout("kohya")
    # The diffusers format needs nothing of the family but its denoiser subfolder.
    path = export_lora(state, path, format="diffusers", lora=LoraOptions(rank=RANK), family=family, info={})
    assert set(load_file(path)) == {f"transformer.{k}" for k in state}
    # The export callback refuses the format at setup, not after training.
    module = SimpleNamespace(family=family)
    with pytest.raises(ConfigError, match=r"LoraExport\.formats: there is no kohya layout for the 'nokohya' family"):
        LoraExport(formats=["diffusers", "kohya"]).setup(None, module, "fit")  # type: ignore[arg-type]
    LoraExport(formats=["diffusers"]).setup(None, module, "fit")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the options


@pytest.mark.parametrize("family", [Flux(), SDXL()], ids=["flux", "sdxl"])
def test_export_takes_the_options_and_the_family(tmp_path: Path, family: DiffusionFamily) -> None:
    state = _state(FLUX_STATE if isinstance(family, Flux) else UNET_STATE)
    lora = LoraOptions(rank=RANK, alpha=None, targets=["to_q"], dropout=0.25, init="kaiming")  # alpha null: rank
    path = export_lora(state, tmp_path / "d.safetensors", format="diffusers", lora=lora, family=family, info={"a": 1})
    prefix = family.architecture.denoiser_subfolder
    assert set(load_file(path)) == {f"{prefix}.{k}" for k in state}
    meta = read_metadata(path)
    assert (meta["lightning_lora.rank"], meta["lightning_lora.alpha"]) == ("4", "4.0")
    assert json.loads(meta["lightning_lora.targets"]) == ["to_q"] and meta["lightning_lora.a"] == "1"
    adapter = json.loads(meta["lora_adapter_metadata"])
    assert all(k.startswith(f"{prefix}.") for k in adapter)
    reference = peft_config(lora, "x").to_dict()  # the one peft config of these options
    for field in ("r", "lora_alpha", "init_lora_weights"):
        assert adapter[f"{prefix}.{field}"] == reference[field], field
    # Dropout is for training: a file that kept it would make diffusers drop LoRA inputs at random at inference.
    assert adapter[f"{prefix}.lora_dropout"] == 0.0
    assert adapter[f"{prefix}.lora_alpha"] == 4.0 and adapter[f"{prefix}.init_lora_weights"] is True


def _checkpoint(path: Path, state: dict[str, torch.Tensor], hparams: dict | None = None) -> Path:
    """A checkpoint shaped like those of ``lightning-lora fit`` (model, loops, optimizer state; LoRA tensors only)."""
    checkpoint = {
        "state_dict": {f"denoiser.{k}": v for k, v in state.items()},
        "loops": {},
        "optimizer_states": [],
        "global_step": 3,
        "hyper_parameters": hparams if hparams is not None else {},
    }
    torch.save(checkpoint, path)
    return path


def _peft_to_module_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft state-dict keys -> the training model's parameter names (adapter ``default``)."""
    return {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
        for k, v in state.items()
    }


def test_checkpoint_gives_the_options_and_the_family(tmp_path: Path) -> None:
    trained = _peft_to_module_keys(_state(UNET_STATE))
    family = {"class_path": "lightning_lora.families.sd15.SD15", "init_args": {"clip_skip": 1, "noise_offset": 0.1}}
    lora = {"rank": RANK, "alpha": None, "targets": "locon", "dropout": 0.0, "init": "gaussian"}
    hparams = {"family": family, "lora": lora, "pretrained": "/models/sd15", "denoiser_file": "/a/b/unet.safetensors"}
    state, options, sd15, info = checkpoint_lora(_checkpoint(tmp_path / "a.ckpt", trained, hparams))
    assert set(state) == {f"{m}.lora_{p}.weight" for m in UNET_STATE for p in "AB"}
    assert options == LoraOptions(rank=RANK, alpha=None, targets="locon")
    assert type(sd15) is SD15 and (sd15.clip_skip, sd15.noise_offset) == (1, 0.1)
    assert info == {
        "family": "sd15",
        "base_model": "/models/sd15",
        "denoiser_file": "unet.safetensors",
        "steps": 3,
        "checkpoint": "a.ckpt",
    }

    # The short class path of a YAML; options this version refuses: the family with its defaults.
    hparams["family"] = {"class_path": "lightning_lora.families.SDXL", "init_args": {"noise_offset": -1.0}}
    sdxl = checkpoint_lora(_checkpoint(tmp_path / "b.ckpt", trained, hparams)).family
    assert type(sdxl) is SDXL and sdxl.noise_offset == 0.0
    # No family saved: FLUX, the default of lightning-lora fit; no LoRA options saved: the rank of the tensors.
    flux_state = _peft_to_module_keys(_state(FLUX_STATE))
    _, options, flux, _ = checkpoint_lora(_checkpoint(tmp_path / "c.ckpt", flux_state))
    assert type(flux) is Flux and options.rank == RANK
    hparams["family"] = {"class_path": "my_package.Wan22"}
    with pytest.raises(ConfigError, match=r"d\.ckpt: was trained with the model family 'my_package\.Wan22'"):
        checkpoint_lora(_checkpoint(tmp_path / "d.ckpt", trained, hparams))


# ------------------------------------------------------------------------------------------------ the variants


def test_every_format_says_which_variants_it_holds() -> None:
    assert set(VARIANTS) == set(FORMATS) and all("LoRA" in v for v in VARIANTS.values())


def _loha_state(modules: dict[str, tuple[int, int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoHa peft state dict: ``{module: (in, out)}`` -> rank-4 ``hada_w1_a/_b``, ``hada_w2_a/_b``."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (fan_in, fan_out) in modules.items():
        for i in (1, 2):
            state[f"{module}.hada_w{i}_a"] = torch.randn(fan_out, RANK, generator=g)
            state[f"{module}.hada_w{i}_b"] = torch.randn(RANK, fan_in, generator=g)
    return state


def test_variant_checkpoints_through_the_export_command(tmp_path: Path, capsys) -> None:
    """DoRA exports in both formats; LoHa, which diffusers cannot load, is refused by the diffusers format (exit 2,
    one line naming LoHa, the format and the format that holds it) and written in the kohya one."""
    hparams = {"family": {"class_path": "lightning_lora.families.flux.Flux", "init_args": {}}}
    trained = _peft_to_module_keys(_state(FLUX_STATE))
    magnitudes = {f"{m}.lora_magnitude_vector.default.weight": torch.rand(8) + 1 for m in FLUX_STATE}
    dora = _checkpoint(
        tmp_path / "dora.ckpt", {**trained, **magnitudes}, {**hparams, "lora": {"rank": RANK, "variant": "dora"}}
    )
    for fmt in Flux.lora_files.formats:
        out = tmp_path / f"dora_{fmt}.safetensors"
        assert export_main([str(dora), "--format", fmt, "--out", str(out)]) == 0, capsys.readouterr().err
        assert read_metadata(out)["lightning_lora.variant"] == "DoRA"
    capsys.readouterr()

    loha = {f"denoiser.{k}.default": v for k, v in _loha_state(FLUX_STATE).items()}
    checkpoint = tmp_path / "loha.ckpt"
    torch.save(
        {
            "state_dict": loha,
            "loops": {},
            "optimizer_states": [],
            "global_step": 3,
            "hyper_parameters": {**hparams, "lora": {"rank": RANK, "variant": "loha"}},
        },
        checkpoint,
    )
    out = tmp_path / "out" / "lora.safetensors"
    out.parent.mkdir()
    assert export_main([str(checkpoint), "--format", "diffusers", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--format diffusers: the LoRA is a LoHa adapter" in err and "hada_w1_a" in err
    assert "a diffusers file holds LoRA and DoRA only" in err and "Export it with --format kohya" in err
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert export_main([str(checkpoint), "--format", "kohya", "--out", str(out)]) == 0
    assert "lora_unet_double_blocks_0_img_attn_qkv.hada_w1_a" in load_file(out)


def test_mixed_dora_and_lora_layers_are_refused_by_the_diffusers_format(tmp_path: Path) -> None:
    state = _state(FLUX_STATE)
    state["transformer_blocks.0.attn.to_q.lora_magnitude_vector"] = torch.ones(8)
    with pytest.raises(ValueError, match="some layers are DoRA and others plain LoRA"):
        export_lora(
            state, tmp_path / "d.safetensors", format="diffusers", lora=LoraOptions(rank=RANK), family=Flux(), info={}
        )
