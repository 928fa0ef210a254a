"""Configuration: pydantic models, YAML files and dotted command-line overrides.

A run is described by one `TrainConfig`. Each backend subclasses it to narrow
`model`, `task` and `method` to its own typed unions (a `type:` field picks the
variant). Loading is three layers, later ones winning:

    embedded default (the backend's)  <-  YAML file  <-  --set key.path=value

A YAML file may build on others: `base: common.yaml` (or a list) layers it over them
(read_config_file), so a variant of an experiment holds only what differs.

Every section forbids unknown keys, and every error is turned into one
`ConfigError` whose message names the key path, so a CLI can print it instead of
a traceback.
"""

from __future__ import annotations

import copy
import difflib
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

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator


class ConfigError(ValueError):
    """A bad config: the message is one paragraph, fit for a user."""


def config_warning(message: str) -> None:
    """A UserWarning from a config validator, attributed to the code that built or changed the
    config: the first caller outside pydantic, this module and the validator's own module (a
    fixed stacklevel would name pydantic's BaseModel.__init__, whose depth under the caller
    differs between a section built directly and one validated inside load_config)."""
    import pydantic
    import pydantic_core

    inside = tuple(os.path.dirname(m.__file__) + os.sep for m in (pydantic, pydantic_core))
    frame, level = sys._getframe(1), 2  # stacklevel 2: the validator that called us
    own = {frame.f_code.co_filename, __file__}
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


def deep_merge(base: dict, update: dict) -> dict:
    """Recursive dict merge, `update` winning. A section whose `type` changes is replaced,
    not merged, so switching method or task does not drag the old variant's keys along."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and value.get("type", old.get("type")) == old.get("type")
        ):
            out[key] = deep_merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Loader(yaml.SafeLoader):
    """safe_load with YAML 1.2 floats (`1e-5` is a float, not the string '1e-5') and no
    duplicate keys: plain YAML keeps the last silently, and a config would lose a section.
    Anchors and merge keys (`<<: *anchor`) work as in safe_load."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: flatten_mapping (in the base) merges it, the keys written here winning
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (lines {seen[key]} and {line})", key_node.start_mark)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            seen[key] = line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# YAML 1.2 integers: decimal (a leading 0 is still decimal), 0o octal, 0x hex. YAML 1.1's
# base-60 ("20:00" read as 1200) and leading-0 octal ("010" read as 8) are strings or decimals.
for _first, _resolvers in list(_Loader.yaml_implicit_resolvers.items()):
    _Loader.yaml_implicit_resolvers[_first] = [(tag, rx) for tag, rx in _resolvers if tag != "tag:yaml.org,2002:int"]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith(("0o", "0x")):
        return int(text, 8 if text[1] == "o" else 16)
    return int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# YAML 1.2 booleans: true and false only. YAML 1.1's yes/no/on/off/y/n were read as booleans,
# so `task.answer=no` or a prompt "on" became False; a bool field still takes them (pydantic).
for _first, _resolvers in list(_Loader.yaml_implicit_resolvers.items()):
    _Loader.yaml_implicit_resolvers[_first] = [(tag, rx) for tag, rx in _resolvers if tag != "tag:yaml.org,2002:bool"]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


class _Dumper(yaml.SafeDumper):
    """safe_dump that quotes every string _Loader or safe_load would read as something else:
    safe_dump knows YAML 1.1 only, so it wrote the strings "1e-5" and "0o17" plain, and a
    dumped config (`config`, a run's config.yaml) loaded back with a float and an int there."""


for _first, _resolvers in _Loader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        _Dumper.add_implicit_resolver(_tag, _regexp, [_first])


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """yaml.safe_dump(data, **kwargs) that loads back as it was by load_config (read_yaml) and
    by yaml.safe_load alike."""
    return yaml.dump(data, Dumper=_Dumper, **kwargs)


def _yaml(text: str, name: str | None = None) -> Any:
    """`text` read as YAML; an error's marks name `name` (a file's path) where yaml's would
    say "<unicode string>"."""
    loader = _Loader(text)
    if name is not None:
        loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def parse_override(item: str) -> tuple[list[str], Any]:
    """"a.b.c=value" -> (["a", "b", "c"], value parsed as YAML: 3 -> int, [1, 2] -> list, x -> str)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key in {key!r}")
    try:
        value = _yaml(raw, "the value") if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_one_line(e)})") from None
    return parts, value


def _override_list(overrides) -> tuple[str, ...]:
    """load_config's `overrides` from Python: a list of strings. One string would be read
    character by character ("override 't' must look like ..."), and a dict's keys without
    their values, so both are refused with the list to write instead."""
    if overrides is None:
        return ()
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings, not one string: "
                          f"write [{overrides!r}]")
    if isinstance(overrides, dict):
        hint = ", ".join(repr(f"{k}={v}") for k, v in list(overrides.items())[:2])
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings, not a dict: write [{hint}]")
    bad = [o for o in overrides if not isinstance(o, str)]
    if bad:
        raise ConfigError(f"overrides must be a list of 'key.path=value' strings; {bad[0]!r} is not a string ("
                          f"{type(bad[0]).__name__})")
    return tuple(overrides)


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    data = copy.deepcopy(data)
    done: list[tuple[list[str], str]] = []  # (key, override) applied so far
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if isinstance(child, list):  # `reward.atoms.0.weight=2`: items have no key path
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a list, and --set reaches into sections "
                                  f"only: give the whole list, e.g. --set '{where}=[...]'")
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        if parts[-1] == "type" and node.get("type") != value:
            node.clear()  # a new variant starts from its own defaults
            section = parts[:-1]
            # the section's keys given before, or the whole section given as a mapping
            wiped = [o for key, o in done if key[: len(section)] == section and len(key) >= len(section)]
            if wiped:  # said, not silent: the same keys given after the type would stay
                warnings.warn(f"{', '.join(wiped)} given before {item.strip()} no longer applies: a new "
                              f"{'.'.join(section)} type starts from its own defaults (give the type first "
                              "to keep them)", stacklevel=3)
        node[parts[-1]] = value
        done.append((parts, item.strip()))
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        from mmrl.core.runconfig import not_installed_note

        raise ConfigError(f"config file {str(path)!r} does not exist{not_installed_note(path)}")
    try:
        data = _yaml(path.read_text(encoding="utf-8"), str(path))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


_ENV_VAR = re.compile(r"\$([A-Za-z_]\w*|\{[A-Za-z_]\w*\})")


def expand_env(data: Any, path: str | Path) -> Any:
    """A config file's values with $NAME and ${NAME} replaced by set environment variables, as
    a shell would (`output_dir: $SCRATCH/runs/axpo` on a cluster; a --set value the shell has
    expanded already), and `$$` by one `$` (`price: $$5`; `$$HOME` is the text "$HOME"). An
    unset variable stays as written, with one warning: it would otherwise become a directory
    named "$SCRATCH" without a word."""
    unset: dict[str, str] = {}

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and "$" in value:
            # each piece between the `$$`s on its own: "$$HOME" is "$" and "HOME", never $HOME
            pieces = [os.path.expandvars(piece) for piece in value.split("$$")]
            for m in (m for piece in pieces for m in _ENV_VAR.finditer(piece)):
                unset.setdefault(m.group(1).strip("{}"), key)
            value = "$".join(pieces)
        return value

    data = walk(data, "")
    if unset:
        name, key = next(iter(unset.items()))
        config_warning(f"{path}: {key} names the environment variable ${name}, which is not set: kept as written")
    return data


BASE_KEY = "base"


def read_config_file(path: str | Path, layers: list[tuple[Path, dict]] | None = None) -> dict:
    """A config file's settings as load_config layers them: the file read (read_yaml), its
    variables expanded (expand_env), over the config files its `base:` names (a path or a list,
    relative to the file), the later of a list over the earlier, each read the same way (bases
    of bases too), merged with deep_merge. A relative path in a base that names an existing
    file or directory there is made absolute (runconfig.absolute_paths), so it still means the
    file beside the base. `layers`, when given, gets each file's own settings (path, dict), the
    bases first: whose key an error is."""
    return _read_layered(Path(path), (), None, [] if layers is None else layers)


def _read_layered(path: Path, chain: tuple[Path, ...], named_by: str | None,
                  layers: list[tuple[Path, dict]]) -> dict:
    """read_config_file of `path`, reached through the files of `chain` (named_by: the `base:`
    entry that named it, for its errors)."""
    from mmrl.core.runconfig import absolute_paths  # runconfig imports this module

    try:
        data = expand_env(read_yaml(path), path)
    except ConfigError as e:
        raise ConfigError(f"{named_by}: {e}" if named_by else str(e)) from None
    bases = data.pop(BASE_KEY, None)
    names = [bases] if isinstance(bases, str) else [] if bases is None else bases
    if bases is not None:
        where = f"{path}, line {_key_line(path, BASE_KEY)}: {BASE_KEY}"
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"{where} takes a config file's path or a list of them (relative to "
                          f"{path.resolve().parent}), got {bases!r}")
    merged: dict = {}
    chain = (*chain, path.resolve())
    for name in names:
        file = (path.parent / Path(name).expanduser()).resolve()  # an absolute name stays as it is
        if file in chain:
            cycle = " -> ".join(map(str, [*chain[chain.index(file):], file]))
            raise ConfigError(f"{where} {name!r} makes a cycle of bases: {cycle}")
        unset = " (it names an environment variable that is not set)" if _ENV_VAR.search(name) else ""
        base = _read_layered(file, chain, f"{where} {name!r}{unset}", layers)
        merged = deep_merge(merged, absolute_paths(base, file.parent))  # its paths start beside it
    layers.append((path, data))
    return deep_merge(merged, data)


def _key_line(path: Path, key: str) -> int | str:
    """The line of the top-level `key` in YAML file `path` ("?" where it cannot be read)."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "?"
    for k, _ in getattr(node, "value", None) or ():
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return k.start_mark.line + 1
    return "?"


def _foreign_bases(cls: type[BaseModel], layers: list[tuple[Path, dict]]) -> None:
    """A ConfigError where a base file picks a method or task type that `cls` has none of: a
    base written for another backend (a diffusion config on a VLM one), which may still merge
    into a valid config where the file on top replaces that section."""
    top = layers[-1][0]
    for file, data in layers[:-1]:
        for section in ("method", "task"):
            given = data.get(section)
            kind = given.get("type") if isinstance(given, dict) else None
            field = cls.model_fields.get(section)
            tags = [m.model_fields["type"].default for m in _members(field.annotation) if isinstance(m, type)
                    and issubclass(m, BaseModel) and "type" in m.model_fields] if field is not None else []
            if kind is not None and tags and kind not in tags:
                raise ConfigError(f"{file}, a base of {top}, sets {section} {kind!r}, not one of this config's "
                                  f"({', '.join(map(str, tags))}): is it another backend's config?")


def _file_of(key: str, layers: list[tuple[Path, dict]]) -> Path | None:
    """The file of `layers` that sets most of dotted `key` (the later one of a tie): where a
    key an error names, or the section a validator's error names, was written."""
    best, depth = None, 0
    for file, data in layers:
        node, n = data, 0
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node, n = node[part], n + 1
        if n and n >= depth:
            best, depth = file, n
    return best


def load_config(
    cls: type[TrainConfig] = TrainConfig,
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    defaults: dict | None = None,
) -> TrainConfig:
    """Build a validated config: `defaults` <- YAML file at `path` <- dotted `overrides`, a list
    of "key.path=value" strings as --set takes them (the value read as YAML)."""
    overrides = _override_list(overrides)
    if isinstance(path, dict):  # load_config(Cfg, {...}): the second argument is the file's path
        raise ConfigError("load_config's path is a dict: pass a mapping as defaults=..., e.g. "
                          "load_config(cls, defaults={'train': {'max_steps': 2}})")
    if defaults is not None and not isinstance(defaults, dict):
        raise ConfigError(f"load_config's defaults must be a mapping of sections, got a {type(defaults).__name__}")
    # Start from the full default dump, so every union section carries its `type`.
    data = deep_merge(cls().model_dump(mode="json"), defaults or {})
    layers: list[tuple[Path, dict]] = []  # each file's own settings: whose key an error is
    if path is not None:
        from mmrl.core.runconfig import resolve_config_file  # runconfig imports this module

        path = resolve_config_file(path)
        data = deep_merge(data, read_config_file(path, layers))
        _foreign_bases(cls, layers)
    if any(parse_override(o)[0][0] == BASE_KEY for o in overrides):
        raise ConfigError(f"--set {BASE_KEY}=...: a config's base files are named in the config file itself "
                          f"(`{BASE_KEY}: FILE` in the --config file), not by --set")
    before, data = data, apply_overrides(data, overrides)
    try:
        cfg = cls.model_validate(data)
    except ValidationError as e:
        set_keys = {".".join(parse_override(o)[0]) for o in overrides}
        keys = [".".join(map(str, _error_loc(err, data))) for err in e.errors()]
        # an error of a whole section (a validator's) may come from a --set inside it: blame no one then
        files = dict.fromkeys(_file_of(k, layers) or path for k in keys
                              if not any(k == s or k.startswith(s + ".") or s.startswith(k + ".") for s in set_keys))
        # a --set value is not the file's fault; a base's key is the base's
        named = [str(f) if f == path else f"{f} (a base of {path})" for f in files if f is not None]
        where = f" in {' and '.join(named)}" if named else ""
        raise ConfigError(f"invalid config{where}: " + "; ".join(_describe(e, cls, data))) from None
    _say_replaced_sections(cfg, before, overrides)
    if path is not None:
        cfg._base_dir = str(Path(path).resolve().parent)
    return cfg


def _say_replaced_sections(cfg: BaseModel, before: dict, overrides: tuple[str, ...]) -> None:
    """A warning where a --set gave a whole section as a mapping (`method.loss={clip_high: 0.3}`)
    and so returned keys the file or the backend's defaults had set (DAPO's token_mean) to their
    class defaults: the section is replaced, not merged as a file's is, and that went unsaid."""
    parsed = [(item, *parse_override(item)) for item in overrides]
    mappings = [(item, parts, value) for item, parts, value in parsed if isinstance(value, dict)]
    if not mappings:  # the usual case: no dump of the whole config
        return
    after = cfg.model_dump(mode="json", warnings=False)
    for item, parts, value in mappings:
        old, new, section = before, after, cfg
        for part in parts:
            old, new = (d.get(part) if isinstance(d, dict) else None for d in (old, new))
            section = getattr(section, part, None)
        if not (isinstance(section, BaseModel) and isinstance(old, dict) and isinstance(new, dict)) \
                or new.get("type") != old.get("type"):
            continue  # a new variant (given here or by a later --set) starts from its own defaults
        where = ".".join(parts)
        lost = [f"{where}.{k} {json.dumps(v)} -> {json.dumps(new[k])}" for k, v in old.items()
                if k not in value and v != new.get(k)]
        if lost:
            config_warning(f"--set {item.strip()} replaces the whole {where} section: {', '.join(lost)} (its "
                           f"defaults); give only the keys to change (--set {where}.KEY=VALUE) to keep the others")


def check_built(cfg: BaseModel) -> None:
    """A config that a Trainer is handed, validated again: pydantic's model_copy(update=...)
    does not validate, so `cfg.model_copy(update={"train": {"max_steps": 5}})` put a dict where
    the section was (an AttributeError deep in the trainer) and a max_steps of -3 trained
    nothing without a word. ConfigError naming the key; the config itself is not replaced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a validator's warnings were shown when it was built
        data = cfg.model_dump(mode="json", warnings=False)
        try:
            fresh = type(cfg).model_validate(data)
        except ValidationError as e:
            raise ConfigError("invalid config (model_copy(update=...) does not validate what it sets): "
                              + "; ".join(_describe(e, type(cfg), data))) from None
    _check_sections(cfg, fresh, "")


def _check_sections(cfg: BaseModel, fresh: BaseModel, prefix: str) -> None:
    for name in type(fresh).model_fields:
        top = (prefix + name).split(".")[0]  # the example below updates a top-level section
        want, got = getattr(fresh, name), getattr(cfg, name, None)
        if isinstance(want, BaseModel):
            if not isinstance(got, type(want)):
                raise ConfigError(f"config section {prefix}{name} is a {type(got).__name__}, not a "
                                  f"{type(want).__name__}: model_copy(update=...) sets values as given; "
                                  f"update a section with its own model_copy, e.g. "
                                  f"cfg.model_copy(update={{{top!r}: cfg.{top}.model_copy(update={{...}})}}), "
                                  f"or build the config with load_config(..., overrides=[...])")
            _check_sections(got, want, f"{prefix}{name}.")


# --------------------------------------------------------------------------- error messages


def _describe(error: ValidationError, cls: type[BaseModel], data: dict) -> list[str]:
    lines = []
    for err in error.errors():
        loc = _error_loc(err, data)
        key = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = _known_keys(cls, data, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = f"unknown key {key!r}"
            if hint:
                msg += f" (did you mean {'.'.join([*map(str, loc[:-1]), hint[0]])!r}?)"
            elif known:
                msg += f" (allowed here: {', '.join(sorted(known))})"
        elif (err["type"] in ("model_attributes_type", "model_type") and isinstance(err.get("input"), str)
              and "type" in _known_keys(cls, data, loc)):  # `method: axpo`, for `method: {type: axpo}`
            got = err["input"]
            msg = f"{key}: {got!r} is given where a mapping is due: write `{key}: {{type: {got}}}` in a file, or --set {key}.type={got}"
        elif err["type"] in ("model_type", "model_attributes_type") and err.get("input", "") is None:
            # `optim:` with every key under it commented out, or --set optim=null
            msg = f"{key} is empty (null) where a section is due: leave {key} out for its defaults"
        else:
            text = err["msg"].removeprefix("Value error, ")  # pydantic's prefix to a validator's message
            msg = f"{key}: {text}"
            if err["type"] not in ("missing",) and "input" in err and not isinstance(err["input"], dict):
                msg += f" (got {err['input']!r}){_input_note(err['type'], err['input'])}"
        lines.append(msg)
    return lines


def _input_note(kind: str, got: Any) -> str:
    """Why a value YAML read is not the one meant, where that shows: a Python None (YAML's null
    is null or ~), or a name or tag YAML read as a number or a boolean (2024, 1e-5, true)."""
    if got in ("None", "none"):
        return ": 'None' is a string in YAML; null (or ~) is none"
    if kind == "string_type" and isinstance(got, int | float):  # bool is an int
        read = "a boolean" if isinstance(got, bool) else "an integer" if isinstance(got, int) else "a number"
        return f": YAML read it as {read}; quote it to give a string (\"...\")"
    return ""


def _error_loc(err: dict, data: Any) -> list:
    """The key path of one pydantic error, down to the key a section validator named."""
    loc = _clean_loc(err["loc"], data)
    cause = (err.get("ctx") or {}).get("error")
    return [*loc, cause.key] if isinstance(cause, KeyValueError) else loc


def _clean_loc(loc: tuple, data: Any) -> list:
    """Drop the union tags pydantic inserts ("method.grpo.loss" -> "method.loss")."""
    out, node = [], data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("type") == part:
            continue
        out.append(part)
        node = node.get(part) if isinstance(node, dict) else None
    return out


def _known_keys(cls: type[BaseModel], data: Any, loc: list) -> list[str]:
    """Field names of the section at `loc`, following unions by the data's `type`."""
    model: Any = cls
    node = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        model = _resolve(field.annotation, node)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _resolve(annotation: Any, node: Any) -> Any:
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _resolve(args[0], node)
    if args:
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        tag = node.get("type") if isinstance(node, dict) else None
        for m in models:
            f = m.model_fields.get("type")
            if f is not None and tag is not None and f.default == tag:
                return m
        return models[0] if models else None
    return annotation
