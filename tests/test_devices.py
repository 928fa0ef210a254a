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


def test_model_device_spellings():
    import pytest
    from pydantic import ValidationError

    from mmrl.core.config import ConfigError, ModelConfig
    from mmrl.core.device import model_device

    assert ModelConfig().device == "cpu" and ModelConfig(device="cuda:1").device == "cuda:1"
    for bad in ("gpu", "cuda:", "CPU", "cuda:x", "mps"):
        with pytest.raises(ValidationError, match="not one of cpu, cuda, cuda:N, auto"):
            ModelConfig(device=bad)
    assert model_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():  # this machine: auto falls back, an explicit GPU is refused by name
        assert model_device("auto") == torch.device("cpu")
        for spec in ("cuda", "cuda:0"):
            with pytest.raises(ConfigError, match=f"model.device {spec}: no CUDA device"):
                model_device(spec)


def test_fork_rng_restores_the_cpu_draws_of_a_cpu_model():
    from mmrl.core.device import fork_rng, module_device

    model = torch.nn.Linear(2, 2)
    assert module_device(model) == torch.device("cpu") and module_device(torch.nn.ReLU()) == torch.device("cpu")
    torch.manual_seed(0)
    with fork_rng(model):
        torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


def test_transformers_hub_kernels_are_off_unless_asked_for():
    """transformers >= 5 would swap layers for code from the Hub once a model is on a GPU (a
    download at run time, and code nobody gave mmrl): importing mmrl turns that off, and a
    user's own USE_HUB_KERNELS wins (subprocesses: the variable is read at import). Each also
    loads the model with plain transformers: asked for, kernels are on where transformers turns
    them on by default (5.6, the floor, never does; newer releases do)."""
    import os
    import subprocess
    import sys

    probe = ("import os, dllm_rl, transformers; from dllm_rl.models import load_mask_predictor; "
             "print(os.environ['USE_HUB_KERNELS'], load_mask_predictor('assets/tiny-dllm').model.use_kernels, "
             "transformers.AutoModelForCausalLM.from_pretrained('assets/tiny-dllm').use_kernels)")
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = {given: subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=root, env=env if given is None else {**env, "USE_HUB_KERNELS": given})
             for given in (None, "YES")}  # both at once: each is mostly imports
    for given, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        variable, ours, plain = out.strip().splitlines()[-1].split()
        if given is None:
            assert (variable, ours, plain) == ("NO", "False", "False")
        else:  # the user's YES is kept, and mmrl's load does what transformers' own does with it
            assert (variable, ours) == ("YES", plain)


def test_which_gpu_model_device_picks(monkeypatch):
    """With GPUs (faked here): cuda/auto take LOCAL_RANK's, or GPU 0 where a launcher shows each
    rank one GPU; cuda:N is that GPU, refused under data parallel (every rank on one GPU); a GPU
    that is not there is named. The choice becomes the thread's current GPU."""
    import pytest

    from mmrl.core.config import ConfigError
    from mmrl.core.device import model_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for count, local_rank, spec, want in ((4, None, "cuda", 0), (4, "2", "auto", 2), (1, "3", "cuda", 0),
                                          (4, None, "cuda:3", 3)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        if local_rank is not None:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert model_device(spec) == torch.device("cuda", want) and chosen[-1] == want
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="GPU 5 does not exist"):
        model_device("cuda:5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="would put every rank on GPU 1"):
        model_device("cuda:1")
