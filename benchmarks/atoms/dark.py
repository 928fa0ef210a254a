"""Darkness of a generated image, as an extra reward atom: a reward any image model can move,
the control of the diffusion sections of RESULTS.md:

    diffusion-rl train --set 'reward.atoms=[{path: benchmarks/atoms/dark.py:dark, weight: 5}]'
    python benchmarks/diffusion_gradient_agreement.py \
        --set 'reward.atoms=[{path: ../../benchmarks/atoms/dark.py:dark}]' --extra-atoms-only

(a relative path starts at the config file's folder, configs/diffusion/ for the script, or
the working directory without one).
"""


def dark(sample) -> float:
    """1 - the image's mean brightness (greyscale, 0..1)."""
    grey = sample.completion.convert("L")
    return 1.0 - sum(grey.getdata()) / (255.0 * grey.width * grey.height)
