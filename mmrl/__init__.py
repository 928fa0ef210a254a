"""mmrl: reinforcement-learning fine-tuning of generative models on one shared core."""

import os

__version__ = "0.1.0"

# transformers >= 5 swaps layers for "hub kernels", code it downloads from the Hugging Face Hub,
# once a model is on a GPU (and again at each train/eval switch). mmrl downloads nothing at run
# time and runs no code it was not given: off unless the user sets USE_HUB_KERNELS=YES.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
