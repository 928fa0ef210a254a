"""Flow / diffusion image models: SDE sampling with log-probs, Flow-GRPO, CAST, FTFC."""
