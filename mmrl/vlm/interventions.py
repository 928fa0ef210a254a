"""Interventions on a batch's images, for teacher-forced re-scoring of fixed responses
(VPPO's random patch masking, a box masked out as in DSPO's CVIG; METHODS.md section 2).

Qwen VL processors flatten each image into patch rows: an image of grid (t, h, w) patches
gives t*h*w rows of channel x temporal_patch x patch x patch values, ordered by
(t, h / merge, w / merge, merge, merge), so that each merge x merge block of patches (one
visual token) is contiguous. `patch_positions` inverts that order; the interventions
replace whole rows, which is exactly blacking out 14-px (Qwen2/2.5) or 16-px (Qwen3)
squares of the resized image. The batch layout is VLMPolicy's: data["pixel_values"]
[N, patches, D] (each sample's own rows, zero-padded) and data["image_grid_thw"]
[N, images, 3] (zero rows are padding).

Departure: the box intervention blacks out pixels; CVIG zeroes the visual features of
the box. At patch granularity the two differ only by what the vision tower makes of a
black patch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def patch_positions(grid: Tensor, merge: int) -> Tensor:
    """[rows, 3] long: (image, h, w) of each patch row of one sample, in the processor's order.
    grid: [images, 3] (t, h, w) rows of that sample; zero rows are skipped."""
    out = []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t * h * w == 0:
            continue
        bh, bw, mh, mw = torch.meshgrid(torch.arange(h // merge), torch.arange(w // merge),
                                        torch.arange(merge), torch.arange(merge), indexing="ij")
        hh = (bh * merge + mh).reshape(-1).repeat(t)
        ww = (bw * merge + mw).reshape(-1).repeat(t)
        out.append(torch.stack([torch.full_like(hh, i), hh, ww], 1))
    return torch.cat(out) if out else torch.zeros((0, 3), dtype=torch.long)


def black_row(image_processor, dim: int) -> Tensor:
    """[D]: a black patch row after the processor's normalisation ((0 - mean) / std per channel)."""
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float32)
    std = torch.tensor(image_processor.image_std, dtype=torch.float32)
    channels = len(mean)
    if dim % channels:
        raise ValueError(f"patch rows of {dim} values do not split into {channels} channels")
    return ((0.0 - mean) / std).repeat_interleave(dim // channels)


def mask_patches(pixel_values: Tensor, grid: Tensor, *, p: float, fill: Tensor,
                 generator: torch.Generator | None = None) -> Tensor:
    """Each real patch row replaced by `fill` with probability p (VPPO: p = 0.5), independently.
    pixel_values [N, P, D], grid [N, I, 3]; padding rows stay as they are."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    out = pixel_values.clone()
    real = _real_rows(grid, pixel_values.shape[1])  # [N, P]
    hit = (torch.rand(real.shape, generator=generator) < p) & real
    out[hit] = fill.to(out.dtype)
    return out


def mask_box(pixel_values: Tensor, grid: Tensor, box: tuple[float, float, float, float], *, merge: int,
             fill: Tensor, image: int = 0) -> Tensor:
    """Patch rows of image `image` whose patch centre lies in `box` (x0, y0, x1, y1 as fractions
    of the image's width and height) replaced by `fill`, in every sample."""
    x0, y0, x1, y1 = box
    if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
        raise ValueError(f"box must be fractions 0 <= x0 < x1 <= 1, 0 <= y0 < y1 <= 1; got {box}")
    out = pixel_values.clone()
    for n in range(pixel_values.shape[0]):
        pos = patch_positions(grid[n], merge)
        if not bool((pos[:, 0] == image).any()):
            continue
        h, w = (int(v) for v in grid[n][grid[n].prod(-1) > 0][image, 1:])
        cy, cx = (pos[:, 1] + 0.5) / h, (pos[:, 2] + 0.5) / w
        inside = (pos[:, 0] == image) & (cx >= x0) & (cx < x1) & (cy >= y0) & (cy < y1)
        out[n, : len(pos)][inside] = fill.to(out.dtype)
    return out


def _real_rows(grid: Tensor, width: int) -> Tensor:
    """[N, P] bool: the rows of each sample that hold patches (the rest is padding)."""
    counts = grid.prod(-1).sum(-1)  # [N]
    return torch.arange(width)[None] < counts[:, None]
