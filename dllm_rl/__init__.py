"""Masked diffusion language models: samplers, log-probs, diffu-GRPO, TraceRL, SLIM-RL, ForkGRPO."""

import mmrl  # noqa: F401  (its import turns transformers' hub kernels off: mmrl/__init__.py)
