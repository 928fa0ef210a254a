"""Image interventions (mmrl.vlm.interventions) against the real Qwen processors, and
teacher-forced re-scoring with them (VLMPolicy.rescore)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.vlm.config import VLMModelConfig, VLMTrainConfig
from mmrl.vlm.interventions import (
    black_row,
    blur,
    mask_box,
    mask_patches,
    patch_positions,
    to_images,
    to_rows,
)
from mmrl.vlm.models import load_vlm
from mmrl.vlm.policy import VLMPolicy
from mmrl.vlm.tasks.shapes_qa import QAItem


def make_policy(path) -> VLMPolicy:
    mcfg = VLMModelConfig(path=str(path))
    model, processor = load_vlm(mcfg)
    return VLMPolicy(model, processor, min_pixels=mcfg.min_pixels, max_pixels=mcfg.max_pixels)


def quadrant_image(size=112) -> Image.Image:
    """White, with the top-left quadrant red."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    img.paste((220, 40, 40), (0, 0, size // 2, size // 2))
    return img


def mostly_red(rows):
    """Rows (patches) nearer the red first patch than the white last one: resizing blurs the
    quadrant's edge, so a patch beside it is tinged, not red."""
    red, white = rows[0], rows[-1]
    return (rows - red).abs().mean(-1) < (rows - white).abs().mean(-1)


def items(*images):
    return [QAItem(images=[im], question="What colour is it?", answer="red") for im in images]


def test_patch_positions_follow_the_processor_order(model_dir):
    """Every Qwen family: the rows patch_positions puts in the top-left quadrant are exactly
    the red ones, and a black image's rows all equal black_row."""
    policy = make_policy(model_dir)
    batch = policy.teacher_batch(items(quadrant_image(), Image.new("RGB", (112, 112))), ["red", "red"])
    merge = policy.processor.image_processor.merge_size
    grid, pixels = batch.data["image_grid_thw"], batch.data["pixel_values"]
    pos = patch_positions(grid[0], merge)
    h, w = int(grid[0, 0, 1]), int(grid[0, 0, 2])
    assert len(pos) == int(grid[0].prod(-1).sum())
    red = mostly_red(pixels[0, : len(pos)])
    assert torch.equal(red, (pos[:, 1] < h // 2) & (pos[:, 2] < w // 2))
    black = black_row(policy.processor.image_processor, pixels.shape[-1])
    torch.testing.assert_close(pixels[1, : len(pos)], black.expand(len(pos), -1), atol=1e-4, rtol=0)


def test_mask_patches_and_mask_box(qwen25_dir):
    policy = make_policy(qwen25_dir)
    big = quadrant_image(112)
    small = quadrant_image(56)  # fewer patches: its rows are zero-padded in the batch
    batch = policy.teacher_batch(items(big, small), ["red", "red"])
    pixels, grid = batch.data["pixel_values"], batch.data["image_grid_thw"]
    fill = black_row(policy.processor.image_processor, pixels.shape[-1])
    real = torch.arange(pixels.shape[1])[None] < grid.prod(-1).sum(-1)[:, None]
    assert not real[1].all()  # the small image has padding rows
    assert torch.equal(mask_patches(pixels, grid, p=0.0, fill=fill), pixels)
    every = mask_patches(pixels, grid, p=1.0, fill=fill)
    assert (every[real] == fill).all() and torch.equal(every[~real], pixels[~real])
    half = mask_patches(pixels, grid, p=0.5, fill=fill, generator=torch.Generator().manual_seed(0))
    share = float((half[real] == fill).all(-1).float().mean())
    assert 0.3 < share < 0.7
    # The top-left quadrant box blacks out exactly the red patches.
    merge = policy.processor.image_processor.merge_size
    boxed = mask_box(pixels, grid, (0.0, 0.0, 0.5, 0.5), merge=merge, fill=fill)
    for n in range(2):
        rows = len(patch_positions(grid[n], merge))
        was_red = mostly_red(pixels[n, :rows])
        now_black = (boxed[n, :rows] == fill).all(-1)
        assert torch.equal(was_red, now_black)
    with pytest.raises(ValueError, match="box must be fractions"):
        mask_box(pixels, grid, (0.5, 0.0, 0.2, 1.0), merge=merge, fill=fill)
    with pytest.raises(ValueError, match="p must be in"):
        mask_patches(pixels, grid, p=1.5, fill=fill)


def test_rescore_is_the_training_forward_under_the_new_image(qwen25_dir):
    """Unchanged pixels: the rollout's own log-probs; masked pixels: different ones."""
    policy = make_policy(qwen25_dir)
    rollout = VLMTrainConfig().rollout.model_copy(update={"max_new_tokens": 6})
    batch = policy.generate(items(quadrant_image()), 2, rollout, torch.Generator().manual_seed(0))
    same = policy.rescore(batch, batch.data["pixel_values"])
    torch.testing.assert_close(same[batch.mask], batch.old_logp[batch.mask], atol=2e-4, rtol=1e-4)
    fill = black_row(policy.processor.image_processor, batch.data["pixel_values"].shape[-1])
    masked = mask_patches(batch.data["pixel_values"], batch.data["image_grid_thw"], p=1.0, fill=fill)
    other = policy.rescore(batch, masked)
    assert not same.requires_grad and not torch.allclose(other[batch.mask], same[batch.mask])


def test_rows_reassemble_the_image_and_blur_it(model_dir):
    """to_images puts every patch row where the processor took it from (checked against the
    image itself, normalised), to_rows inverts it; the blur keeps a flat image flat and
    smooths the quadrant's edge, on every Qwen family (14- and 16-px patches)."""
    policy = make_policy(model_dir)
    ip = policy.processor.image_processor
    side = ip.patch_size * ip.merge_size * 3  # no resize: on the grid, within max_pixels
    enc = policy.encode(items(quadrant_image(side)))
    rows, grid = enc["pixel_values"], enc["image_grid_thw"][0]
    image = to_images(rows, grid, ip.merge_size, ip.patch_size)  # [t, C * tp, H, W]
    assert image.shape[-2:] == (side, side)
    mean = torch.tensor(ip.image_mean).repeat_interleave(ip.temporal_patch_size)[:, None, None]
    std = torch.tensor(ip.image_std).repeat_interleave(ip.temporal_patch_size)[:, None, None]
    pixels = torch.from_numpy(np.asarray(quadrant_image(side), dtype=np.float32))  # [H, W, 3]
    expected = (pixels.permute(2, 0, 1).repeat_interleave(ip.temporal_patch_size, 0) / 255 - mean) / std
    # away from the quadrant's edges exactly the image (Qwen3's processor smooths the edge itself)
    far = torch.ones((side, side), dtype=torch.bool)
    far[side // 2 - 2: side // 2 + 2] = False
    far[:, side // 2 - 2: side // 2 + 2] = False
    torch.testing.assert_close(image[0][:, far], expected[:, far], atol=1e-4, rtol=0)
    torch.testing.assert_close(to_rows(image, grid, ip.merge_size, ip.patch_size), rows.float())
    batch_rows, batch_grid = rows[None], grid[None, None]
    blurred = blur(batch_rows, batch_grid, merge=ip.merge_size, patch=ip.patch_size, sigma=3.0)
    smooth = to_images(blurred[0], grid, ip.merge_size, ip.patch_size)[0]
    edge = side // 2
    step = (expected[:, 5, edge - 1] - expected[:, 5, edge]).abs()  # the sharp edge, per plane
    assert bool(((smooth[:, 5, edge - 1] - smooth[:, 5, edge]).abs() < 0.5 * step).all())
    torch.testing.assert_close(smooth[:, -8:, -8:], expected[:, -8:, -8:], atol=1e-4, rtol=0)  # flat corner stays
    with pytest.raises(ValueError, match="sigma"):
        blur(batch_rows, batch_grid, merge=ip.merge_size, patch=ip.patch_size, sigma=0.0)
