"""Text-encoder memory while caching: FLUX.1-dev's CLIP-L + T5-XXL (4.7 B parameters) in bf16, NF4 and FP8.

``data.text_encoder_quantization`` stores the encoders' linear layers quantized while captions are encoded, so that
caching fits a small card. This measures, for each mode, with randomly initialised encoders of the real size (the
same shapes and memory as the real ones), through the code ``LatentCache.encode_texts`` runs
(:func:`~lightning_lora.data.cache.quantize_text_encoders`, ``.to(device)``, ``Flux.encode_prompts``):

* ``weights_GiB``: GPU memory after the encoders are on the device;
* ``peak_GiB``: peak allocated while encoding ``--batch`` captions at T5 length ``--tlen``;
* ``s_per_batch``: mean over ``--repeat`` batches after one warm-up;
* ``cosine_vs_bf16``: cosine similarity of the T5 embeddings to the bf16 encoders' (same weights), the mean over
  tokens, and its minimum (how far a quantized cache is from a bf16 one).

One JSON line per mode on stdout.

    python dev/probes/bench_text.py                       # GPU: real sizes, modes none nf4 fp8
    python dev/probes/bench_text.py --tiny --modes none fp8   # CPU check with small encoders
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

import torch

from lightning_lora.data.cache import quantize_text_encoders
from lightning_lora.families import encoders
from lightning_lora.families.flux import Flux
from lightning_lora.tiny.shared import CAPTION_WORDS, make_clip_tokenizer, make_t5_tokenizer

# google/t5-v1_1-xxl (FLUX.1-dev's text_encoder_2) and openai/clip-vit-large-patch14 (its text_encoder): the
# architectures the memory planner uses (lightning_lora.families.encoders).
T5_XXL = {
    k: v
    for k, v in encoders.T5_XXL.items()
    if k in ("d_model", "d_ff", "d_kv", "num_heads", "num_layers", "vocab_size")
}
CLIP_L = {
    k: v
    for k, v in encoders.CLIP_L.items()
    if k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
}
T5_TINY = dict(d_model=128, d_ff=256, d_kv=32, num_heads=4, num_layers=2, vocab_size=32128)
CLIP_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=2, vocab_size=49408)


def build_encoders(tiny: bool, dtype: torch.dtype) -> Any:
    """FLUX's text parts with random weights, on the CPU (as ``Flux.load_text_encoders`` leaves them)."""
    from diffusers import FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    t5_config = T5Config(
        **(T5_TINY if tiny else T5_XXL), feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False
    )
    clip_config = CLIPTextConfig(**(CLIP_TINY if tiny else CLIP_L), projection_dim=768, max_position_embeddings=77)
    encoders = []
    for cls, config in ((CLIPTextModel, clip_config), (T5EncoderModel, t5_config)):
        if cls is T5EncoderModel:  # 4.7 B parameters: skip the slow CPU initialisation, fill below
            with torch.device("meta"):
                model = cls(config)
            assert not list(model.buffers()), "to_empty would leave buffers uninitialised"
            model = model.to_empty(device="cpu")
        else:  # small, and its position_ids buffer must be real
            model = cls(config)
        model = model.to(dtype)
        # Random weights with the scale of trained ones (norms near one), drawn on the GPU when there is one: 4.7 B
        # draws on one CPU thread took most of call 11's time limit.
        where = "cuda" if torch.cuda.is_available() else "cpu"
        generator = torch.Generator(where).manual_seed(0)
        for p in model.parameters():
            values = torch.empty(p.shape, dtype=dtype, device=where).normal_(
                0.0, 0.02 if p.dim() > 1 else 0.1, generator=generator
            )
            p.data = (values + 1.0 if p.dim() == 1 else values).cpu()
        log(f"built {cls.__name__}")
        encoders.append(model.requires_grad_(False).eval())
    return FluxPipeline(
        scheduler=None,
        vae=None,
        text_encoder=encoders[0],
        tokenizer=make_clip_tokenizer(),
        text_encoder_2=encoders[1],
        tokenizer_2=make_t5_tokenizer(),
        transformer=None,
    )


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def captions(batch: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    words = list(CAPTION_WORDS)
    return [
        " ".join(words[int(i)] for i in torch.randint(len(words), (40,), generator=generator)) for _ in range(batch)
    ]


def measure(base: Any, mode: str, a: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], Any]:
    log(f"mode {mode}")
    encoders = copy.deepcopy(base)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    swapped = quantize_text_encoders(encoders, Flux.architecture.text_encoders, mode, device, torch.bfloat16)
    encoders = encoders.to(device)
    setup = time.perf_counter() - t0
    family = Flux(max_sequence_length=a.tlen)
    out: dict[str, Any] = {"mode": mode, "quantized_layers": swapped, "setup_s": round(setup, 1)}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["weights_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    family.encode_prompts(encoders, captions(a.batch, 0))  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(a.repeat):
        embeds = family.encode_prompts(encoders, captions(a.batch, i + 1))
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["s_per_batch"] = round((time.perf_counter() - t0) / a.repeat, 4)
    del encoders
    return out, embeds["prompt_embeds"].float().cpu()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["none", "nf4", "fp8"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tlen", type=int, default=512)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = build_encoders(a.tiny, torch.bfloat16)
    reference = None
    for mode in sorted(a.modes, key=lambda m: m != "none"):  # bf16 first: the others' embeddings are compared to it
        try:
            out, embeds = measure(base, mode, a, device)
        except Exception as e:  # one JSON line per mode, also when it fails
            out, embeds = {"mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}, None
        if embeds is not None and mode == "none":
            reference = embeds
        if embeds is not None and reference is not None and mode != "none":
            cosine = torch.nn.functional.cosine_similarity(embeds, reference, dim=-1)
            out["cosine_vs_bf16"] = round(float(cosine.mean()), 4)
            out["cosine_vs_bf16_min"] = round(float(cosine.min()), 4)
        out.update({"tool": "bench_text", "batch": a.batch, "tlen": a.tlen, "tiny": a.tiny})
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
