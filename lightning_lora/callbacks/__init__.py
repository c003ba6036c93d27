"""Callbacks: sample images, fixed evaluation (loss, drift, the best LoRA), LoRA export, EMA of the LoRA, monitoring,
exact resume."""

from lightning_lora.callbacks.ema import LoraEMA
from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.callbacks.monitor import ConfigSummary, StartSummary, Throughput, VRAMMonitor
from lightning_lora.callbacks.resume import GracefulStop, RNGState, RunFolder
from lightning_lora.callbacks.samples import SampleImages

__all__ = [
    "ConfigSummary",
    "FixedEvalLoss",
    "GracefulStop",
    "LoraEMA",
    "LoraExport",
    "RNGState",
    "RunFolder",
    "SampleImages",
    "StartSummary",
    "Throughput",
    "VRAMMonitor",
]
