"""kohya / ComfyUI export: the fused BFL-layout LoRA is the same function as the peft LoRA it came from.

Three independent witnesses:

* diffusers' own kohya converter (``pipe.load_lora_weights`` on the kohya file) must give the transformer output of
  the in-memory peft model and of the diffusers-format file;
* merging the kohya file into the BFL weights the way ComfyUI does (``W += alpha / R * up @ down`` on the module named
  by ``lora_unet_<key with _>``), then converting back with :mod:`lightning_lora.formats.bfl`, must give the
  same output too (this also covers the global layers that diffusers' converter drops, see below);
* the math on small random tensors.

diffusers quirks (0.42.1) the tests work around, each scoped to the test that needs it:

* ``_convert_kohya_flux_lora_to_diffusers`` splits ``single_blocks.i.linear1``'s ``lora_up`` with the hard-coded
  FLUX.1 widths ``dims=[3072, 3072, 3072, 12288]`` and asserts they add up to its rows, so any narrower model fails.
  Everything else in it is width-agnostic (the qkv split is in thirds).
  :func:`helpers.diffusers_quirks.diffusers_kohya_reads_flux_widths` rebuilds that function from diffusers' own source
  with only that literal replaced by the widths the file has.
* It maps the non-block layers (``img_in``, ``txt_in``, ``time_in``, ``vector_in``, ``guidance_in``, ``final_layer``)
  to keys without the ``transformer.`` prefix, so they are silently not loaded (and ``final_layer`` ignores alpha).
  Our presets never target those layers; a test that does uses the BFL merge as witness instead of diffusers.

The ``lightning-lora export`` command (checkpoint to file) is tested in tests/cli/test_export_verb.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from helpers import ALPHA, RANK, diffusers_kohya_reads_flux_widths, lora_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from lightning_lora.export import export_lora, read_metadata
from lightning_lora.families.flux import Flux, latent_image_ids
from lightning_lora.formats.adapters import adapters_from_peft
from lightning_lora.formats.bfl import FluxDims, bfl_to_diffusers, diffusers_to_bfl, flux_lora_dims, flux_lora_slices
from lightning_lora.formats.kohya import fused_to_kohya, kohya_name
from lightning_lora.lora import LoraOptions, split_lora_state

INFO = {"family": "flux", "base_model": "tiny", "steps": 3}
flux_to_kohya = functools.partial(fused_to_kohya, slices=flux_lora_slices)  # FLUX's kohya names (its KohyaLayout)
INNER, MLP = 32, 128  # the tiny FLUX of lightning_lora.tiny.flux (dim64=False)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _inputs(config: object) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 16, config.in_channels, generator=g),  # type: ignore[attr-defined]
        "encoder_hidden_states": torch.randn(1, 5, config.joint_attention_dim, generator=g),  # type: ignore[attr-defined]
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=g),  # type: ignore[attr-defined]
        "timestep": torch.tensor([0.6]),
        "guidance": torch.tensor([3.5]),
        "txt_ids": torch.zeros(5, 3),
        "img_ids": latent_image_ids(8, 8),
    }


@torch.no_grad()
def _forward(transformer: torch.nn.Module) -> torch.Tensor:
    return transformer(**_inputs(transformer.config), return_dict=False)[0]


def _export_both(model: torch.nn.Module, folder: Path, targets: object) -> tuple[Path, Path]:
    state = get_peft_model_state_dict(model)
    lora = LoraOptions(rank=RANK, alpha=ALPHA, targets=targets)  # type: ignore[arg-type]
    diffusers_file = export_lora(
        state, folder / "d.safetensors", format="diffusers", lora=lora, family=Flux(), info=INFO
    )
    kohya_file = export_lora(state, folder / "k.safetensors", format="kohya", lora=lora, family=Flux(), info=INFO)
    return diffusers_file, kohya_file


def _loaded(model_dir: Path, lora_file: Path | None) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(model_dir)
    if lora_file is not None:
        pipe.load_lora_weights(lora_file)
    return pipe


# ------------------------------------------------------------------------------------------------ the math


def _delta(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], module: str, scale: float) -> torch.Tensor:
    a, b = pairs[module]
    return scale * b @ a


def test_fused_lora_is_the_same_delta_as_the_parts() -> None:
    g = torch.Generator().manual_seed(0)
    inner, mlp, alpha = 8, 20, 1.5  # alpha here: the scale peft applies (alpha / r)
    dims = FluxDims(inner, mlp)

    def pair(rank: int, out: int, fan_in: int = inner) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(rank, fan_in, generator=g), torch.randn(out, rank, generator=g)

    pairs = {
        "transformer_blocks.0.attn.to_q": pair(2, inner),
        "transformer_blocks.0.attn.to_v": pair(2, inner),  # k has no LoRA: zero rows in the middle
        "transformer_blocks.0.attn.add_k_proj": pair(2, inner),
        "single_transformer_blocks.1.proj_mlp": pair(2, mlp),  # only the MLP part of linear1
        "single_transformer_blocks.1.attn.to_k": pair(4, inner),  # another rank (a converted file): same scale
        "norm_out.linear": pair(2, 2 * inner),
        "transformer_blocks.0.ff.net.2": pair(2, inner, 4 * inner),
    }
    state = {f"{m}.lora_{p}.weight": t for m, (a, b) in pairs.items() for p, t in (("A", a), ("B", b))}
    assert flux_lora_dims(adapters_from_peft(state)) == dims
    kohya = flux_to_kohya(state, alpha)

    def fused(name: str) -> torch.Tensor:
        down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
        return kohya[f"{name}.alpha"] / down.shape[0] * up @ down

    zeros = torch.zeros(inner, inner)
    qkv = torch.cat(
        [
            _delta(pairs, "transformer_blocks.0.attn.to_q", alpha),
            zeros,
            _delta(pairs, "transformer_blocks.0.attn.to_v", alpha),
        ]
    )
    torch.testing.assert_close(fused("lora_unet_double_blocks_0_img_attn_qkv"), qkv)
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (4, inner)
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 4 * alpha  # alpha_fused / R = the scale
    txt = torch.cat([zeros, _delta(pairs, "transformer_blocks.0.attn.add_k_proj", alpha), zeros])
    torch.testing.assert_close(fused("lora_unet_double_blocks_0_txt_attn_qkv"), txt)
    linear1 = torch.cat(
        [
            zeros,
            _delta(pairs, "single_transformer_blocks.1.attn.to_k", alpha),
            zeros,
            _delta(pairs, "single_transformer_blocks.1.proj_mlp", alpha),
        ]
    )
    torch.testing.assert_close(fused("lora_unet_single_blocks_1_linear1"), linear1)
    assert kohya["lora_unet_single_blocks_1_linear1.lora_up.weight"].shape == (3 * inner + mlp, 6)
    # Unfused layers map one to one; the final modulation's output halves swap (BFL: shift, scale).
    torch.testing.assert_close(
        fused("lora_unet_double_blocks_0_img_mlp_2"), _delta(pairs, "transformer_blocks.0.ff.net.2", alpha)
    )
    norm = _delta(pairs, "norm_out.linear", alpha)
    torch.testing.assert_close(
        fused("lora_unet_final_layer_adaLN_modulation_1"), torch.cat([norm[inner:], norm[:inner]])
    )
    assert all(kohya[k].ndim == 0 and kohya[k].dtype == torch.float32 for k in kohya if k.endswith(".alpha"))
    assert set(kohya) == {
        f"{n}.{s}" for n in {k.split(".")[0] for k in kohya} for s in ("lora_down.weight", "lora_up.weight", "alpha")
    }

    # bf16 weights are the float32 ones rounded (the fusing only copies values); alpha stays exact.
    half = flux_to_kohya(state, alpha, dtype=torch.bfloat16)
    for key, value in kohya.items():
        expected = value if key.endswith(".alpha") else value.to(torch.bfloat16)
        assert half[key].dtype == expected.dtype and torch.equal(half[key], expected), key


def test_what_cannot_be_exported_is_named() -> None:
    a, b = torch.zeros(2, 8), torch.zeros(8, 2)
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        split_lora_state(
            {"x_embedder.lora_A.weight": a, "x_embedder.lora_B.weight": b, "x_embedder.lora_magnitude_vector": a}
        )
    with pytest.raises(ValueError, match="not both"):
        split_lora_state({"x_embedder.lora_A.weight": a})
    with pytest.raises(ValueError, match="do not form"):
        split_lora_state({"x_embedder.lora_A.weight": a, "x_embedder.lora_B.weight": a})
    with pytest.raises(ValueError, match="no kohya/ComfyUI name"):
        flux_to_kohya(
            {"transformer_blocks.0.attn.to_qq.lora_A.weight": a, "transformer_blocks.0.attn.to_qq.lora_B.weight": b},
            2.0,
        )
    state = {"x_embedder.lora_A.weight": a, "x_embedder.lora_B.weight": b}
    with pytest.raises(ValueError, match="rank 2 but the LoRA options say rank 4"):
        export_lora(
            state, "/nonexistent/x.safetensors", format="kohya", lora=LoraOptions(rank=4), family=Flux(), info={}
        )
    with pytest.raises(ValueError, match="'comfy' is not one of diffusers, kohya"):
        export_lora(
            state, "/nonexistent/x.safetensors", format="comfy", lora=LoraOptions(rank=2), family=Flux(), info={}
        )  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ against diffusers


@pytest.fixture(scope="module")
def all_linear(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, Path]:
    """The all_linear LoRA, exported in both formats."""
    model = lora_model(Flux(), tiny_flux_dir, "all_linear")
    return (model, *_export_both(model, tmp_path_factory.mktemp("all_linear"), "all_linear"))


def test_kohya_file_keys_and_metadata(all_linear: tuple[torch.nn.Module, Path, Path]) -> None:
    _, diffusers_file, kohya_file = all_linear
    tensors = load_file(kohya_file)
    names = {k.split(".")[0] for k in tensors}
    per_double = (
        "img_attn_qkv",
        "img_attn_proj",
        "txt_attn_qkv",
        "txt_attn_proj",
        "img_mlp_0",
        "img_mlp_2",
        "txt_mlp_0",
        "txt_mlp_2",
    )
    expected = {f"lora_unet_double_blocks_{i}_{m}" for i in range(2) for m in per_double}
    expected |= {f"lora_unet_single_blocks_{i}_{m}" for i in range(2) for m in ("linear1", "linear2")}
    assert names == expected
    qkv = "lora_unet_double_blocks_1_img_attn_qkv"
    assert tensors[f"{qkv}.lora_down.weight"].shape == (3 * RANK, INNER)
    assert tensors[f"{qkv}.lora_up.weight"].shape == (3 * INNER, 3 * RANK)
    assert tensors[f"{qkv}.alpha"].item() == 3 * ALPHA
    up = tensors["lora_unet_single_blocks_0_linear1.lora_up.weight"]
    assert up.shape == (3 * INNER + MLP, 4 * RANK)
    assert not up[:INNER, RANK:].any() and not up[3 * INNER :, : 3 * RANK].any()  # block-diagonal
    assert tensors["lora_unet_single_blocks_0_linear2.lora_down.weight"].shape == (RANK, INNER + MLP)
    assert tensors["lora_unet_single_blocks_0_linear2.alpha"].item() == ALPHA

    meta = read_metadata(kohya_file)
    assert meta["ss_network_module"] == "networks.lora_flux"
    assert (meta["ss_network_dim"], float(meta["ss_network_alpha"])) == (str(RANK), ALPHA)
    assert meta["ss_base_model_version"] == "flux1"
    assert meta["modelspec.architecture"] == "flux-1-dev/lora"
    assert meta["lightning_lora.format"] == "kohya" and json.loads(meta["lightning_lora.steps"]) == 3
    assert "lora_adapter_metadata" not in meta  # diffusers would apply alpha a second time
    adapter = json.loads(read_metadata(diffusers_file)["lora_adapter_metadata"])
    assert (adapter["transformer.r"], adapter["transformer.lora_alpha"]) == (RANK, RANK)  # the scale is in lora_B
    assert json.loads(meta["lightning_lora.module_ranks"])["lora_unet_double_blocks_1_img_attn_qkv"] == 3 * RANK


@pytest.mark.parametrize(
    "targets",
    [
        "all_linear",
        "attention",
        ["to_q", "to_k"],
        ["add_v_proj", "proj_mlp", "to_add_out", "norm1_context.linear", "norm.linear"],
    ],
    ids=["all_linear", "attention", "q_k_only", "mixed"],
)
def test_kohya_and_diffusers_files_load_the_same_lora(
    tiny_flux_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, targets: str | list[str], all_linear: tuple
) -> None:
    if targets == "all_linear":
        model, diffusers_file, kohya_file = all_linear
    else:
        model = lora_model(Flux(), tiny_flux_dir, targets, seed=1)
        diffusers_file, kohya_file = _export_both(model, tmp_path, targets)
    expected = _forward(model)
    base = _forward(_loaded(tiny_flux_dir, None).transformer)
    assert (expected - base).abs().max() > 1e-2  # a wrong scale or a dropped layer would show
    from_diffusers = _forward(_loaded(tiny_flux_dir, diffusers_file).transformer)
    torch.testing.assert_close(from_diffusers, expected, atol=1e-5, rtol=1e-5)
    diffusers_kohya_reads_flux_widths(monkeypatch)
    from_kohya = _forward(_loaded(tiny_flux_dir, kohya_file).transformer)
    torch.testing.assert_close(from_kohya, expected, atol=1e-5, rtol=1e-5)


def test_two_step_images_agree(
    tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, all_linear: tuple[torch.nn.Module, Path, Path]
) -> None:
    _, diffusers_file, kohya_file = all_linear
    diffusers_kohya_reads_flux_widths(monkeypatch)
    kwargs = {"prompt": "a photo of sks cat", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "pt"}
    images = [
        _loaded(tiny_flux_dir, f)(generator=torch.Generator().manual_seed(0), max_sequence_length=16, **kwargs).images
        for f in (None, diffusers_file, kohya_file)
    ]
    base, from_diffusers, from_kohya = images
    torch.testing.assert_close(from_kohya, from_diffusers, atol=1e-5, rtol=1e-5)
    assert (from_kohya - base).abs().max() > 1e-3


def test_kohya_file_merged_into_bfl_weights(tiny_flux_dir: Path, tmp_path: Path) -> None:
    """Apply the file the way ComfyUI does, on the BFL layout; this also covers layers diffusers' loader drops."""
    targets = [
        "x_embedder",
        "context_embedder",
        "guidance_embedder.linear_2",
        "norm_out.linear",
        "proj_out",
        "to_v",
        "proj_mlp",
    ]
    model = lora_model(Flux(), tiny_flux_dir, targets, seed=2)
    _, kohya_file = _export_both(model, tmp_path, targets)
    base = FluxPipeline.from_pretrained(tiny_flux_dir).transformer
    bfl = diffusers_to_bfl(base.state_dict())
    by_kohya_name = {kohya_name(k.removesuffix(".weight")): k for k in bfl if k.endswith(".weight")}
    tensors = load_file(kohya_file)
    for name in {k.split(".")[0] for k in tensors}:
        down, up, alpha = (tensors[f"{name}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha"))
        bfl[by_kohya_name[name]] = bfl[by_kohya_name[name]] + alpha / down.shape[0] * up @ down
    assert "lora_unet_final_layer_adaLN_modulation_1" in {k.split(".")[0] for k in tensors}
    base.load_state_dict(bfl_to_diffusers(bfl))
    torch.testing.assert_close(_forward(base), _forward(model), atol=1e-5, rtol=1e-5)
