"""Config of a vision-language run: the core TrainConfig with VLM model, task and rollout sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from mmrl.core.config import (
    GroupAdvantageConfig,
    GRPOConfig,
    KeyValueError,
    ModelConfig,
    RolloutConfig,
    Section,
    TrainConfig,
    changed_settings,
    config_warning,
)
from mmrl.core.lora_config import LoRAConfig
from mmrl.vlm.tasks.scenes import check_ranges


class VLMModelConfig(ModelConfig):
    min_pixels: int = Field(56 * 56, ge=1)
    """Smallest image area after qwen-vl-utils' smart resize (pixels)."""
    max_pixels: int = Field(112 * 112, ge=1)
    """Largest image area after resize; bigger images are scaled down to it."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel of the transformers model (from_pretrained's attn_implementation): sdpa
    (PyTorch's scaled_dot_product_attention) or eager (plain matmuls)."""
    lora: LoRAConfig | None = None
    """None = full fine-tuning (the default for the tiny model)."""
    freeze_vision: bool = False
    """Keep the vision encoder and its patch merger fixed (under LoRA, adapters inside it too)
    and train the rest (EasyR1's freeze_vision_tower)."""

    @model_validator(mode="after")
    def _pixel_range(self):
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is above max_pixels ({self.max_pixels}): "
                             "no image size fits both")
        return self


class ShapesQATaskConfig(Section):
    """Synthetic images of coloured shapes with questions on counts, colours and positions."""

    type: Literal["shapes-qa"] = "shapes-qa"
    """The task: shapes-qa (generated images and questions)."""
    seed: int = 0
    """Seed of the item generator (the run's seed orders the prompts, this one makes them)."""
    num_train: int = Field(2000, ge=1)
    """Training items generated."""
    num_eval: int = Field(200, ge=1)
    """Held-out items generated (from a seed stream of their own; one identical to a training
    item is skipped)."""
    image_size: int = Field(112, ge=28)
    """Side of the square image in pixels."""
    min_shapes: int = Field(1, ge=1)
    """Fewest shapes in a scene."""
    max_shapes: int = Field(2, ge=1)
    """Most shapes in a scene (a scene's count is drawn uniformly from min_shapes to this)."""
    shape_size: tuple[int, int] = (36, 48)
    """Smallest and largest shape side in pixels. The bundled tiny model's 28-px vision
    tokens learn to read objects this size quickly; much smaller ones it barely sees."""
    kinds: list[str] | None = None
    """Question kinds to draw from (None = all)."""

    @model_validator(mode="after")
    def _scene(self):  # at load, with the key named (the task would refuse them only when built)
        check_ranges(self.shape_size, self.min_shapes, self.max_shapes)
        return self


class JSONLTaskConfig(Section):
    """Your own data: one JSON object per line with question, answer and image(s)."""

    type: Literal["jsonl"] = "jsonl"
    """The task: jsonl (your own questions and images)."""
    train_path: str
    """JSONL file of the training items (mmrl.vlm.tasks.jsonl); a relative path starts at the
    config file's directory, else the working directory. Image paths in it start at its own
    directory."""
    eval_path: str
    """JSONL file of the held-out items, in the same format."""
    on_bad_image: Literal["raise", "skip"] = "raise"
    """A missing or corrupt image: stop with an error naming it, or skip the sample with a warning."""


class ShapesZoomTaskConfig(Section):
    """shapes-qa with details too small to read without the zoom tool: a large image, one
    small shape per quadrant, questions about one quadrant (mmrl.vlm.tasks.shapes_zoom)."""

    type: Literal["shapes-zoom"] = "shapes-zoom"
    """The task: shapes-zoom (generated, read with the zoom tool)."""
    seed: int = 0
    """Seed of the item generator (the run's seed orders the prompts, this one makes them)."""
    num_train: int = Field(2000, ge=1)
    """Training items generated."""
    num_eval: int = Field(200, ge=1)
    """Held-out items generated (from a seed stream of their own; one identical to a training
    item is skipped)."""
    image_size: int = Field(448, ge=56)
    """Side of the full-resolution image (the model sees it scaled to within model.max_pixels)."""
    shape_size: tuple[int, int] = (150, 200)
    """Smallest and largest shape side in full-resolution pixels."""
    kinds: list[str] | None = None
    """Question kinds (None = the task's default, colour_at)."""

    @model_validator(mode="after")
    def _scene(self):  # at load, with the key named (the task would refuse it only when built)
        check_ranges(self.shape_size)
        return self


class ShapesMoodTaskConfig(Section):
    """Subjective emotion labels for shapes scenes: a distribution over eight emotions, a
    trigger box, K candidate emotions (mmrl.vlm.tasks.shapes_mood; DSPO's task)."""

    type: Literal["shapes-mood"] = "shapes-mood"
    """The task: shapes-mood (generated scenes with emotion labels)."""
    seed: int = 0
    """Seed of the item generator (the run's seed orders the prompts, this one makes them)."""
    num_train: int = Field(2000, ge=1)
    """Training items generated."""
    num_eval: int = Field(200, ge=1)
    """Held-out items generated (in distribution, from a seed stream of their own)."""
    num_ood: int = Field(200, ge=0)
    """Items whose scenes hold an unseen colour-shape composition (ShapesMood.ood_items)."""
    image_size: int = Field(112, ge=56)
    """Side of the square image in pixels."""
    min_shapes: int = Field(1, ge=1)
    """Fewest shapes in a scene."""
    max_shapes: int = Field(3, ge=1)
    """Most shapes in a scene."""
    shape_size: tuple[int, int] = (36, 48)
    """Smallest and largest shape side in pixels (as shapes-qa: sizes the tiny model reads)."""
    ood_compositions: list[tuple[str, str]] = Field(
        default_factory=lambda: [("yellow", "triangle"), ("blue", "circle")])
    """(colour, shape) pairs kept out of train and eval scenes; every OOD scene has one."""
    diversity_weight: float = Field(0.3, ge=0)
    """Weight of the task's DEDR atom (uniform candidate weights); 0 leaves it out (answer and
    format only: GRPO's reward in the DSPO comparison)."""

    @model_validator(mode="after")
    def _scene(self):  # at load, with the key named (the task would refuse them only when built)
        check_ranges(self.shape_size, self.min_shapes, self.max_shapes)
        return self


TaskConfig = Annotated[ShapesQATaskConfig | ShapesZoomTaskConfig | ShapesMoodTaskConfig | JSONLTaskConfig,
                       Field(discriminator="type")]


class ToolsConfig(Section):
    """Multi-turn tool rollouts (mmrl.vlm.agent): the model may call tools between turns."""

    names: list[str] = Field(default_factory=lambda: ["zoom", "calculator"])
    """Builtin tools (zoom, calculator) or your own, as "path/to/file.py:function" (sync or async def).
    A function's `ctx` parameter gets the prompt's images at full resolution (ctx.images; a jsonl
    task keeps only the model's view and decodes the original from its file for the call)."""
    max_turns: int = Field(3, ge=1)
    """Model turns per rollout (a turn ends at a tool call or at the end of the answer)."""
    max_tool_calls: int = Field(2, ge=0)
    """Tool calls per rollout, failed ones (malformed, unknown tool) included; later calls get an error observation."""
    timeout: float = Field(10.0, gt=0)
    """Seconds a tool may take; a slower call returns a timeout observation. Under isolation
    thread, a tool stuck in C code that holds Python's GIL (a regex that backtracks for ever)
    cannot be interrupted and hangs the rollout (one that ends past 2 x timeout + 0.1 s is a
    timeout, and warned about): use isolation process for such tools."""
    isolation: Literal["thread", "process"] = "thread"
    """Where tools run. thread: a thread of this process; a call past its timeout is left running
    (see max_stuck), and one in C code holding the GIL cannot time out. process: each tool in
    worker processes of its own, killed at the timeout and replaced (the next call waits for a
    fresh start: 0.1 s, more where the tool's file imports torch); the tool must be importable
    there (a builtin or a "file.py:function"). A calculator call takes about 0.1-0.3 ms either way
    (2 shared cores). One tool only: Tool(fn, isolation="process") in its file."""
    max_stuck: int = Field(4, ge=1)
    """Calls of one tool that may be left running past `timeout` (each in a thread that cannot be
    stopped, and may spin for ever); while that many still run, the tool's calls return a timeout
    observation at once, without running, so a policy that keeps calling a hanging tool does not
    slow the run without bound."""
    max_observation_tokens: int = Field(1024, ge=16)
    """Tokens of a tool's text kept in its observation; a longer text is cut there, says so, and
    counts as a tool failure (too_long): a tool returning a megabyte would otherwise be a
    completion of a million tokens to train on."""
    image_max_pixels: int | None = Field(None, ge=1)
    """Largest area of an image a tool returns (e.g. a zoomed crop) as the model sees it;
    None = model.max_pixels. A zoom's gain is its crop scale times this over max_pixels."""
    schema_in_prompt: bool = True
    """Render the tools' JSON schemas into the system prompt (Qwen's chat template). Off for
    models that learned the tools from demonstrations (the bundled tiny tool VLM)."""

    @field_validator("names")
    @classmethod
    def _some_tool(cls, names: list[str]) -> list[str]:
        # Refused, not warned: a tools section turns on multi-turn rollouts, and with no tool every
        # call the model writes fails as unknown, so a run would train the tool format on nothing
        # but error observations, looking like a tool run in every metric but the tool-call rate.
        # Single-turn rollouts are the tools section left out, which says what it means.
        if not names:
            raise ValueError("no tools: a tools section turns on multi-turn tool rollouts, and with no tool every "
                             "call fails; name one (builtins: zoom, calculator; or path/to/file.py:function), or "
                             "leave rollout.tools out (--set rollout.tools=null) for single-turn rollouts")
        return names


class VLMRolloutConfig(RolloutConfig):
    max_new_tokens: int = Field(48, ge=1)
    """Most tokens sampled per completion, and per model turn in a tool rollout; a completion
    that spends them without ending is truncated. Greedy evaluation uses it too; it is the
    default of method.loss.max_len and reward.overlong.max_len."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (besides the end-of-turn token)."""
    eval_batch_size: int = Field(64, ge=1)
    """Prompts per greedy decoding batch in held-out evaluation; the sampled evaluation
    (eval_samples) decodes eval_batch_size // eval_samples prompts (at least 1) per batch. Memory
    and speed only: every metric, sampled_accuracy and pass@k included, is the same at any value
    (each sample draws from its own generator, seeded by its item and sample index)."""
    eval_samples: int = Field(4, ge=0)
    """Completions sampled per held-out item for `sampled_accuracy` and pass@k (0 = greedy only)."""
    eval_temperature: float | None = Field(None, gt=0)
    """Temperature of those held-out samples (pass@k at 0.6, say, while training samples at 1);
    None = rollout.temperature. Training rollouts always sample at rollout.temperature."""
    tools: ToolsConfig | None = None
    """None = single-turn rollouts; a tools section turns on multi-turn tool rollouts."""
    old_logprobs: Literal["generate", "forward"] = "generate"
    """Where a rollout's log-probs (and entropies) come from. generate: the logits generate
    returns, free but held whole (T x [N, V] float32: tens of GB at a 150k vocabulary and long
    completions). forward: a teacher-forced pass after generation, score_batch_size rows at a
    time, the same computation as training's (the on-policy ratio is exactly 1 in bf16 too; on
    torch 2.6 about 4e-7 off, exact on 2.14, those between unchecked, where a scoring chunk and
    a training micro-batch differ in padding: attention takes another path with and without a
    padding mask), at the cost of that pass (a tool rollout's whole transcript, once complete)."""
    score_batch_size: int = Field(16, ge=1)
    """Rows per teacher-forced pass when old_logprobs is forward."""


class AXPOResampleConfig(Section):
    k: int = Field(2, ge=2)
    """K: continuations resampled from each selected prefix (z-scored among themselves)."""
    budget: float = Field(0.25, ge=0)
    """Extra decoding per group as a fraction of G: M = max(1, round(budget * G / K)) prefixes.
    0 turns resampling off (GRPO, with AXPO's metrics: an ablation)."""
    force_call: bool = False
    """False: the kept prefix ends before the first call's opening tag, so a continuation may
    not call the tool at all. True: the prefix keeps that tag, so every continuation is a call
    whose arguments (and what follows) are re-drawn. AXPO's "resample K continuations starting
    at the tool call" (docs/methods.md section 2) reads either way."""

    @model_validator(mode="after")
    def _unused_without_budget(self):  # said, not silently ignored
        unused = changed_settings(self, ("k", "force_call"))
        if self.budget == 0 and unused:
            config_warning(f"method.resample.{', method.resample.'.join(unused)} unused with method.resample.budget 0: "
                           "nothing is resampled (GRPO with AXPO's metrics)")
        return self


class AXPOConfig(GRPOConfig):
    """AXPO (mmrl.vlm.methods.axpo): GRPO plus resampling from the least confident tool-call
    prefixes of groups whose tool-using rollouts are all wrong."""

    type: Literal["axpo"] = "axpo"
    """The method: axpo (GRPO with AXPO's resampling from tool-call prefixes)."""
    resample: AXPOResampleConfig = Field(default_factory=AXPOResampleConfig)
    """AXPO's resampling: continuations per selected prefix, the extra decoding budget, where a
    prefix ends."""
    success: float = Field(0.5, ge=0)
    """A rollout is right when its `answer` atom (else its total reward) is at least this."""

    @model_validator(mode="after")
    def _dynamic_sampling_drops_first(self):
        if self.dynamic_sampling.enabled and self.resample.budget > 0:  # said: it quietly undoes AXPO's point
            config_warning("method.dynamic_sampling drops a group whose rewards are all equal before AXPO looks at "
                           "it: a group whose rollouts are all wrong (and score alike) is dropped, never resampled, "
                           "so AXPO resamples only groups whose rewards differ (a right rollout without a tool call, "
                           "or another format score)")
        return self


BLUR_SIGMA_MIN = 0.2  # pixels: below about 0.17 a float32 Gaussian blur is the identity


class VPPOConfig(GRPOConfig):
    """VPPO (mmrl.vlm.methods.vppo): visual-dependency advantage shaping and token filtering."""

    type: Literal["vppo"] = "vppo"
    """The method: vppo (GRPO with visual-dependency shaping and token filtering)."""
    intervention: Literal["mask", "blur"] = "mask"
    """The re-scoring pass's image: random patches blacked out (VPPO's) or a Gaussian blur."""
    mask_p: float = Field(0.5, ge=0, le=1)
    """Chance that each image patch is blacked out in the re-scoring pass."""
    blur_sigma: float = Field(4.0, gt=0)
    """intervention: blur -- the blur's std in pixels of the image the model sees (at least 0.2:
    a narrower Gaussian leaves a float32 image unchanged)."""
    beta_min: float = Field(0.9, ge=0, le=1)
    """Smallest trajectory advantage scale."""
    top_frac: float = Field(0.4, gt=0, le=1)
    """Share of each response's tokens (highest visual dependency) that keep their gradient,
    rounded up: at least one token per response."""
    cap: float = Field(10.0, gt=0)
    """Clamp of the token visual dependency s_t."""

    @model_validator(mode="after")
    def _something_masked(self):
        if self.intervention == "mask" and self.mask_p == 0:  # the re-scoring would see the image unchanged
            raise ValueError("mask_p 0 blacks out no patch: every token's visual dependency is 0, so the method "
                             "shapes and filters by nothing; give mask_p in (0, 1] (VPPO's is 0.5)")
        return self

    @model_validator(mode="after")
    def _something_blurred(self):
        # the kernel's radius is at least 1 pixel, but a neighbour's weight exp(-1 / (2 sigma^2)) falls below
        # float32's resolution (2^-24) under sigma 0.17: the image comes back unchanged, as with mask_p 0
        if self.intervention == "blur" and self.blur_sigma < BLUR_SIGMA_MIN:
            raise ValueError(f"blur_sigma {self.blur_sigma} blurs nothing (a neighbouring pixel's weight "
                             f"exp(-1 / (2 sigma^2)) is below float32's resolution): every token's visual dependency "
                             f"is 0; give blur_sigma >= {BLUR_SIGMA_MIN} pixels (the default is 4)")
        return self

    @model_validator(mode="after")
    def _unused_by_the_intervention(self):  # said, not silently ignored
        other = {"mask": "blur_sigma", "blur": "mask_p"}[self.intervention]
        for setting in changed_settings(self, (other,)):
            config_warning(f"method.{setting} unused with method.intervention {self.intervention}: "
                           + ("the patches are masked, not blurred" if self.intervention == "mask"
                              else "the whole image is blurred, no patch is masked"))
        return self


class PACGConfig(VPPOConfig):
    """PACG (mmrl.vlm.methods.pacg): positive credit of unusually persistent visual claims
    attenuated, on DAPO or on VPPO; the intervention is VPPO's (patch masking with mask_p, or
    intervention: blur)."""

    type: Literal["pacg"] = "pacg"
    """The method: pacg (persistence-gated credit on DAPO or VPPO)."""
    base: Literal["dapo", "vppo"] = "dapo"
    """The method PACG gates: "dapo" (plain group advantages) or "vppo" (VPPO's shaping and
    token filter, then the gate)."""
    z0: float = 1.0
    """Claims whose batch z-scored persistence exceeds z0 are gated."""
    eta: float = Field(0.5, ge=0)
    """Gate slope: g = max(g_min, 1 - eta (z - z0))."""
    g_min: float = Field(0.5, ge=0, le=1)
    """Smallest gate: a persistent claim keeps at least this share of its positive credit."""
    claim_words: list[str] | None = None
    """Words that make a reasoning segment a visual claim (None = mmrl.vlm.claims.CLAIM_WORDS)."""
    answer_tag: str = "<answer>"
    """The reasoning is the response's text before this tag (its first occurrence, in any case)."""

    @model_validator(mode="after")
    def _claim_words_named(self):
        words = self.claim_words
        if words is not None and (not words or any(not w.strip() for w in words)):
            # [] fell back to the default vocabulary, and a blank word made every segment a claim
            raise ValueError(f"claim_words {words!r}: give claim words, none blank (leave it unset for the default "
                             "vocabulary, mmrl.vlm.claims.CLAIM_WORDS)")
        return self

    @model_validator(mode="after")
    def _vppo_settings_unused_on_dapo(self):  # said, not silently ignored
        unused = changed_settings(self, ("beta_min", "top_frac", "cap"))
        if self.base == "dapo" and unused:
            config_warning(f"method.{', method.'.join(unused)} unused with method.base dapo: VPPO's advantage "
                           "shaping and token filter run only with base vppo")
        return self


class CORAConfig(GRPOConfig):
    """CORA (mmrl.vlm.methods.cora): a consistency reward model's stream beside the task's,
    each normalised in its group (HRAS), the consistency weight warmed up."""

    type: Literal["cora"] = "cora"
    """The method: cora (GRPO with a consistency reward stream, HRAS advantages)."""
    consistency_model: str = "assets/tiny-consistency-modernbert"
    """The consistency classifier (a local sequence-classification model with a "consistent" label)."""
    lam: float = Field(1.0, gt=0)
    """lambda: r_cons = lambda * P(consistent), the consistency atom's weight in the run's reward (its
    total: reward metrics, dynamic sampling). HRAS z-scores the stream in its group, so lam does not
    change CORA's advantages (but for the z-score's eps): beta weighs the stream there."""
    alpha: float = Field(1.0, ge=0)
    """Weight of the task stream's group z-score."""
    beta: float = Field(0.2, ge=0)
    """Weight of the consistency stream's group z-score after warm-up."""
    warmup_steps: int = Field(20, ge=0)
    """Steps over which beta rises linearly from 0 (0 = no warm-up)."""

    @model_validator(mode="after")
    def _hras_advantages(self):
        if self.advantage != GroupAdvantageConfig():  # it would be ignored
            raise ValueError("CORA's advantages are HRAS's (each stream z-scored in its group, weighted by alpha "
                             "and beta): method.advantage is not used; leave it unset")
        if self.alpha == 0 and self.beta == 0:  # every advantage 0: the run would train nothing, silently
            raise ValueError("alpha and beta are both 0: every advantage is 0 and nothing is learnt; give the "
                             "task stream (alpha) or the consistency stream (beta) a weight")
        if self.beta == 0 and changed_settings(self, ("warmup_steps",)):  # said, not silently ignored
            config_warning(f"method.warmup_steps {self.warmup_steps} unused with method.beta 0: there is no "
                           "consistency weight to warm up")
        return self


class DSPOConfig(GRPOConfig):
    """DSPO (mmrl.vlm.methods.dspo): CVIG's counterfactual box re-scoring and DEDR's
    distribution-aware diversity of the candidate emotions, on GRPO (shapes-mood)."""

    type: Literal["dspo"] = "dspo"
    """The method: dspo (GRPO with CVIG's and DEDR's rewards, on shapes-mood)."""
    div_weight: float = Field(0.3, ge=0)
    """Weight of R_div (DEDR with CVIG's weights; it replaces the task's uniform-weight atom)."""
    cf_weight: float = Field(0.1, ge=0)
    """Weight of R_cf (CVIG's mean probability drop of the candidates with the box masked)."""
    tau: float = Field(0.05, gt=0)
    """Temperature of the candidate weights w_k = softmax_k(dP_k / tau) in DEDR (tau -> 0: all the
    weight on the candidate of the largest drop)."""
    tau_ctr: float = Field(1.0, gt=0)
    """DEDR's centring temperature (mmrl.vlm.dedr)."""
    tau_div: float = Field(0.5, gt=0)
    """DEDR's per-candidate contribution temperature: candidate k adds 1 - exp(-Delta_k / tau_div),
    unbounded below where removing it would centre the set (Delta_k < 0), so a small tau_div lets
    one such candidate outweigh every other atom (an R_div that overflows is refused)."""

    @model_validator(mode="after")
    def _group_advantages(self):
        if self.advantage.type != "group":
            raise ValueError(f"DSPO normalises its rewards in each group (advantage.type group, with its scale and "
                             f"eps); advantage.type {self.advantage.type!r} is not supported")
        return self

    @model_validator(mode="after")
    def _dedr_settings_unused_without_its_weight(self):  # said, not silently ignored
        unused = changed_settings(self, ("tau", "tau_ctr", "tau_div"))
        if self.div_weight == 0 and unused:
            config_warning(f"method.{', method.'.join(unused)} unused with method.div_weight 0: each shapes R_div "
                           "(DEDR and its CVIG weights), which then counts for nothing")
        return self


class VLMTrainConfig(TrainConfig):
    model: VLMModelConfig = Field(default_factory=VLMModelConfig)
    """The vision-language model (a Qwen-VL checkpoint, or the bundled tiny one), its image
    resolution, LoRA and frozen parts."""
    task: TaskConfig = Field(default_factory=ShapesQATaskConfig)
    """The training and held-out data and their reward: type shapes-qa, shapes-zoom, shapes-mood
    or jsonl."""
    rollout: VLMRolloutConfig = Field(default_factory=VLMRolloutConfig)
    """Sampling of the rollouts, multi-turn tools, and the decoding of held-out evaluation."""
    method: Annotated[GRPOConfig | AXPOConfig | VPPOConfig | PACGConfig | CORAConfig | DSPOConfig, Field(discriminator="type")] = Field(
        default_factory=GRPOConfig)
    """The RL algorithm: type grpo (GRPO, Dr.GRPO, DAPO, GSPO, RLOO), axpo, vppo, pacg, cora or
    dspo."""

    @model_validator(mode="after")
    def _dspo_scores_mood_responses(self):
        if self.method.type == "dspo" and self.task.type in ("shapes-qa", "shapes-zoom"):
            # no response of these tasks is in DSPO's template: R_cf = R_div = 0 for all, silently GRPO
            raise ValueError(f"method.type dspo scores shapes-mood's responses (a trigger box, candidate emotions "
                             f"and the item's VAD prior); task.type {self.task.type} has none, so every R_cf and "
                             f"R_div would be 0 (GRPO, at the cost of CVIG's passes): use task.type shapes-mood, "
                             f"or a jsonl task of mood items with mu and sigma")
        return self

    @model_validator(mode="after")
    def _cora_warmup_ends(self):  # said: a warm-up longer than the run never reaches the beta it names
        m, steps = self.method, self.train.max_steps
        if (m.type == "cora" and m.beta > 0 and steps > 0 and m.warmup_steps >= steps
                and changed_settings(m, ("warmup_steps",))):
            # beta_t = beta * step / warmup_steps at step 0 .. max_steps - 1
            config_warning(f"method.warmup_steps {m.warmup_steps} is not shorter than the run (train.max_steps "
                           f"{steps}): the consistency weight rises to {m.beta * (steps - 1) / m.warmup_steps:.3g} "
                           f"at most, never method.beta {m.beta}")
        return self

    @model_validator(mode="after")
    def _tool_images_fit(self):
        # qwen-vl-utils refuses a max_pixels below min_pixels: every image a tool returned failed as
        # an error observation (one warning, counted in rollout/tool_failures) and the run went on
        tools, model = self.rollout.tools, self.model
        if tools is not None and tools.image_max_pixels is not None and tools.image_max_pixels < model.min_pixels:
            raise KeyValueError("rollout.tools.image_max_pixels",
                                f"{tools.image_max_pixels} is below model.min_pixels ({model.min_pixels}): no size "
                                f"of a tool's image fits both, so every image a tool returns would fail; give at "
                                f"least {model.min_pixels}, or null for model.max_pixels ({model.max_pixels})")
        return self

    @model_validator(mode="after")
    def _overlong_budget(self):
        ol = self.reward.overlong
        if ol is not None and ol.max_len is None and self.rollout.tools is not None:
            raise ValueError("reward.overlong.max_len: a tool rollout's token budget (rollout.max_new_tokens) is "
                             "per turn, so say how many of the model's own tokens a whole rollout may have "
                             f"(at most tools.max_turns x max_new_tokens = "
                             f"{self.rollout.tools.max_turns * self.rollout.max_new_tokens})")
        return self


# The backend's settings as the CLI reads them (mmrl.vlm.backend re-exports them): `mmrl config`
# imports this module alone (BackendSpec.settings), not the model code, torch or transformers.
CONFIG_CLASS = VLMTrainConfig
DEFAULT_CONFIG = {
    "output_dir": "runs/vlm-default",
    "rollout": {"num_generations": 8, "prompts_per_step": 8, "max_new_tokens": 32, "temperature": 1.0},
    # lr 5e-4 for 500 steps: over seeds 0-7 it gained +18.8 points held-out, against +12.1 at
    # 300 steps and +5.1 for lr 1e-3 at 200 (benchmarks/RESULTS.md). Encoding each group's image
    # once made a step 1.6-2x cheaper, so 500 steps take what 300 did: 2-4 minutes on 2 cores.
    "optim": {"lr": 5e-4, "max_grad_norm": 1.0},
    "train": {"max_steps": 500, "log_samples_every": 25},
    # Colour and shape questions: the bundled model answers every count question "1" and every
    # left_of question with one word whatever the image, a prior that neither its SFT nor a few
    # hundred RL steps move (benchmarks/RESULTS.md); `--set task.kinds=null` asks all five kinds.
    "task": {"type": "shapes-qa", "num_train": 2000, "num_eval": 200, "kinds": ["colour_of", "shape_of"]},
}
