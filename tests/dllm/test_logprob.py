"""CPU tests of dllm_rl.logprob: hand-worked values and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from dllm_rl.logprob import (
    coupled_logprob,
    coupled_masks,
    d1_masked_input,
    elbo_loss,
    forward_mask,
    masked_input,
    token_logprobs,
    trace_rows,
)

LN2, LN3 = math.log(2.0), math.log(3.0)
M = 99  # mask id


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- token_logprobs
def test_token_logprobs_hand_values():
    # logits [ln3, 0] -> softmax [3/4, 1/4]: log p = [ln 3/4, ln 1/4] = [-0.287682, -1.386294].
    # T = 2: logits [ln3 / 2, 0] -> p0 = sqrt3 / (1 + sqrt3) = 0.633975, ln = -0.455746.
    logits = torch.tensor([[[LN3, 0.0], [LN3, 0.0]]], dtype=torch.bfloat16)  # [1, 2, 2]
    targets = torch.tensor([[0, 1]])
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    close(out, [[math.log(0.75), math.log(0.25)]], atol=1e-2)  # bf16 ln3 = 1.0938
    logits = torch.tensor([[[LN3, 0.0], [LN3, 0.0]]])  # float32
    close(token_logprobs(logits, targets), [[-0.287682, -1.386294]])
    close(token_logprobs(logits, targets, temperature=2.0)[0, 0], -0.455746)
    # temperature <= 0 means 1
    close(token_logprobs(logits, targets, temperature=0.0), token_logprobs(logits, targets))


def test_token_logprobs_hands_its_chunk_to_the_memory_saving_form():
    """chunk goes to mmrl.core's chunked form: the same numbers (ln 3/4, ln 1/4), and a chunk
    below 1 refused there."""
    logits = torch.tensor([[[LN3, 0.0], [LN3, 0.0], [0.0, LN3]]])
    targets = torch.tensor([[0, 1, 1]])
    close(token_logprobs(logits, targets, chunk=2), [[math.log(0.75), math.log(0.25), math.log(0.75)]])
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        token_logprobs(logits, targets, chunk=0)


# ---------------------------------------------------------------- d1
def test_d1_masked_input_deterministic_and_padding():
    B, P, C = 4, 200, 5
    prompt = torch.randint(0, 50, (B, P), generator=gen(1))
    completion = torch.randint(0, 50, (B, C), generator=gen(2))
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[:, :20] = False  # left padding
    a = d1_masked_input(prompt, completion, mask_id=M, seed=7, prompt_valid=valid)
    b = d1_masked_input(prompt, completion, mask_id=M, seed=7, prompt_valid=valid)
    c = d1_masked_input(prompt, completion, mask_id=M, seed=8, prompt_valid=valid)
    assert a.shape == (B, P + C)
    assert torch.equal(a, b)  # same seed: old and new log-probs see one mask
    assert not torch.equal(a, c)
    assert (a[:, P:] == M).all()  # every completion token masked
    assert torch.equal(a[:, :20], prompt[:, :20])  # padding never masked
    kept = a[:, :P] == prompt
    assert torch.equal(a[:, :P][~kept], torch.full_like(prompt[~kept], M))
    frac = (~kept[:, 20:]).float().mean().item()  # 720 valid tokens, p = 0.15: sd 0.013
    assert 0.09 < frac < 0.21
    # p_mask = 0: prompt untouched; p_mask = 1: every valid prompt token masked.
    assert torch.equal(
        d1_masked_input(prompt, completion, mask_id=M, p_mask=0.0, seed=1)[:, :P], prompt
    )
    full = d1_masked_input(prompt, completion, mask_id=M, p_mask=1.0, seed=1, prompt_valid=valid)
    assert (full[:, 20:] == M).all() and torch.equal(full[:, :20], prompt[:, :20])


def test_d1_masks_prompt_tokens_at_its_default_rate():
    """p_mask defaults to 0.15 (d1): 16000 valid prompt tokens, sd sqrt(0.15 * 0.85 / 16000) = 0.0028,
    so the masked fraction lies within 0.15 +- 0.012 (4 sd); 0.1 or 0.2 would not."""
    prompt = torch.zeros(8, 2000, dtype=torch.long)
    out = d1_masked_input(prompt, torch.zeros(8, 3, dtype=torch.long), mask_id=M, seed=0)
    frac = (out[:, :2000] == M).float().mean().item()
    assert abs(frac - 0.15) < 0.012


# ---------------------------------------------------------------- coupled-GRPO
def test_coupled_masks_complementary():
    valid = torch.ones(64, 30, dtype=torch.bool)
    valid[:, 25:] = False
    m1, m2 = coupled_masks(valid, generator=gen(3))
    assert not (m1 & m2).any()  # never masked twice
    assert torch.equal(m1 | m2, valid)  # every valid token masked once, padding never
    rate = m1[:, :25].float().mean().item()  # E[t] = 0.5 for t ~ U(0.2, 0.8)
    assert 0.4 < rate < 0.6
    r1, _ = coupled_masks(valid, generator=gen(3))
    assert torch.equal(r1, m1)


def test_coupled_masks_rate_of_each_row_stays_in_t_range():
    """Each row's t is drawn from t_range itself: no row masks far more or less than t_range allows."""
    valid = torch.ones(200, 4000, dtype=torch.bool)
    m1, _ = coupled_masks(valid, generator=gen(5))
    rates = m1.float().mean(1)
    assert rates.min().item() > 0.17 and rates.max().item() < 0.83
    m1, _ = coupled_masks(valid, generator=gen(5), t_range=(0.5, 0.6))
    rates = m1.float().mean(1)
    assert rates.min().item() > 0.47 and rates.max().item() < 0.63


def test_coupled_masks_draw_one_t_per_row():
    """t ~ U(0.2, 0.8) for each row (DiffuCoder draws one per batch): with 2000 positions a
    row's mask rate is its t within +-0.04 (4 sd), so 64 rows spread over most of (0.2, 0.8)
    (the chance that 64 uniform draws span less than 0.4 of the 0.6 range is ~1e-9)."""
    m1, _ = coupled_masks(torch.ones(64, 2000, dtype=torch.bool), generator=gen(4))
    rates = m1.float().mean(1)
    assert rates.max().item() - rates.min().item() > 0.3


def test_coupled_logprob_hand_values():
    logp1 = torch.tensor([[-1.0, -2.0, -3.0]])
    logp2 = torch.tensor([[-4.0, -5.0, -6.0]])
    m1 = torch.tensor([[True, False, False]])
    m2 = torch.tensor([[False, True, False]])  # position 2 invalid
    # pos 0 masked in pass 1 -> -1; pos 1 in pass 2 -> -5; pos 2 in neither -> 0
    close(coupled_logprob(logp1, logp2, m1, m2), [[-1.0, -5.0, 0.0]])
    ids = torch.tensor([[5, 6, 7]])
    assert masked_input(ids, m1, M).tolist() == [[M, 6, 7]]


# ---------------------------------------------------------------- TraceRL
# Hand-made commit-step map, C = 8, sampler blocks of 4 positions, -1 = padding.
#   rollout 0: [0, 2, 1, 2 | 3, 5, 4, -1]  distinct {0,1,2,3,4,5}, K = 6
#   rollout 1: [3, 0, 0, 1 | 7, 7, 9, -1]  distinct {0,1,3,7,9},   K = 5
COMMIT = torch.tensor([[0, 2, 1, 2, 3, 5, 4, -1], [3, 0, 0, 1, 7, 7, 9, -1]])


def positions(mask_row):
    return torch.nonzero(mask_row).flatten().tolist()


def check_invariants(rows, commit, s, block_length):
    valid = commit >= 0
    for b in range(commit.shape[0]):
        sel = rows.sample == b
        k = len(set(commit[b][valid[b]].tolist()))
        assert sel.sum().item() <= math.ceil(k / s)
        cover = rows.target[sel].sum(0)  # [C]
        assert torch.equal(cover, valid[b].long())  # each token a target of exactly one row
    assert not (rows.target & ~rows.input_masked).any()  # targets always masked in the input
    assert not (rows.input_masked & ~valid[rows.sample]).any()  # padding never masked
    for i in range(rows.sample.numel()):  # each row's targets are whole steps
        c = commit[rows.sample[i]]
        steps = set(c[rows.target[i]].tolist())
        assert rows.step[i].item() == min(steps)
        assert torch.equal(rows.target[i], torch.isin(c, torch.tensor(sorted(steps))))
        if block_length is None:
            assert len(steps) <= s
            assert torch.equal(rows.input_masked[i], c >= rows.step[i])


def test_trace_rows_full_attention_hand_map():
    # s = 2, merged over all steps of the rollout (TraceRL rl_llada.py):
    #   rollout 0 groups {0,1} {2,3} {4,5} -> 3 rows = ceil(6/2);
    #     row step 0: targets pos 0,2; input masks commit >= 0: pos 0..6
    #     row step 2: targets pos 1,3,4 (straddles the block boundary); masks pos 1,3,4,5,6
    #     row step 4: targets pos 5,6; masks pos 5,6
    #   rollout 1 groups {0,1} {3,7} {9} -> 3 rows = ceil(5/2);
    #     step 0: targets 1,2,3; masks 0..6 | step 3: targets 0,4,5; masks 0,4,5,6 | step 9: 6; 6
    rows = trace_rows(COMMIT, s=2)
    assert rows.sample.tolist() == [0, 0, 0, 1, 1, 1]
    assert rows.step.tolist() == [0, 2, 4, 0, 3, 9]
    assert [positions(t) for t in rows.target] == [
        [0, 2],
        [1, 3, 4],
        [5, 6],
        [1, 2, 3],
        [0, 4, 5],
        [6],
    ]
    assert [positions(m) for m in rows.input_masked] == [
        [0, 1, 2, 3, 4, 5, 6],
        [1, 3, 4, 5, 6],
        [5, 6],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 4, 5, 6],
        [6],
    ]
    check_invariants(rows, COMMIT, 2, None)
    one = trace_rows(COMMIT, s=1)  # s = 1: one row per distinct step, K rows
    assert (one.sample == 0).sum() == 6 and (one.sample == 1).sum() == 5
    check_invariants(one, COMMIT, 1, None)
    big = trace_rows(COMMIT, s=10)  # s >= K: one row, every valid token a target
    assert big.sample.tolist() == [0, 1] and big.step.tolist() == [0, 0]
    check_invariants(big, COMMIT, 10, None)


def test_trace_rows_refuses_a_group_size_below_one():
    with pytest.raises(ValueError, match="s must be >= 1, got 0"):
        trace_rows(torch.tensor([[0, 1, 2]]), s=0)


def test_trace_rows_block_attention_hand_map():
    # block_length 4, s = 2, merged within each block, r-th groups packed (TraceRL rl_sdar.py):
    #   rollout 0: block 0 steps {0,1} {2}; block 1 steps {3,4} {5}  -> 2 rows <= ceil(6/2)
    #     row 0: targets pos 0,2 + 4,6; masks all valid pos 0..6; step min(0, 3) = 0
    #     row 1: targets pos 1,3 + 5;  masks pos 1,3,5;          step min(2, 5) = 2
    #   rollout 1: block 0 steps {0,1} {3}; block 1 steps {7,9}      -> 2 rows <= ceil(5/2)
    #     row 0: targets 1,2,3 + 4,5,6; masks 0..6; step 0 | row 1: target 0; masks 0; step 3
    rows = trace_rows(COMMIT, s=2, block_length=4)
    assert rows.sample.tolist() == [0, 0, 1, 1]
    assert rows.step.tolist() == [0, 2, 0, 3]
    assert [positions(t) for t in rows.target] == [[0, 2, 4, 6], [1, 3, 5], [1, 2, 3, 4, 5, 6], [0]]
    assert [positions(m) for m in rows.input_masked] == [
        [0, 1, 2, 3, 4, 5, 6],
        [1, 3, 5],
        [0, 1, 2, 3, 4, 5, 6],
        [0],
    ]
    check_invariants(rows, COMMIT, 2, 4)


@pytest.mark.parametrize("block_length", [None, 4])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_trace_rows_random_block_sampler(block_length, s):
    # A block-sequential sampler: block j commits at steps after block j-1's; random padding tail.
    g = gen(11)
    B, C, bl = 6, 16, 4
    commit = torch.full((B, C), -1)
    for b in range(B):
        n = int(torch.randint(1, C + 1, (1,), generator=g))
        base = 0
        for j in range(0, n, bl):
            width = min(bl, n - j)
            local = torch.randint(0, 3, (width,), generator=g)
            commit[b, j : j + width] = base + local
            base += int(local.max()) + 1
    rows = trace_rows(commit, s=s, block_length=block_length)
    check_invariants(rows, commit, s, block_length)
    empty = trace_rows(torch.full((2, 5), -1), s=s, block_length=block_length)
    assert empty.sample.numel() == 0 and empty.target.shape == (0, 5)


def test_trace_rows_of_no_rollouts_or_no_positions_are_empty():
    """A batch of no rollouts [0, C], or of rollouts with no positions [B, 0], gives no rows."""
    for B, C in ((0, 5), (3, 0)):
        rows = trace_rows(torch.zeros(B, C, dtype=torch.long), s=2, block_length=4)
        assert rows.sample.numel() == 0 and rows.step.numel() == 0
        assert rows.target.shape == (0, C) and rows.input_masked.shape == (0, C)
        assert rows.target.dtype == torch.bool


# ---------------------------------------------------------------- LLaDA ELBO
def test_elbo_loss_hand_value():
    # V = 2. Logits [0,0] -> CE ln2; logits [ln3, 0] with target 1 -> CE ln4 = 2 ln2.
    # valid [[1,1,1],[1,1,0]] -> 5 tokens; masked [[1,0,1],[0,1,1]], p = [0.5, 0.25]
    #   row 0: pos 0 ln2 / 0.5 = 2 ln2; pos 2 2ln2 / 0.5 = 4 ln2
    #   row 1: pos 1 ln2 / 0.25 = 4 ln2; pos 2 invalid, ignored (would add 8 ln2)
    #   loss = 10 ln2 / 5 = 2 ln2 = 1.386294
    z, r, o = [0.0, 0.0], [LN3, 0.0], [5.0, -5.0]
    logits = torch.tensor([[z, o, r], [o, z, r]])  # [2, 3, 2]
    targets = torch.tensor([[0, 0, 1], [0, 0, 1]])
    masked = torch.tensor([[True, False, True], [False, True, True]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    p = torch.tensor([0.5, 0.25])
    close(elbo_loss(logits, targets, masked, p, valid), 2 * LN2)
    close(elbo_loss(logits, targets, masked, p, valid), 1.386294)


def test_forward_mask_and_elbo_unbiased():
    # Logits that ignore the mask: E[1{masked}/p] = 1 per token, so E[loss] = mean CE over
    # valid tokens. 20000 draws of one 4-token row (the 4th padding), CE = [ln2, ln4, ln2]:
    # mean CE = 4 ln2 / 3 = 0.924196. Per-draw sd <= 2 ln2 * sqrt(E[1/p] - 1), E[1/p] =
    # ln(1/eps)/(1 - eps) = 6.92 -> sd(mean) ~ 0.01; tolerance 0.05.
    n = 20000
    valid = torch.tensor([[True, True, True, False]]).expand(n, 4)
    masked, p = forward_mask(valid, generator=gen(5))
    assert masked.shape == (n, 4) and p.shape == (n,)
    assert not masked[:, 3].any()  # padding never masked
    assert p.min() >= 1e-3 and p.max() <= 1.0
    assert abs(masked[:, :3].float().mean().item() - 0.5) < 0.02  # E[p] ~ 0.5
    z, r = [0.0, 0.0], [LN3, 0.0]
    logits = torch.tensor([[z, r, z, z]]).expand(n, 4, 2)
    targets = torch.tensor([[0, 1, 1, 0]]).expand(n, 4)
    loss = elbo_loss(logits, targets, masked, p, valid)
    assert abs(loss.item() - 4 * LN2 / 3) < 0.05
    # A full mask with p = 1 gives exactly the mean CE.
    ones = torch.ones(n)
    close(elbo_loss(logits, targets, valid, ones, valid), 4 * LN2 / 3)


def test_forward_mask_rate_spans_eps_to_one_in_float32():
    """p = (1 - eps) t + eps with eps = 1e-3 and t ~ U(0, 1): over 20000 rows p covers [1e-3, 1);
    the least t of 20000 is below 1e-3 (chance 1 - e^-20), so min p < 1e-3 + 1e-3."""
    _, p = forward_mask(torch.ones(20000, 2, dtype=torch.bool), generator=gen(6))
    assert p.dtype == torch.float32
    assert 1e-3 <= p.min().item() < 2e-3
    assert 0.99 < p.max().item() < 1.0


def test_elbo_loss_without_valid_tokens_is_zero_and_one_token_is_its_ce_over_p():
    """No valid token: 0 (the token count is clamped to 1), not 0/0. One valid token, masked
    at p = 0.5, with CE ln 2 (logits [0, 0]): loss = ln2 / 0.5 / 1 = 2 ln 2."""
    logits = torch.zeros(1, 2, 2)
    targets = torch.tensor([[0, 1]])
    none = torch.zeros(1, 2, dtype=torch.bool)
    loss = elbo_loss(logits, targets, none, torch.tensor([0.5]), none)
    assert loss.item() == 0.0
    one = torch.tensor([[True, False]])
    close(elbo_loss(logits, targets, torch.ones(1, 2, dtype=torch.bool), torch.tensor([0.5]), one), 2 * LN2)
