"""dllm_rl.samplers: commit rules worked by hand, and the block decoding loop."""

import math

import pytest
import torch

from dllm_rl.samplers import (
    DecodeResult,
    decode,
    num_transfer_tokens,
    select_commits,
    state_at,
)

T, F = True, False


# ---------------------------------------------------------------- select_commits


def test_low_confidence_takes_most_confident_masked():
    conf = torch.tensor([[0.9, 0.1, 0.5, 0.7], [0.2, 0.3, 0.99, 0.4]])
    masked = torch.tensor([[T, T, T, F], [T, T, F, T]])
    c = select_commits(conf, masked, strategy="low_confidence", num_commit=2)
    # row 0: masked confidences 0.9, 0.1, 0.5 -> positions 0 and 2 (0.7 is not masked)
    # row 1: masked 0.2, 0.3, 0.4 -> positions 3 and 1 (0.99 is not masked)
    assert c.mask.tolist() == [[T, F, T, F], [F, T, F, T]]
    assert c.fallback.tolist() == [F, F]
    # expected wrong: row 0 (1-0.9)+(1-0.5) = 0.6; row 1 (1-0.3)+(1-0.4) = 1.3
    torch.testing.assert_close(c.expected_wrong, torch.tensor([0.6, 1.3]))


def test_low_confidence_per_row_count_is_clamped():
    conf = torch.tensor([[0.9, 0.1, 0.5, 0.7], [0.2, 0.3, 0.99, 0.4]])
    masked = torch.tensor([[T, T, T, F], [T, T, F, T]])
    c = select_commits(conf, masked, strategy="low_confidence", num_commit=torch.tensor([1, 5]))
    # row 0: one -> position 0 (0.9); row 1: 5 clamped to its 3 masked positions
    assert c.mask.tolist() == [[T, F, F, F], [T, T, F, T]]


def test_ties_commit_the_leftmost_positions_first():
    """Equal confidences go leftmost first (a stable sort): rows of 32, since up to 16 entries
    torch's CPU sort keeps the order of ties even when not asked to be stable."""
    conf = torch.full((2, 32), 0.5)
    conf[1, 20] = 0.9                                    # row 1: one clear winner, then the tie
    masked = torch.ones(2, 32, dtype=torch.bool)
    masked[1, :3] = F                                    # row 1's leftmost masked is position 3
    c = select_commits(conf, masked, strategy="low_confidence", num_commit=3)
    assert [r.nonzero().squeeze(1).tolist() for r in c.mask] == [[0, 1, 2], [3, 4, 20]]
    # the other rules that rank: threshold's fallback (the most confident one) and tau_budget's k = n_s
    th = select_commits(torch.full((1, 32), 0.5), torch.ones(1, 32, dtype=torch.bool), strategy="threshold")
    assert th.mask[0].nonzero().squeeze(1).tolist() == [0]
    tb = select_commits(torch.full((1, 32), 0.5), torch.ones(1, 32, dtype=torch.bool), strategy="tau_budget",
                        num_commit=2)
    assert tb.mask[0].nonzero().squeeze(1).tolist() == [0, 1]


def test_unmasked_confidence_is_ignored_whatever_its_value():
    masked = torch.tensor([[T, F, T]])
    for junk in (float("-inf"), float("inf"), 5.0, -3.0):
        conf = torch.tensor([[0.3, junk, 0.6]])
        for strategy in ("low_confidence", "threshold", "fork", "tau_budget", "ar"):
            c = select_commits(conf, masked, strategy=strategy, num_commit=1)
            assert not c.mask[0, 1], (strategy, junk)
            assert torch.isfinite(c.expected_wrong).all()


def test_threshold_and_fork():
    conf = torch.tensor([[0.85, 0.95, 0.3, 0.99], [0.5, 0.7, 0.6, 0.99]])
    masked = torch.tensor([[T, T, T, F], [T, T, T, F]])
    th = select_commits(conf, masked, strategy="threshold", threshold=0.8)
    fk = select_commits(conf, masked, strategy="fork", threshold=0.8)
    # row 0: 0.85 and 0.95 > 0.8 -> both rules commit positions 0, 1
    # row 1: nothing masked > 0.8: threshold takes the most confident (0.7, pos 1),
    #        fork the leftmost masked (pos 0) and flags the fallback
    assert th.mask.tolist() == [[T, T, F, F], [F, T, F, F]]
    assert fk.mask.tolist() == [[T, T, F, F], [T, F, F, F]]
    assert th.fallback.tolist() == [F, F]
    assert fk.fallback.tolist() == [F, T]
    # fork row 1 expected wrong = 1 - 0.5 = 0.5
    torch.testing.assert_close(fk.expected_wrong, torch.tensor([0.2, 0.5]))


def test_fork_leftmost_skips_unmasked_prefix():
    conf = torch.tensor([[0.1, 0.2, 0.7, 0.3]])
    masked = torch.tensor([[F, F, T, T]])
    fk = select_commits(conf, masked, strategy="fork")
    assert fk.mask.tolist() == [[F, F, T, F]] and fk.fallback.tolist() == [T]


def test_tau_budget_slim_example():
    conf = torch.tensor([[0.97, 0.96, 0.95, 0.5]])
    masked = torch.ones(1, 4, dtype=torch.bool)
    c = select_commits(conf, masked, strategy="tau_budget", num_commit=1, tau=0.9, m=1.0)
    # A = {0.97, 0.96, 0.95}; risks 0.03, 0.04, 0.05; budget 1 * (1 - 0.9) = 0.1
    # 0.03 + 0.04 = 0.07 <= 0.1, + 0.05 = 0.12 > 0.1 -> k_budget = 2 = max(2, n_s=1)
    assert c.mask.tolist() == [[T, T, F, F]]
    torch.testing.assert_close(c.expected_wrong, torch.tensor([0.07]))
    # n_s = 3 exceeds the budget's 2 -> the 3 most confident
    c = select_commits(conf, masked, strategy="tau_budget", num_commit=3)
    assert c.mask.tolist() == [[T, T, T, F]]
    # m = 2 -> budget 0.2 >= 0.12 -> all of A (3), never 0.5 (not > tau)
    c = select_commits(conf, masked, strategy="tau_budget", num_commit=1, m=2.0)
    assert c.mask.tolist() == [[T, T, T, F]]


def test_tau_budget_edge_cases():
    # nothing above tau -> k_budget = 0 -> n_s = 1 most confident (0.6)
    c = select_commits(torch.tensor([[0.5, 0.6]]), torch.ones(1, 2, dtype=torch.bool),
                       strategy="tau_budget", num_commit=1)
    assert c.mask.tolist() == [[F, T]]
    # 0.95, 0.95: risks 0.05 + 0.05 = 0.1 == budget, but in float64 the sum is
    # 0.10000000000000009 > 1 - 0.9 = 0.09999999999999998; the 1e-9 tolerance commits both
    c = select_commits(torch.tensor([[0.95, 0.95, 0.2]], dtype=torch.float64),
                       torch.ones(1, 3, dtype=torch.bool), strategy="tau_budget", num_commit=1)
    assert c.mask.tolist() == [[T, T, F]]
    # an unmasked 0.99 is neither in A nor committed: A = {0.97}
    c = select_commits(torch.tensor([[0.99, 0.97, 0.96]]), torch.tensor([[F, T, T]]),
                       strategy="tau_budget", num_commit=1, tau=0.95)
    # tau 0.95: budget 0.05; risks 0.03 (+0.04 = 0.07 > 0.05) -> k = 1
    assert c.mask.tolist() == [[F, T, F]]


def test_ar_and_empty_rows():
    conf = torch.tensor([[0.1, 0.9, 0.8], [0.9, 0.9, 0.9]])
    masked = torch.tensor([[F, T, T], [F, F, F]])
    c = select_commits(conf, masked, strategy="ar")
    assert c.mask.tolist() == [[F, T, F], [F, F, F]]
    for strategy in ("low_confidence", "threshold", "fork", "tau_budget"):
        c = select_commits(conf, masked, strategy=strategy, num_commit=2)
        assert not c.mask[1].any() and not c.fallback[1], strategy
        assert c.expected_wrong[1] == 0


def test_select_commits_errors():
    conf, masked = torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="bogus"):
        select_commits(conf, masked, strategy="bogus")
    for strategy in ("low_confidence", "tau_budget"):
        with pytest.raises(ValueError, match=f"{strategy}.*num_commit"):
            select_commits(conf, masked, strategy=strategy)


def test_select_commits_refuses_confidence_and_mask_of_other_shapes():
    """confidence and masked must both be [B, L]: a [1, L] confidence is not broadcast over a
    [2, L] mask, and 1-D inputs of one shape are refused too."""
    masked = torch.ones(2, 3, dtype=torch.bool)
    for conf, mask in ((torch.rand(1, 3), masked), (torch.rand(3), masked[0])):
        with pytest.raises(ValueError, match="must both be"):
            select_commits(conf, mask, strategy="low_confidence", num_commit=1)


def test_a_masked_confidence_of_zero_still_outranks_unmasked_positions():
    """A drawn token of probability 0 (underflow) is still a candidate: the unmasked position
    to its left, whatever its value, never takes its place."""
    conf = torch.tensor([[0.0, 0.0]])
    masked = torch.tensor([[F, T]])
    for strategy in ("low_confidence", "threshold", "tau_budget"):
        c = select_commits(conf, masked, strategy=strategy, num_commit=1)
        # the only masked position is 1: low_confidence n = 1, threshold's fallback, tau_budget's n_s = 1
        assert c.mask.tolist() == [[F, T]], strategy
        torch.testing.assert_close(c.expected_wrong, torch.tensor([1.0]))  # 1 - 0


def test_tau_budget_sums_the_risks_of_the_most_confident_first():
    """A is sorted by descending c: 0.99, 0.98, 0.91 give risks 0.01, 0.02, 0.09; 0.01 + 0.02
    = 0.03 <= 0.1 and + 0.09 = 0.12 > 0.1, so k_budget = 2 (summed from the least confident,
    0.09 <= 0.1 but 0.09 + 0.02 = 0.11 > 0.1 would give 1)."""
    conf = torch.tensor([[0.91, 0.99, 0.5, 0.98]])
    c = select_commits(conf, torch.ones(1, 4, dtype=torch.bool), strategy="tau_budget", num_commit=1,
                       tau=0.9, m=1.0)
    assert c.mask.tolist() == [[F, T, F, T]]
    torch.testing.assert_close(c.expected_wrong, torch.tensor([0.03]))


def test_tau_budget_risk_of_float32_confidences_is_summed_in_float64():
    """c = 0.37 - 2.5e-8 (a float32): its exact risk 1 - c = 0.630000025 exceeds the budget
    m (1 - tau) = 0.7 * 0.9 = 0.63 by more than the 1e-9 slack, so with n_s = 0 nothing is
    committed; in float32, 1 - c and the budget both round to 0.62999999523 and it would be."""
    c32 = torch.tensor([[0.3699999749660492]], dtype=torch.float32)
    assert 1.0 - c32.double().item() > 0.63 + 1e-8             # the float64 risk, as worked above
    c = select_commits(c32, torch.ones(1, 1, dtype=torch.bool), strategy="tau_budget", num_commit=0,
                       tau=0.1, m=0.7)
    assert c.mask.tolist() == [[F]]
    # a float32 c clearly inside the budget (risk 0.6 <= 0.63) is committed
    c = select_commits(torch.tensor([[0.4]]), torch.ones(1, 1, dtype=torch.bool), strategy="tau_budget",
                       num_commit=0, tau=0.1, m=0.7)
    assert c.mask.tolist() == [[T]]


def test_expected_wrong_keeps_the_confidences_float_dtype():
    """float64 confidences give a float64 expected-wrong sum, 1 - 0.75 + 1 - 0.875 = 0.375."""
    conf = torch.tensor([[0.75, 0.875, 0.1]], dtype=torch.float64)
    c = select_commits(conf, torch.ones(1, 3, dtype=torch.bool), strategy="low_confidence", num_commit=2)
    assert c.expected_wrong.dtype == torch.float64
    assert c.expected_wrong.tolist() == [0.375]
    half = select_commits(conf.half(), torch.ones(1, 3, dtype=torch.bool), strategy="low_confidence",
                          num_commit=2)
    assert half.expected_wrong.dtype == torch.float16 and half.expected_wrong.tolist() == [0.375]


def test_select_commits_default_threshold_tau_and_m():
    """Defaults threshold 0.8 (Fast-dLLM, Fork-dLLM's lambda), tau 0.9 and m 1 (SLIM-RL)."""
    masked = torch.ones(1, 4, dtype=torch.bool)
    # threshold 0.8: 0.85 and 0.81 are above it, 0.79 and 0.5 are not
    c = select_commits(torch.tensor([[0.85, 0.81, 0.79, 0.5]]), masked, strategy="threshold")
    assert c.mask.tolist() == [[T, T, F, F]]
    # tau 0.9, m 1: A = {0.96, 0.95, 0.94} (0.85 < tau), risks 0.04 + 0.05 = 0.09 <= 0.1,
    # + 0.06 = 0.15 > 0.1 -> k = 2 (tau 0.8 or m 2 would give 3)
    c = select_commits(torch.tensor([[0.96, 0.95, 0.94, 0.85]]), masked, strategy="tau_budget", num_commit=1)
    assert c.mask.tolist() == [[T, T, F, F]]


def test_num_transfer_tokens():
    out = num_transfer_tokens(torch.tensor([10, 4, 3]), 4)
    # 10 = 3+3+2+2 (remainder 2 to the first steps); 4 = 1 each; 3 = 1,1,1,0
    assert out.tolist() == [[3, 3, 2, 2], [1, 1, 1, 1], [1, 1, 1, 0]]


def test_num_transfer_tokens_width_keeps_only_the_first_steps():
    """width: the first `width` columns of the schedule; a width beyond `steps` gives `steps` columns."""
    counts = torch.tensor([10, 3])
    assert num_transfer_tokens(counts, 4, width=2).tolist() == [[3, 3], [1, 1]]       # of 3,3,2,2 and 1,1,1,0
    assert num_transfer_tokens(counts, 4, width=6).tolist() == [[3, 3, 2, 2], [1, 1, 1, 0]]
    assert num_transfer_tokens(counts, 4, width=0).shape == (2, 0)                    # none, not "no width"


# ---------------------------------------------------------------- decode

V, MASK = 6, 5


def table_model(x):
    """Position j of the answer (prompt length 2) predicts token j % 3 with logit j+1 over
    zeros, so confidence grows to the right: e^(j+1) / (e^(j+1) + 5)."""
    B, L = x.shape
    logits = torch.zeros(B, L, V)
    for j in range(L - 2):
        logits[:, 2 + j, j % 3] = j + 1.0
    return logits


def seeded_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb, pos = torch.randn(V, V, generator=g) * 2, torch.randn(64, V, generator=g)

    def fn(x):  # depends on the whole context through a running mean, deterministic
        h = emb[x]
        return h.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1) + pos[: x.shape[1]]
    return fn


PROMPT = torch.tensor([[1, 2], [3, 0], [4, 4]])


def run(fn=None, **kw):
    args = {"gen_length": 8, "block_length": 4, "steps": 4, "mask_id": MASK,
            "record_states": True}
    args.update(kw)
    return decode(fn or seeded_model(), PROMPT, **args)


def check_invariants(r: DecodeResult):
    B, G = r.completion.shape
    S = r.num_steps
    assert torch.equal(r.tokens[:, :2], PROMPT)                      # prompt untouched
    assert ((r.commit_step >= 0) & (r.commit_step < S)).all()        # each committed once
    assert torch.equal(r.nfe, r.active.sum(1))
    # a row commits at a step iff it is active (each active step commits >= 1)
    per_step = torch.stack([(r.commit_step == s).sum(1) for s in range(S)], 1)  # [B, S]
    assert torch.equal(per_step > 0, r.active)
    # blocks are decoded left to right
    cs = r.commit_step.view(B, G // r.block_length, r.block_length)
    assert (cs[:, :-1].amax(-1) < cs[:, 1:].amin(-1)).all()
    # the trajectory is recoverable from the final tokens
    assert r.states.shape == (S, B, 2 + G)
    for s in range(S):
        assert torch.equal(r.state(s), r.states[s])
        assert torch.equal(state_at(r.tokens, r.commit_step, s, mask_id=MASK), r.states[s])
    assert torch.equal(r.state(S), r.tokens)
    return per_step


def test_decode_low_confidence_table_model():
    r = run(table_model, steps=4)
    # 2 blocks of 4, 2 steps each, 2 tokens a step; the right half of a block is more
    # confident, so step 0 commits answer positions 2, 3, step 1 positions 0, 1, ...
    assert r.commit_step.tolist() == [[1, 1, 0, 0, 3, 3, 2, 2]] * 3
    assert r.completion.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]] * 3
    assert r.nfe.tolist() == [4, 4, 4]
    # confidence of position 0: e^1 / (e^1 + 5) = 2.71828 / 7.71828 = 0.35218
    assert r.commit_confidence[0, 0].item() == pytest.approx(math.e / (math.e + 5), rel=1e-6)
    # temperature 0: logp is log_softmax(logits) = log(confidence)
    torch.testing.assert_close(r.commit_logp, r.commit_confidence.log())
    # expected wrong of step 0: (1 - c2) + (1 - c3), c_j = e^(j+1) / (e^(j+1) + 5)
    c = [math.exp(j + 1) / (math.exp(j + 1) + 5) for j in (2, 3)]
    assert r.expected_wrong[0, 0].item() == pytest.approx(2 - sum(c), rel=1e-6)
    check_invariants(r)


def test_low_confidence_step_i_of_a_block_commits_the_schedules_ith_count():
    """Blocks of 10 over 4 steps commit 3, 3, 2, 2 (num_transfer_tokens, in order), and the
    schedule starts again with each block; table_model's confidence grows to the right."""
    r = run(table_model, gen_length=20, block_length=10, steps=8)
    per_step = check_invariants(r)
    assert per_step.tolist() == [[3, 3, 2, 2] * 2] * 3
    block = [3, 3, 2, 2, 1, 1, 1, 0, 0, 0]              # the 3 rightmost first, then the next 3, ...
    assert r.commit_step.tolist() == [block + [s + 4 for s in block]] * 3


@pytest.mark.parametrize("strategy", ["low_confidence", "threshold", "fork", "tau_budget", "ar"])
def test_decode_invariants(strategy):
    gen = torch.Generator().manual_seed(1)
    r = run(strategy=strategy, temperature=1.0, generator=gen, threshold=0.5)
    per_step = check_invariants(r)
    if strategy == "low_confidence":
        assert r.nfe.tolist() == [4, 4, 4]             # = steps
        assert (per_step == 2).all()                     # 4 tokens / 2 steps per block
    if strategy == "ar":
        assert r.nfe.tolist() == [8, 8, 8]             # = gen_length
        # one per step, left to right: commit_step = position
        assert r.commit_step.tolist() == [list(range(8))] * 3
    if strategy == "fork":
        # a fallback step commits exactly the leftmost masked position of the block
        for b, s in r.fallback.nonzero().tolist():
            assert per_step[b, s] == 1
            pos = (r.commit_step[b] == s).nonzero().item()
            assert (r.commit_step[b, (pos // 4) * 4:pos] < s).all()
    else:
        assert not r.fallback.any()


@pytest.mark.parametrize("strategy", ["threshold", "tau_budget"])
def test_confidence_is_tempered_for_tau_budget_only(strategy):
    """tau_budget's c is p_T(x0), the drawn token's probability under the distribution it was
    drawn from (SLIM-RL); Fast-dLLM's threshold (and LLaDA's, Fork-dLLM's) is softmax(logits)."""
    t = 0.5
    r = run(table_model, strategy=strategy, temperature=t, generator=torch.Generator().manual_seed(0))
    # table_model: answer position j has logit j + 1 on token j % 3 and 0 on the other 5
    scale = 1 / t if strategy == "tau_budget" else 1.0
    for b in range(3):
        for j in range(8):
            z = math.exp((j + 1) * scale) + 5
            drew_it = int(r.completion[b, j]) == j % 3
            expected = math.exp((j + 1) * scale) / z if drew_it else 1 / z
            assert r.commit_confidence[b, j].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("strategy", ["low_confidence", "tau_budget"])
def test_more_steps_than_a_block_has_tokens_allocates_no_more(strategy):
    """A block is filled after block_length steps whatever `steps` says: 10^12 steps decode as
    8 do (the schedule was a [B, steps] tensor, 4 TB here)."""
    kw = {"strategy": strategy, "temperature": 1.0}
    a = run(steps=10**12, generator=torch.Generator().manual_seed(3), **kw)
    b = run(steps=8, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.nfe, b.nfe) and torch.equal(a.commit_step, b.commit_step)


def test_threshold_confident_model_one_step_per_block():
    def confident(x):
        logits = torch.zeros(x.shape[0], x.shape[1], V)
        logits[..., 3] = 50.0                            # p(3) ~ 1 - 5e-22 > 0.8
        return logits
    for strategy in ("threshold", "fork"):
        r = run(confident, strategy=strategy)
        assert r.nfe.tolist() == [2, 2, 2] and r.num_steps == 2     # 2 blocks
        assert r.completion.tolist() == [[3] * 8] * 3
        check_invariants(r)


def test_rows_done_early_do_not_count_nfe():
    def mixed(x):  # row 0 confident (all commit at once), rows 1-2 flat (one at a time)
        logits = torch.zeros(x.shape[0], x.shape[1], V)
        logits[0, :, 3] = 50.0
        return logits
    r = run(mixed, strategy="fork")
    # row 0: 1 step per block = 2; rows 1, 2: all-equal confidences 1/6 < 0.8, every step
    # is a fallback committing the leftmost -> 4 per block = 8; the batch runs 8 steps
    assert r.nfe.tolist() == [2, 8, 8] and r.num_steps == 8
    assert r.active[0].tolist() == [T, F, F, F, T, F, F, F]
    assert r.fallback[1:].all() and not r.fallback[0].any()
    check_invariants(r)


@pytest.mark.parametrize("strategy", ["low_confidence", "threshold", "fork", "tau_budget", "ar"])
def test_stop_id_ends_an_answer_at_its_first_stop_token(strategy):
    """stop_id: a row stops once the token is committed with nothing masked before it. What it
    committed is what the whole decode commits there (one row per decode, so the random draws
    agree up to the stop), the rest stays masked, and later steps cost no NFE."""
    kw = {"gen_length": 16, "block_length": 4, "steps": 8, "mask_id": MASK, "strategy": strategy,
          "temperature": 1.0, "threshold": 0.5}
    stopped = 0
    for seed in range(6):
        for b in range(len(PROMPT)):
            full = decode(seeded_model(), PROMPT[b:b + 1], generator=torch.Generator().manual_seed(seed), **kw)
            row = full.completion[0].tolist()
            stop = row[5]  # a token the answer holds, so the stop is reached
            k = row.index(stop)
            cut = decode(seeded_model(), PROMPT[b:b + 1], generator=torch.Generator().manual_seed(seed),
                         stop_id=stop, **kw)
            committed = cut.commit_step[0] >= 0  # through the stop, and whatever the same steps filled after it
            assert committed[: k + 1].all()
            assert torch.equal(cut.completion[0][committed], full.completion[0][committed])
            assert (cut.completion[0][~committed] == MASK).all()
            assert cut.nfe[0] <= full.nfe[0]
            stopped += int(cut.nfe[0] < full.nfe[0])
            if strategy == "ar":
                assert int(cut.nfe[0]) == k + 1 and int(committed.sum()) == k + 1
    assert stopped > 0


@pytest.mark.parametrize("strategy", ["low_confidence", "threshold", "fork", "tau_budget", "ar"])
@pytest.mark.parametrize("stop", [None, 2])
def test_rows_arg_runs_only_decoding_rows_and_samples_the_same(strategy, stop):
    """rows_arg: the model sees only the rows still decoding, and the result is the whole-batch
    decode's, field by field (the draws stay the batch's)."""
    model, seen = seeded_model(), []

    def by_rows(x, rows):
        seen.append(rows.tolist())
        return model(x)
    prompt = torch.tensor([[1, 2], [3, 0], [4, 4], [0, 1], [2, 2], [3, 3]])
    kw = {"gen_length": 16, "block_length": 4, "steps": 8, "mask_id": MASK, "strategy": strategy,
          "temperature": 1.0, "threshold": 0.5, "stop_id": stop, "record_states": True}
    whole = decode(model, prompt, generator=torch.Generator().manual_seed(3), **kw)
    part = decode(by_rows, prompt, generator=torch.Generator().manual_seed(3), rows_arg=True, **kw)
    for field in ("tokens", "commit_step", "commit_logp", "commit_confidence", "fallback", "active",
                  "nfe", "expected_wrong", "states"):
        assert torch.equal(getattr(whole, field), getattr(part, field)), field
    assert [sorted(r) for r in seen] == [a.nonzero().squeeze(1).tolist() for a in whole.active.T]
    assert sum(map(len, seen)) == int(whole.nfe.sum())
    if strategy in ("threshold", "fork"):  # this model makes some row wait, so rows were saved
        assert int(whole.nfe.sum()) < whole.num_steps * len(prompt)


@pytest.mark.parametrize("strategy", ["low_confidence", "threshold", "fork"])
@pytest.mark.parametrize("stop", [None, 2])
def test_a_generator_per_row_samples_each_row_as_it_samples_it_alone(strategy, stop):
    """Held-out evaluation's generators, one per row: a row's answer, log-probs and NFE are
    those it gets decoded alone with its generator (its commit steps count the batch's steps),
    though threshold and fork rows (and rows stopping at `stop`) finish blocks at different
    steps and wait for the batch: a row draws only at the steps where it decodes. (One
    generator for the batch draws for every row at every step, so a row's noise depends on
    its batch.)"""
    prompt = torch.tensor([[1, 2], [3, 0], [4, 4], [0, 1], [2, 2], [3, 3]])
    kw = {"gen_length": 16, "block_length": 4, "steps": 8, "mask_id": MASK, "strategy": strategy,
          "temperature": 1.0, "threshold": 0.5, "stop_id": stop}

    def gens(rows):
        return [torch.Generator().manual_seed(10 + r) for r in rows]
    batch = decode(seeded_model(), prompt, generator=gens(range(6)), **kw)
    for r in range(6):
        alone = decode(seeded_model(), prompt[r:r + 1], generator=gens([r]), **kw)
        for field in ("completion", "commit_logp", "nfe"):
            assert torch.equal(getattr(batch, field)[r], getattr(alone, field)[0]), (r, field)
    if strategy != "low_confidence" or stop:  # rows waited for the batch: the case the per-row draws are for
        assert not batch.active.all()
    with pytest.raises(ValueError, match="5 generators for 6 rows"):
        decode(seeded_model(), prompt, generator=gens(range(5)), **kw)


def test_seeds():
    def sample(seed):
        return run(temperature=1.0, generator=torch.Generator().manual_seed(seed),
                   gen_length=16, steps=8).completion
    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


def test_gumbel_draws_match_tempered_softmax():
    base = torch.tensor([1.0, 0.0, -1.0, -math.inf, -math.inf, -math.inf])

    def fixed(x):
        return base.expand(x.shape[0], x.shape[1], V).clone()
    prompt = torch.zeros(500, 1, dtype=torch.long)
    temp = 0.7
    r = decode(fixed, prompt, gen_length=8, block_length=8, steps=8, mask_id=MASK,
               strategy="ar", temperature=temp, generator=torch.Generator().manual_seed(0))
    # "ar" commits whatever was drawn at the leftmost position: 4000 unbiased draws
    p = torch.softmax(base[:3] / temp, 0)              # [0.8034, 0.1923, 0.0460] at T = 0.7
    n = r.completion.numel()
    counts = torch.bincount(r.completion.flatten(), minlength=3)[:3].double()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 20                                    # 2 dof: P(chi2 > 20) ~ 5e-5
    # logp under softmax(logits / T); confidence under softmax(logits)
    torch.testing.assert_close(r.commit_logp, torch.log(p)[r.completion].float())
    torch.testing.assert_close(r.commit_confidence,
                               torch.softmax(base[:3], 0)[r.completion].float())


def test_a_uniform_draw_of_zero_gives_finite_gumbel_noise(monkeypatch):
    """u is clamped away from 0: -log(-log(u)) stays finite, so draws whose u are all 0 add the
    same noise to every token and give the argmax (unclamped, every score is -inf and token 0 wins)."""
    greedy = run(table_model)
    monkeypatch.setattr(torch, "rand", lambda shape, dtype=None, generator=None, device=None:
                        torch.zeros(shape, dtype=dtype, device=device))
    r = run(table_model, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(r.completion, greedy.completion) and torch.equal(r.commit_step, greedy.commit_step)
    assert torch.isfinite(r.commit_logp).all()
    torch.testing.assert_close(r.commit_logp, greedy.commit_logp)  # T = 1: the same log-softmax


def uncalled_model():
    """A model for argument checks, and the list of its calls (which must stay empty)."""
    calls = []

    def fn(x):
        calls.append(1)
        return torch.zeros(x.shape[0], x.shape[1], V)
    return fn, calls


def test_decode_argument_errors():
    fn, calls = uncalled_model()
    with pytest.raises(ValueError, match=r"gen_length \(10\).*block_length \(4\)"):
        decode(fn, PROMPT, gen_length=10, block_length=4, steps=4, mask_id=MASK)
    with pytest.raises(ValueError, match=r"steps \(5\).*number of blocks"):
        decode(fn, PROMPT, gen_length=8, block_length=4, steps=5, mask_id=MASK)
    with pytest.raises(ValueError, match="bogus"):
        decode(fn, PROMPT, gen_length=8, block_length=4, steps=4, mask_id=MASK, strategy="bogus")
    assert not calls                                    # raised before any forward


def test_threshold_is_strict_a_confidence_equal_to_it_is_not_committed():
    """threshold/fork commit conf > threshold: a masked 0.5 at threshold 0.5 waits."""
    conf = torch.tensor([[0.9, 0.5, 0.5], [0.5, 0.5, 0.25]])
    masked = torch.ones(2, 3, dtype=torch.bool)
    for strategy in ("threshold", "fork"):
        c = select_commits(conf, masked, strategy=strategy, threshold=0.5)
        # row 0: only 0.9 is above; row 1: nothing above, so one fallback commit (most confident / leftmost: pos 0)
        assert c.mask.tolist() == [[T, F, F], [T, F, F]], strategy
        assert c.fallback.tolist() == [F, strategy == "fork"], strategy
        torch.testing.assert_close(c.expected_wrong, torch.tensor([0.1, 0.5]))


def test_tau_budget_set_a_is_strict_a_confidence_equal_to_tau_is_outside_it():
    """SLIM-RL's A holds the positions with c > tau: a masked c = tau adds nothing to the budget,
    so with n = 0 nothing is committed; a c just above tau is committed."""
    masked = torch.ones(1, 3, dtype=torch.bool)
    c = select_commits(torch.tensor([[0.5, 0.5, 0.25]]), masked, strategy="tau_budget", num_commit=0, tau=0.5)
    assert c.mask.tolist() == [[F, F, F]]
    c = select_commits(torch.tensor([[0.5, 0.75, 0.25]]), masked, strategy="tau_budget", num_commit=0, tau=0.5)
    assert c.mask.tolist() == [[F, T, F]]


def test_decode_refuses_a_negative_temperature():
    fn, calls = uncalled_model()
    with pytest.raises(ValueError, match=r"temperature \(-0.5\) must be a finite number >= 0"):
        decode(fn, PROMPT, gen_length=8, block_length=4, steps=4, mask_id=MASK, temperature=-0.5)
    assert not calls


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, r"temperature \(nan\) must be a finite number >= 0"),
    ({"threshold": 1.0}, r"threshold \(1.0\) must be in \(0, 1\)"),
    ({"threshold": 0.0}, r"threshold \(0.0\) must be in \(0, 1\)"),
    ({"tau": 1.5}, r"tau \(1.5\) must be in \(0, 1\)"),
    ({"tau": float("nan")}, r"tau \(nan\) must be in \(0, 1\)"),
    ({"m": 0.0}, r"m \(0.0\) must be a finite number > 0"),
    ({"m": float("nan")}, r"m \(nan\) must be a finite number > 0"),
    ({"threshold": float("nan")}, r"threshold \(nan\) must be in \(0, 1\)"),
    ({"temperature": float("inf")}, r"temperature \(inf\) must be a finite number >= 0"),  # every draw NaN
    ({"m": float("inf")}, r"m \(inf\) must be a finite number > 0"),
])
def test_decode_refuses_strategy_parameters_out_of_range_before_any_step(kwargs, message):
    fn, calls = uncalled_model()
    with pytest.raises(ValueError, match=message):
        decode(fn, PROMPT, gen_length=8, block_length=4, steps=4, mask_id=MASK, **kwargs)
    assert not calls


def ratio_model(odds):
    """Answer position j (prompt length 2) puts logit ln(odds[j]) on token 0 and 0 on token 1
    (the rest -inf): token 0 is drawn at T = 0, with confidence odds / (odds + 1)."""
    def fn(x):
        logits = torch.full((x.shape[0], x.shape[1], V), -math.inf, dtype=torch.float64)
        logits[:, :, :2] = 0.0
        for j, o in enumerate(odds):
            logits[:, 2 + j, 0] = math.log(o)
        return logits
    return fn


def test_decode_default_threshold_and_tau_budget():
    """decode's defaults: threshold 0.8, tau 0.9, m 1."""
    # fork, one block of 2: c = 6/7 = 0.857 > 0.8 commits at step 0 (not a fallback), then c = 1/2
    # is a fallback (a threshold of 0.9 would make both steps fallbacks)
    r = decode(ratio_model([6, 1]), PROMPT, gen_length=2, block_length=2, steps=2, mask_id=MASK, strategy="fork")
    assert r.commit_step.tolist() == [[0, 1]] * 3
    assert r.fallback.tolist() == [[F, T]] * 3
    # tau_budget, one block of 4 over 4 steps (n_s = 1 each): c = 24/25, 19/20, 47/50, 17/20 =
    # 0.96, 0.95, 0.94, 0.85. Step 0: A = the first three, risks 0.04 + 0.05 = 0.09 <= 0.1, + 0.06 > 0.1
    # -> 2; step 1: A = {0.94}, 0.06 <= 0.1 -> 1; step 2: 0.85, n_s = 1 (tau 0.8 or m 2: 3 at step 0)
    r = decode(ratio_model([24, 19, 47 / 3, 17 / 3]), PROMPT, gen_length=4, block_length=4, steps=4,
               mask_id=MASK, strategy="tau_budget")
    assert r.commit_step.tolist() == [[0, 0, 1, 2]] * 3
    assert r.commit_confidence[0].tolist() == pytest.approx([0.96, 0.95, 0.94, 0.85], rel=1e-6)


@pytest.mark.parametrize("bad", ["gen_length", "block_length", "steps"])
def test_decode_refuses_a_zero_length_block_or_step_count(bad):
    """0 is not positive: a ValueError before any forward, not a division by zero or an empty loop."""
    fn, calls = uncalled_model()
    kw = {"gen_length": 8, "block_length": 4, "steps": 4, bad: 0}
    with pytest.raises(ValueError, match="must be positive"):
        decode(fn, PROMPT, mask_id=MASK, **kw)
    assert not calls


@pytest.mark.parametrize("rows_arg", [False, True])
def test_bfloat16_logits_are_read_in_float64(rows_arg):
    """The sampler casts the logits to float64 (module docstring, step 1), so a bf16 model's
    confidence and log-prob are softmax(logits) of its bf16 numbers computed exactly, not
    rounded to bf16. Row 0 is certain (logit 50) and fills a block in one step, so with
    rows_arg the other rows are run alone; rows 1, 2 are table_model's (logits j + 1, all exact in
    bf16): c_j = e^(j+1) / (e^(j+1) + 5)."""
    def model(x, rows=None):
        rows = torch.arange(x.shape[0]) if rows is None else rows
        assert x.shape[0] == len(rows)                     # only the rows still decoding are run
        logits = table_model(x)
        logits[rows == 0, 2:] = 0.0
        logits[rows == 0, 2:, 3] = 50.0
        return logits.bfloat16()
    r = run(model, strategy="threshold", threshold=0.5, steps=2, rows_arg=rows_arg)
    assert not r.active[0].all()                           # row 0 waited: rows_arg ran rows 1, 2 alone
    c = [math.exp(j + 1) / (math.exp(j + 1) + 5) for j in range(8)]
    for b in (1, 2):
        assert r.completion[b].tolist() == [j % 3 for j in range(8)]
        assert r.commit_confidence[b].tolist() == pytest.approx(c, rel=1e-6)
        assert r.commit_logp[b].tolist() == pytest.approx([math.log(v) for v in c], rel=1e-6)
    assert r.completion[0].tolist() == [3] * 8


@pytest.mark.parametrize("strategy", ["low_confidence", "threshold", "fork", "tau_budget", "ar"])
def test_a_commit_rule_that_commits_nothing_is_an_error_not_a_hang(strategy, monkeypatch):
    """Every step commits one or more positions of each active row, so a block takes at most
    block_length steps (low_confidence: its steps per block); a rule that stalls (here: commits
    nothing) stops with an error there instead of looping for ever (the stub gives up after 50
    calls, so a loop without the bound fails too). 2 blocks of 4, 4 steps: 2 per block."""
    from dllm_rl import samplers

    calls = []

    def stalled(confidence, masked, **kw):
        calls.append(1)
        assert len(calls) < 50, "decode kept stepping a block nothing was committed in"
        none = torch.zeros_like(masked)
        return samplers.Commit(mask=none, fallback=none.any(1), expected_wrong=confidence.new_zeros(len(masked)))
    monkeypatch.setattr(samplers, "select_commits", stalled)
    bound = 2 if strategy == "low_confidence" else 4
    with pytest.raises(RuntimeError, match=f"block 0 (still has|left) masked positions after {bound} "):
        run(strategy=strategy)
    assert len(calls) == bound


@pytest.mark.parametrize(("settings", "said"), [
    ({"strategy": "low_confidence", "threshold": 0.5}, r"rollout.threshold \(0.5\) is unused by the low_confidence"),
    ({"strategy": "fork", "tau": 0.5, "m": 2.0}, r"rollout.tau \(0.5\), rollout.m \(2.0\) are unused by the fork"),
])
def test_commit_settings_no_decoder_of_the_run_reads_are_said_to_be_unused(settings, said):
    """A sampler knob of another strategy was ignored without a word: an ablation over
    rollout.threshold under low_confidence decoded the same answers at every value."""
    import warnings

    from dllm_rl.config import DLLMRolloutConfig

    with pytest.warns(UserWarning, match=said):
        DLLMRolloutConfig(**settings)
    with warnings.catch_warnings():  # read by the rollout's or the evaluation's decoder, or at defaults: quiet
        warnings.simplefilter("error")
        DLLMRolloutConfig(strategy="fork", threshold=0.5)
        DLLMRolloutConfig(strategy="ar", eval_strategy="threshold", threshold=0.5)
        DLLMRolloutConfig(strategy="tau_budget", tau=0.5, m=2.0)
        DLLMRolloutConfig(strategy="low_confidence")


def test_steps_is_read_by_low_confidence_and_tau_budget_only_as_its_description_says():
    """rollout.steps' description called it an upper guide for threshold and fork: they (and ar)
    do not read it at all, decoding each block until it is filled, so a sweep over steps with
    them decodes the same answers with the same NFE."""
    from dllm_rl.config import DLLMRolloutConfig

    table = torch.randn(20, 30)
    prompt = torch.randint(2, 20, (4, 5))

    def run(strategy, steps):
        return decode(lambda x: table[x % 20] * 3, prompt, gen_length=8, block_length=4, steps=steps, mask_id=0,
                      strategy=strategy, temperature=0.8, threshold=0.5, tau=0.5,
                      generator=torch.Generator().manual_seed(0))

    for strategy in ("threshold", "fork", "ar"):
        a, b = run(strategy, 2), run(strategy, 8)
        assert torch.equal(a.completion, b.completion) and torch.equal(a.nfe, b.nfe)
    assert run("low_confidence", 2).nfe.tolist() == [2, 2, 2, 2]  # one step per block: 4 tokens each
    said = " ".join(DLLMRolloutConfig.model_fields["steps"].description.split())
    assert "threshold, fork and ar do not read it" in said
