"""Configuration: the pydantic models of a run's config, section by section.

A run is described by one `TrainConfig`. Each backend subclasses it to narrow
`model`, `task` and `method` to its own typed unions (a `type:` field picks the
variant). Loading is three layers, later ones winning (mmrl.core.config_loading):

    embedded default (the backend's)  <-  YAML file  <-  --set key.path=value

Every section forbids unknown keys, and every error is turned into one
`ConfigError` whose message names the key path, so a CLI can print it instead of
a traceback. load_config and the rest of the loading machinery live in
mmrl.core.config_loading and stay importable from here (see __getattr__ at the end).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import types
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class ConfigError(ValueError):
    """A bad config: the message is one paragraph, fit for a user."""


def config_warning(message: str) -> None:
    """A UserWarning from a config validator, attributed to the code that built or changed the
    config: the first caller outside pydantic, this module, config_loading (load_config) and the
    validator's own module (a fixed stacklevel would name pydantic's BaseModel.__init__, whose
    depth under the caller differs between a section built directly and one validated inside
    load_config)."""
    import pydantic
    import pydantic_core

    inside = tuple(os.path.dirname(m.__file__) + os.sep for m in (pydantic, pydantic_core))
    frame, level = sys._getframe(1), 2  # stacklevel 2: the validator that called us
    own = {frame.f_code.co_filename, __file__, os.path.join(os.path.dirname(__file__), "config_loading.py")}
    while frame.f_back is not None and (frame.f_code.co_filename in own
                                        or frame.f_code.co_filename.startswith(inside)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values re-validated on assignment,
    and no number may be inf or nan (a bound such as gt=0 lets inf through, and an inf weight,
    temperature or learning rate fails, or turns the loss to nan, only once the run is under way)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)  # the docstrings under the keys: `<cli> config`

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        # pydantic reads true as 1 for an int or float key: `max_steps: true` would train one step.
        # (Not a field validator: a "before" one is refused on the `type` keys that pick a variant.)
        for name, value in (data.items() if isinstance(data, dict) else ()):
            field = cls.model_fields.get(name)
            if field is None or not _takes_bool_for_number(field.annotation, value):
                continue
            if isinstance(value, bool):
                raise KeyValueError(name, f"{str(value).lower()} is a boolean; this key takes a number")
            raise KeyValueError(name, f"{json.dumps(value)} holds a boolean where this key takes numbers")
        return data


class KeyValueError(ValueError):
    """A section validator's error about one of its keys: the message names `section.key`."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _takes_bool_for_number(annotation: Any, value: Any) -> bool:
    """Whether `value` holds a bool where `annotation` wants an int or float (and no bool): the
    value itself, or an item of a list, tuple or mapping of numbers."""
    if isinstance(value, bool):
        kinds = _leaf_types(annotation)
        return bool(kinds & {int, float}) and bool not in kinds
    if isinstance(value, dict):
        wanted = [typing.get_args(t)[1] for t in _members(annotation) if typing.get_origin(t) is dict]
        return any(_takes_bool_for_number(a, v) for a in wanted for v in value.values())
    if isinstance(value, list | tuple):
        wanted = [a for t in _members(annotation) if typing.get_origin(t) in (list, tuple)
                  for a in typing.get_args(t) if a is not Ellipsis]
        return any(_takes_bool_for_number(a, v) for a in wanted for v in value)
    return False


def _members(annotation: Any) -> list:
    """The alternatives of a union (Annotated and Optional unwrapped), else [annotation]."""
    if typing.get_origin(annotation) is Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _leaf_types(annotation: Any) -> set:
    return {m for m in _members(annotation) if isinstance(m, type)}


# --------------------------------------------------------------------------- sections


class ModelConfig(Section):
    path: str | None = None
    """Local directory of a from_pretrained checkpoint; None = the backend's bundled tiny model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype. The CPU default is float32; float16 is for eval and sample only (training
    refuses it: plain AdamW without loss scaling underflows in float16)."""
    trust_remote_code: bool = False
    """Run the model directory's own Python code (its config.json's auto_map: the released LLaDA,
    Dream and SDAR checkpoints ship theirs). Off unless set; the CLI names the directory first."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (less
    memory, about a third more compute). The update's forwards then run in training mode with
    every dropout off (transformers checkpoints only in training mode); a model whose config
    sets a dropout or stochastic depth (drop_path_rate, layerdrop) above 0 is refused, as is a
    model class without checkpointing. mmrl.core.memory."""
    logprob_chunk: int | None = Field(None, ge=1)
    """Language models: token positions per chunk of the training log-probabilities. Set, the
    log-softmax over the vocabulary is computed a chunk at a time and recomputed in the backward
    pass, so only the logits as they came (bfloat16 on a GPU) are kept, not float32 [N, T, V]
    copies. The same numbers (to float rounding); None, the default: the plain computation, bit
    for bit as before. mmrl.core.logprob."""
    device: str = "cpu"
    """Where the model samples and trains: "cpu", "cuda", "cuda:N", or "auto" (this process's GPU
    when one is visible, else the CPU). Under data parallel, "cuda" and "auto" mean the rank's own
    GPU (LOCAL_RANK; cuda:N is refused there). mmrl.core.device.model_device resolves it."""

    @model_validator(mode="after")
    def _device_spelling(self):
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not one of cpu, cuda, cuda:N, auto")
        return self

    @model_validator(mode="after")
    def _path_not_empty(self):
        # `--set model.path=$MODEL` with MODEL unset: "" resolved to the config file's directory
        if self.path is not None and not self.path.strip():
            raise KeyValueError("path", f"{self.path!r} is empty: give a model directory, or null for the "
                                        "backend's bundled tiny model (was a --set value's variable unset?)")
        return self


# Files of a from_pretrained directory whose "auto_map" makes transformers import the
# directory's own Python code.
_CODE_MAPS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def remote_code_maps(path: str | Path) -> list[str]:
    """The files of model directory `path` with an "auto_map" (loading it runs its Python code)."""
    import json

    found = []
    for name in _CODE_MAPS:
        try:
            data = json.loads((Path(path) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # absent or unreadable: the loader reports it
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(name)
    return found


def check_remote_code(path: str | Path, trust_remote_code: bool) -> None:
    """Before a model directory is loaded: a ConfigError when it ships code and
    model.trust_remote_code is off; a notice on stderr naming the directory when it is on
    (security: the user sees whose code is about to run). docs/errors.md."""
    import sys

    maps = remote_code_maps(path)
    if maps and not trust_remote_code:
        raise ConfigError(
            f"model.path: the model in {path} ships its own Python code (auto_map in {', '.join(maps)}); "
            "loading it runs that code. Set model.trust_remote_code=true if you trust it."
        )
    if trust_remote_code:
        what = (f"about to run the Python code in {path} (auto_map in {', '.join(maps)})" if maps
                else f"{path} ships no Python code (no auto_map), so none of it runs")
        print(f"notice: model.trust_remote_code is on: {what}", file=sys.stderr, flush=True)


class SchedulerConfig(Section):
    """How rollouts reach the trainer (docs/methods.md section 3, RolloutPipe)."""

    mode: Literal["sync", "pipelined"] = "sync"
    """sync: roll out the whole round, then train. pipelined: complete-group pipelining
    (a group goes to the trainer as soon as its samples, rewards and advantages exist;
    the trainer steps once U = prompts_per_step / mini_batches groups are in)."""
    frontier: int | None = Field(None, ge=0)
    """Frontier-group dispatch: the engines work only on the F_w lowest-numbered incomplete
    groups. None = F_w = U (RolloutPipe's setting); 0 = off (every group admitted at once)."""
    placement: Literal["auto", "inline", "thread", "process", "remote"] = "auto"
    """Where the engine runs: in the trainer's thread (inline), a background thread with its
    own copy of the weights, a local `mmrl serve` subprocess, or the `servers` below.
    auto = inline for sync, thread for pipelined."""
    servers: list[str] = Field(default_factory=list)
    """Remote engines (placement=remote), one worker each (several = data-parallel rollout):
    "http://host:port" for `mmrl serve`, "vllm+http://host:port" for vLLM's OpenAI server."""
    engine_batch: int | None = Field(None, ge=1)
    """Samples per engine call; None = U x G when pipelined, the whole round when sync,
    divided among the engines."""
    timeout: float = Field(600.0, gt=0)
    """Seconds an engine may take for one call (or to take new weights) before it counts as hung."""
    max_redispatch: int = Field(2, ge=0)
    """Times the samples of a failed or hung engine call are retried on another engine before the
    run stops (calls still queued on a failed engine move without counting)."""


class RolloutConfig(Section):
    num_generations: int = Field(8, ge=1)
    """G: samples per prompt (the group)."""
    prompts_per_step: int = Field(4, ge=1)
    """Prompts per training step; the batch holds prompts_per_step * num_generations samples."""
    max_new_tokens: int = Field(64, ge=1)
    """Most tokens sampled per completion (per model turn in a tool rollout); a completion that
    spends them without ending is truncated. Also the default of method.loss.max_len and
    reward.overlong.max_len."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature: the logits are divided by it when sampling, and the log-probs
    trained on are taken at the same temperature. The image backend has none (it must stay 1)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p;
    1 = the whole softmax (the log-probs trained on are always the whole softmax's). The dLLM
    and image backends require 1."""
    engine: str = "hf"
    """Rollout engine of the backend ("hf"; "vllm" with the GPU extra)."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """How rollouts reach the trainer: sync or pipelined, where the engines run, and how their
    failures are retried."""


class GroupAdvantageConfig(Section):
    """GRPO / Dr.GRPO: A = r - mean_g, divided by the group std, the batch std, or nothing."""

    type: Literal["group"] = "group"
    """group: A = r - group mean, scaled as `scale` says (GRPO, Dr.GRPO)."""
    scale: Literal["group", "batch", "none"] = "group"
    """What r - group mean is divided by: the group's std + eps (group, GRPO), the std of all the
    batch's rewards + eps (batch), or nothing (none, Dr.GRPO). Unbiased std; a group whose
    rewards are all equal gets 0."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing (scale group or batch)."""


class RLOOAdvantageConfig(Section):
    """RLOO: A_i = r_i - mean of the other samples of its group."""

    type: Literal["rloo"] = "rloo"
    """rloo: each sample's reward minus the mean of the other samples of its group (no scaling)."""


class MultiStreamAdvantageConfig(Section):
    """Several reward atoms: normalise each atom in its group, then weight (GDPO / HRAS), or the reverse."""

    type: Literal["multi_stream"] = "multi_stream"
    """multi_stream: advantages from each reward atom's own scores (GDPO, CORA's HRAS)."""
    mode: Literal["normalize_then_sum", "sum_then_normalize"] = "normalize_then_sum"
    """normalize_then_sum: each atom's scores normalised in their group (as `scale` says), then
    summed with the atoms' weights; sum_then_normalize: the weighted total normalised (plain
    GRPO)."""
    scale: Literal["group", "batch", "none"] = "group"
    """As advantage.scale of type group: divide by the group std, the batch std, or nothing (none)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing (scale group or batch)."""


AdvantageConfig = Annotated[
    GroupAdvantageConfig | RLOOAdvantageConfig | MultiStreamAdvantageConfig,
    Field(discriminator="type"),
]


def changed_settings(section: Section, keys: tuple[str, ...]) -> list[str]:
    """`key value` of each of `keys` set away from its default (what a warning names)."""
    fields = type(section).model_fields
    return [f"{k} {getattr(section, k)}" for k in keys if getattr(section, k) != fields[k].default]


class LossConfig(Section):
    clip_low: float = Field(0.2, ge=0, lt=1)
    """eps_low of the PPO clip: rho is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """eps_high: rho is clipped above at 1 + clip_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip PPO's c (verl's clip_ratio_c, 3.0 there): a token with a negative advantage A
    has its loss capped at c |A|, so a ratio far above 1 on a bad sample neither dominates the
    loss nor gets a gradient; loss/dual_clip_frac logs the tokens capped. None = off."""
    level: Literal["token", "sequence"] = "token"
    """"sequence" is GSPO's ratio: exp(mean token log-ratio), shared by the sample's tokens."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "seq_mean_token_mean"
    )
    """How per-token losses become one number: token_mean (over every trained token of the
    mini-batch, DAPO), seq_mean_token_mean (each sample's token mean, averaged over samples,
    GRPO) or seq_mean_token_sum_norm (each sample's token sum / max_len, averaged over
    samples, Dr.GRPO)."""
    max_len: int | None = Field(None, ge=1)
    """Dr.GRPO's constant divisor (aggregation seq_mean_token_sum_norm only); None =
    rollout.max_new_tokens."""

    @model_validator(mode="after")
    def _max_len_unused(self):  # said, not silently ignored
        if self.max_len is not None and self.aggregation != "seq_mean_token_sum_norm":
            config_warning(f"method.loss.max_len {self.max_len} unused with method.loss.aggregation "
                           f"{self.aggregation}: only seq_mean_token_sum_norm (Dr.GRPO) divides by it")
        return self


class KLConfig(Section):
    beta: float = Field(0.0, ge=0)
    """KL coefficient. 0 means no reference model is loaded at all."""
    kind: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's), with d = log pi - log pi_ref:
    k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 (unbiased and >= 0)."""


class DynamicSamplingConfig(Section):
    """DAPO: drop groups whose rewards are all equal and refill the batch with new groups."""

    enabled: bool = False
    """Drop the groups whose rewards are all equal (no advantage) and roll out new ones, up to
    max_rounds, to refill the batch. Off by default."""
    max_rounds: int = Field(3, ge=1)
    """Extra rollout rounds allowed per step to refill; a batch still short after them trains as is."""

    @model_validator(mode="after")
    def _unused_when_off(self):
        if not self.enabled and changed_settings(self, ("max_rounds",)):
            config_warning(f"method.dynamic_sampling.max_rounds {self.max_rounds} unused with "
                           "method.dynamic_sampling.enabled false: no group is dropped, nothing refilled")
        return self


class FastRLConfig(Section):
    """FastRL (docs/methods.md section 2): differential-aware advantage pruning (MDAP) drops
    near-duplicate rollouts of equal advantage before training; adaptive rollout sampling
    (ARS) sets the group size of each data epoch from how many were kept."""

    enabled: bool = False
    """Prune each group with MDAP (and, with `ars`, adapt G at epoch boundaries)."""
    tau: float = Field(0.8, ge=0, le=1)
    """A rollout is dropped when a kept one of equal advantage is closer than this
    (1 - Jaccard similarity of their n-gram sets). 0 keeps everything."""
    ngram: int = Field(1, ge=1)
    """n of the n-grams compared (over trained token ids, else words); 1 as the released code."""
    against: Literal["kept", "seed"] = "seed"
    """Compare each rollout only with its advantage set's seed, its highest-|A| member (the
    released code), or with every kept one of the set ("kept": the paper's greedy rule)."""
    adv_tol: float = Field(1e-4, gt=0)
    """Two advantages closer than this count as equal (one advantage set)."""
    pad_multiple: int | None = Field(None, ge=1)
    """Pad each group's kept count up to a multiple of this with the dropped rollouts of
    highest |A|; None = the data-parallel world size."""
    weight: Literal["none", "count"] = "none"
    """"count" (ours, not in the paper or the released code): a kept rollout counts in the
    loss, and in its normaliser, as many times as the rollouts it stands for (itself and the
    near-copies dropped for it), so each outcome of a group weighs as in the unpruned update;
    "none": each kept rollout counts once, as in the paper."""
    zero_sets: Literal["prune", "one"] = "prune"
    """"one" (ours): an advantage set of advantage 0 (no policy gradient) keeps only its seed,
    whatever its diversity; "prune": it is pruned like any other set. With `weight: count`
    and no KL term the update is unchanged by it (a KL term sees only the seed's tokens)."""
    ars: bool = False
    """Adaptive rollout sampling: set num_generations of each data epoch from the kept counts
    (off, as the released code's FastRL launch script runs)."""
    min_group_size: int = Field(2, ge=2)
    """ARS never shrinks the group below this (a group of one sample has no advantage)."""

    @model_validator(mode="after")
    def _unused_when_off(self):
        unused = changed_settings(self, tuple(k for k in type(self).model_fields if k != "enabled"))
        if not self.enabled and unused:
            config_warning(f"method.fastrl.{', method.fastrl.'.join(unused)} unused with method.fastrl.enabled "
                           "false: nothing is pruned")
        return self


class GRPOConfig(Section):
    """The GRPO family (GRPO, Dr.GRPO, DAPO, GSPO, RLOO) as one method with dials."""

    type: Literal["grpo"] = "grpo"
    """The method: grpo, the GRPO family (its variants are the dials below)."""
    advantage: AdvantageConfig = Field(default_factory=GroupAdvantageConfig)
    """How rewards become advantages: type group (GRPO, Dr.GRPO), rloo or multi_stream (per
    atom)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The PPO-clip surrogate: clip range, token or sequence ratio (GSPO), aggregation."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL penalty to the reference model, the starting weights (beta 0 = none, and none is
    loaded)."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: drop and refill groups whose rewards are all equal."""
    fastrl: FastRLConfig = Field(default_factory=FastRLConfig)
    """FastRL: prune near-duplicate rollouts of equal advantage before training (off by default)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: completions that spent their token budget without ending
    (rollout/truncated) carry no loss; they still count in their group's advantages."""

    @model_validator(mode="after")
    def _kl_kind_unused(self):
        if self.kl.beta == 0 and changed_settings(self.kl, ("kind",)):
            config_warning(f"method.kl.kind {self.kl.kind} unused with method.kl.beta 0: there is no KL term")
        return self


MethodConfig = Annotated[GRPOConfig, Field(discriminator="type")]


class OverlongConfig(Section):
    """DAPO's soft overlong punishment (mmrl.core.overlong): a reward atom "overlong" scoring
    0 up to max_len - buffer completion tokens, then falling linearly to -penalty at max_len."""

    buffer: int = Field(ge=1)
    """L_cache: the last tokens of the budget that cost (DAPO: 4096 of 20480)."""
    max_len: int | None = Field(None, ge=1)
    """L_max; None = rollout.max_new_tokens (a tool rollout's budget is per turn, so it must
    be set there)."""
    penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    """The score at max_len and past it is -penalty."""


class RewardConfig(Section):
    atoms: list[str | dict[str, Any]] = Field(default_factory=list)
    """Extra reward atoms beside the task's, each "path/to/file.py:function" or
    {path, weight, name, parents}; parents may name the task's atoms (gate a partial-credit
    atom on the task's format atom). Or a learned reward model scoring the text, {reward_model:
    DIR, weight, name, parents, device, batch_size, max_length, dtype, template}
    (mmrl.core.reward_models; device and dtype default to model.device and model.dtype). Relative paths start at the
    config file's directory."""
    on_error: Literal["raise", "zero"] = "raise"
    """An atom that raises or returns NaN: stop with an error naming it ("raise"), or
    score it 0 and count it in reward/errors ("zero")."""
    timeout: float | None = Field(None, gt=0, le=threading.TIMEOUT_MAX)
    """Seconds allowed for each call of an atom (a sync one runs in a thread to be timed, and one
    that hangs is left running there); None = no limit."""
    max_stuck: int = Field(4, ge=1)
    """With a timeout: calls of one sync atom that may be left running past it; while that many
    are, its calls fail as timed out at once without running (no thread piles up, no timeout is
    waited out per sample)."""
    overlong: OverlongConfig | None = None
    """DAPO's soft overlong punishment, as an extra atom "overlong" (VLM backend only: it reads
    each completion's token count); None = off."""


class OptimConfig(Section):
    lr: float = Field(1e-5, ge=0)
    """Peak learning rate of AdamW (after the warm-up; the schedule decays from it). 0 = a
    control run: rollouts, rewards, losses and gradient norms logged as the method makes them,
    and no weight changed (a no-learning baseline to set a run's reward curve against)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay, applied to every trained parameter; 0 = none."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2): decay rates of the running means of the gradient and of its
    square."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the root of the second moment in the update's denominator."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None = no clipping (0 and inf are refused, not read
    as off). loss/grad_norm logs the norm before clipping."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up: constant, or decayed from lr toward 0 linearly or
    along a half cosine over the rest of the run's optimizer steps (train.max_steps x
    ppo_epochs x mini_batches)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where the linear or cosine decay ends, as a fraction of lr: the schedule's factor f (from 1
    to 0) becomes min_lr_ratio + (1 - min_lr_ratio) f; 0 = decay to 0. Unused with constant."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps (not training steps) over which the learning rate rises linearly to lr
    (optimizer step n, from 0, uses lr x (n + 1) / warmup_steps); 0 = no warm-up."""
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    """The warm-up as a fraction of the run's optimizer steps (train.max_steps x ppo_epochs x
    mini_batches, the count the decay spans): ceil(warmup_ratio x that count) warm-up steps, rounded
    up as transformers' warmup_ratio (verl's lr_warmup_steps_ratio rounds down). Set this or
    warmup_steps, not both; 0 = no warm-up."""
    master_weights: bool = True
    """Trainable parameters stored below float32 (model.dtype bfloat16) get a float32 copy that
    the optimizer steps and gradients accumulate into; the model holds its rounding. Without
    it most updates at a fine-tuning lr round away in bfloat16. Costs 10 bytes more per such
    parameter (the 4-byte copy; its gradient and AdamW's two moments in float32 instead of
    bfloat16); float32 parameters and LoRA adapters need none. Only training makes copies (not
    eval). mmrl.core.master."""
    shard_state: bool = False
    """Data parallel only: each process keeps AdamW's moments for its own share of the
    parameters, steps that share and broadcasts it (ZeRO stage 1). The same update; the moments
    per process are about 1 / processes of them, for one broadcast of the weights per optimizer
    step. No effect in one process."""
    fsdp: bool = False
    """Data parallel only: the model fully sharded with torch's FSDP2 (ZeRO stage 3). Each
    process keeps 1 / processes of every weight, gradient and AdamW moment, in float32; a
    bfloat16 model computes in bfloat16 (the float32 shards are its master weights). Rollouts and
    evaluation gather the whole weights for their duration. For full fine-tuning with sync,
    inline rollouts: refused with LoRA, method.ema, pipelined or remote engines, shard_state.
    No effect in one process (a warning says so). mmrl.core.fsdp."""

    @model_validator(mode="before")
    @classmethod
    def _clipping_off_is_null(cls, data: Any) -> Any:
        # Other trainers read max_grad_norm 0 (transformers) or inf as "no clipping": say how it is
        # said here, where pydantic alone would answer "should be greater than 0" or "finite".
        value = data.get("max_grad_norm") if isinstance(data, dict) else None
        if isinstance(value, bool):
            return data  # the base's message: a boolean where a number is due
        try:
            number = float(value)
        except (TypeError, ValueError):
            return data  # None, or not a number: pydantic's own message
        if not 0 < number < math.inf:
            raise KeyValueError("max_grad_norm", f"{value} is not a positive, finite norm; for no clipping set it to "
                                "null (--set optim.max_grad_norm=null)")
        return data

    @model_validator(mode="after")
    def _min_lr_unused(self):  # said, not silently ignored
        if self.schedule == "constant" and changed_settings(self, ("min_lr_ratio",)):
            config_warning(f"optim.min_lr_ratio {self.min_lr_ratio} is unused with optim.schedule constant "
                           "(it is where a linear or cosine decay ends)")
        return self

    @model_validator(mode="after")
    def _one_warmup(self):  # two lengths for one warm-up: which was meant is not ours to guess
        if self.warmup_steps and self.warmup_ratio:
            raise KeyValueError("warmup_ratio", f"{self.warmup_ratio} and optim.warmup_steps {self.warmup_steps} are "
                                "both set: give the warm-up as one of them and set the other to 0")
        return self

    def warmup(self, total: int) -> int:
        """The warm-up's length in optimizer steps, for a run of `total` of them."""
        if self.warmup_ratio:
            return math.ceil(self.warmup_ratio * total)  # as transformers' get_warmup_steps
        return self.warmup_steps

    @model_validator(mode="after")
    def _betas_in_range(self):
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        return self


class TrainLoopConfig(Section):
    max_steps: int = Field(20, ge=0)
    """Rollout-and-update steps."""
    ppo_epochs: int = Field(1, ge=1)
    """mu: passes over each rollout batch. With 1 and mini_batches 1 training is exactly
    on-policy. With mini_batches 1 and sync, inline rollouts the first pass is: the dLLM
    methods take its log-probs as the old ones instead of scoring them in a pass of their own."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the batch is split into this many mini-batches (shuffled; their
    sizes differ by at most one). At most prompts_per_step x num_generations (per process) in
    sync mode; a batch a method pruned below this leaves mini-batches empty, which are skipped:
    fewer steps than asked, while a learning-rate schedule counts mini_batches per pass."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward (gradient accumulation); None = the whole mini-batch."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only at the end). The final step is always saved."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N steps (0 = only before and after training)."""
    log_samples_every: int = Field(10, ge=0)
    """Write a sample table every N steps (0 = never)."""
    max_bad_steps: int = Field(3, ge=1)
    """Non-finite loss or gradients: the step is skipped; after this many in a row the run stops."""
    best_metric: str | None = None
    """A held-out metric (e.g. accuracy) to keep the best checkpoint by: each periodic
    evaluation (eval_every) and the final one that beats the best so far makes its step's
    checkpoint the best, recorded in best.json and summary.json and spared by keep_last.
    None: no best is kept. mmrl.core.best."""
    best_mode: Literal["max", "min"] = "max"
    """Whether a higher (max) or lower (min) best_metric is better."""

    @model_validator(mode="after")
    def _best_needs_evaluations(self):
        if self.best_metric is not None and self.eval_every == 0:
            raise ValueError("best_metric needs eval_every > 0: without evaluations during training the "
                             "final checkpoint is the only one scored")
        return self


class WandbConfig(Section):
    """Weights & Biases (mmrl.core.wandb_run): the config, each step's metrics and the held-out
    metrics before and after, from the main process. wandb's own environment variables
    (WANDB_API_KEY, WANDB_MODE, ...) apply as usual."""

    enabled: bool = False
    """Log the run to W&B (the wandb extra: pip install -e '.[wandb]'); --resume continues the same
    W&B run (its id is kept in <output_dir>/wandb.json)."""
    project: str = "mmrl"
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user; None = wandb's default for the logged-in user."""
    name: str | None = None
    """The W&B run's display name; None = the output directory's name."""
    group: str | None = None
    """A W&B group, e.g. to see a method's seeds together."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags of the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (a run folder under <output_dir>/wandb to `wandb sync` later) or disabled;
    None = wandb's own choice (WANDB_MODE, else online)."""


class LoggingConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard event files to <output_dir>/tensorboard (metrics.jsonl is written either
    way)."""
    progress: bool = True
    """Rich progress bar on a terminal; where output is not one (a cluster job's log), a plain
    line every 5% of the steps with the time left. Each held-out evaluation is said as it starts
    and ends. The libraries' own bars (transformers and diffusers loading and writing weights)
    follow it, off without a terminal."""
    keep_last_samples: int | None = Field(None, ge=1)
    """Sample tables (samples/step_*.jsonl, one every train.log_samples_every steps) kept on disk;
    older ones are deleted once a newer one is written, as train.keep_last does for checkpoints.
    None = keep them all (a long run writes one per log_samples_every steps)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging, off by default."""


class TrainConfig(Section):
    """A whole run. Backends narrow `model`, `task` and `method` in subclasses."""

    seed: int = 0
    """The run's seed: Python, NumPy and torch RNGs, the order of the training prompts, the
    rollouts' sampling noise and LoRA's initial adapters."""
    output_dir: str = "runs/default"
    """Directory the run writes to: config.yaml, metrics.jsonl, TensorBoard logs, samples and
    checkpoints/ (a relative path starts at the working directory; -o / --output-dir sets it)."""
    plugins: list[str] = Field(default_factory=list)
    """Python files the command lines import before they read the rest of the config (relative
    to the config file's directory, else the working directory): a method of one's own registers
    itself there, and a file defining CONFIG_CLASS, a subclass of the backend's config that takes
    the method's config, makes the command line read configs with it. mmrl.core.plugins."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model: which checkpoint, its dtype and device, memory settings."""
    task: dict[str, Any] | None = None
    """The backend's task section; its schema belongs to the backend."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling of the rollouts: G per prompt, prompts per step, the engine and its scheduler."""
    method: MethodConfig = Field(default_factory=GRPOConfig)
    """The RL algorithm; `type` picks it, and the rest of the section are its settings."""
    reward: RewardConfig = Field(default_factory=lambda: RewardConfig())
    """Extra reward atoms beside the task's, and how failing or slow atoms are handled."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The AdamW optimizer, its learning-rate schedule, gradient clipping and weight sharding."""
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    """The training loop: steps, passes and mini-batches per rollout batch, checkpoints,
    evaluation."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """What the run logs besides metrics.jsonl: TensorBoard, the progress bar, Weights & Biases."""

    _base_dir: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _output_dir_not_empty(self):
        # `--set output_dir=$RUNS/x` is caught by the shell; `output_dir=$OUT` with OUT unset is "",
        # which wrote the run's checkpoints and logs into the working directory
        if not self.output_dir.strip():
            raise KeyValueError("output_dir", f"{self.output_dir!r} is empty: give a directory for the run "
                                              "(was a --set value's variable unset?)")
        # "~/runs" in a file or a quoted --set (no shell expands it) made a folder named "~" here,
        # and "run/" printed as run//summary.json
        expanded = os.path.expanduser(self.output_dir)
        expanded = expanded.rstrip("/") or expanded
        if expanded != self.output_dir:
            object.__setattr__(self, "output_dir", expanded)
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self):
        ol = self.reward.overlong
        if ol is not None and ol.buffer > (ol.max_len or self.rollout.max_new_tokens):
            limit = (f"reward.overlong.max_len ({ol.max_len})" if ol.max_len else
                     f"rollout.max_new_tokens ({self.rollout.max_new_tokens})")
            raise ValueError(f"reward.overlong.buffer ({ol.buffer}) is longer than {limit}: the "
                             "penalty would start before the first token")
        return self

    @model_validator(mode="after")
    def _fastrl_fits_the_group(self):  # with the config, not after the model has loaded
        fastrl, g = getattr(self.method, "fastrl", None), self.rollout.num_generations
        if fastrl is None or not fastrl.enabled:
            return self
        if fastrl.ars and fastrl.min_group_size > g:
            # ARS's floor would not keep the group from shrinking but grow it past G_1 at the first shrink
            raise ValueError(f"method.fastrl.min_group_size ({fastrl.min_group_size}) is above "
                             f"rollout.num_generations ({g}): ARS only shrinks the group from num_generations, "
                             f"so give min_group_size in [2, {g}]")
        if fastrl.pad_multiple is not None and 1 < g <= fastrl.pad_multiple:
            # the only multiple of it a group's kept count can reach is the whole group: silently no pruning
            raise ValueError(f"method.fastrl.pad_multiple ({fastrl.pad_multiple}) is not below "
                             f"rollout.num_generations ({g}): every group's kept rollouts would be padded back "
                             f"to all {g}, so MDAP prunes nothing; give pad_multiple below {g} (or null: the "
                             f"data-parallel world size)")
        return self

    @property
    def base_dir(self) -> str | None:
        """Directory of the YAML file this config came from: relative atom paths start there."""
        return self._base_dir


# --------------------------------------------------------------------------- loading

# What moved to mmrl/core/config_loading.py stays importable from here as before (`from
# mmrl.core.config import load_config` in backends, tests and users' code): looked up on first
# use (__getattr__), not imported at the top, since config_loading imports this module's sections
# at its own top. The names are these (for type checkers and readers), and its private helpers.
if typing.TYPE_CHECKING:
    from mmrl.core.config_loading import (  # noqa: F401
        BASE_KEY,
        _Loader,
        _yaml,
        apply_overrides,
        check_built,
        deep_merge,
        dump_yaml,
        expand_env,
        load_config,
        parse_override,
        read_config_file,
        read_yaml,
    )


def __getattr__(name: str) -> Any:
    if not name.startswith("__"):  # not a probe such as __path__: that needs no loading
        from mmrl.core import config_loading

        if name in vars(config_loading):
            return vars(config_loading)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
