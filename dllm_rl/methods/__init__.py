"""The diffusion-LLM methods; importing this package registers them with the core loop."""

from dllm_rl.methods import diffu_grpo, tracerl  # noqa: F401
from dllm_rl.methods.common import estimator_for  # noqa: F401
