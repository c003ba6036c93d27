"""Names of a Stable Diffusion UNet in diffusers and in the original (LDM / SGM) checkpoints, and the map between them.

Why this exists
---------------
diffusers names a UNet by its structure (``down_blocks.1.attentions.0``); the original Stability AI code (``ldm`` for
SD1.x, ``sgm`` for SDXL) numbers a flat list of blocks (``input_blocks.4.1``). Single-file checkpoints
(``sd_xl_base_1.0.safetensors``, ComfyUI / A1111 downloads) use the original names, and so do kohya's sd-scripts
for SDXL LoRAs (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``; its SD1.x LoRAs use diffusers names,
because sd-scripts trains SD1.x on a diffusers-structured UNet).

The numbering, for ``n`` ResNets per level (``layers_per_block``) and ``L`` levels::

    conv_in                                   input_blocks.0.0
    down_blocks.i.resnets.j                   input_blocks.(1 + i(n+1) + j).0
    down_blocks.i.attentions.j                input_blocks.(1 + i(n+1) + j).1
    down_blocks.i.downsamplers.0.conv         input_blocks.(1 + i(n+1) + n).0.op          (i < L - 1)
    mid_block.resnets.0 / attentions.0 / resnets.1      middle_block.0 / .1 / .2
    up_blocks.i.resnets.j                     output_blocks.(i(n+1) + j).0                 (j <= n: one more)
    up_blocks.i.attentions.j                  output_blocks.(i(n+1) + j).1
    up_blocks.i.upsamplers.0.conv             output_blocks.(i(n+1) + n).2.conv, or .1.conv when level i has no
                                              attention
    time_embedding.linear_1 / linear_2        time_embed.0 / .2
    add_embedding.linear_1 / linear_2         label_emb.0.0 / .2   (SDXL's size/crop/pooled-text conditioning)
    conv_norm_out / conv_out                  out.0 / out.2

Inside a ResNet the layers are renamed (``norm1`` -> ``in_layers.0``, ``conv1`` -> ``in_layers.2``, ``time_emb_proj`` ->
``emb_layers.1``, ``norm2`` -> ``out_layers.0``, ``conv2`` -> ``out_layers.3``, ``conv_shortcut`` ->
``skip_connection``); inside an attention block (``Transformer2DModel`` / ``SpatialTransformer``) the names are the
same on both sides (``proj_in``, ``transformer_blocks.0.attn1.to_q``, ``ff.net.0.proj``, ...).

:data:`SDXL_LAYOUT` is the layout of every SDXL-architecture model (base 1.0 and its fine-tunes: n = 2, three levels,
attention on the lower two). The map is checked against diffusers' own single-file converter (the inverse direction)
in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SD15_LAYOUT", "SDXL_LAYOUT", "UNetLayout", "diffusers_to_ldm", "unet_state_dict_to_ldm"]

_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_TOP = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_BLOCK = re.compile(
    r"^(?P<side>down_blocks|up_blocks)\.(?P<i>\d+)\.(?P<kind>resnets|attentions|downsamplers|upsamplers)\.(?P<j>\d+)"
    r"(?:\.(?P<rest>.+))?$"
)
_MID = re.compile(r"^mid_block\.(?P<kind>resnets|attentions)\.(?P<j>\d+)(?:\.(?P<rest>.+))?$")


@dataclass(frozen=True)
class UNetLayout:
    """What the block numbering depends on: ResNets per level, and which levels have attention.

    Args:
        layers_per_block: ResNets per down level (up levels have one more).
        down_attention: per down level, whether it has attention blocks (``CrossAttnDownBlock2D``).
        up_attention: per up level, whether it has attention blocks (``CrossAttnUpBlock2D``).
    """

    layers_per_block: int
    down_attention: tuple[bool, ...]
    up_attention: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UNetLayout:
        """The layout of a diffusers ``UNet2DConditionModel`` config."""
        n = config["layers_per_block"]
        if not isinstance(n, int):
            raise ValueError(f"layers_per_block {n!r} differs per level; only one value per UNet is supported")
        return cls(
            layers_per_block=n,
            down_attention=tuple("CrossAttn" in t for t in config["down_block_types"]),
            up_attention=tuple("CrossAttn" in t for t in config["up_block_types"]),
        )

    @property
    def levels(self) -> int:
        return len(self.down_attention)


#: stabilityai/stable-diffusion-xl-base-1.0 and every model of its architecture.
SDXL_LAYOUT = UNetLayout(layers_per_block=2, down_attention=(False, True, True), up_attention=(True, True, False))
#: The SD1.x / SD2.x UNet.
SD15_LAYOUT = UNetLayout(
    layers_per_block=2, down_attention=(True, True, True, False), up_attention=(False, True, True, True)
)


def diffusers_to_ldm(module: str, layout: UNetLayout) -> str:
    """The original (LDM/SGM) name of the diffusers UNet module ``module`` (or parameter, e.g. ``conv_in.weight``).

    Raises ``KeyError`` for a name that is not part of a UNet of this ``layout``.
    """
    for diffusers_name, ldm_name in _TOP.items():
        if module == diffusers_name or module.startswith(diffusers_name + "."):
            return ldm_name + module[len(diffusers_name) :]
    n, levels = layout.layers_per_block, layout.levels
    match = _BLOCK.match(module)
    if match is not None:
        side, i, kind, j, rest = match["side"], int(match["i"]), match["kind"], int(match["j"]), match["rest"]
        attention = layout.down_attention if side == "down_blocks" else layout.up_attention
        resamplers = "downsamplers" if side == "down_blocks" else "upsamplers"
        layers = n if side == "down_blocks" else n + 1
        valid = (
            i < levels
            and (kind != "attentions" or attention[i])
            and (j < layers if kind in ("resnets", "attentions") else kind == resamplers and j == 0 and i < levels - 1)
        )
        if not valid:
            raise KeyError(f"{module}: not a module of a UNet with layout {layout}")
        if side == "down_blocks":
            if kind == "downsamplers":
                return f"input_blocks.{1 + i * (n + 1) + n}.0" + _sub(rest, {"conv": "op"})
            prefix = f"input_blocks.{1 + i * (n + 1) + j}.{0 if kind == 'resnets' else 1}"
        else:
            if kind == "upsamplers":
                return f"output_blocks.{i * (n + 1) + n}.{2 if attention[i] else 1}" + _sub(rest, {})
            prefix = f"output_blocks.{i * (n + 1) + j}.{0 if kind == 'resnets' else 1}"
        return prefix + _sub(rest, _RESNET if kind == "resnets" else {})
    match = _MID.match(module)
    if match is not None:
        kind, j, rest = match["kind"], int(match["j"]), match["rest"]
        if (kind == "resnets" and j > 1) or (kind == "attentions" and j > 0):
            raise KeyError(f"{module}: the middle block has two ResNets and one attention block")
        index = 1 if kind == "attentions" else 2 * j
        return f"middle_block.{index}" + _sub(rest, _RESNET if kind == "resnets" else {})
    raise KeyError(f"{module}: not a module of a diffusers UNet2DConditionModel")


def _sub(rest: str | None, renames: Mapping[str, str]) -> str:
    """``.rest`` with its first component renamed (``conv1.weight`` -> ``.in_layers.2.weight``)."""
    if rest is None:
        return ""
    head, _, tail = rest.partition(".")
    head = renames.get(head, head)
    return "." + head + ("." + tail if tail else "")


def unet_state_dict_to_ldm(
    state: Mapping[str, torch.Tensor], layout: UNetLayout, prefix: str = "model.diffusion_model."
) -> dict[str, torch.Tensor]:
    """A diffusers UNet state dict in the original checkpoint layout (``prefix`` + LDM name)."""
    return {prefix + diffusers_to_ldm(k, layout): v for k, v in state.items()}
