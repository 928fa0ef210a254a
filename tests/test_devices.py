"""Device safety of the pure tensor helpers: no GPU here, so the "meta" device stands in for
one. A helper given its inputs on an accelerator must not build CPU tensors to meet them
(the CPU run cannot show it: every tensor is on the CPU there)."""

from __future__ import annotations

import torch

META = torch.device("meta")


def test_cast_advantage_map_follows_the_maps_device():
    from diffusion_rl.methods.cast import advantage_map

    out = advantage_map(torch.zeros(2, 3), torch.ones(3), torch.zeros(2, 3, 5, device=META), torch.zeros(2),
                        global_weight=0.5, clip=1.0)
    assert out.device == META and out.shape == (2, 5)


def test_the_real_patch_rows_follow_the_grids_device():
    from mmrl.vlm.interventions import _real_rows

    out = _real_rows(torch.tensor([[[1, 2, 2]], [[1, 2, 1]]], device=META), 6)
    assert out.device == META and out.shape == (2, 6)
