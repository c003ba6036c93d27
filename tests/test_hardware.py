"""Backend detection and the ROCm refusals/fallbacks, on a CPU machine with a faked CUDA or HIP build of torch."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_lora.errors import ConfigError
from lightning_lora.hardware import Backend, check_attention, detect, fp8_compute_supported, fp8_dtype
from lightning_lora.model.assembly import configure_attention
from lightning_lora.model.attention import hand_sdpa_matching_gradients, sdpa_hands_matching_gradients
from lightning_lora.precision import FP8Compute
from lightning_lora.precision import fp8 as fp8_module
from lightning_lora.precision.nf4 import require_bitsandbytes

CUDA = torch.device("cuda", 0)


def fake_gpu(
    monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int], hip: str | None = None, arch: str = ""
) -> None:
    """Make torch look like a CUDA build (``hip=None``) or a ROCm build with one GPU."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(name=name, major=capability[0], minor=capability[1])
    if hip is not None:
        props.gcnArchName = arch
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def mi300(monkeypatch: pytest.MonkeyPatch) -> None:
    # ROCm reports a capability made up from the arch (9.4 here); only gcnArchName counts.
    fake_gpu(monkeypatch, "AMD Instinct MI300X", (9, 4), hip="6.4.43483", arch="gfx942:sramecc+:xnack-")


def rx7900(monkeypatch: pytest.MonkeyPatch) -> None:
    # Consumer RDNA3: reports capability 11.0, which would pass an NVIDIA ">= 8.9" check by accident.
    fake_gpu(monkeypatch, "AMD Radeon RX 7900 XTX", (11, 0), hip="6.4.43483", arch="gfx1100")


@pytest.mark.parametrize(
    ("name", "capability", "fp8"),
    [
        ("NVIDIA A100-SXM4-80GB", (8, 0), False),  # Ampere
        ("NVIDIA GeForce RTX 4090", (8, 9), True),  # Ada
        ("NVIDIA H200", (9, 0), True),  # Hopper
    ],
)
def test_cuda_detection_and_fp8(monkeypatch, name: str, capability: tuple[int, int], fp8: bool) -> None:
    fake_gpu(monkeypatch, name, capability)
    backend = detect(CUDA)
    assert backend == Backend("cuda", name, capability=capability)
    assert detect() == backend  # default: the current GPU
    supported, reason = fp8_compute_supported(CUDA)
    assert supported is fp8 and f"compute capability {capability[0]}.{capability[1]}" in reason


def test_rocm_mi300_detection_and_fp8(monkeypatch) -> None:
    mi300(monkeypatch)
    backend = detect(CUDA)
    assert backend == Backend("rocm", "AMD Instinct MI300X", arch="gfx942")
    assert backend.is_gpu and backend.describe() == "AMD Instinct MI300X (ROCm, gfx942)"
    assert fp8_compute_supported(CUDA)[0]
    assert fp8_module.fp8_compute_supported is fp8_compute_supported  # one implementation, re-exported


def test_rocm_consumer_card_has_no_fp8_compute(monkeypatch) -> None:
    rx7900(monkeypatch)
    backend = detect(CUDA)
    assert backend.kind == "rocm" and backend.arch == "gfx1100" and backend.capability is None
    supported, reason = fp8_compute_supported(CUDA)
    assert not supported and "gfx1100" in reason and "MI300" in reason


def test_cpu_and_mps_detection(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect() == Backend("cpu", "cpu") and not detect().is_gpu
    assert detect("cuda") == Backend("cpu", "cpu")  # a cuda device without a GPU is no GPU
    assert detect("mps").kind == "mps"
    assert fp8_compute_supported("cpu") == (False, "device cpu has none")


@pytest.mark.parametrize("card", [mi300, rx7900])
def test_xformers_is_refused_on_rocm_naming_the_option(monkeypatch, card) -> None:
    card(monkeypatch)
    with pytest.raises(ConfigError, match=r"model.attention: xformers has no ROCm kernels .*gfx.*use auto"):
        configure_attention(nn.Linear(2, 2), "xformers", CUDA)


def test_cudnn_attention_is_refused_on_rocm(monkeypatch) -> None:
    mi300(monkeypatch)
    with pytest.raises(ConfigError, match="model.attention: cudnn"):
        check_attention("cudnn", CUDA)
    for allowed in ("auto", "flash", "efficient", "math"):
        check_attention(allowed, CUDA)


def test_xformers_on_cuda_passes_the_hardware_check(monkeypatch) -> None:
    fake_gpu(monkeypatch, "NVIDIA H200", (9, 0))
    check_attention("xformers", CUDA)
    check_attention("cudnn", CUDA)
    with pytest.raises(ConfigError, match="model.attention: xformers has no kernels for cpu"):
        check_attention("xformers", Backend("cpu", "cpu"))


@pytest.mark.parametrize(
    ("card", "compute", "fp8"),
    [(mi300, True, torch.float8_e4m3fnuz), (rx7900, False, torch.float8_e4m3fn)],
)
def test_fp8_on_rocm_quantizes_in_the_cards_format_and_falls_back_without_fp8_units(
    monkeypatch, card, compute: bool, fp8: torch.dtype
) -> None:
    """The real quantizer (on the CPU: the layers are in ``on_cpu``, as for offloaded blocks) with a faked ROCm card:
    MI300's matrix units take e4m3fnuz (largest value 240), so its weights are quantized in that format."""
    card(monkeypatch)
    assert fp8_dtype(CUDA) == fp8
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[0].weight.mul_(1000.0)  # beyond both formats' largest value: the scale must use the card's
    x = torch.randn(4, 64)
    reference = model(x)
    plugin = FP8Compute()
    on_cpu = frozenset(id(layer) for layer in model)
    if compute:
        assert plugin.quantize(model, CUDA, on_cpu=on_cpu) == 2
    else:
        with pytest.warns(UserWarning, match=r"trainer.plugins: FP8Compute needs FP8 .*gfx1100"):
            assert plugin.quantize(model, CUDA, on_cpu=on_cpu) == 2
    layers = list(model)
    assert all(isinstance(layer, fp8_module.FP8Linear) and layer.compute is compute for layer in layers)
    assert all(layer.weight.dtype == fp8 for layer in layers)
    assert float(layers[0].weight.float().abs().max()) == torch.finfo(fp8).max
    error = (model(x) - reference).norm() / reference.norm()
    assert error < 0.1  # e4m3's 3 mantissa bits: a few percent


def test_fp8_format_by_card(monkeypatch) -> None:
    assert fp8_dtype(Backend("cuda", "NVIDIA GeForce RTX 4090", capability=(8, 9))) == torch.float8_e4m3fn
    assert fp8_dtype(Backend("rocm", "AMD Instinct MI355X", arch="gfx950")) == torch.float8_e4m3fn  # OCP on CDNA4
    assert fp8_dtype(Backend("rocm", "AMD Instinct MI300X", arch="gfx942")) == torch.float8_e4m3fnuz
    assert fp8_dtype(Backend("cpu", "cpu")) == torch.float8_e4m3fn


def test_nf4_without_bitsandbytes_names_the_extra_and_rocm(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43483")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    require_bitsandbytes.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"NF4 \(lightning_lora.precision.NF4.*lightning-lora\[bnb\].*ROCm 6.4"):
            require_bitsandbytes()
    finally:
        require_bitsandbytes.cache_clear()


@pytest.mark.parametrize(
    ("backend", "cudnn_in_auto", "expected"),
    [
        ("auto", False, (True, True, False, True)),  # a family that leaves cuDNN out of auto
        ("auto", True, (True, True, True, True)),  # every family now: PyTorch's full choice
        ("sdpa", False, (True, True, True, True)),
        ("flash", False, (True, False, False, False)),
        ("math", True, (False, False, False, True)),
    ],
)
def test_attention_switches(monkeypatch, backend: str, cudnn_in_auto: bool, expected: tuple[bool, ...]) -> None:
    cuda = torch.backends.cuda
    switches = (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.cudnn_sdp_enabled, cuda.math_sdp_enabled)
    before = tuple(f() for f in switches)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        configure_attention(nn.Linear(2, 2), backend, torch.device("cpu"), cudnn_in_auto)  # type: ignore[arg-type]
        assert tuple(f() for f in switches) == expected
        # cuDNN's backward is handed dO in O's strides wherever cuDNN may run (lightning_lora.model.attention)
        assert sdpa_hands_matching_gradients() == expected[2]
    finally:
        hand_sdpa_matching_gradients(False)
        enables = (cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp, cuda.enable_cudnn_sdp, cuda.enable_math_sdp)
        for enable, value in zip(enables, before, strict=True):
            enable(value)


def test_every_family_lets_auto_use_cudnn_attention() -> None:
    """cuDNN's SDPA crashed in FLUX's backward until its output gradient was handed over in the output's strides
    (lightning_lora.model.attention, dev/LOG.md, call 31); since then no family leaves it out of ``auto``."""
    from lightning_lora.families import FAMILIES

    assert FAMILIES and all(family.compiling.cudnn_attention_in_auto for family in FAMILIES.values())


def test_allocator_grows_segments_unless_the_user_configured_it() -> None:
    from lightning_lora.hardware import ALLOCATOR_SETTINGS, set_allocator_defaults

    environ: dict[str, str] = {"HOME": "/home/me"}
    assert set_allocator_defaults(environ) and environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_SETTINGS
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        mine = {name: "expandable_segments:False"}
        assert not set_allocator_defaults(mine) and mine == {name: "expandable_segments:False"}


def test_the_command_sets_the_allocator_before_a_verb_runs(monkeypatch) -> None:
    """The allocator reads its settings once, at the first GPU allocation: the command sets them before any verb."""
    import os

    from lightning_lora.cli import main

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # then removed: monkeypatch restores the variable as it was before the test
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_a_configs_allocator_is_read_before_the_parser_in_the_order_the_parser_applies(tmp_path) -> None:
    """``allocator`` must act before the config's classes import a GPU library (bitsandbytes starts CUDA): the command
    reads it from the files and flags first, the last one winning as in the parser; what it cannot read it leaves to
    the parser."""
    from lightning_lora.cli.peek import config_allocator

    slow, fast, bad = (tmp_path / f"{n}.yaml" for n in ("slow", "fast", "bad"))
    slow.write_text("allocator: pytorch_default\nmodel: {}\n")
    fast.write_text("allocator: expandable_segments\n")
    bad.write_text("allocator: [\n")
    assert config_allocator(["fit", "--config", str(slow)]) == "pytorch_default"
    assert config_allocator(["fit", f"--config={slow}", "--allocator", "expandable_segments"]) == "expandable_segments"
    assert config_allocator(["fit", "--allocator=expandable_segments", "-c", str(slow)]) == "pytorch_default"
    assert config_allocator(["fit", "-c", str(slow), "--config", str(fast)]) == "expandable_segments"
    assert config_allocator(["fit", "-c", str(slow), "--config", str(bad), "--trainer.max_steps", "3"]) == (
        "pytorch_default"
    )
    assert config_allocator(["fit", "--config", str(tmp_path / "missing.yaml")]) is None
    assert config_allocator(["fit", "--allocator", "pytorch_defualt"]) is None  # the parser names the typo
    assert config_allocator(["fit", "-c", str(slow), "--allocator", "null"]) is None


def test_the_command_applies_the_configs_allocator_and_a_users_variable_wins(tmp_path, monkeypatch) -> None:
    import os

    from lightning_lora.cli import main
    from lightning_lora.hardware import allocator_conflict, expandable_segments, set_allocator_defaults

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    config = tmp_path / "sdxl.yaml"
    config.write_text("allocator: pytorch_default\n")
    with pytest.raises(SystemExit):
        main(["export", "--config", str(config), "--help"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert allocator_conflict("pytorch_default") is None  # what the command set is what the config asked for

    mine = {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8,expandable_segments:True"}
    assert not set_allocator_defaults(mine, choice="pytorch_default") and len(mine) == 1
    assert expandable_segments(mine["PYTORCH_ALLOC_CONF"]) and not expandable_segments("max_split_size_mb:128")
    message = allocator_conflict("pytorch_default", mine)
    assert message and "PYTORCH_ALLOC_CONF=garbage_collection_threshold:0.8,expandable_segments:True" in message
    assert "allocator: pytorch_default" in message and "unset PYTORCH_ALLOC_CONF" in message
    assert allocator_conflict("expandable_segments", mine) is None and allocator_conflict(None, mine) is None


@pytest.mark.parametrize(
    ("device_type", "environ", "limited"),
    [("cuda", {}, True), ("cpu", {}, False), ("cuda", {"OMP_NUM_THREADS": "6"}, False)],
)
def test_a_gpu_run_gives_torchs_cpu_operators_one_thread_unless_the_user_chose(
    device_type: str, environ: dict[str, str], limited: bool
) -> None:
    from lightning_lora.hardware import limit_host_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert limit_host_threads(device_type, environ) == (2 if limited else None)  # what to restore
        assert torch.get_num_threads() == (1 if limited else 2)  # a CPU run and the user's choice keep what they had
    finally:
        torch.set_num_threads(before)


def test_training_on_a_gpu_runs_with_one_host_thread_and_restores_the_count_after(monkeypatch) -> None:
    from lightning_lora.module import LoraModule

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # make test sets it; a user who set it keeps theirs
    lora = object.__new__(LoraModule)
    lora.__dict__["recipe"] = SimpleNamespace(cuda_graphs=False)  # no model built: the thread count is what is tested
    monkeypatch.setattr(LoraModule, "device", property(lambda self: torch.device("cuda", 0)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        LoraModule.on_train_start(lora)
        assert torch.get_num_threads() == 1
        LoraModule.on_train_end(lora)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
