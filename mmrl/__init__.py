"""mmrl: reinforcement-learning fine-tuning of generative models on one shared core."""
__version__ = "0.1.0"
