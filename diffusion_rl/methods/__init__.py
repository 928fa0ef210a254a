"""The flow / diffusion methods; importing this package registers them with the core loop."""

from diffusion_rl.methods import cast, flow_grpo, ftfc  # noqa: F401
