"""The memory planner: the peak GPU memory of a training run, predicted from the model's config before any weight
loads, and the changes that make a run fit a card.

* :mod:`.estimate`: the bytes of each part of a run (frozen weights, LoRA, optimizer state, saved activations,
  transients, sample images, the cache's encoders, host memory): :func:`plan_training`, :func:`plan_for`;
* :mod:`.search`: the search over changes (checkpointing, offloading, base format, batches) for the fastest way to run
  the same training in a card's memory: :func:`choose_for_memory`, :func:`fitting_changes`, :func:`cards_table`;
* :mod:`.sampling`: what drawing sample images adds, and :mod:`.live_bytes`: what a computation holds, both measured
  on the ``meta`` device (each op's shapes computed once per process, the model built once: a plan takes seconds).
"""

from __future__ import annotations

from lightning_lora.plan.estimate import (
    HEADROOM,
    MemoryPlan,
    caching_peaks,
    compiled_saved_bytes,
    offloaded_weight_bytes,
    optimizer_bytes_per_param,
    optimizer_name,
    plan_for,
    plan_training,
    weight_bytes,
)
from lightning_lora.plan.sampling import sampling_bytes, sampling_pieces
from lightning_lora.plan.search import (
    CARDS,
    OUTSIDE_ALLOCATOR_GIB,
    Fit,
    card_memory,
    cards_of,
    cards_table,
    choose_for_memory,
    fitting_changes,
    larger_batches,
    merged_batches,
    smaller_batches,
    visible_card_memory,
)

__all__ = [
    "CARDS",
    "HEADROOM",
    "Fit",
    "MemoryPlan",
    "OUTSIDE_ALLOCATOR_GIB",
    "caching_peaks",
    "card_memory",
    "cards_of",
    "cards_table",
    "choose_for_memory",
    "compiled_saved_bytes",
    "fitting_changes",
    "larger_batches",
    "merged_batches",
    "optimizer_name",
    "plan_for",
    "offloaded_weight_bytes",
    "optimizer_bytes_per_param",
    "plan_training",
    "sampling_bytes",
    "sampling_pieces",
    "smaller_batches",
    "visible_card_memory",
    "weight_bytes",
]
