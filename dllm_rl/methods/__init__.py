"""The diffusion-LLM methods; importing this package registers them with the core loop."""

from dllm_rl.methods import (  # noqa: F401
    diffu_grpo,
    fork_grpo,
    slim_rl,
    tracerl,
)
from dllm_rl.methods.common import estimator_for  # noqa: F401
