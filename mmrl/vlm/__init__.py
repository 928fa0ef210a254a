"""Vision-language backend: Qwen-VL models, rollout engines, tasks, methods."""
