"""The modality-agnostic core: advantages, losses, rewards, batch, scheduler, trainer."""
