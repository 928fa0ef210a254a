"""Chunked token log-probabilities (mmrl.core.logprob): the plain numbers and gradients, and
less kept for the backward pass."""

from __future__ import annotations

import pytest
import torch

from mmrl.core.logprob import token_entropy, token_logprobs

BANNED = torch.tensor([3, 17])


def _inputs(dtype, seed=0, shape=(3, 5, 40)):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets[targets == 3] = 4  # no target is a banned token
    targets[targets == 17] = 18
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_matches_the_plain_form_and_its_gradient(dtype, chunk):
    logits, targets = _inputs(dtype)
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    plain = token_logprobs(logits, targets, 0.7, banned=BANNED)
    (grad_plain,) = torch.autograd.grad((plain * weights).sum(), logits)
    chunked = token_logprobs(logits, targets, 0.7, banned=BANNED, chunk=chunk)
    (grad_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    assert chunked.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    assert grad_chunked.dtype == dtype
    torch.testing.assert_close(grad_chunked.float(), grad_plain.float(), rtol=1e-5, atol=1e-6)
    assert float(grad_chunked[..., BANNED].abs().sum()) == 0.0


def test_the_plain_form_is_the_usual_expression_bit_for_bit():
    logits, targets = _inputs(torch.float32)
    usual = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(token_logprobs(logits, targets, 0.7), usual)
    token_logprobs(logits, targets, 0.7, banned=BANNED)  # banning never writes into the logits
    assert bool((logits[..., 3] != float("-inf")).all())


def test_entropy_matches_the_plain_form():
    logits, _ = _inputs(torch.float32)
    logp = torch.log_softmax(logits.detach() / 0.7, -1)
    torch.testing.assert_close(token_entropy(logits, 0.7, chunk=4), -(logp.exp() * logp).sum(-1))


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_chunked_keeps_the_logits_not_float32_copies_for_the_backward():
    """bfloat16 logits [2, 16, 4096]: the plain form keeps a float32 log-softmax (4 bytes a
    logit); the chunked one the bfloat16 logits (2 bytes) and one float per position."""
    logits, targets = _inputs(torch.bfloat16, shape=(2, 16, 4096))
    n = logits.numel()
    plain = _saved_bytes(lambda: token_logprobs(logits, targets, 1.0))
    chunked = _saved_bytes(lambda: token_logprobs(logits, targets, 1.0, chunk=8))
    assert plain >= 4 * n and chunked <= 2 * n + 16 * targets.numel()


@pytest.mark.parametrize("modality", ["vlm", "dllm"])
def test_model_logprob_chunk_trains_with_the_same_loss_and_gradient(modality, tmp_path, one_thread):
    """The bundled VLM (GRPO) and dLLM (diffu-GRPO): one batch's loss and gradient with
    model.logprob_chunk=5 against the plain computation."""
    import importlib

    from mmrl.core.config import load_config
    from mmrl.core.trainer import Trainer

    backend = importlib.import_module({"vlm": "mmrl.vlm.backend", "dllm": "dllm_rl.backend"}[modality])
    small = {"vlm": ["rollout.max_new_tokens=16", "task.num_eval=2"], "dllm": ["task.num_eval=2", "task.num_train=20"]}
    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG, overrides=[
        "rollout.prompts_per_step=2", "rollout.num_generations=4", f"output_dir={tmp_path}", *small[modality]])
    trainer = Trainer(cfg, *backend.build(cfg))
    batch, _ = trainer.scheduler.next_groups(version=0)
    if batch.advantages.abs().sum() == 0:  # every group alike: give the loss something to weigh
        batch.advantages = torch.linspace(-1, 1, len(batch))
    runs = []
    for chunk in (None, 5):
        trainer.policy.logprob_chunk = chunk
        trainer.optimizer.zero_grad(set_to_none=True)
        out = trainer.method.loss(trainer.policy, batch, batch.advantages, denom=None)
        out.loss.backward()
        runs.append((float(out.loss.detach()), torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None])))
    (loss, grad), (loss_c, grad_c) = runs
    assert loss_c == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert float(grad.norm()) > 0
    torch.testing.assert_close(grad_c, grad, rtol=1e-4, atol=1e-6)


def test_sliced_transposed_and_empty_inputs():
    """What the callers pass: a slice such as out.logits[:, :-1] (not contiguous), read in views;
    a transposed tensor; no positions at all."""
    full, targets = _inputs(torch.float32, shape=(3, 6, 40))
    sliced = full[:, :-1]
    for logits in (sliced, full.detach().transpose(0, 1).contiguous().transpose(0, 1)[:, :-1].requires_grad_()):
        plain = token_logprobs(logits, targets[:, :-1], 0.7)
        (g_plain,) = torch.autograd.grad(plain.sum(), logits)
        chunked = token_logprobs(logits, targets[:, :-1], 0.7, chunk=4)
        (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
        torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_chunked, g_plain, rtol=1e-5, atol=1e-6)
    empty = torch.randn(2, 0, 40)
    assert token_entropy(empty, 0.7, chunk=1).shape == (2, 0)
    assert token_logprobs(empty.requires_grad_(), torch.zeros(2, 0, dtype=torch.long), chunk=4).shape == (2, 0)


def test_chunked_on_the_simulated_device_with_banned_ids_as_a_list():
    from simdevice import SIM, simulated_device

    full, targets = _inputs(torch.float32, shape=(2, 6, 40))
    cpu = token_logprobs(full[:, :-1], targets[:, :-1], 0.7, banned=[3, 17], chunk=3)
    (g_cpu,) = torch.autograd.grad(cpu.sum(), full)
    with simulated_device():
        x = full.detach().to(SIM).requires_grad_()
        lp = token_logprobs(x[:, :-1], targets[:, :-1].to(SIM), 0.7, banned=[3, 17], chunk=3)
        lp.sum().backward()
        assert lp.device == SIM and x.grad.device == SIM
        got, grad = lp.detach().cpu(), x.grad.cpu()
    assert torch.equal(got, cpu.detach()) and torch.equal(grad, g_cpu)


def test_entropy_with_banned_ids_is_that_of_the_tokens_left():
    """A banned token has probability 0 and adds 0 (not 0 * -inf = nan) to the entropy, which is
    then the entropy of the softmax over the other tokens."""
    from mmrl.core.logprob import entropy_of

    logits, _ = _inputs(torch.float32)
    allowed = [v for v in range(logits.shape[-1]) if v not in BANNED.tolist()]
    logp = torch.log_softmax(logits.detach()[..., allowed] / 0.7, -1)
    expected = -(logp.exp() * logp).sum(-1)
    got = token_entropy(logits, 0.7, banned=BANNED, chunk=4)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, expected)
    masked = torch.log_softmax(logits.detach() / 0.7, -1).index_fill(-1, BANNED, float("-inf"))
    torch.testing.assert_close(entropy_of(masked.log_softmax(-1)), expected)


@pytest.mark.parametrize("shape", [(5, 40), (2, 3, 5, 40)])
def test_chunked_takes_any_leading_dimensions(shape):
    """[..., L, V]: one row of positions, or several leading dimensions, as the plain form does."""
    logits, targets = _inputs(torch.float32, shape=shape)
    plain = token_logprobs(logits, targets, 0.7, banned=BANNED)
    (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    chunked = token_logprobs(logits, targets, 0.7, banned=BANNED, chunk=2)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert chunked.shape == plain.shape == shape[:-1]
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_chunked, g_plain, rtol=1e-5, atol=1e-6)
    assert token_entropy(logits, 0.7, chunk=2).shape == shape[:-1]


def test_a_chunk_below_one_is_refused_by_name():
    logits, targets = _inputs(torch.float32)
    for chunk in (0, -1):
        with pytest.raises(ValueError, match="chunk must be >= 1"):
            token_logprobs(logits, targets, chunk=chunk)
