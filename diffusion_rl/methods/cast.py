"""CAST, Causal Advantage-Structured Training (docs/methods.md section 4).

RECONSTRUCTION: no paper text or code was available. What is here follows the method's
summary in docs/methods.md section 4; every choice below that the summary leaves open is ours,
and where it matters it is a config option (diffusion_rl.config.CASTConfig).

What CAST changes against Flow-GRPO (diffusion_rl/methods/flow_grpo.py):

    advantage   per reward atom k (the columns of batch.scores: shapes-geneval's exist, colour,
                count, relation and all, already causally gated -- a child whose parent failed
                scores 0 -- plus any image atoms) a signed group advantage
                    A_ik = (r_ik - mean_group_k) / (std_group_k + std_eps)      [N, K]
                (exactly 0 in a group whose column is constant); A_i = sum_k w_k A_ik with the
                reward's atom weights w_k, clipped to +-adv_clip.
    window      the SDE window comes from the model's own trajectory (diffusion_rl.calibrate:
                the median step at which the detector's atom verdicts on x0_hat commit), stored
                in a window.json by `diffusion-rl calibrate-window` and read at build time
                (method.window_from; diffusion_rl.calibrate.apply_window_file).
    projection  (method.projection: attention) the training forward on each stored x_t of the
                window also records, in the joint-attention layers of method.attention_layers
                (null: the middle half; the config reads layer 0), the attention of
                every image token to the text tokens (diffusion_rl.attention_maps); a prompt
                parser (diffusion_rl.scene_graph) says which words each atom is about, and
                M_ik(l) is the attention of image token l to those words, normalised to mean 1
                over the image. The advantage map is
                    A_i(l) = (sum_k w_k A_ik M_ik(l) + lambda A_i) / (1 + lambda),  clipped,
                so uniform maps give back A_i exactly. (method.projection: detector, ours, a
                diagnostic: M_ik from the boxes of the objects the reward's detector found for
                atom k in the sample's final image instead, the same map at every trained step.)
    loss        per latent token l (a patch) of each trained step, the log-prob is the mean of
                the Gaussian's per-element terms over the token's channels only (not over the
                whole image), rho_l = exp(logp_l - old_logp_l), and
                    loss = -mean over samples, steps and tokens of min(rho_l A_i(l), clip(rho_l) A_i(l))
                plus Flow-GRPO's KL term. On-policy its gradient is mean_l A_i(l) grad logp_l;
                with uniform maps that is Flow-GRPO's A_i grad logp (tests check both), with
                CAST's A_i = sum_k w_k A_ik, not Flow-GRPO's z-score of the weighted total.
                Off-policy (later mini-batches, epochs) the clip acts per token, not per image;
                a token's log-ratio spreads about sqrt(L) times an image's (L latent tokens), so at the default
                patch_clip_range (= clip_range) more of it is clipped.

Departures / open choices: the group std is Flow-GRPO's (method.adv_std: population by default); by
default (method.atoms: types) the atoms are the reward's atom TYPES (a type's score is the mean
over the prompt's atoms of that type), since that is what the batch carries, so a type's map
covers the words of all its atoms in the prompt; method.atoms: nodes takes one column per
scene-graph atom instead (its own verdict, advantage and words; shapes-geneval only); the maps
are taken at each trained step from the same forward that is trained (teacher-forced on the
stored x_t) and treated as constants; the "all" atom and image atoms (CLIP score) are not
projected (uniform maps); the sum over atoms is not normalised by the number of atoms, so
adv_clip binds more often than in Flow-GRPO; attention maps exist for the FLUX- and SD3-style
joint attention only (Qwen-Image and FLUX.2 need method.projection: none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_rl.attention_maps import atom_maps, region_maps, text_key_spans
from diffusion_rl.methods.flow_grpo import FlowGRPO, std_of
from diffusion_rl.scene_graph import BUILTIN, checked_spans, load_parser, shapes_geneval_atom_spans
from diffusion_rl.tasks.shapes_geneval import (
    ATOM_TYPES,
    MAX_ATOMS,
    atom_regions,
    cached_score_image,
    can_parse,
    parse_prompt,
)
from mmrl.core.advantages import atom_advantages
from mmrl.core.batch import RolloutBatch
from mmrl.core.config import ConfigError
from mmrl.core.losses import LossOutput, policy_loss
from mmrl.core.method import register_method

ATOM_ADVANTAGES = "cast/atom_advantages"
ATOM_WEIGHTS = "cast/atom_weights"  # [N, K] per-sample column weights (method.atoms: nodes)


@dataclass
class CASTAdvantages:
    atom: Tensor  # [N, K] signed per-atom group advantages A_ik
    total: Tensor  # [N]    A_i = sum_k w_k A_ik, clipped to +-clip


def cast_advantages(scores: Tensor, group_ids: Tensor, weights: Tensor, *, eps: float = 1e-4,
                    clip: float | None = None, population: bool = False, scale: str = "group") -> CASTAdvantages:
    """Per-atom signed group advantages and their weighted sum, a pure tensor function.

    scores [N, K] atom scores (already gated), group_ids [N], weights [K] or per sample [N, K].
    A column that is constant within a group (a gated child at 0 for every sample, a vacuous
    atom at 1, a padding column, a group of one) gives exactly 0 there."""
    atom = atom_advantages(scores.float(), group_ids, scale=scale, eps=eps, population=population)  # [N, K]
    w = torch.as_tensor(weights, dtype=atom.dtype, device=atom.device)
    if w.shape not in ((atom.shape[1],), tuple(atom.shape)):
        raise ValueError(f"weights must have shape [{atom.shape[1]}] (one per atom) or {list(atom.shape)} "
                         f"(per sample); got {list(w.shape)}")
    total = atom @ w if w.dim() == 1 else (atom * w).sum(-1)  # [N]
    if clip is not None:
        total = total.clamp(-clip, clip)
    return CASTAdvantages(atom=atom, total=total)


def advantage_map(atom: Tensor, weights: Tensor, maps: Tensor, total: Tensor, *, global_weight: float,
                  clip: float | None = None) -> Tensor:
    """[N, L]: A_i(l) = (sum_k w_k A_ik M_ik(l) + lambda A_i) / (1 + lambda), clipped to +-clip.
    atom [N, K], weights [K] or [N, K], maps [N, K, L], total [N] (A_i)."""
    w = torch.as_tensor(weights, dtype=maps.dtype, device=maps.device)
    projected = torch.einsum("nk,k,nkl->nl" if w.dim() == 1 else "nk,nk,nkl->nl", atom.to(maps), w, maps)
    out = (projected + global_weight * total.to(maps)[:, None]) / (1 + global_weight)
    return out.clamp(-clip, clip) if clip is not None else out


@register_method("cast")
class CAST(FlowGRPO):
    """Flow-GRPO with CAST's per-atom advantages, projected to pixels through attention (the
    window is set at build time)."""

    def __init__(self, cfg, run, reward):
        super().__init__(cfg, run, reward)
        self.parser = None
        if cfg.projection == "attention":
            self.parser = load_parser(cfg.parser, getattr(run, "base_dir", None))
        self._spans: dict[str, dict] = {}

    def atom_spans(self, prompt: str) -> dict:
        """The parser's {atom: character spans} of a prompt, cached. A prompt the built-in
        shapes-geneval grammar cannot parse (kept under task.unparsed=whole_prompt, warned about
        when the prompts were read) gets none: uniform maps."""
        if prompt not in self._spans:
            builtin = self.parser is BUILTIN.get(self.cfg.parser)
            try:
                spans = checked_spans(self.parser, prompt)
            except ValueError as e:
                if not builtin:  # the user's code: named as the config names it (exit 2, not a traceback)
                    raise ConfigError(f"method.parser {self.cfg.parser!r}: {e}") from e
                spans = {}
            columns = getattr(self.reward, "names", None)
            unknown = [name for name in spans if not builtin and columns is not None and name not in columns]
            if unknown:  # a name of the user's that is no column (a typo) would leave that column's map uniform, silently
                raise ConfigError(f"method.parser {self.cfg.parser!r} gave {prompt!r} words for {unknown}, which "
                                  f"are not atoms of the reward (its atoms: {', '.join(columns)})")
            self._spans[prompt] = spans
        return self._spans[prompt]

    def loss(self, policy, batch: RolloutBatch, advantages: Tensor, denom: float | None = None) -> LossOutput:
        if self.cfg.projection == "none":
            return super().loss(policy, batch, advantages, denom)
        prompts = [s.prompt for s in batch.samples]
        names = batch.scores.names if batch.scores is not None else self.reward.names
        nodes = self.cfg.atoms == "nodes"
        columns = self.node_names(names) if nodes else names
        weights = batch.data[ATOM_WEIGHTS] if nodes else self.reward.weights
        if self.cfg.projection == "detector":  # one map per sample, the same at every trained step
            steps = policy.sde_outputs(batch)
            regions = [self.detector_regions(s.completion, s.prompt, nodes) for s in batch.samples]
            maps = region_maps(regions, columns, policy.flow.grid, self.cfg.map_norm).to(policy.flow.device)
            all_maps = [maps] * len(steps)
        else:
            steps, attention = policy.sde_outputs(batch, attention=self.cfg.attention_layers)
            keys = text_key_spans(policy.flow, prompts)
            spans = [self.node_spans(p) if nodes else self.atom_spans(p) for p in prompts]
            all_maps = [atom_maps(att, keys, spans, columns, self.cfg.map_norm) for att in attention]  # [N, K, L]
        adv = torch.stack([advantage_map(batch.data[ATOM_ADVANTAGES], weights, maps, advantages,
                                         global_weight=self.cfg.global_weight, clip=self.cfg.adv_clip)
                           for maps in all_maps], 1)  # [N, T, L]
        logp = torch.stack([s.elem_log_prob.mean(-1) for s in steps], 1)  # [N, T, L]
        n, t, length = logp.shape
        mask = batch.mask[:, :, None].expand(n, t, length).reshape(n, t * length)
        eps = self.cfg.patch_clip_range or self.cfg.clip_range
        out = policy_loss(logp.reshape(n, -1), batch.data["token_logp"].reshape(n, -1), adv.reshape(n, -1), mask,
                          clip_low=eps, clip_high=eps, aggregation="token_mean",
                          denom=None if denom is None else denom * length)
        out.per_token = out.per_token.reshape(n, t, length).mean(-1)
        trained = adv[batch.mask.bool()]  # [M, L]: the metrics describe the (sample, step) pairs trained on
        if len(trained):
            out.metrics["cast/adv_map_spatial_std"] = float(trained.std(-1).mean())
            if self.cfg.adv_clip is not None:  # the share of patch advantages at the clip (a sample's
                # own A_i at the clip counts too: with uniform maps that is all this counts)
                at_clip = trained.abs() >= self.cfg.adv_clip * (1 - 1e-6)
                out.metrics["cast/adv_map_clipped"] = float(at_clip.float().mean())
        return self.add_kl(out, steps, batch, denom)

    def advantages(self, batch: RolloutBatch) -> Tensor:  # [N]
        if batch.scores is None:
            raise ValueError("CAST needs the per-atom scores of the batch (batch.scores is None)")
        values, weights = batch.scores.values, self.reward.weights
        if self.cfg.atoms == "nodes":
            values, weights = self.node_columns(batch)
            batch.data[ATOM_WEIGHTS] = weights
        out = cast_advantages(values, batch.group_ids, weights, eps=self.cfg.std_eps, clip=self.cfg.adv_clip,
                              **std_of(self.cfg.adv_std))
        batch.data[ATOM_ADVANTAGES] = out.atom
        return out.total

    @staticmethod
    def detector_regions(image, prompt: str, nodes: bool) -> dict:
        """{column: [H, W] mask or None} from the detected objects (atom_regions): per
        scene-graph atom ("atom<j>") with atoms=nodes, else per atom type (the union of its
        atoms' masks); {} (uniform maps) for a prompt the grammar cannot parse."""
        if not can_parse(prompt):
            return {}
        regions = atom_regions(image, prompt)
        if nodes:
            return {f"atom{j}": m for j, m in enumerate(regions.values())}
        out: dict = {}
        for atom, mask in zip(parse_prompt(prompt), regions.values()):
            if mask is not None:
                out[atom.kind] = mask if out.get(atom.kind) is None else out[atom.kind] | mask
        return out

    # ------------------------------------------------------------ method.atoms: nodes

    @staticmethod
    def node_names(names) -> list[str]:
        """The columns with atoms=nodes: MAX_ATOMS scene-graph slots (a prompt's atoms in
        parse order, the rest padding), then the reward's columns that are not atom types."""
        return [f"atom{j}" for j in range(MAX_ATOMS)] + [n for n in names if n not in ATOM_TYPES]

    def node_columns(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """[N, K] verdicts and weights of node_names' columns. A scene-graph atom of type t
        weighs w_t / (the prompt's atoms of type t), so each type keeps its weight in total;
        padding and prompts the grammar cannot parse weigh 0. Shares the reward's detection."""
        names = list(batch.scores.names)  # on the CPU, as the scores are: advantage_map moves them
        w = dict(zip(names, self.reward.weights.tolist()))
        extra = [k for k, n in enumerate(names) if n not in ATOM_TYPES]
        values = torch.zeros(len(batch), MAX_ATOMS + len(extra))
        weights = torch.zeros_like(values)
        for i, s in enumerate(batch.samples):
            if not can_parse(s.prompt):
                continue
            atoms = parse_prompt(s.prompt)
            verdicts = cached_score_image(s.completion, s.prompt)
            for j, a in enumerate(atoms):
                values[i, j] = verdicts[a.name]
                weights[i, j] = w[a.kind] / sum(b.kind == a.kind for b in atoms)
        values[:, MAX_ATOMS:] = batch.scores.values[:, extra].float()
        weights[:, MAX_ATOMS:] = torch.tensor([w[names[k]] for k in extra])
        return values, weights

    def node_spans(self, prompt: str) -> dict:
        """{"atom<j>": the words of the prompt's j-th scene-graph atom}, cached; {} (uniform
        maps) for a prompt the grammar cannot parse."""
        key = ("nodes", prompt)
        if key not in self._spans:
            spans = shapes_geneval_atom_spans(prompt) if can_parse(prompt) else {}
            self._spans[key] = {f"atom{j}": v for j, v in enumerate(spans.values())}
        return self._spans[key]

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Per atom: the mean |A_ik| and the fraction of samples with a non-zero A_ik (how
        often that atom separates the samples of a group). With atoms=nodes, per atom type over
        the scene-graph atoms of that type."""
        atom = batch.data.get(ATOM_ADVANTAGES)
        if atom is None or batch.scores is None:
            return {}
        cols: dict[str, list[Tensor]] = {}
        if self.cfg.atoms == "nodes":
            for i, s in enumerate(batch.samples):
                for j, a in enumerate(parse_prompt(s.prompt) if can_parse(s.prompt) else []):
                    cols.setdefault(a.kind, []).append(atom[i, j : j + 1])
            names = self.node_names(batch.scores.names)
            cols.update({n: [atom[:, k]] for k, n in enumerate(names) if k >= MAX_ATOMS})
        else:
            cols = {n: [atom[:, k]] for k, n in enumerate(batch.scores.names)}
        out = {}
        for name, parts in cols.items():
            col = torch.cat(parts).float()
            out[f"cast/adv_abs/{name}"] = float(col.abs().mean())
            out[f"cast/adv_nonzero/{name}"] = float((col != 0).float().mean())
        return out
