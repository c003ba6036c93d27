"""The tiny random FLUX pipeline: deterministic, offline, and a faithful diffusers folder after save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline

from lightning_lora.tiny.flux import build_tiny_flux, save_tiny_flux
from lightning_lora.tiny.shared import CAPTION_WORDS, build_clip_tokenizer, build_t5_tokenizer

CAPTION = "a photo of sks person, astronaut with a coffee cup"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)


def _sample(pipe: FluxPipeline) -> torch.Tensor:
    out = pipe(
        CAPTION,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=64,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    return out.images


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("dim64", [False, True])
def test_build_shapes_and_modes(dim64: bool) -> None:
    # (No wall-clock bound here: on a loaded 2-core CI machine a 0.5 s bound failed at 0.88 s.)
    pipe = build_tiny_flux(dim64=dim64)

    assert pipe.vae_scale_factor == 8
    assert pipe.transformer.config.in_channels == (64 if dim64 else 16) == 4 * pipe.vae.config.latent_channels
    assert pipe.transformer.config.guidance_embeds is True
    assert pipe.tokenizer.model_max_length == 77
    assert pipe.text_encoder_2.config.dropout_rate == 0
    sched = pipe.scheduler.config
    assert (sched.shift, sched.use_dynamic_shifting, sched.base_shift, sched.max_shift) == (3.0, True, 0.5, 1.15)
    assert (sched.base_image_seq_len, sched.max_image_seq_len) == (256, 4096)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name)
        assert not any(m.training for m in module.modules()), name
        assert all(p.dtype == torch.float32 for p in module.parameters()), name
    if dim64:
        for name in ("transformer", "text_encoder", "text_encoder_2"):
            linears = [m for m in getattr(pipe, name).modules() if isinstance(m, torch.nn.Linear)]
            assert linears and all(m.in_features % 64 == 0 for m in linears), name
    assert build_tiny_flux(guidance_embeds=False).transformer.config.guidance_embeds is False


def test_weights_are_seeded_and_leave_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_flux(seed=0)
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG stream is untouched
    b = build_tiny_flux(seed=0)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        _assert_same_state(getattr(a, name), getattr(b, name))
    c = build_tiny_flux(seed=1)
    assert not torch.equal(a.transformer.x_embedder.weight, c.transformer.x_embedder.weight)


def test_tokenizers_are_identical_across_builds(tmp_path: Path) -> None:
    clip_a, clip_b = build_clip_tokenizer(tmp_path / "clip_a"), build_clip_tokenizer(tmp_path / "clip_b")
    t5_a, t5_b = build_t5_tokenizer(tmp_path / "t5_a"), build_t5_tokenizer(tmp_path / "t5_b")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        assert (tmp_path / "clip_a" / name).read_bytes() == (tmp_path / "clip_b" / name).read_bytes()
    assert (tmp_path / "t5_a/tokenizer.json").read_bytes() == (tmp_path / "t5_b/tokenizer.json").read_bytes()
    assert clip_a(CAPTION).input_ids == clip_b(CAPTION).input_ids
    assert t5_a(CAPTION).input_ids == t5_b(CAPTION).input_ids

    # Pinned ids: they must not change between processes, runs or machines (tokenizer trainers would reorder them).
    clip_ids = [320, 518, 519, 545, 553, 267, 531, 562, 320, 536, 538]  # 320 = "a</w>", as in real CLIP
    assert clip_a(CAPTION, add_special_tokens=False).input_ids == clip_ids
    assert t5_a(CAPTION).input_ids == [98, 101, 102, 109, 111, 77, 105, 115, 98, 106, 107, 1]
    assert clip_a(CAPTION).input_ids == [clip_a.bos_token_id, *clip_ids, clip_a.eos_token_id]
    assert clip_a.pad_token_id == clip_a.eos_token_id
    assert (t5_a.pad_token_id, t5_a.eos_token_id, t5_a.unk_token_id) == (0, 1, 2)

    # Every built-in word is one token, with or without a leading space.
    for word in CAPTION_WORDS:
        assert len(clip_a(word, add_special_tokens=False).input_ids) == 1, word
        assert len(t5_a(word, add_special_tokens=False).input_ids) == 1, word
    # The in-pipeline (in-memory) tokenizers agree with the saved/loaded ones.
    pipe = build_tiny_flux()
    assert pipe.tokenizer(CAPTION).input_ids == clip_a(CAPTION).input_ids
    assert pipe.tokenizer_2(CAPTION).input_ids == t5_a(CAPTION).input_ids


def test_save_load_round_trip(tmp_path: Path) -> None:
    folder = save_tiny_flux(tmp_path / "tiny-flux")
    assert folder == tmp_path / "tiny-flux" and (folder / "model_index.json").is_file()
    assert not list(tmp_path.glob(".tiny-flux.tmp-*"))  # the staging folder is gone

    built = build_tiny_flux()
    # disable_mmap: weights memory-mapped from a .safetensors file are not 64-byte aligned, and on CPU the GEMM
    # kernels then round differently (about 4e-7 on the transformer output). Read into fresh memory, results are exact.
    loaded = FluxPipeline.from_pretrained(folder, local_files_only=True, disable_mmap=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        _assert_same_state(getattr(built, name), getattr(loaded, name))
    assert loaded.tokenizer(CAPTION).input_ids == built.tokenizer(CAPTION).input_ids
    assert loaded.tokenizer_2(CAPTION).input_ids == built.tokenizer_2(CAPTION).input_ids
    assert loaded.tokenizer.model_max_length == 77

    image_built, image_loaded = _sample(built), _sample(loaded)
    assert image_built.shape == (1, 3, 64, 64)
    assert torch.equal(image_built, image_loaded)
    assert torch.equal(image_built, _sample(built))  # eval mode: no dropout, same image on every call
    mapped = FluxPipeline.from_pretrained(folder, local_files_only=True)  # the default, memory-mapped load
    torch.testing.assert_close(_sample(mapped), image_built, rtol=0, atol=1e-5)


def test_save_tiny_flux_reuses_and_refuses(tmp_path: Path) -> None:
    folder = save_tiny_flux(tmp_path / "p", dim64=True)
    stamp = (folder / "transformer/config.json").stat().st_mtime_ns
    assert save_tiny_flux(folder, dim64=True) == folder  # already there: returned as is
    assert (folder / "transformer/config.json").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="dim64"):
        save_tiny_flux(folder, dim64=False)  # a tiny pipeline, but built with other arguments

    foreign = tmp_path / "my-photos"
    foreign.mkdir()
    (foreign / "cat.png").write_bytes(b"not a pipeline")
    with pytest.raises(FileExistsError, match="not empty"):
        save_tiny_flux(foreign)
    assert [p.name for p in foreign.iterdir()] == ["cat.png"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (save_tiny_flux(empty) / "model_index.json").is_file()
