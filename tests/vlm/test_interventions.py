"""Image interventions (mmrl.vlm.interventions) against the real Qwen processors, and
teacher-forced re-scoring with them (VLMPolicy.rescore)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmrl.vlm.config import VLMModelConfig, VLMTrainConfig
from mmrl.vlm.interventions import black_row, mask_box, mask_patches, patch_positions
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
