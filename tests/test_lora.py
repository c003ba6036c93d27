"""The adapter's names: one parser for parameter names, checkpoint keys and peft state-dict keys; variants are the
adapter's and are refused by name where a format holds plain LoRA only."""

from __future__ import annotations

import pytest
import torch

from lightning_lora.lora import AdapterKey, adapter_state, is_adapter_param, parse_key, split_lora_state


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "transformer_blocks.0.attn.to_q.lora_A.default.weight",
            ("transformer_blocks.0.attn.to_q", "lora_A", "default"),
        ),
        ("denoiser.blocks.0.attn.to_q.lora_B.default.weight", ("blocks.0.attn.to_q", "lora_B", "default")),
        ("down_blocks.1.attentions.0.proj_in.lora_A.weight", ("down_blocks.1.attentions.0.proj_in", "lora_A", None)),
        (
            "denoiser.s.3.proj_out.lora_magnitude_vector.default.weight",
            ("s.3.proj_out", "lora_magnitude_vector", "default"),
        ),
        ("single_blocks.3.proj_out.lora_magnitude_vector", ("single_blocks.3.proj_out", "lora_magnitude_vector", None)),
        ("denoiser.blocks.0.to_q.lokr_w1.default", ("blocks.0.to_q", "lokr_w1", "default")),
        ("blocks.0.to_q.hada_w2_b", ("blocks.0.to_q", "hada_w2_b", None)),
    ],
)
def test_one_parser_for_every_spelling(key: str, expected: tuple) -> None:
    parsed = parse_key(key)
    assert parsed == AdapterKey(*expected)
    assert is_adapter_param(key)


@pytest.mark.parametrize("key", ["transformer_blocks.0.attn.to_q.weight", "denoiser.norm_out.linear.bias", "lora"])
def test_base_weights_are_not_the_adapters(key: str) -> None:
    assert parse_key(key) is None and not is_adapter_param(key)


def test_variants_are_named() -> None:
    assert parse_key("a.lora_A.weight").variant == "LoRA"
    assert parse_key("a.lora_magnitude_vector").variant == "DoRA"
    assert parse_key("a.lokr_w1").variant == "LoKr"
    assert parse_key("a.hada_w1_a").variant == "LoHa"


def test_a_checkpoint_state_becomes_peft_keys_with_every_adapter_tensor() -> None:
    a, b, m = torch.ones(2, 4), torch.ones(8, 2), torch.ones(8)
    state = adapter_state(
        {
            "denoiser.x.to_q.lora_A.default.weight": a,
            "denoiser.x.to_q.lora_B.default.weight": b,
            "denoiser.x.to_q.lora_magnitude_vector.default.weight": m,
            "denoiser.x.to_q.weight": torch.zeros(8, 4),  # a base weight (never in our checkpoints, ignored)
        }
    )
    assert state.keys() == {"x.to_q.lora_A.weight", "x.to_q.lora_B.weight", "x.to_q.lora_magnitude_vector"}
    # A plain-LoRA format refuses the DoRA magnitude by name instead of dropping it.
    with pytest.raises(ValueError, match="is a DoRA tensor"):
        split_lora_state(state)
    assert set(split_lora_state({k: v for k, v in state.items() if "magnitude" not in k})) == {"x.to_q"}
