"""Tiny, randomly initialised diffusion pipelines, built offline and deterministically: one module per family
(:mod:`.flux`, :mod:`.sdxl`, :mod:`.sd15`, :mod:`.zimage`, :mod:`.qwenimage`, :mod:`.flux2`, :mod:`.krea2`) and the
parts they share (:mod:`.shared`: the caption words, the tokenizers, seeded construction, the atomic save).

Why this exists
---------------
The real FLUX.1-dev weights are 24 GB and live behind a model hub. Tests and the CPU demo need something with
exactly the same *structure* (same classes, same config keys, same tokenizers, same scheduler settings) but small
enough to build in milliseconds and with no download at all. Each module builds such a pipeline from configs alone
(:mod:`.flux` lists what the tiny FLUX.1 holds).

Determinism
-----------
Two processes given the same seed produce bit-identical weights and identical token ids:

* weights: each component is created under its own seed (``seed`` plus a fixed offset) inside
  ``torch.random.fork_rng``, so the caller's global RNG is left alone and the order of construction does not matter;
* tokenizers: the vocabularies are written out by hand from a fixed word list. We deliberately do *not* use the
  ``tokenizers`` trainers: ``BpeTrainer``/``UnigramTrainer`` return the same merges/pieces in a different order on
  every run, so token ids would change between processes.

Gotcha: modules built from a config start in ``train()`` mode (``from_pretrained`` returns ``eval()``). With dropout
that makes every call random, so every component is put in ``eval()`` and T5's ``dropout_rate`` is 0.
"""
