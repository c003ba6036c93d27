"""Caching throughput: images per second through the real cache code path, with the real-size FLUX VAE.

What is measured (one JSON line on stdout):

* ``images_per_s``: the whole pipeline of ``lightning-lora cache`` for images that are not cached yet: JPEG
  decode + resize in DataLoader worker processes, upload, VAE encode in batches of one bucket, safetensors writes in
  two threads (:meth:`lightning_lora.data.cache.LatentCache.encode_latents`). Timed from the first decode to the
  last file written.
* ``vae_only_images_per_s``: the VAE encode alone, on pixels already on the device (the ceiling of the above).
* ``decode_only_images_per_s``: the decode workers alone (how many images per second the CPUs can feed).
* ``pipeline_efficiency`` = images_per_s / min(vae_only, decode_only): 1.0 means decoding and writing are fully
  hidden behind the encoder (or the other way round).

The VAE is FLUX.1-dev's (``AutoencoderKL``: 16 latent channels, block_out_channels (128, 256, 512, 512), two layers
per block, scaling 0.3611, shift 0.1159, no quant convs) with random weights (the same compute as the real one),
built directly on the device in ``--dtype``. Images are synthetic ``--size`` x ``--size`` JPEGs with photo-like
smooth content and grain, or the images of ``--images`` (a folder of your own photos).

    python dev/probes/bench_cache.py                              # GPU: 256 images of 1024x1024, bf16, batch 8
    python dev/probes/bench_cache.py --batch-size 16 --workers 12
    python dev/probes/bench_cache.py --tiny                       # CPU check: a small VAE, 16 images of 256x256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lightning_lora.data.buckets import BucketSpec
from lightning_lora.data.build import DataSpec, missing_jobs, plan
from lightning_lora.data.cache import ImageIndex, LatentCache, decode_loader
from lightning_lora.data.sources import ImageFolder, scan
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import FLUX1_VAE, Flux
from lightning_lora.precision import DTYPES

FLUX_VAE_CONFIG = {k: v for k, v in FLUX1_VAE.items() if k != "_class_name"}
TINY_VAE_CONFIG = {**FLUX_VAE_CONFIG, "block_out_channels": [32, 32, 64, 64], "layers_per_block": 1}


def build_vae(config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built directly in the benchmark dtype, on the device
    try:
        with torch.device(device):
            vae = AutoencoderKL(**config)
    finally:
        torch.set_default_dtype(default)
    return vae.eval().requires_grad_(False)


def synthetic_images(folder: Path, n: int, size: int, seed: int = 0) -> None:
    """Photo-like JPEGs: smooth random shapes plus grain (compress and decode like real photos, not like noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        coarse = rng.integers(0, 256, (max(2, size // 64), max(2, size // 64), 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
        grain = rng.integers(-12, 13, (size, size, 3), dtype=np.int16)
        pixels = np.clip(smooth + grain, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:05d}.jpg", quality=92)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vae_only(
    vae: torch.nn.Module, device: torch.device, size: int, batch: int, iters: int, channels_last: bool
) -> float:
    family = Flux()
    x = torch.rand(batch, 3, size, size, device=device) * 2 - 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    family.encode_images(vae, x)  # warm-up (kernel selection, allocator)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        family.encode_images(vae, x)
    _sync(device)
    return batch * iters / (time.perf_counter() - start)


def decode_only(jobs: list, batch: int, workers: int) -> float:
    start = time.perf_counter()
    count = sum(len(ok) for ok, _, _ in decode_loader(jobs, batch, workers))
    return count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small VAE on the CPU, small images: a quick check")
    parser.add_argument("--n", type=int, default=None, help="images (default 256; 16 with --tiny)")
    parser.add_argument("--size", type=int, default=None, help="synthetic image side (default 1024; 256 with --tiny)")
    parser.add_argument("--resolution", type=int, default=None, help="bucket resolution (default: --size)")
    parser.add_argument("--images", type=Path, default=None, help="a folder of real images instead of synthetic ones")
    parser.add_argument("--batch-size", type=int, default=None, help="images per VAE call (default 8; 4 with --tiny)")
    parser.add_argument("--workers", type=int, default=None, help="decode workers (default: min(8, CPU cores))")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu (always cpu for --tiny)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (fp32 with --tiny)")
    parser.add_argument("--channels-last", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA")
    parser.add_argument("--vae-iters", type=int, default=None, help="batches for the VAE-only figure (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    tiny = args.tiny
    n = args.n or (16 if tiny else 256)
    size = args.size or (256 if tiny else 1024)
    resolution = args.resolution or size
    batch = args.batch_size or (4 if tiny else 8)
    workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1)
    device = torch.device("cpu" if tiny else args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("fp32" if tiny or device.type == "cpu" else "bf16")]
    channels_last = {"auto": device.type == "cuda", "on": True, "off": False}[args.channels_last]

    with tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp:
        root = Path(tmp)
        folder = args.images or root / "images"
        t0 = time.perf_counter()
        if args.images is None:
            synthetic_images(folder, n, size)
        make_s = time.perf_counter() - t0
        vae = build_vae(TINY_VAE_CONFIG if tiny else FLUX_VAE_CONFIG, device, dtype)
        if channels_last:  # what encode_latents does to the VAE it loads itself
            vae = vae.to(memory_format=torch.channels_last)
        family = Flux()
        cache = LatentCache(root / "cache", family, ModelSource("bench/flux-vae-random-weights", dtype=dtype))
        items, _ = scan([ImageFolder(str(folder))], default_caption="a photo")
        items = items[:n]
        step = 64 if resolution % 64 == 0 else family.architecture.latent_divisor
        spec = DataSpec(BucketSpec((resolution,), step, min_resolution=step))
        entries, skips = plan(cache, items, spec, ImageIndex(cache.root))
        jobs, _ = missing_jobs(cache, entries)

        vae_rate = vae_only(vae, device, resolution, batch, args.vae_iters or (2 if tiny else 8), channels_last)
        decode_rate = decode_only(jobs, batch, workers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = cache.encode_latents(
            jobs, device, batch_size=batch, workers=workers, vae=vae, channels_last=channels_last
        )
        rate = result.encoded / result.seconds
        files = len(list((cache.root / "latents").glob("*.safetensors")))

    report = {
        "what": "cache_encode_throughput",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "vae": "tiny" if tiny else "flux1-dev-size (random weights)",
        "dtype": str(dtype).replace("torch.", ""),
        "channels_last": channels_last,
        "image_size": None if args.images else size,
        "bucket_resolution": resolution,
        "images": result.encoded,
        "skipped": len(skips) + len(result.skips),
        "latent_files": files,
        "batch_size": batch,
        "workers": workers,
        "seconds": round(result.seconds, 3),
        "images_per_s": round(rate, 2),
        "vae_only_images_per_s": round(vae_rate, 2),
        "decode_only_images_per_s": round(decode_rate, 2),
        "pipeline_efficiency": round(rate / min(vae_rate, decode_rate), 3),
        "peak_vram_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "synthetic_images_s": round(make_s, 1),
        "torch": torch.__version__,
    }
    line = json.dumps(report)
    print(line, flush=True)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return report


if __name__ == "__main__":
    main()
