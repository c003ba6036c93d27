"""dev/probes/ref_sd15.py: the plain recipe's loop for SD1.5 trains peft's LoRA on the four attention projections
only."""

from __future__ import annotations

import math

import ref_sd15
import torch


def test_the_lora_is_on_the_four_attention_projections_and_a_step_trains_it() -> None:
    a = ref_sd15.parse(["--tiny", "--opt", "adamw", "--h", "64", "--w", "64", "--rank", "4"])
    model, cfg = ref_sd15.build_unet(True, "cpu", torch.bfloat16)
    assert cfg["cross_attention_dim"] == 32 and cfg["down_block_types"][0] == "CrossAttnDownBlock2D"
    params = ref_sd15.add_lora(model, a.rank)
    wrapped = {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.requires_grad}
    # every trainable tensor is a lora_A / lora_B of one of the four projections, in float32
    assert wrapped and all(n.split(".lora_")[0].endswith(tuple(ref_sd15.TARGETS)) for n in wrapped)
    assert {p.dtype for p in params} == {torch.float32}
    targets = tuple(ref_sd15.TARGETS)
    projections = [m for n, m in model.named_modules() if n.endswith(targets) and hasattr(m, "base_layer")]
    expected = sum(a.rank * (m.base_layer.in_features + m.base_layer.out_features) for m in projections)
    assert sum(p.numel() for p in params) == expected
    before = [p.detach().clone() for p in params]
    step = ref_sd15.make_step(model, torch.optim.AdamW(params, lr=1e-2), cfg, a, "cpu")
    loss = step()
    assert math.isfinite(float(loss))
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))  # the optimizer moved the LoRA
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_the_command_prints_the_reference_recipes_keys(capsys) -> None:
    ref_sd15.main(["--tiny", "--opt", "adamw", "--h", "64", "--w", "64", "--steps", "1", "--warm", "1", "--gc", "1"])
    import json

    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "error" not in out, out
    assert out["mode"] == "sd15-bf16" and out["gc"] == 1 and out["s_per_step"] > 0
    assert out["lora_params_M"] > 0 and math.isfinite(out["loss"])
