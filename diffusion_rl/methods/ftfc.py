"""FTFC, Fenchel Tilt Flow Control (docs/methods.md section 4) -- a RECONSTRUCTION: neither the
paper's text nor its code was available, so every design choice below is ours and is a
config option (diffusion_rl.config.FTFCConfig).

    target    max_p E_p[r] - beta D_f(p || p0) per prompt; its optimum is p0 tilted by
              w = (f*)'((r - lambda) / beta), lambda the Fenchel dual's minimiser (E_p0[w] = 1)
    pool      samples of the model, scored by the reward: a rollout batch (ODE rollouts with
              rollout.noise_level = 0, or SDE ones); pool_refresh = 0 keeps step 0's batch (the
              pretrained model) for the whole run, the paper's single stage
    weights   per group (one prompt): lambda solved on the group's rewards, w self-normalised to
              mean 1 and capped (diffusion_rl.ftfc.ftfc_weights); these are the `advantages`.
              They depend on the pool's stored rewards only, so they stay frozen while theta trains
    loss      importance-weighted flow matching on the pool's clean latents x1, with a fresh t and
              eps per sample and step: L = sum_i w_i mean((v_theta(x_t, t, c) - (eps - x1))^2) / N,
              x_t = (1 - t) x1 + t eps (sigma = t, the sampler's convention)
    anchor    (ours, method.anchor = base) a control variate from the pretrained velocity v0:
              L = sum_i |v_theta(x_t) - v0(x_t) - (w_i - 1)(u_i - v0(x_t))|^2 / N, u_i = eps - x1_i;
              where E[w | x_t] = 1 its optimum is v0 + E_q[u | x_t] - E_p[u | x_t], the tilt's
              correction on the pretrained field, and w = 1 leaves the model where it is
    target    (ours, method.target = posterior) each row's target and weight replaced by their
              expectation given x_t over which of the group's pool samples made x_t (a Gaussian-
              kernel posterior; diffusion_rl.ftfc.posterior_moments): the same optimum, less noise
              where the samples' kernels overlap (high t, where the layout is decided)
    metrics   ftfc/ess ((sum w)^2 / sum w^2 over the trained batch), ftfc/lambda_mean, ftfc/w_max,
              ftfc/ess_group_mean, ftfc/num_capped, ftfc/pool_age (steps since the pool was drawn);
              with the posterior target ftfc/posterior_ess (pool samples per x_t) and ftfc/posterior_rho

No log-probs, no reference model, no differentiation through sampling. With pool_refresh = k >= 1
each pool is drawn from the current model, so the tilt is relative to that model (an iterated,
proximal version of the single stage), not to the pretrained one.

Departures and choices (the paper's details are unknown):
- g_phi: by default (effective_reward = observed) the dual is fitted per prompt on the pool's
  observed rewards (g = r). effective_reward = learned fits a network g_phi(x, c) on the pool
  (diffusion_rl.effective_reward: an MLP on the clean latents and the prompt conditioning, fitted
  by the value of the weights it implies, once per pool) and tilts by it; the network and its fit
  are ours. It is refitted, not checkpointed: a resumed run refits it from the restored pool with
  the same seed. Metrics: ftfc/g_gap, ftfc/g_gap_uniform, ftfc/g_recovered, ftfc/g_corr, ftfc/g_fit_s;
  with method.g_heldout > 0 also ftfc/g_heldout_* (a second fit that leaves some prompts out).
- Pool: one rollout batch, drawn through the core loop at step 0 (or every k steps). With
  method.monitor = true the core still rolls out and scores a fresh batch each step; with
  pool_refresh != 1 that batch only feeds the reward/... metrics (the current model's reward)
  and is not trained on, which costs a rollout per step. monitor = false (the config's) skips
  it (Method.stored_batch): such a step costs its flow-matching passes alone. The pool lives
  in the method's state, so checkpoints carry it (the clean latents, the conditioning, the
  rewards and the images, base64 in the trainer state: large for big models and pools) and a
  resumed run goes on exactly.
- Self-normalisation and the cap are per group (each group's lambda already gives mean 1, so per
  batch is the same); the cap is applied to its fixed point (clip and rescale until no weight
  exceeds it). The squared error is a mean over latent elements (diffusers' convention).
- The anchor is not in the paper's description. Plain importance-weighted flow matching also
  fits the pool's samples themselves: on the tiny model that lowers held-out accuracy even with
  uniform weights (benchmarks/RESULTS.md). The anchor removes that part and keeps the tilt's.
  Its v0 comes from the trainer's frozen reference (needs_reference), run inside the loss at
  each pass's own t and eps, one no-grad row per trained sample.
- t, eps: drawn per sample from a generator seeded by (seed, step, epoch, sample), so micro-batching
  does not change them and a resume replays them.
- Scheduling: pool_refresh != 1 needs the synchronous inline scheduler (Method.on_groups); with
  pool_refresh = 1 the weights are per group, so pipelined rollouts work too.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import replace

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from diffusion_rl.effective_reward import fit_effective_reward, heldout_metrics
from diffusion_rl.ftfc import check_finite, ftfc_weights, posterior_moments
from mmrl.core import distributed
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.losses import LossOutput
from mmrl.core.method import Method, register_method
from mmrl.core.rewards import AtomScores, Sample

SAMPLE_ID = "ftfc/sample"  # data key: a per-sample id (group id * 2^20 + rank), seeds its t and eps
POOL_KEYS = ("final_latents", "request_tag", SAMPLE_ID)  # with "cond/*": what the pool keeps


@register_method("ftfc")
class FTFC(Method):
    count_metrics = ("ftfc/ess", "ftfc/num_capped")

    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        from mmrl.core.pipeline import placement

        if cfg.pool_refresh != 1 and (placement(run) != "inline" or run.rollout.scheduler.mode != "sync"):
            raise ConfigError(f"method.pool_refresh={cfg.pool_refresh} keeps a pool across steps, which needs "
                              "the synchronous inline scheduler (rollout.scheduler.mode=sync, placement inline); "
                              "set method.pool_refresh=1 to train on each step's own rollouts")
        if cfg.target == "posterior" and (placement(run) != "inline" or run.rollout.scheduler.mode != "sync"):
            raise ConfigError("method.target=posterior reads each group's whole pool in the loss, which needs the "
                              "synchronous inline scheduler (rollout.scheduler.mode=sync, placement inline): a "
                              "pipelined scheduler scores groups while the trainer runs; or set method.target=sample")
        if cfg.effective_reward == "learned" and (placement(run) != "inline" or run.rollout.scheduler.mode != "sync"):
            raise ConfigError("method.effective_reward=learned fits g_phi on each whole pool, which needs the "
                              "synchronous inline scheduler (rollout.scheduler.mode=sync, placement inline); "
                              "or set method.effective_reward=observed")
        if cfg.effective_reward == "learned" and cfg.g_heldout > 0 and \
                run.rollout.prompts_per_step // distributed.world_size() < 2:
            raise ConfigError(f"method.g_heldout={cfg.g_heldout} tests g_phi on prompts held out of its pool, which "
                              "needs at least two prompts per pool (rollout.prompts_per_step per process); raise "
                              "rollout.prompts_per_step or set method.g_heldout=0")
        self.pool: RolloutBatch | None = None
        self._fit = None  # (pool key, EffectiveRewardFit, {sample id: row}) of the learned g_phi
        self.pool_step = -1
        self.needs_reference = cfg.anchor == "base"  # the anchor's v0: the trainer's frozen copy
        self._groups: dict[int, tuple[Tensor, Tensor]] = {}  # group id -> (pool latents, weights)

    # ------------------------------------------------------------------ pool and weights

    def _redraw(self) -> bool:
        """Whether this step draws a new pool (the first step, then every pool_refresh steps)."""
        k = self.cfg.pool_refresh
        return self.pool is None or k == 1 or (k > 1 and self.step - self.pool_step >= k)

    def stored_batch(self) -> RolloutBatch | None:
        """Without monitoring, a step that does not redraw the pool trains on it unrolled."""
        if self.cfg.monitor or self._redraw():
            return None
        return self._pool_copy()

    def on_groups(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch to train on: this step's rollouts (pool_refresh = 1) or the frozen pool."""
        if self.cfg.pool_refresh == 1:
            return batch
        if self._redraw():
            keep = {n: v for n, v in batch.data.items() if n in POOL_KEYS or n.startswith("cond/")}
            self.pool = replace(batch, mask=None, old_logp=None, ref_logp=None, advantages=None, data=keep)
            self.pool_step = self.step
        return self._pool_copy()

    def _pool_copy(self) -> RolloutBatch:
        """The pool as a batch of its own (the loop writes advantages and data into it)."""
        return replace(self.pool, data=dict(self.pool.data))

    def effective_reward(self, batch: RolloutBatch) -> Tensor:  # [N]
        """g of w = (f*)'((g - lambda) / beta): the observed rewards, or g_phi fitted on this pool."""
        if self.cfg.effective_reward == "observed":
            return batch.rewards
        key = self.step if self.cfg.pool_refresh == 1 else self.pool_step
        ids = batch.data.get(SAMPLE_ID, _sample_ids(batch.group_ids)).tolist()
        if self._fit is None or self._fit[0] != key or not set(ids) <= self._fit[2].keys():
            check_finite(batch.rewards)  # before a network is fitted to them
            d, c = self.cfg, {k[len("cond/"):]: v for k, v in batch.data.items() if k.startswith("cond/")}
            pool = (batch.data["final_latents"], c, batch.rewards, batch.group_ids)
            settings = {"beta": d.beta, "divergence": d.divergence, "hidden": d.g_hidden, "steps": d.g_steps,
                        "lr": d.g_lr, "weight_decay": d.g_weight_decay, "seed": self.run.seed * 100003 + max(key, 0)}
            fit = fit_effective_reward(*pool, **settings)
            if d.g_heldout > 0:
                fit.heldout = heldout_metrics(*pool, d.g_heldout, **settings)
            self._fit = (key, fit, {i: row for row, i in enumerate(ids)})
        rows = torch.tensor([self._fit[2][i] for i in ids], dtype=torch.long)  # a pruned batch: its samples'
        return self._fit[1].g[rows].to(batch.rewards)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]: the FTFC weights, mean 1 per group
        batch.data[SAMPLE_ID] = _sample_ids(batch.group_ids)
        w, _ = self._weights(batch)
        if self.cfg.target == "posterior":  # each group's pool and weights, for the loss's mini-batches
            x1 = batch.data["final_latents"]
            self._groups = {g: (x1[batch.group_ids == g], w[batch.group_ids == g])
                            for g in batch.group_ids.unique().tolist()}
        return w

    def _weights(self, batch: RolloutBatch):
        try:
            return ftfc_weights(self.effective_reward(batch), batch.group_ids, self.cfg.beta,
                                self.cfg.divergence, self.cfg.cap)
        except ValueError as e:
            raise ValueError(f"method ftfc: {e}") from e

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        _, stats = self._weights(batch)
        out = stats.metrics()
        out["ftfc/ess_fraction"] = stats.ess_total / len(batch)
        if self.cfg.pool_refresh != 1:
            out["ftfc/pool_age"] = float(self.step - self.pool_step)
        if self._fit is not None:
            out.update(self._fit[1].metrics())
        return out

    # ------------------------------------------------------------------ loss

    def loss_denominator(self, batch: RolloutBatch) -> float:
        return float(len(batch))  # samples: L = sum_i w_i err_i / N over the mini-batch

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        d = batch.data
        # x1 and cond are on the model's device, or on the CPU in a pool restored from a checkpoint
        # (load_state_dict): the model moves its inputs, and the terms below follow its output
        x1 = d["final_latents"]  # [n, L, C]
        cond = {k[len("cond/"):]: v for k, v in d.items() if k.startswith("cond/")}
        t, eps = self._noise(d[SAMPLE_ID], x1)
        denom = denom if denom is not None else len(batch)
        shape = (-1,) + (1,) * (x1.dim() - 1)
        post, metrics = None, {}
        if self.cfg.target == "posterior":
            post = self._posterior(x1, t, eps, batch.group_ids)
            metrics = {"ftfc/posterior_ess": float(post.ess.mean()), "ftfc/posterior_rho": float(post.rho.mean())}
        if self.cfg.anchor == "base":  # v0 + (w - 1)(u - v0): the tilt's correction on v0
            v0 = self.reference.flow_velocity(x1, t, eps, cond, guided=self.cfg.guided)
            if post is None:
                w = advantages.to(v0).reshape(shape)
                target = v0 + (w - 1) * ((eps - x1).to(v0) - v0)
            else:  # its expectation given x_t: v0 + E[w u | x_t] - E[u | x_t] - (E[w | x_t] - 1) v0
                rho = post.rho.to(v0).reshape(shape)
                target = v0 + post.mean_wu.to(v0) - post.mean_u.to(v0) - (rho - 1) * v0
            err = policy.flow_matching_error(x1, t, eps, cond, guided=self.cfg.guided, target=target)
            return LossOutput(err.sum() / denom, {"loss/anchored_flow_matching": float(err.detach().mean()), **metrics})
        if post is not None:  # rho |v - E[w u | x_t] / rho|^2, rho = E[w | x_t]
            rho = post.rho.to(x1)
            target = post.mean_wu.to(x1) / rho.clamp_min(1e-12).reshape(shape)  # rho = 0: no weight on this row
            err = policy.flow_matching_error(x1, t, eps, cond, guided=self.cfg.guided, target=target)
            return LossOutput((rho.to(err) * err).sum() / denom, {"loss/flow_matching": float(err.detach().mean()), **metrics})
        err = policy.flow_matching_error(x1, t, eps, cond, guided=self.cfg.guided)  # [n]
        w = advantages.to(err)
        loss = (w * err).sum() / denom
        return LossOutput(loss, {"loss/flow_matching": float(err.detach().mean()),
                                 "loss/weighted_flow_matching": float((w * err).detach().mean())})

    def _posterior(self, x1: Tensor, t: Tensor, eps: Tensor, group_ids: Tensor):
        """target=posterior: the moments of each row's x_t over its group's pool
        (diffusion_rl.ftfc.posterior_moments), which replace the row's target and weight in
        the losses above by their expectations given x_t. The pool's weights are those
        advantages() gave the whole batch (a mini-batch holds only part of each group)."""
        groups = [self._groups[g] for g in group_ids.tolist()]
        tt = t.to(x1).reshape(-1, *([1] * (x1.dim() - 1)))
        return posterior_moments((1 - tt) * x1 + tt * eps, t, [g[0] for g in groups], [g[1] for g in groups])

    def annotate_reference(self, reference, batch: RolloutBatch) -> None:
        """Nothing ahead: the anchor runs the reference in the loss, at each pass's own t and eps."""

    def _noise(self, ids: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """t [n] and eps [n, L, C], each sample's from its own generator (seed, step, epoch, id):
        CPU generators, so the draws do not depend on the device; moved to x1's."""
        ts, eps = [], []
        for i in ids.tolist():
            key = f"{self.run.seed}/{self.step}/{self.epoch}/{i}".encode()
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
            if self.cfg.t_sampling == "uniform":
                ts.append(torch.rand((), generator=g))
            else:
                ts.append(torch.sigmoid(self.cfg.logit_mean + self.cfg.logit_std * torch.randn((), generator=g)))
            eps.append(torch.randn(x1.shape[1:], generator=g))
        return torch.stack(ts).to(x1.device), torch.stack(eps).to(x1)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        if self.pool is None:
            return {}
        p = self.pool
        tensors = {"group_ids": p.group_ids, "values": p.scores.values, "total": p.scores.total,
                   **{f"data/{k}": v for k, v in p.data.items()}}
        images = [s.completion for s in p.samples]
        if all(isinstance(im, Image.Image) and im.size == images[0].size for im in images):
            tensors["images"] = torch.from_numpy(np.stack([np.asarray(im.convert("RGB")) for im in images]))
        blob = st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        return {"pool_step": self.pool_step, "policy_version": p.policy_version, "names": list(p.scores.names),
                "prompts": [s.prompt for s in p.samples], "metas": [s.meta for s in p.samples],
                "group_prompts": {str(k): v for k, v in p.prompts.items()},
                "tensors": base64.b64encode(blob).decode("ascii")}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            self.pool, self.pool_step = None, -1
            return
        t = st_load(base64.b64decode(state["tensors"]))
        images = [Image.fromarray(a) for a in t["images"].numpy()] if "images" in t else [None] * len(t["group_ids"])
        self.pool = RolloutBatch(
            group_ids=t["group_ids"],
            samples=[Sample(p, im, m) for p, im, m in zip(state["prompts"], images, state["metas"])],
            scores=AtomScores(state["names"], t["values"], t["total"]),
            policy_version=state["policy_version"],
            data={k[len("data/"):]: v for k, v in t.items() if k.startswith("data/")},
            prompts={int(k): v for k, v in state["group_prompts"].items()},
        )
        self.pool_step = state["pool_step"]


def _sample_ids(group_ids: Tensor) -> Tensor:  # [N] long: group id * 2^20 + rank in the group
    ids = torch.empty_like(group_ids, dtype=torch.long)
    seen: dict[int, int] = {}
    for row, g in enumerate(group_ids.tolist()):
        ids[row] = g * 2**20 + seen.get(g, 0)
        seen[g] = seen.get(g, 0) + 1
    return ids
