"""Tiny, randomly initialised diffusion pipelines for the demo and the tests (see :mod:`.shared`)."""
