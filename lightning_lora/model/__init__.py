"""The trainable model's build: what is built (:mod:`.recipe`, the frozen ``ModelRecipe``), how (:mod:`.assembly`:
load, freeze, quantize, inject LoRA, checkpoint, compile), what leaves the GPU (:mod:`.offload` for frozen blocks,
:mod:`.recompute` for checkpointed inputs), the attention's gradient handover (:mod:`.attention`), and the
multi-GPU strategies (:mod:`.parallel`, with FSDP2 sharding of the base in :mod:`.sharding`).
"""
