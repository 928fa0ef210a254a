"""Interventions on a batch's images, for teacher-forced re-scoring of fixed responses
(VPPO's random patch masking, a box masked out as in DSPO's CVIG, a Gaussian blur;
docs/methods.md section 2).

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
    """[rows, 3] long: (image, h, w) of each patch row of one sample, in the processor's order,
    on grid's device. grid: [images, 3] (t, h, w) rows of that sample; zero rows are skipped."""
    out = []
    dev = grid.device
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t * h * w == 0:
            continue
        bh, bw, mh, mw = torch.meshgrid(torch.arange(h // merge, device=dev), torch.arange(w // merge, device=dev),
                                        torch.arange(merge, device=dev), torch.arange(merge, device=dev),
                                        indexing="ij")
        hh = (bh * merge + mh).reshape(-1).repeat(t)
        ww = (bw * merge + mw).reshape(-1).repeat(t)
        out.append(torch.stack([torch.full_like(hh, i), hh, ww], 1))
    return torch.cat(out) if out else torch.zeros((0, 3), dtype=torch.long, device=dev)


def black_row(image_processor, dim: int) -> Tensor:
    """[D]: a black patch row after the processor's normalisation ((0 - mean) / std per channel).
    On the CPU: the interventions move it to the pixels' device and dtype."""
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
    # drawn on the CPU from the (CPU) generator, then moved: the same draws on any device
    hit = (torch.rand(real.shape, generator=generator) < p).to(real.device) & real
    out[hit] = fill.to(out)
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
        out[n, : len(pos)][inside] = fill.to(out)
    return out


def to_images(rows: Tensor, grid_row: Tensor, merge: int, patch: int) -> Tensor:
    """One image's patch rows [t*h*w, D] -> [t, D / patch^2, h*patch, w*patch] (planes are
    channel x temporal, the row layout of Qwen VL processors)."""
    t, h, w = (int(v) for v in grid_row)
    pos = patch_positions(grid_row[None], merge)
    tiles = rows.float().view(len(rows), -1, patch, patch)
    out = torch.zeros((t, tiles.shape[1], h * patch, w * patch), device=rows.device)
    pos = pos.tolist()  # Python ints for the slices: one copy, not two per row
    for r in range(len(rows)):
        y0, x0 = pos[r][1] * patch, pos[r][2] * patch
        out[r // (h * w), :, y0: y0 + patch, x0: x0 + patch] = tiles[r]
    return out


def to_rows(images: Tensor, grid_row: Tensor, merge: int, patch: int) -> Tensor:
    """The inverse of to_images."""
    _, h, w = (int(v) for v in grid_row)
    pos = patch_positions(grid_row[None], merge).tolist()  # Python ints for the slices
    return torch.stack([images[r // (h * w), :, pos[r][1] * patch: (pos[r][1] + 1) * patch,
                               pos[r][2] * patch: (pos[r][2] + 1) * patch].reshape(-1)
                        for r in range(len(pos))])


def gaussian_blur(images: Tensor, sigma: float) -> Tensor:
    """[..., H, W] blurred with a separable Gaussian of std `sigma` pixels, reflect padding."""
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    shape = images.shape
    h, w = shape[-2:]
    radius = max(1, min(int(3 * sigma + 0.5), h - 1, w - 1))
    x = torch.arange(-radius, radius + 1, dtype=torch.float32, device=images.device)
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k = k / k.sum()
    c = torch.nn.functional.pad(images.reshape(-1, 1, h, w), (radius,) * 4, mode="reflect")
    c = torch.nn.functional.conv2d(c, k.view(1, 1, -1, 1))
    return torch.nn.functional.conv2d(c, k.view(1, 1, 1, -1)).view(shape)


def blur(pixel_values: Tensor, grid: Tensor, *, merge: int, patch: int, sigma: float) -> Tensor:
    """Every image Gaussian-blurred (std `sigma` pixels of the resized image): reassembled
    from its rows, blurred per channel and frame, cut back into rows. The processor's
    normalisation is affine per channel, so blurring normalised values equals normalising
    the blurred image. Padding rows stay as they are."""
    out = pixel_values.clone()
    for n in range(pixel_values.shape[0]):
        start = 0
        for g in grid[n]:
            rows = int(g.prod())
            if rows == 0:
                continue
            image = to_images(pixel_values[n, start: start + rows], g, merge, patch)
            out[n, start: start + rows] = to_rows(gaussian_blur(image, sigma), g, merge, patch).to(out.dtype)
            start += rows
    return out


def _real_rows(grid: Tensor, width: int) -> Tensor:
    """[N, P] bool: the rows of each sample that hold patches (the rest is padding)."""
    counts = grid.prod(-1).sum(-1)  # [N]
    return torch.arange(width, device=counts.device)[None] < counts[:, None]
