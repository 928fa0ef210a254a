"""Config of a diffusion-LLM run: the core TrainConfig with the mask-predictor model, the
arithmetic / sudoku task, the block sampler (rollout) and the method (diffu-GRPO, TraceRL)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from mmrl.core.config import (
    DynamicSamplingConfig,
    ModelConfig,
    RolloutConfig,
    Section,
    TrainConfig,
    config_warning,
)
from mmrl.core.lora_config import LoRAConfig

Strategy = Literal["low_confidence", "threshold", "fork", "tau_budget", "ar"]


class DLLMModelConfig(ModelConfig):
    kind: Literal["llada", "dream", "sdar", "masked_lm"] | None = None
    """How to run the directory's model; None = its dllm.json (llada: a decoder with full
    attention; dream: the same with shifted logits; sdar: block-causal attention;
    masked_lm: any AutoModelForMaskedLM)."""
    mask_token_id: int | None = None
    """The [MASK] id; None = dllm.json, else the tokenizer's mask token. Checked against the vocabulary."""
    block_length: int | None = Field(None, ge=1)
    """Attention block of an sdar (block-causal) model; None = dllm.json."""
    lora: LoRAConfig | None = None
    """None = train every weight (the default for the tiny model); else PEFT LoRA adapters
    on `target_modules` (d1 trains LLaDA-8B so, on q_proj, k_proj, v_proj)."""


class DLLMRolloutConfig(RolloutConfig):
    """Semi-autoregressive block decoding (docs/methods.md section 5)."""

    gen_length: int = Field(16, ge=1)
    """Tokens generated per answer (the rest of an answer is <eos> filler)."""
    block_length: int = Field(8, ge=1)
    """Decoding block: blocks are filled left to right, each by `steps / blocks` steps."""
    steps: int = Field(16, ge=1)
    """Denoising steps over the whole answer, steps / blocks per block. low_confidence runs that
    many (the LLaDA schedule: block_length / that tokens a step); tau_budget commits at least the
    schedule's count a step and stops a block once it is filled. threshold, fork and ar do not
    read it: they decode a block until it is filled (ar: one token a step, block_length steps)."""
    strategy: Strategy = "low_confidence"
    """Which masked positions a step commits (dllm_rl.samplers.select_commits)."""
    eval_strategy: Strategy | None = None
    """The strategy of held-out evaluation (greedy and sampled); None = `strategy`. Set it to
    compare methods whose rollouts decode differently (ForkGRPO's fork, AR-GRPO's ar) on one
    held-out decoder, so that the comparison measures their training, not their samplers."""
    threshold: float = Field(0.8, gt=0, lt=1)
    """lambda of threshold (Fast-dLLM) and fork (Fork-dLLM): a step commits every masked position
    of the block whose confidence exceeds it (none: one fallback position). Unused by the others."""
    tau: float = Field(0.9, gt=0, lt=1)
    """tau of SLIM-RL's tau_budget: only positions with confidence above it may exceed the static
    per-step count, within the risk budget. Unused by the other strategies."""
    m: float = Field(1.0, gt=0)
    """Risk budget scale of tau_budget: b = m (1 - tau), the summed 1 - confidence a step may
    commit beyond the static count (SLIM-RL's 1). Unused by the other strategies."""
    stop_at_eos: bool = False
    """Stop decoding an answer once its <eos> is committed with every position before it
    filled (LLaDA2's eos_early_stop): the same answers, fewer NFE. Off: the whole gen_length
    is decoded, as LLaDA does."""
    eval_samples: int = Field(0, ge=0)
    """n samples per held-out problem at eval_temperature (else the rollout temperature) for
    pass@k (k = 1..min(16, n), the unbiased estimator); 0 = greedy accuracy only. `dllm-rl eval` uses 16 unless set (or, on a run, unless the run set n > 0)."""
    eval_temperature: float | None = Field(None, gt=0)
    """Temperature of those held-out samples (pass@k at 0.6, say, while training samples at 1);
    None = rollout.temperature. Training rollouts always sample at rollout.temperature."""
    eval_batch_size: int = Field(128, ge=1)
    """Problems per decoding batch in held-out evaluation (greedy and sampled): memory and speed
    only. Every metric, the sampled pass@k included, is the same at any value: each sampled
    answer draws its noise from its own generator, seeded by its problem and sample index."""
    max_new_tokens: int = Field(16, exclude=True)  # the core's Dr.GRPO length constant: set to gen_length
    # (out of config dumps, so that only a user's own setting reaches the check below)
    """Not a dLLM setting: always gen_length (the core's Dr.GRPO length constant). Left out of
    config dumps; another value is ignored with a warning."""

    @model_validator(mode="before")
    @classmethod
    def _max_new_tokens_is_gen_length(cls, data):
        """A max_new_tokens other than gen_length would be silently replaced: say so."""
        if isinstance(data, dict) and "max_new_tokens" in data:
            given, length = data["max_new_tokens"], data.get("gen_length", cls.model_fields["gen_length"].default)
            if given != length:
                config_warning(f"rollout.max_new_tokens ({given}) is not a dLLM setting: an answer is "
                               f"rollout.gen_length ({length}) tokens; max_new_tokens is ignored")
        return data

    @model_validator(mode="after")
    def _blocks_fit(self):
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length ({self.gen_length}) must be divisible by block_length "
                             f"({self.block_length})")
        blocks = self.gen_length // self.block_length
        if self.steps % blocks:
            raise ValueError(f"steps ({self.steps}) must be divisible by the number of blocks "
                             f"(gen_length / block_length = {blocks})")
        self.__dict__["max_new_tokens"] = self.gen_length  # not setattr: that re-validates
        return self

    @model_validator(mode="after")
    def _commit_settings_read(self):
        """threshold, tau and m belong to some commit rules only: one set away from its default
        for none of the run's decoders (rollout.strategy, rollout.eval_strategy) is said, not
        silently ignored (a run's config.yaml, which holds every key at its value, stays quiet)."""
        used = {self.strategy, self.eval_strategy or self.strategy}
        readers = {"threshold": ("threshold", "fork"), "tau": ("tau_budget",), "m": ("tau_budget",)}
        unused = [f"rollout.{k} ({getattr(self, k)})" for k, by in readers.items()
                  if getattr(self, k) != type(self).model_fields[k].default and not used & set(by)]
        if unused:
            decoders = " and ".join(sorted(used))
            config_warning(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} unused by the {decoders} "
                           "decoder (threshold: threshold and fork; tau and m: tau_budget)")
        return self

    @model_validator(mode="after")
    def _no_nucleus(self):
        """The block sampler draws from the whole softmax at `temperature`: a top_p would be ignored."""
        if self.top_p != 1.0:
            raise ValueError(f"top_p ({self.top_p}) is not used by the dLLM sampler, which draws from the whole "
                             "softmax at rollout.temperature; leave it at 1")
        return self


def _band(band: tuple[float, float]) -> tuple[float, float]:
    lo, hi = band
    if not 0 <= lo <= hi <= 1:
        raise ValueError("an accuracy band [lo, hi] needs 0 <= lo <= hi <= 1")
    return band


AccuracyBand = Annotated[tuple[float, float], AfterValidator(_band)]


class DLLMTaskConfig(Section):
    """Verifiable problems: `arith` (addition, subtraction, multiplication), `sudoku` (4x4),
    or `jsonl`, your own from train_path and eval_path (dllm_rl.tasks.jsonl)."""

    type: Literal["arith", "sudoku", "jsonl"] = "arith"
    """The task: arith or sudoku (generated problems), or jsonl (train_path and eval_path)."""
    seed: int = 0
    """Seed of the problem generator (arith, sudoku; the run's seed orders the prompts, this one
    makes them)."""
    num_train: int = Field(4000, ge=1)
    """Problems generated for training (arith, sudoku; jsonl uses every line of its file)."""
    num_eval: int = Field(200, ge=1)
    """Held-out problems generated (arith, sudoku; jsonl uses every line of its file)."""
    options: dict = Field(default_factory=dict)
    """Extra arguments of the task's generator (arith: digits, mul_digits, ops; sudoku: blanks),
    e.g. {digits: 3, ops: ["+", "-"]} or {blanks: [4, 8]}."""
    train_path: str | None = None
    """jsonl: the training problems, one {"prompt", "answer"} object per line."""
    eval_path: str | None = None
    """jsonl: the held-out problems, in the same format."""

    @model_validator(mode="after")
    def _paths(self):
        given = [k for k in ("train_path", "eval_path") if getattr(self, k)]
        if self.type == "jsonl" and len(given) < 2:
            raise ValueError("task.type jsonl needs task.train_path and task.eval_path (JSONL files of "
                             '{"prompt": ..., "answer": ...} objects)')
        if self.type != "jsonl" and given:
            raise ValueError(f"task.{given[0]} is read by task.type jsonl only; the {self.type} task "
                             "generates its problems")
        if self.type == "jsonl" and self.options:
            raise ValueError("task.options are the arith and sudoku generators' arguments; jsonl takes none")
        if self.type == "jsonl":  # a warning, not an error: a run's config.yaml holds every key
            ignored = [f"task.{k} ({getattr(self, k)})" for k in ("num_train", "num_eval", "seed")
                       if getattr(self, k) != type(self).model_fields[k].default]
            if ignored:
                config_warning(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} for the arith and "
                               "sudoku generators; task.type jsonl uses every line of task.train_path and "
                               "task.eval_path (write shorter files to use fewer problems)")
        return self


class KLOldConfig(Section):
    beta: float = Field(0.0, ge=0)
    """Coefficient of the k3 KL to the pre-update policy (the weights that made the rollout);
    no reference model is loaded. It acts from a batch's second pass or mini-batch on: with
    train.ppo_epochs 1 and train.mini_batches 1 the policy is the pre-update one throughout,
    so the term (loss/kl) and its gradient are exactly 0 whatever beta."""


class DiffuGRPOConfig(Section):
    """diffu-GRPO (d1): one-step mean-field log-probs with a randomly masked prompt."""

    type: Literal["diffu_grpo"] = "diffu_grpo"
    """The method: diffu_grpo (d1)."""
    p_mask_prompt: float = Field(0.15, ge=0, lt=1)
    """Probability of masking each prompt token in the log-prob pass."""
    clip: float = Field(0.5, gt=0)
    """eps of the PPO clip (d1 uses 0.5)."""
    logprob_temperature: float | None = Field(None, gt=0)
    """Temperature of the log-probs; None: rollout.temperature (the sampling policy's). d1's code
    samples at 0.9 and scores the unscaled logits (1.0)."""
    scale: Literal["group", "none"] = "none"
    """Advantage: r - group mean, divided by the group std ("group") or not ("none", as d1's code)."""
    kl: KLOldConfig = Field(default_factory=lambda: KLOldConfig(beta=0.04))
    """k3 KL penalty to the pre-update policy (d1's beta 0.04); 0 = off."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """Drop groups whose rewards are all equal (and refill); off in d1's code."""


class TraceRLConfig(Section):
    """TraceRL (dLLM-RL): train on the rollout's own decoding trajectory."""

    type: Literal["tracerl"] = "tracerl"
    """The method: tracerl (dLLM-RL's TraceRL)."""
    merge_steps: int = Field(2, ge=1)
    """s: consecutive decoding steps merged into one training row (<= ceil(K/s) rows per rollout)."""
    clip: float = Field(0.2, gt=0)
    """eps of the PPO clip: the ratio is clipped to [1 - clip, 1 + clip]."""
    logprob_temperature: float | None = Field(None, gt=0)
    """Temperature of the log-probs; None: rollout.temperature (the sampling policy's).
    dLLM-RL's code samples at its rollout temperature and scores the unscaled logits (1.0)."""
    scale: Literal["group", "none"] = "group"
    """Advantage: r - group mean, divided by the group std ("group") or not ("none")."""
    kl: KLOldConfig = Field(default_factory=lambda: KLOldConfig(beta=0.01))
    """k3 KL penalty to the pre-update policy (beta 0.01 by default); 0 = off."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """On: drop the groups whose rewards are all equal (accuracy_band None), or those outside
    accuracy_band, and refill the batch with new groups (up to max_rounds extra rounds). Off:
    nothing is dropped but by accuracy_band, and nothing is refilled."""
    accuracy_band: AccuracyBand | None = None
    """None: drop the groups whose rewards are all equal (with dynamic_sampling on). [lo, hi]:
    drop the groups whose accuracy lies outside it, as dLLM-RL's code does with [0.2, 0.8]
    (refilled only with dynamic_sampling on; that code does not refill)."""


class SLIMRLConfig(Section):
    """SLIM-RL (laolaorkkkkk/SLIM-RL; docs/methods.md section 5): tau-budget rollouts, trace-free
    training rows at Gauss-Legendre masking levels with a decreasing per-block mask schedule,
    a clamped sequence-level ratio, Dr.GRPO advantages, an accuracy-band group filter."""

    type: Literal["slim_rl"] = "slim_rl"
    """The method: slim_rl (SLIM-RL)."""
    quadrature_points: int = Field(3, ge=1, le=8)
    """Gauss-Legendre nodes over the masking level t in (0, 1): rows per rollout (3: t = 0.1127,
    0.5, 0.8873 with weights 0.2778, 0.4444, 0.2778)."""
    max_spread: float = Field(0.2, ge=0, lt=1)
    """Cap of the per-block schedule's spread s = min(max_spread, 2 min(t, 1 - t) - 1e-6): block j of
    B is masked at rate t + (s/2) cos(pi j / (B - 1)). 0 = every block at t; unused with one block."""
    clip: float = Field(0.1, gt=0)
    """eps of the sequence-ratio clip: clip(s, 1 - eps, 1 + eps) (0.9 / 1.1)."""
    max_log_ratio: float = Field(10.0, gt=0)
    """The mean log-ratio of a row is clamped to +-this before exp."""
    scale: Literal["group", "none"] = "none"
    """Dr.GRPO: A = r - group mean (none); group divides by the group std."""
    kl: KLOldConfig = Field(default_factory=lambda: KLOldConfig(beta=0.01))
    """k3 KL penalty to the pre-update policy (SLIM-RL's beta 0.01); 0 = off."""
    accuracy_band: AccuracyBand = (0.2, 0.8)
    """Groups whose accuracy (the task's success atom) lies outside [lo, hi] are dropped."""
    length_limit_wrong: bool = True
    """An answer with no <eos> within gen_length counts as wrong (every atom scores 0)."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """Off (SLIM-RL's code): a step trains on the groups the band keeps. On: up to max_rounds
    extra rollout rounds per step replace the dropped groups (the scheduler reads it)."""


class ForkGRPOConfig(Section):
    """ForkGRPO (Fork-dLLM, arXiv 2609.39859; training rows a RECONSTRUCTION; docs/methods.md section 5):
    one training row per fallback state of a fork rollout, the exact single-token ratio at the
    committed (leftmost) position, averaged per rollout over its fallback steps."""

    type: Literal["fork_grpo"] = "fork_grpo"
    """The method: fork_grpo (ForkGRPO; rollouts with rollout.strategy fork)."""
    rows: Literal["fallback", "all"] = "fallback"
    """fallback: the steps where the fork sampler fell back to the leftmost token (ForkGRPO);
    all: every step that committed exactly one token (AR-GRPO with rollout.strategy ar)."""
    clip: float = Field(0.2, gt=0)
    """eps of the PPO clip of the single-token ratio: clipped to [1 - clip, 1 + clip]."""
    scale: Literal["group", "none"] = "group"
    """Advantage: r - group mean, divided by the group std ("group") or not ("none"). Groups
    whose rewards are all equal are dropped."""
    kl: KLOldConfig = Field(default_factory=lambda: KLOldConfig(beta=0.0))
    """k3 KL penalty to the pre-update policy on the training rows; 0 (the default) = off."""


class ARGRPOConfig(ForkGRPOConfig):
    """AR-GRPO, ForkGRPO's baseline: rollouts decoded strictly left to right (rollout.strategy
    ar), every token's exact ratio given the state it was decoded from."""

    type: Literal["ar_grpo"] = "ar_grpo"
    """The method: ar_grpo (AR-GRPO, with rollout.strategy ar)."""
    rows: Literal["fallback", "all"] = "all"
    """As fork_grpo's rows; all (the default here): every step that committed exactly one token,
    which under rollout.strategy ar is every token."""


MethodConfig = Annotated[DiffuGRPOConfig | TraceRLConfig | SLIMRLConfig | ForkGRPOConfig | ARGRPOConfig,
                         Field(discriminator="type")]


class DLLMTrainConfig(TrainConfig):
    model: DLLMModelConfig = Field(default_factory=DLLMModelConfig)
    """The masked diffusion language model (LLaDA, Dream, SDAR, a masked LM, or the bundled tiny
    one), its mask token and LoRA."""
    task: DLLMTaskConfig = Field(default_factory=DLLMTaskConfig)
    """The problems and their reward: arith, sudoku or jsonl."""
    rollout: DLLMRolloutConfig = Field(default_factory=DLLMRolloutConfig)
    """The block sampler that decodes the rollouts and held-out evaluation."""
    method: MethodConfig = Field(default_factory=DiffuGRPOConfig)
    """The RL algorithm: type diffu_grpo, tracerl, slim_rl, fork_grpo or ar_grpo."""

    @model_validator(mode="after")
    def _sampler_fits_method(self):  # here, not when the estimator is built: `config` shows it, and
        strategy = self.rollout.strategy  # train says it before the model loads
        if getattr(self.method, "rows", None) == "fallback" and strategy != "fork":
            raise ValueError(f"method.rows: fallback trains on the fork sampler's fallback steps, but "
                             f"rollout.strategy is {strategy!r} (set it to fork, or rows: all)")
        if self.method.type == "ar_grpo" and strategy != "ar":
            raise ValueError(f"method.type ar_grpo decodes left to right: rollout.strategy must be ar, got {strategy!r}")
        r = self.rollout
        per_step = r.block_length // (r.steps // (r.gen_length // r.block_length))  # the LLaDA schedule's least count
        if getattr(self.method, "rows", None) == "all" and strategy == "low_confidence" and per_step >= 2:
            # every step commits that many or more: no single-token step, so no row would ever train
            raise ValueError(f"method.rows: all trains on the steps that commit exactly one token, but rollout.strategy "
                             f"low_confidence with rollout.steps {r.steps} commits at least {per_step} tokens at every "
                             f"step (block_length {r.block_length} over {r.steps // (r.gen_length // r.block_length)} "
                             f"steps a block): no row would train; set rollout.steps to gen_length ({r.gen_length}) or "
                             "more, or rollout.strategy ar")
        return self

    @model_validator(mode="after")
    def _spread_needs_blocks(self):  # said, not silently ignored
        m, r = self.method, self.rollout
        if m.type == "slim_rl" and r.gen_length == r.block_length and m.max_spread != type(m).model_fields["max_spread"].default:
            config_warning(f"method.max_spread {m.max_spread} is unused with one decoding block (rollout.gen_length = "
                           f"block_length = {r.block_length}): the schedule spreads the mask rate across blocks, and "
                           "one block is masked at t itself")
        return self

    @model_validator(mode="after")
    def _kl_to_the_pre_update_policy_acts(self):  # said, not silently ignored
        # One pass over one mini-batch runs under the rollout's weights: the k3 KL to them and its
        # gradient are 0 whatever beta, so a beta sweep trains alike. A beta other than the method's
        # default only: SLIM-RL's own config runs its paper's 0.01 in one pass (its description says so).
        beta, default = self.method.kl.beta, type(self.method).model_fields["kl"].default_factory().beta
        one_pass = self.train.ppo_epochs == 1 and self.train.mini_batches == 1
        if beta > 0 and beta != default and one_pass and self.rollout.scheduler.mode == "sync":
            config_warning(f"method.kl.beta {beta} weighs a KL to the pre-update policy, which is 0 with "
                           "train.ppo_epochs 1 and train.mini_batches 1 (the only pass runs under the rollout's "
                           "weights): the term and its gradient are 0; raise ppo_epochs or mini_batches for it to act")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self):  # in place of the core's check of the buffer: no budget here
        if self.reward.overlong is not None:
            raise ValueError("reward.overlong (DAPO's length penalty) is for the VLM backend: a masked diffusion "
                             "model decodes a fixed-length canvas (rollout.gen_length), so there is no budget "
                             "to run over")
        return self


# The backend's settings as the CLI reads them (dllm_rl.backend re-exports them): `dllm-rl config`
# imports this module alone (BackendSpec.settings), not the model code, torch or transformers.
CONFIG_CLASS = DLLMTrainConfig
DEFAULT_CONFIG = {
    "output_dir": "runs/dllm-default",
    "method": {"type": "diffu_grpo"},  # d1's code: A = r - group mean, every group trains
    "rollout": {"num_generations": 16, "prompts_per_step": 8, "gen_length": 8, "block_length": 4,
                "steps": 8, "temperature": 0.7},
    "optim": {"lr": 3e-5, "max_grad_norm": 1.0},
    "train": {"max_steps": 300, "ppo_epochs": 2, "log_samples_every": 50},
    "task": {"type": "arith", "num_train": 4000, "num_eval": 200},
}
# `dllm-rl eval` samples 16 answers per problem for pass@1..16 unless the config, --set or the
# evaluated run (an n > 0 it trained with) says otherwise; training keeps eval_samples 0 (greedy
# only), for the cost of its evaluations.
EVAL_DEFAULTS = {"rollout": {"eval_samples": 16}}
