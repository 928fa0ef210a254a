"""Image interventions (mmrl.vlm.interventions) against the real Qwen processors, and
teacher-forced re-scoring with them (VLMPolicy.rescore)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.vlm.config import VLMModelConfig, VLMTrainConfig
from mmrl.vlm.interventions import (
    black_row,
    blur,
    gaussian_blur,
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


# Pure tensor checks on small hand-made grids (no processor): a patch row here is `merge` x
# `merge`-ordered as in the module docstring, and its values are whatever the test puts there.

GRIDS = torch.tensor([[[1, 2, 4], [0, 0, 0]], [[1, 2, 2], [1, 2, 4]]])  # [N, I, 3]: 8 rows; 4 + 8 rows
FILL = torch.tensor([-1.0, -1.0])


def _pixels():
    """[2, 14, 2]: every row distinct, none equal to FILL; sample 0 has 6 padding rows, sample 1 two."""
    return torch.arange(2 * 14 * 2, dtype=torch.float32).view(2, 14, 2)


def _filled(out):
    return [torch.nonzero((row == FILL).all(-1)).view(-1).tolist() for row in out]


def test_patch_positions_by_hand_wide_image_frames_and_second_image():
    """merge 2: a (1, 2, 4) image is two 2x2 blocks, left then right, each row-major; a
    (2, 2, 2) second image is one block per frame, image index 1; the zero row is padding."""
    pos = patch_positions(torch.tensor([[1, 2, 4], [2, 2, 2], [0, 0, 0]]), 2)
    first = [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 0, 2], [0, 0, 3], [0, 1, 2], [0, 1, 3]]
    block = [[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
    assert pos.tolist() == first + block + block
    assert patch_positions(torch.zeros((1, 3), dtype=torch.long), 2).shape == (0, 3)


def test_black_row_by_hand_and_a_row_that_does_not_split_into_channels():
    from types import SimpleNamespace

    ip = SimpleNamespace(image_mean=[0.1, 0.4, 0.9], image_std=[0.1, 0.2, 0.3])
    torch.testing.assert_close(black_row(ip, 6), torch.tensor([-1.0, -1.0, -2.0, -2.0, -3.0, -3.0]))  # -m / s
    with pytest.raises(ValueError, match="do not split into 3 channels"):
        black_row(ip, 7)


def test_mask_patches_draws_from_its_generator_only():
    """The same seeded generator masks the same rows whatever the global RNG's state: the
    draws of a [N, P] uniform from it below p, among the real rows (8 and 4 + 8 = 12)."""
    pixels = _pixels()
    masks = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        out = mask_patches(pixels, GRIDS, p=0.5, fill=FILL, generator=torch.Generator().manual_seed(0))
        masks.append(_filled(out))
    assert masks[0] == masks[1]
    draws = torch.rand((2, 14), generator=torch.Generator().manual_seed(0)) < 0.5
    real = torch.arange(14)[None] < torch.tensor([[8], [12]])
    assert masks[0] == [torch.nonzero(row).view(-1).tolist() for row in draws & real]
    assert (draws & ~real).any()  # a padding row drawn below p is still left alone
    # p = 1: every real row, t * h * w of each image: 1 * 2 * 4 = 8; 1 * 2 * 2 + 1 * 2 * 4 = 12
    assert _filled(mask_patches(pixels, GRIDS, p=1.0, fill=FILL)) == [list(range(8)), list(range(12))]


def test_mask_box_by_hand_on_a_wide_image():
    """Sample 0's (1, 2, 4) image: patch centres x = (w + 0.5) / 4, y = (h + 0.5) / 2. Rows in
    order (h, w): (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3). Sample 1's first image is
    (1, 2, 2): rows (0,0) (0,1) (1,0) (1,1), x = (w + 0.5) / 2."""
    pixels = _pixels()

    def box(b, image=0):
        return _filled(mask_box(pixels, GRIDS, b, merge=2, fill=FILL, image=image))

    assert box((0.0, 0.0, 0.5, 1.0)) == [[0, 1, 2, 3], [0, 2]]  # left half: w < 2; w = 0
    assert box((0.0, 0.0, 1.0, 0.5)) == [[0, 1, 4, 5], [0, 1]]  # top half: h = 0
    # two boxes meeting at x = 0.375 (= w 1's centre in sample 0) split every row between them
    assert box((0.0, 0.0, 0.375, 1.0)) == [[0, 2], [0, 2]]
    assert box((0.375, 0.0, 1.0, 1.0)) == [[1, 3, 4, 5, 6, 7], [1, 3]]
    assert box((0.0, 0.0, 1.0, 1.0)) == [list(range(8)), [0, 1, 2, 3]]  # the whole image 0, no padding
    # image 1: sample 0 has none (untouched); sample 1's (1, 2, 4) image starts at row 4
    assert box((0.0, 0.0, 0.5, 1.0), image=1) == [[], [4, 5, 6, 7]]
    out = mask_box(pixels, GRIDS, (0.0, 0.0, 1.0, 1.0), merge=2, fill=FILL)
    assert torch.equal(out[0, 8:], pixels[0, 8:]) and torch.equal(out[1, 4:], pixels[1, 4:])
    for bad in ((0.3, 0.0, 0.3, 1.0), (0.0, 0.0, 1.0, 1.5), (0.0, 0.5, 1.0, 0.5), (0.0, 0.0, 1.2, 1.0)):
        with pytest.raises(ValueError, match="box must be fractions"):
            mask_box(pixels, GRIDS, bad, merge=2, fill=FILL)


def test_to_images_by_hand_frames_and_a_wide_image():
    """patch 1, merge 1, grid (2, 1, 2): rows 1, 2 are frame 0, rows 3, 4 frame 1. patch 2,
    merge 2, grid (1, 2, 4): row r (at (h, w) as in test_mask_box_by_hand_on_a_wide_image)
    holds 10 r + (0, 1, 2, 3) row-major in its 2x2 tile."""
    frames = to_images(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), torch.tensor([2, 1, 2]), 1, 1)
    assert frames.tolist() == [[[[1.0, 2.0]]], [[[3.0, 4.0]]]]
    rows = torch.arange(8, dtype=torch.float32)[:, None] * 10 + torch.arange(4.0)
    where = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3, (0, 2): 4, (0, 3): 5, (1, 2): 6, (1, 3): 7}
    expected = torch.zeros((1, 1, 4, 8))
    for y in range(4):
        for x in range(8):
            expected[0, 0, y, x] = 10 * where[(y // 2, x // 2)] + 2 * (y % 2) + x % 2
    image = to_images(rows, torch.tensor([1, 2, 4]), 2, 2)
    assert torch.equal(image, expected)
    assert torch.equal(to_rows(image, torch.tensor([1, 2, 4]), 2, 2), rows)


def test_gaussian_blur_of_an_impulse_by_hand():
    """sigma 1: radius 3, k_d = exp(-d^2 / 2) / Z, Z = 1 + 2 (e^-0.5 + e^-2 + e^-4.5); an impulse
    at (7, 7) becomes k_dy k_dx, nothing past 3 pixels. sigma 0.5: radius int(1.5 + 0.5) = 2.
    At a corner, reflect padding (the pixel not repeated) leaves k_0^2 at (0, 0)."""
    z = 1 + 2 * (math.exp(-0.5) + math.exp(-2) + math.exp(-4.5))
    k = [math.exp(-d * d / 2) / z for d in range(4)]
    impulse = torch.zeros((1, 15, 15))
    impulse[0, 7, 7] = 1.0
    out = gaussian_blur(impulse, 1.0)[0]
    assert out.shape == (15, 15) and float(out.sum()) == pytest.approx(1.0, abs=1e-6)
    for (y, x), want in {(7, 7): k[0] ** 2, (7, 10): k[0] * k[3], (8, 9): k[1] * k[2], (4, 7): k[3] * k[0],
                         (7, 11): 0.0, (3, 7): 0.0}.items():
        assert float(out[y, x]) == pytest.approx(want, abs=1e-7), (y, x)
    z_half = 1 + 2 * (math.exp(-2) + math.exp(-8))
    half = gaussian_blur(impulse, 0.5)[0]
    assert float(half[7, 9]) == pytest.approx(math.exp(-8) / z_half ** 2, rel=1e-4) and float(half[7, 10]) == 0.0
    corner = torch.zeros((5, 5))
    corner[0, 0] = 1.0
    c = gaussian_blur(corner, 1.0)
    assert float(c[0, 0]) == pytest.approx(k[0] ** 2, abs=1e-7) and float(c[0, 1]) == pytest.approx(k[0] * k[1], abs=1e-7)


def test_gaussian_blur_radius_fits_a_small_image():
    """2 x 3 image, sigma 5: the radius is cut to 1 (reflect padding needs less than the side):
    k = (a, b, a), b = 1 / (1 + 2 e^-0.02), a = e^-0.02 b. A row 0 1 0 pads to 1 0 1 0 1 ->
    2a, b, 2a; the two equal rows stay equal."""
    b = 1 / (1 + 2 * math.exp(-1 / 50))
    a = math.exp(-1 / 50) * b
    out = gaussian_blur(torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]), 5.0)
    torch.testing.assert_close(out, torch.tensor([[2 * a, b, 2 * a]] * 2))


def test_blur_each_image_of_a_sample_from_its_own_rows_and_leaves_its_input():
    """Sample 1: image 0 (4 rows) all 1, image 1 (8 rows) all 2, then padding 7: a flat image
    stays flat under a blur, so each image keeps its own value; the input is not written."""
    pixels = torch.full((1, 14, 4), 7.0)  # one plane, patch 2: 4 values a row
    pixels[0, :4], pixels[0, 4:12] = 1.0, 2.0
    before = pixels.clone()
    out = blur(pixels, GRIDS[1:], merge=2, patch=2, sigma=1.0)
    torch.testing.assert_close(out[0, :4], torch.ones(4, 4))
    torch.testing.assert_close(out[0, 4:12], torch.full((8, 4), 2.0))
    assert torch.equal(out[0, 12:], before[0, 12:]) and torch.equal(pixels, before)
