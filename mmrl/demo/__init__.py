"""Gradio before/after demo."""
