"""Shared fixtures: tiny random pipelines saved to disk (one per family), captioned photos, and a quiet, offline,
1-thread torch. Shared helpers (configs, tiny LoRA models, inputs) are in tests/helpers/.

Tests never touch a hub: HF_HUB_OFFLINE is set for the whole session, and every model is built from a config by
:mod:`lightning_lora.tiny` and loaded back through the real ``from_pretrained`` path.

The test folders mirror the package (tests/cli/, tests/data/, tests/families/...). This file puts tests/ on
``sys.path`` so that ``import helpers`` works from every folder, whatever pytest's import mode, and whether pytest runs
from the repository root or elsewhere. Test folders have no ``__init__.py``: test file names are unique.

Markers: ``subprocess`` marks the tests that start another process (the real command, DDP ranks, a Python process
that is killed, the Dockerfile linter); ``pytest -m "not subprocess"`` runs the in-process suite. ``gpu`` marks the
tests that need a CUDA GPU: without one they are skipped at collection (nothing of them runs), and ``make test-gpu``
runs them alone on a GPU machine (``pytest -m gpu``), its header naming the GPU and the versions it ran with.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The test callbacks of tests/helpers (helpers.crash, helpers.fake_memory) that configs name, here and in the commands
# the tests start: a config names classes of trusted modules only (lightning_lora.cli.class_paths).
os.environ.setdefault("LIGHTNING_LORA_ALLOW_IMPORTS", "helpers")

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import pytest  # noqa: E402
import torch  # noqa: E402

# On 2 cores a busy second core slows multi-threaded tiny-model steps 4-150x (measured on the 2-core CI machine).
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "subprocess: starts another process (the lightning-lora command, DDP ranks, a Python that is killed, "
        'hadolint); deselect with -m "not subprocess" to run the in-process suite',
    )
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU; skipped without one, run alone on a GPU machine with make test-gpu (pytest -m gpu)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a CUDA GPU every ``gpu`` test is skipped, saying where it runs (one check for all of them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: make test-gpu on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """On a GPU machine: the GPU and the versions the run used (``make test-gpu``'s record of what passed where)."""
    if not torch.cuda.is_available():
        return []
    from importlib import metadata

    versions = []
    for name in ("diffusers", "peft", "lightning", "transformers", "bitsandbytes", "torchao", "xformers"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    props = torch.cuda.get_device_properties(0)
    return [
        f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
        f"{torch.cuda.device_count()} device(s)",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}); "
        + ", ".join(versions),
    ]


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test module's ``GROUP_BY = "<fixture>"``: its tests that share that parametrized fixture's value go to one
    process of ``make test`` (one ``xdist_group`` per value), so a module-scoped fixture built from it is built once.
    Marked as each test is collected: pytest-xdist reads the groups when the collection is modified."""
    name = getattr(getattr(item, "module", None), "GROUP_BY", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if name and name in params:
        item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{params[name]}"))  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _process_globals() -> Iterator[None]:
    """What one test changes in the process, the next does not inherit (a test process runs many tests, in an order
    that changes with the suite): the SIGINT / SIGTERM handlers (Lightning leaves SIGINT ignored after a run it stopped
    on a KeyboardInterrupt), ``F.scaled_dot_product_attention`` (lightning_lora.model.attention replaces it; a recording
    SDPA left by tests/model/test_attention.py once failed 11 later tests of one process) and ``logging.lastResort``
    (the verbs without a run log replace it for the rest of their process: ``quiet_library_loggers``)."""
    import logging
    import signal

    import torch.nn.functional as F

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sdpa, last_resort = F.scaled_dot_product_attention, logging.lastResort
    yield
    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    logging.lastResort = last_resort
    for sig, handler in handlers.items():
        if handler is not None:  # None: not installed from Python, nothing to put back
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_pipeline(name)``: the saved tiny pipeline folder of the registered family ``name``
    (:meth:`~lightning_lora.families.base.DiffusionFamily.save_tiny`, seed 0), made once per session."""
    from lightning_lora.families import FAMILIES

    root = tmp_path_factory.mktemp("models")
    saved: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in saved:
            saved[name] = FAMILIES[name].save_tiny(root / f"tiny-{name}", seed=0)
        return saved[name]

    return get


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny FLUX.1-dev-like pipeline folder (model_index.json, transformer/, vae/, text encoders...)."""
    return tiny_pipeline("flux")


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny SDXL pipeline folder (SDXL's UNet layout, two CLIP text encoders, Euler scheduler)."""
    return tiny_pipeline("sdxl")


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny SD1.5-like pipeline folder (one CLIP text encoder, PNDM scheduler, epsilon prediction)."""
    return tiny_pipeline("sd15")


@pytest.fixture(scope="session")
def tiny_qwenimage_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny Qwen-Image pipeline folder (video VAE, Qwen2.5-VL text encoder, byte-level BPE tokenizer)."""
    return tiny_pipeline("qwenimage")


@pytest.fixture(scope="session")
def tiny_zimage_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny Z-Image pipeline folder (single-stream transformer, FLUX-like VAE, Qwen3 text encoder, chat-template
    tokenizer)."""
    return tiny_pipeline("zimage")


@pytest.fixture(scope="session")
def tiny_chroma_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny Chroma pipeline folder (FLUX blocks without modulation, the approximator, T5 alone)."""
    return tiny_pipeline("chroma")


@pytest.fixture(scope="session")
def tiny_flux2_dir(tiny_pipeline: Callable[[str], Path]) -> Path:
    """A saved tiny FLUX.2 klein pipeline folder (Flux2 transformer, batch-normalised VAE, 28-layer Qwen3 causal LM,
    chat-template tokenizer; a base model: ``is_distilled`` false)."""
    return tiny_pipeline("flux2")


@pytest.fixture(scope="session")
def tiny_flux2_dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny FLUX.2 dev pipeline folder (``Flux2Pipeline``: Flux2 transformer with a guidance embedder,
    batch-normalised VAE, 31-layer Mistral3 text encoder, tekken-style tokenizer with Mistral's chat template)."""
    from lightning_lora.tiny.flux2 import save_tiny_flux2_dev

    return save_tiny_flux2_dev(tmp_path_factory.mktemp("models") / "tiny-flux2-dev", seed=0)


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four real photos from scikit-image (shipped in its wheel) with .txt captions."""
    from PIL import Image

    from lightning_lora.cli.demo import PHOTOS, _photo

    folder = tmp_path_factory.mktemp("photos")
    for name in list(PHOTOS)[:4]:
        Image.fromarray(_photo(name)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(PHOTOS[name])
    return folder


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path, photos_dir: Path) -> Path:
    """The config of a finished 1 node x 2 processes DDP run (Lightning starts the second process) of
    :data:`helpers.resume.DDP_RUN_STEPS` steps in :data:`helpers.resume.DDP_RUN_LAYOUT`, made with
    :func:`helpers.resume_config` (a checkpoint every step); the folder above it holds the built ``cache``, for the
    runs that compare with it. tests/test_fsdp.py and tests/test_multinode.py compare their layouts with it: their
    tests share ``xdist_group("ddp_run")``, so one process of ``make test`` runs it once for both."""
    from helpers import fit_in_subprocess, resume_config
    from helpers.resume import DDP_RUN_LAYOUT, DDP_RUN_STEPS

    root = tmp_path_factory.mktemp("ddp_run")
    config = resume_config(root, tiny_flux_dir, photos_dir, "ddp", steps=DDP_RUN_STEPS, **DDP_RUN_LAYOUT)
    run = fit_in_subprocess(config)
    assert run.returncode == 0, run.stderr[-3000:]
    return config


@pytest.fixture(scope="session")
def preserved_photos(tmp_path_factory: pytest.TempPathFactory, photos_dir: Path) -> Path:
    """:func:`helpers.preservation_layout`'s folders: ``train/`` (the four photos of ``photos_dir``), ``masks/`` (a
    mask for two of them: the left half white; and one mask of no image), ``regularization/`` (two more photos,
    captioned without the trigger)."""
    from helpers import preservation_layout

    return preservation_layout(tmp_path_factory.mktemp("preserved"), photos_dir)
