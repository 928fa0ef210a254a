"""Config of a flow / diffusion run: the core TrainConfig with the diffusion model,
task, rollout (SDE sampling) and method (Flow-GRPO, FTFC, CAST) sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from mmrl.core.config import (
    KeyValueError,
    KLConfig,
    ModelConfig,
    RolloutConfig,
    Section,
    TrainConfig,
    changed_settings,
    config_warning,
)


class LoRAConfig(Section):
    r: int = Field(8, ge=1)
    """Rank of each adapter's low-rank update."""
    alpha: float = Field(16.0, gt=0)
    """LoRA's scale: the adapter's update is multiplied by alpha / r."""
    target_modules: list[str] = Field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Suffixes of the names of the transformer's modules that get adapters. An empty list means
    diffusion_rl.models.DEFAULT_LORA_TARGETS (the default's four and the joint attention's
    text-stream projections add_q_proj, add_k_proj, add_v_proj, to_add_out)."""


class DiffusionModelConfig(ModelConfig):
    height: int | None = Field(None, ge=8)
    """Image height in pixels; None = the model directory's default."""
    width: int | None = Field(None, ge=8)
    """Image width in pixels; None = the model directory's default."""
    guidance_scale: float = Field(1.0, ge=1.0)
    """Classifier-free guidance; 1.0 = off (one forward per step)."""
    distilled_guidance: float | None = Field(None, ge=0)
    """The guidance value given to a guidance-distilled transformer (config guidance_embeds, as
    FLUX.1-dev and FLUX.2-dev; the pipelines' `guidance_scale` for them), in one forward per step;
    None = the pipeline's default (FLUX 3.5, FLUX.2 4.0). Unused by other transformers (a warning)."""
    lora: LoRAConfig | None = None
    """None = train every transformer weight (the default for the tiny model)."""

    @model_validator(mode="after")
    def _no_vocabulary(self):
        if self.logprob_chunk is not None:
            raise ValueError("logprob_chunk chunks a language model's log-softmax over its vocabulary; "
                             "an image model's step log-probs have none (leave it unset)")
        return self


class ShapesGenevalTaskConfig(Section):
    """Compositional prompts of coloured shapes, each atom checked by a detector."""

    type: Literal["shapes-geneval"] = "shapes-geneval"
    """The task: shapes-geneval (the only one)."""
    seed: int = 0
    """Seed of the prompt generator (the run's seed orders the prompts, this one makes them)."""
    num_train: int = Field(2000, ge=1)
    """Training prompts generated (unused with train_path)."""
    num_eval: int = Field(64, ge=1)
    """Held-out prompts generated (unused with eval_path). They are independent draws of the
    generator, as training's are, so a prompt can come more than once and counts as often as it
    comes: 64 hold 37 distinct prompts at seed 0 (one-phrase prompts are few)."""
    eval_seeds: int = Field(1, ge=1)
    """Images per held-out prompt (fixed noise seeds, the same before and after)."""
    grid_prompts: int = Field(8, ge=0)
    """Held-out prompts drawn in the before/after sample grids."""
    hard_min_atoms: int = Field(4, ge=1)
    """Held-out prompts with at least this many atoms are also scored alone (hard/*); 4 = the
    relational prompts (shapes-geneval prompts have 3 or 7 atoms)."""
    train_path: str | None = None
    """A text file of your own training prompts, one per line (None = generated ones; blank
    lines and # comments are skipped). Each line must parse under the shapes grammar, or see
    `unparsed`."""
    eval_path: str | None = None
    """The same for held-out prompts."""
    held_out: Literal["disjoint", "overlapping"] = "disjoint"
    """Generated prompts. disjoint: the held-out prompts are a fixed fifth of all prompts (by a
    hash of the prompt), never trained on. overlapping: the train and eval streams draw from
    the whole space, as before 2026-12-05 (evening), when 43 of the 64 held-out prompts, and
    every one-phrase one, were training prompts too; it reproduces RESULTS.md's earlier figures."""
    image_atoms: list[dict[str, Any]] = Field(default_factory=list)
    """Extra image rewards (CLIP score, preference models): diffusion_rl.rewards specs. They
    score every sample, on top of the shapes atoms. A spec without a "device" runs on
    model.device's."""
    atom_weights: dict[str, float] = Field(default_factory=dict)
    """The shapes atoms' weights (exist, colour, count, relation, all) in the reward's total,
    which Flow-GRPO and FTFC normalise, and in the sum of CAST's per-atom advantages; an atom
    not named weighs 1.0. A 0 keeps the atom's verdicts (its children's gating, evaluation)
    and drops it from the training signal."""
    unparsed: Literal["error", "whole_prompt"] = "error"
    """A prompt-file line the shapes grammar cannot decompose into atoms. error: a ConfigError
    naming the file, the line and the unparsed words. whole_prompt: the line is kept, one
    warning per file names every such line, and it is scored by the whole-prompt reward only:
    the image_atoms (which must not be gated by shapes atoms), while the shapes atoms score it
    0 (constant within its group, so they add nothing to its advantages). Needs at least one
    image atom (e.g. type clip_score). Evaluation reports the atom metrics over the prompts that
    parse, and `unparsed_prompts` / `whole_prompt_reward` (the image atoms' weighted sum) over
    the others."""

    @model_validator(mode="after")
    def _whole_prompt_needs_an_image_atom(self):
        if self.unparsed == "whole_prompt" and not self.image_atoms:
            raise ValueError("unparsed=whole_prompt scores the prompts the shapes grammar cannot decompose "
                             "with a whole-prompt reward, and none is configured: add an image atom such as "
                             "{type: clip_score, ...} to task.image_atoms")
        return self

    @model_validator(mode="after")
    def _generator_keys_unused_with_files(self):
        """The generator's keys a prompt file replaces, set away from their defaults: said, as the
        dLLM's jsonl task says it (task.num_train=8 with train_path trained on every line, silently).
        A warning, not an error: a run's config.yaml holds every key, the defaults included."""
        fields = type(self).model_fields
        unused = [k for k, path in (("num_train", self.train_path), ("num_eval", self.eval_path)) if path]
        if self.train_path and self.eval_path:  # nothing is generated: the seed and the split are unused too
            unused += ["seed", "held_out"]
        unused = [f"task.{k} ({getattr(self, k)})" for k in unused if getattr(self, k) != fields[k].default]
        if unused:
            config_warning(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for the generated prompts, "
                           "unused where task.train_path / task.eval_path give them: every line of the file is used "
                           "(write a shorter file to use fewer prompts)")
        return self


TaskConfig = Annotated[ShapesGenevalTaskConfig, Field(discriminator="type")]


class DiffusionRolloutConfig(RolloutConfig):
    num_steps: int = Field(10, ge=2)
    """Denoising steps of a training rollout."""
    eval_steps: int | None = Field(None, ge=1)
    """Denoising steps of evaluation (ODE); None = num_steps."""
    shift: Literal["auto", "sd3", "flux", "none"] = "auto"
    """Time shift of the sigma schedule (docs/methods.md section 4); auto: the one the model's
    pipeline samples with, from its scheduler's config (use_dynamic_shifting, as FLUX, FLUX.2
    and Qwen-Image: flux; else sd3 with the config's shift, as SD3 / SD3.5, or none at shift 1,
    as FLUX.1-schnell), set when the model is built. The shift's parameters (mu's line, the
    sd3 shift) always come from the scheduler's config."""
    kind: Literal["sde", "cps"] = "sde"
    """The stochastic step (diffusion_rl.sde): sde, Flow-GRPO's reverse-time SDE (Euler-Maruyama),
    or cps, coefficients-preserving sampling (Flow-CPS; noise_level must lie in [0, 1])."""
    noise_level: float = Field(0.7, ge=0)
    """a: the SDE's noise scale (0: ODE rollouts, for FTFC's pool; the policy-gradient methods
    need noise, since a noiseless step has no log-probability to train). Above sqrt(2) ~ 1.414
    (kind sde) a warning: the Euler-Maruyama step stops tracking the flow (docs/methods.md)."""
    window_size: int | None = Field(None, ge=1)
    """Flow-GRPO-Fast: SDE noise (and training) only on this many consecutive steps; None = every
    step but the last."""
    window_start: tuple[int, int] | None = None
    """Range of the window's first step (inclusive); None = anywhere it fits. Only with
    window_size: without one every step but the last is in the window, and this is unused (with a
    warning)."""
    shared_noise: bool = False
    """The G samples of a prompt start from the same initial noise (DanceGRPO; Flow-GRPO's
    same_latent), so they differ only by the SDE window's noise and the group's reward spread is
    the window's doing."""
    train_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of the window's SDE steps each update trains on: a random subset, drawn per
    rollout. Flow-GRPO's timestep_fraction trains its first int(N x fraction) steps in order
    instead (its 0.99 at 10 steps is our 1 on the default window)."""
    max_new_tokens: int = 1  # unused by images; kept for the core's defaults
    """Unused by image rollouts (their length is num_steps); must stay 1. Kept for the core's
    defaults."""

    @model_validator(mode="after")
    def _no_token_sampling(self):
        """A language model's sampling keys would be ignored by the image sampler: refused."""
        for key, default, instead in (("temperature", 1.0, "their stochasticity is rollout.noise_level"),
                                      ("top_p", 1.0, "their stochasticity is rollout.noise_level"),
                                      ("max_new_tokens", 1, "their length is rollout.num_steps")):
            if getattr(self, key) != default:
                raise ValueError(f"{key} is a language model's sampling setting, unused by image rollouts ({instead})")
        return self

    @model_validator(mode="after")
    def _cps_noise_level(self):
        """CPS steps with transition std sigma_next sin(a pi / 2): a lies in [0, 1] (sde.py)."""
        if self.kind == "cps" and self.noise_level > 1:
            raise ValueError(f"noise_level must lie in [0, 1] for kind cps, got {self.noise_level}")
        return self

    @model_validator(mode="after")
    def _sde_noise_level(self):
        """Flow-GRPO's Euler-Maruyama step's mean is x (1 - a^2 Delta / (2 (1 - sigma))) + ...: at
        sigma = 1 (Delta = sigma_next - 1, sigma_next in the denominator) x's coefficient is
        1 - a^2 / 2 on every schedule, <= 0 from a = sqrt(2). Later steps turn at
        sqrt(2 (1 - sigma) / -Delta), which depends on the schedule (~1.15 to 1.4 at the second
        step of 4 to 40 shifted steps, higher after): a warning, not an error. Nothing turns
        NaN: the latents' spread is off (x 1.7 at 1.4 with exact velocities) and grows
        |1 - a^2 / 2| times a step above a = 2 (the tiny model's: x 100 at 5 on a 2-step window)."""
        if self.kind == "sde" and self.noise_level**2 > 2:
            config_warning(f"rollout.noise_level {self.noise_level:g} is above sqrt(2) ~ 1.414, where Flow-GRPO's SDE "
                           f"step stops tracking the flow: at sigma = 1 its mean keeps the sample times "
                           f"1 - a^2/2 = {1 - self.noise_level**2 / 2:.3g} (later steps turn at about this level, "
                           "depending on the schedule), so the window's latents leave the model's range and grow "
                           "each step above 2; Flow-GRPO uses 0.7")
        return self

    @model_validator(mode="after")
    def _window_fits(self):
        if self.window_size is not None and self.window_size >= self.num_steps:
            raise ValueError(f"window_size ({self.window_size}) must be below num_steps ({self.num_steps}): "
                             "the last step is never stochastic")
        if self.window_start is not None and self.window_size is None:  # unused: said, not silent
            config_warning(f"rollout.window_start {list(self.window_start)} is unused without rollout.window_size: "
                           "every step but the last is in the window (set window_size, or window_start: null)")
        if self.window_start is not None and self.window_size is not None:
            latest = self.num_steps - 1 - self.window_size  # the window stays off the last step
            lo, hi = self.window_start
            if not 0 <= lo <= hi <= latest:
                raise ValueError(
                    f"window_start {list(self.window_start)} must be a range lo <= hi within 0..{latest} "
                    f"(num_steps {self.num_steps} - 1 - window_size {self.window_size})")
        return self


class EMAConfig(Section):
    """Flow-GRPO's exponential moving average of the trainable weights (diffusion_rl.ema):
    after optimizer step n, when n % update_every == 0, avg <- d avg + (1 - d) theta with
    d = min(decay, (1 + n) / (10 + n)) (d = decay without warmup). Evaluation and its sample
    grids use the average; a checkpoint's model/ holds it (what `evaluate` / `sample
    --checkpoint` load), its trainer state the raw weights and the average (for --resume).
    Rollouts and gradients use the raw weights."""

    decay: float = Field(0.9, gt=0, lt=1)
    """Flow-GRPO's 0.9: with update_every=8 the average spans roughly the last 80 steps."""
    update_every: int = Field(8, ge=1)
    """Optimizer steps per EMA update (Flow-GRPO's update_step_interval, 8)."""
    warmup: bool = True
    """Flow-GRPO's warm-up: the decay is at most (1 + n) / (10 + n) after step n, so the
    starting weights fade quickly; false = the constant decay from the first update."""


class FlowGRPOConfig(Section):
    """Flow-GRPO (docs/methods.md section 4): group z-scored advantages, clipped; a PPO ratio
    clip per SDE step; KL to the reference on the step means."""

    type: Literal["flow_grpo"] = "flow_grpo"
    """The method: flow_grpo (Flow-GRPO)."""
    adv_clip: float = Field(5.0, gt=0)
    """Advantages are clipped to +-adv_clip (in group stds). CAST clips each sample's weighted
    sum and each patch's advantage so too."""
    std_eps: float = Field(1e-4, gt=0)
    """A = (R - group mean) / (group std + std_eps)."""
    adv_std: Literal["population", "unbiased", "global"] = "population"
    """The std each group's centred rewards are divided by: population (the group's np.std,
    divides by G), as Flow-GRPO's stat tracker; unbiased (G - 1), as GRPO's and as this backend
    used before 2026-12-05 (RESULTS.md's earlier runs); global, the np.std of the whole step's
    rewards (every process's), as most of Flow-GRPO's SD3 / FLUX configs (sample.global_std)."""
    clip_range: float = Field(1e-4, gt=0)
    """eps of the ratio clip (tiny: the log-prob is a mean over latent elements). Flow-GRPO's
    fast configs use 1e-5; 1e-4 learns faster at this model's small batches."""
    kl: KLConfig = Field(default_factory=lambda: KLConfig(beta=0.0))
    """beta > 0: KL = mean((mean_theta - mean_ref)^2) / (2 std_t^2) per step, std_t = a sqrt(sigma /
    (1 - sigma)) as in Flow-GRPO's code (rollout.kind cps: the CPS step's std, sigma_next sin(a pi / 2));
    kl.kind is not read. Off by default (METHODS.md gives 0.01-0.04): no reference pass, the larger
    share of a step's time on a CPU."""
    ema: EMAConfig | None = None
    """An EMA of the trainable weights for evaluation and checkpoints (Flow-GRPO's train.ema),
    e.g. `{decay: 0.9, update_every: 8}` as Flow-GRPO's scripts set it; None = off."""

    @model_validator(mode="after")
    def _kl_kind_unused(self):  # the core's KLConfig brings kind: said, not silently ignored
        if self.kl.kind != KLConfig.model_fields["kind"].default:
            config_warning(f"method.kl.kind {self.kl.kind} is unused by method {self.type}: its KL is the Gaussian "
                           "steps' closed form, mean((mean_theta - mean_ref)^2) / (2 std_t^2), not a per-token estimator")
        return self


class FTFCConfig(Section):
    """FTFC, Fenchel Tilt Flow Control (docs/methods.md section 4; a RECONSTRUCTION, see
    diffusion_rl/methods/ftfc.py): per-prompt tilt weights w = (f*)'((r - lambda) / beta) from
    the Fenchel dual of max E_p[r] - beta D_f(p || p0), frozen, then importance-weighted flow
    matching on the pool's clean latents. No log-probs: rollouts may be ODE (noise_level 0)."""

    type: Literal["ftfc"] = "ftfc"
    """The method: ftfc (FTFC)."""
    divergence: Literal["kl", "pearson", "reverse_kl", "hellinger"] = "kl"
    """f of D_f: kl (w log w: w = G softmax(r / beta) in the group), pearson ((w - 1)^2: w =
    max(0, 1 + (r - lambda) / (2 beta))), reverse_kl (-log w: w = beta / (lambda - r)), hellinger
    ((sqrt w - 1)^2: w = (1 - (r - lambda) / beta)^-2); diffusion_rl/ftfc.py derives each."""
    beta: float = Field(0.5, gt=0)
    """Strength of the divergence penalty, in reward units: smaller tilts harder."""
    cap: float | None = Field(4.0, ge=1)
    """Largest weight, as a multiple of the group's mean weight (1), after which the group is
    renormalised to mean 1 (water-filling); None = no cap. cap >= G never binds."""
    pool_refresh: int = Field(0, ge=0)
    """Steps between samplings of the pool the weights are frozen on. 0: the pool is step 0's
    rollout batch (the pretrained model) for the whole run, the paper's single stage; k >= 1:
    re-sampled from the current model every k steps (1 = each step's own batch). The pool is
    one rollout batch (prompts_per_step x num_generations samples); train.mini_batches and
    train.ppo_epochs set the optimizer steps per training step. k != 1 needs the synchronous
    inline scheduler (the pool replaces the batch in Method.on_groups)."""
    t_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """Distribution of the flow-matching time t (= sigma, 1 = noise): sigmoid(N(logit_mean,
    logit_std^2)) (SD3's logit-normal, which the bundled tiny model was pre-trained with) or U(0, 1)."""
    logit_mean: float = 0.0
    """t_sampling logit_normal: the mean of the normal whose sigmoid is t
    (0: centred on t = 0.5)."""
    logit_std: float = Field(1.0, gt=0)
    """t_sampling logit_normal: the std of that normal."""
    guided: bool = False
    """With classifier-free guidance (model.guidance_scale > 1): false = fit the conditional
    velocity alone (plain flow matching), true = the guided combination the sampler uses."""
    monitor: bool = True
    """With a frozen pool (pool_refresh != 1): true = each step still rolls out and scores a
    fresh batch of the current model, only for the reward/* metrics (it is not trained on, and
    it costs a rollout per step); false = steps that do not draw the pool run no rollout, so
    a step costs its flow-matching updates alone (judge progress by train.eval_every)."""
    anchor: Literal["none", "base"] = "none"
    """none: importance-weighted flow matching, L = sum_i w_i |v_theta(x_t) - u_i|^2, u_i =
    eps - x1 (the tilt's optimum, and the drift toward the pool's own samples that comes with
    fitting them). base (ours, not the paper's): a control variate from the pretrained
    velocity v0, L = sum_i |v_theta(x_t) - v0(x_t) - (w_i - 1)(u_i - v0(x_t))|^2, whose optimum
    where E[w | x_t] = 1 is v0 + E_q[u | x_t] - E_p[u | x_t]: the tilt's correction added to the
    pretrained field, so uniform weights leave the model where it is. Costs one no-grad
    pass of a frozen copy of the pretrained model per trained sample."""
    target: Literal["sample", "posterior"] = "sample"
    """The regression target of each flow-matching row (ours; diffusion_rl.ftfc.posterior_moments).
    sample: u_i = eps - x1_i of the sample x_t was drawn from. posterior: its expectation given
    x_t over which of the prompt's pool samples made x_t (a Gaussian-kernel posterior), with w_i
    replaced by E[w | x_t] likewise: the same optimum, with the noise of that guess integrated
    out. It matters at high t (noise), where the samples' kernels overlap and where their
    layout is decided; at low t the posterior is one-hot and the two agree. posterior needs the
    synchronous inline scheduler (the loss reads each group's whole pool)."""
    effective_reward: Literal["observed", "learned"] = "observed"
    """g in w = (f*)'((g - lambda) / beta): "observed" = the pool's own rewards, the dual fitted
    per prompt on the samples; "learned" = a network g_phi(x, c) on the clean latents and the
    prompt conditioning, fitted once per pool by the dual's value (diffusion_rl.effective_reward;
    ours, a reconstruction). Needs the synchronous inline scheduler (it fits on the whole pool)."""
    g_hidden: int = Field(64, ge=1)
    """Width of g_phi's two hidden layers (effective_reward=learned)."""
    g_steps: int = Field(300, ge=1)
    """Full-batch AdamW steps of g_phi's fit on each pool: fewer leave the weights nearer uniform."""
    g_lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of g_phi's fit."""
    g_weight_decay: float = Field(1e-2, ge=0)
    """AdamW weight decay of g_phi's fit."""
    g_heldout: float = Field(0.0, ge=0, lt=1)
    """A diagnostic of whether g_phi generalises: > 0 fits a second g_phi on the pool less this
    fraction of its prompts and reports how well it tilts the held-out ones (ftfc/g_heldout_*).
    The weights always come from the fit on the whole pool. 0 = no check."""

    @model_validator(mode="after")
    def _unused_settings(self):  # said, not silently ignored
        unused_by = {"t_sampling uniform": (self.t_sampling == "uniform", ("logit_mean", "logit_std")),
                     "effective_reward observed": (self.effective_reward == "observed",
                                                   ("g_hidden", "g_steps", "g_lr", "g_weight_decay", "g_heldout"))}
        for setting, (applies, keys) in unused_by.items():
            unused = changed_settings(self, keys)
            if applies and unused:
                config_warning(f"method.{', method.'.join(unused)} unused with method.{setting}"
                               + (": t is drawn from U(0, 1)" if setting.startswith("t_") else
                                  ": the weights come from the pool's own rewards, no g_phi is fitted"))
        return self


class CASTConfig(FlowGRPOConfig):
    """CAST, Causal Advantage-Structured Training (docs/methods.md section 4; a RECONSTRUCTION, see
    diffusion_rl/methods/cast.py): signed per-atom group advantages
    A_ik = (r_ik - mean_k) / (std_k + std_eps); the SDE window calibrated from the model's own
    trajectory; each atom's advantage projected to the image through the attention of image
    tokens to the atom's words, and a per-patch clipped ratio objective weighted by that map."""

    type: Literal["cast"] = "cast"
    """The method: cast (CAST, on Flow-GRPO's settings)."""
    window_from: str | None = "model"
    """Where the calibrated SDE window comes from; at build time it sets rollout.window_size and
    a fixed rollout.window_start = (start, start), unless rollout.window_start is set explicitly
    (which always wins). "model": the cast_window.json that `diffusion-rl calibrate-window` stored
    in the model's directory, if there is one (one calibrated for another rollout.num_steps is
    skipped with a warning); a path: a window.json written by calibrate-window (relative to the
    config's directory, else the current one; a missing or malformed file, or one calibrated for another
    rollout.num_steps, is a ConfigError); None: the rollout's own window."""
    calibration_prompts: int = Field(32, ge=1)
    """Held-out prompts `calibrate-window` rolls out (its --prompts overrides)."""
    calibration_seeds: int = Field(1, ge=1)
    """ODE rollouts (noise seeds 0..n-1) per calibration prompt."""
    window_offset: int = 0
    """The calibrated window's last SDE step is the median commit step plus this (0 = the
    commit step itself; -1 = the last step whose noise lands before it), then clamped."""
    projection: Literal["attention", "detector", "none"] = "attention"
    """attention: A_i(h, w) = (sum_k w_k A_ik M_ik(h, w) + global_weight A_i) / (1 + global_weight),
    M_ik the attention map of atom k's words (diffusion_rl/attention_maps.py), trained through
    per-latent-token ratios. detector (ours, a diagnostic): the same with M_ik the boxes of the
    objects the reward's detector found for atom k in sample i's image (shapes_geneval.atom_regions;
    uniform where there is no place to point at: nothing found, a wrong count), pooled onto the
    latent tokens: what CAST does when its maps are right. none: the
    scalar A_i = sum_k w_k A_ik and Flow-GRPO's loss (part 1)."""
    attention_layers: list[int] | None = None
    """Joint-attention layers the maps average (indices over the double-, then single-stream
    blocks; negative counts from the end). None = the middle half."""
    map_norm: Literal["mean", "max"] = "mean"
    """mean: each map averages 1 over the image (moves an advantage, keeps its size); max: peaks at 1."""
    global_weight: float = Field(1.0, ge=0)
    """lambda: the share of the sample's scalar advantage spread uniformly over the image."""
    parser: str = "shapes-geneval"
    """Which words each atom is about (diffusion_rl/scene_graph.py): a built-in parser's name, or
    "path/to/file.py:function" returning {atom name: [(start, end) character spans]}."""
    patch_clip_range: float | None = Field(None, gt=0)
    """eps of the per-patch ratio clip; None = clip_range."""
    atoms: Literal["types", "nodes"] = "types"
    """The columns A_ik are taken over. types: the reward's atoms, shapes-geneval's per TYPE (a
    type's score is the mean over the prompt's atoms of that type, its map covers the words of
    all of them). nodes (ours; shapes-geneval and its parser only): one column per atom of the
    prompt's scene graph (colour[red circle], count[blue square]=2, ...), each with its own
    verdict, signed group advantage and map of its own words, weighted w_type / (the prompt's
    atoms of that type); the reward's other columns ("all", image atoms) as with types."""

    @model_validator(mode="after")
    def _unused_by_projection(self):  # said, not silently ignored
        keys, why = {
            "none": (("global_weight", "patch_clip_range", "attention_layers", "map_norm", "parser"),
                     "its scalar advantage has no maps to mix in, nor per-patch ratios to clip"),
            "detector": (("attention_layers", "parser"),
                         "its maps are the boxes of the objects the detector found, not the attention to the atoms' words"),
        }.get(self.projection, ((), ""))
        unused = changed_settings(self, keys)
        if unused:
            config_warning(f"method.{', method.'.join(unused)} unused with method.projection {self.projection}: {why}")
        return self

    @model_validator(mode="after")
    def _nodes_need_the_shapes_parser(self):
        if self.atoms == "nodes" and self.parser != "shapes-geneval":
            raise ValueError(f"atoms=nodes takes each atom's verdict and words from the shapes-geneval scene "
                             f"graph; parser {self.parser!r} cannot name them (use atoms: types)")
        return self


MethodConfig = Annotated[FlowGRPOConfig | FTFCConfig | CASTConfig, Field(discriminator="type")]


class DiffusionTrainConfig(TrainConfig):
    model: DiffusionModelConfig = Field(default_factory=DiffusionModelConfig)
    """The flow-matching image model (a local diffusers pipeline, or the bundled tiny one), image
    size, guidance and LoRA."""
    task: TaskConfig = Field(default_factory=ShapesGenevalTaskConfig)
    """The prompts and their reward: shapes-geneval."""
    rollout: DiffusionRolloutConfig = Field(default_factory=DiffusionRolloutConfig)
    """SDE sampling of the rollouts: steps, noise, time shift, the Flow-GRPO-Fast window."""
    method: MethodConfig = Field(default_factory=FlowGRPOConfig)
    """The RL algorithm: type flow_grpo, ftfc or cast."""

    @model_validator(mode="after")
    def _guided_fit_needs_guidance(self):
        if getattr(self.method, "guided", False) and self.model.guidance_scale == 1:  # said, not silently ignored
            config_warning("method.guided true is unused with model.guidance_scale 1: without classifier-free "
                           "guidance the guided velocity is the conditional one")
        return self

    @model_validator(mode="after")
    def _ema_moves(self):
        # The average moves on every update_every-th optimizer step: in a run of fewer it never did, and
        # evaluation and the checkpoint's model/ were the starting weights, the training in the raw ones only
        ema, t = getattr(self.method, "ema", None), self.train
        most = t.max_steps * t.ppo_epochs * t.mini_batches  # optimizer steps at most (pruning skips some)
        if ema is not None and 0 < most < ema.update_every:
            raise KeyValueError("method.ema.update_every",
                                f"{ema.update_every} is more than the run's optimizer steps (train.max_steps "
                                f"{t.max_steps} x ppo_epochs {t.ppo_epochs} x mini_batches {t.mini_batches} = {most}): "
                                f"the average would never move, so evaluation and the saved model would be the "
                                f"starting weights; give update_every at most {most}, or leave method.ema out")
        return self

    @model_validator(mode="after")
    def _text_reward_models(self):
        if any(isinstance(a, dict) and "reward_model" in a for a in self.reward.atoms):
            raise ValueError("reward.atoms: a reward_model atom scores text, and this backend's samples are "
                             "images; image reward models go in task.image_atoms (clip_score, preference)")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self):  # in place of the core's check of the buffer: no budget here
        if self.reward.overlong is not None:
            raise ValueError("reward.overlong (DAPO's length penalty) counts completion tokens, and this "
                             "backend's samples are images")
        return self


# The backend's settings as the CLI reads them (diffusion_rl.backend re-exports them): `diffusion-rl config`
# imports this module alone (BackendSpec.settings), not the model code, torch or transformers.
CONFIG_CLASS = DiffusionTrainConfig
DEFAULT_CONFIG = {
    "output_dir": "runs/diffusion-default",
    "method": {"type": "flow_grpo"},
    # 64 samples a step at a small lr is what learns (benchmarks/RESULTS.md, "Flow-GRPO learns");
    # a group shares its start and the SDE window is 2 early steps (DanceGRPO's and
    # Flow-GRPO-Fast's choices): as good as 4 anywhere, and half the update.
    "rollout": {"num_generations": 8, "prompts_per_step": 8, "num_steps": 10, "window_size": 2,
                "window_start": (0, 1), "shared_noise": True, "noise_level": 0.7},
    "optim": {"lr": 5e-5, "max_grad_norm": 1.0},
    "train": {"max_steps": 300, "log_samples_every": 0},
    "task": {"type": "shapes-geneval", "num_train": 2000, "num_eval": 64, "eval_seeds": 2},
}
