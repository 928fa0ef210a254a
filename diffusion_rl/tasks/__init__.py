"""Synthetic, verifiable text-to-image tasks for the flow / diffusion backend (shapes-geneval)."""
