"""Masked diffusion language models: samplers, log-probs, diffu-GRPO, TraceRL, SLIM-RL, ForkGRPO."""
