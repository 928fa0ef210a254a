"""Flow / diffusion image models: SDE sampling with log-probs, Flow-GRPO, CAST, FTFC."""

import mmrl  # noqa: F401  (its import turns transformers' hub kernels off: mmrl/__init__.py)
