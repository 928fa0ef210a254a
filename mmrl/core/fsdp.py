"""Fully sharded data parallel (optim.fsdp): ZeRO stage 3 with torch's FSDP2 (`fully_shard`).

Each transformer block (the model's `_no_split_modules`) and then the whole model become FSDP
units: every rank keeps 1 / world of each weight, of its gradient and of AdamW's moments, in
float32. A forward all-gathers a unit's weights just before it runs and frees them after; a
backward reduce-scatters each unit's gradient into the shards. A bfloat16 model computes in
bfloat16 (FSDP's MixedPrecisionPolicy casts the gathered weights) while the float32 shards are
what the optimizer steps: the master weights of mmrl.core.master, sharded.

Collectives need every rank to run the same forwards, which sampling does not give (a rank
whose sequences end sooner makes fewer). So rollouts, evaluation and checkpoints run inside
`gathered()`: each unit gathers its whole weights once, keeps them (as vLLM colocated with an
FSDP trainer does in verl) and forwards there are local; the units reshard when it ends.
Training forwards run sharded; the trainer pads every rank to the same number of micro-batches.

Checkpoints are the unsharded run's: the main rank writes model/ from the gathered weights,
the float32 weights as `master.{i}` and AdamW's moments whole, indexed as without FSDP.

Forwards outside the model's own (a VLM's shared image encoding) would meet sharded weights:
the VLM encodes images inside the model's forward when sharded. Every rank must also run the
same sharded units in each pass: the VLM refuses training prompts without an image
(`check_sharded`), and ForkGRPO runs its forward even for rows it does not score.

The KL reference (a frozen copy of the starting weights) is sharded too, in its own dtype: after
each rollout the policy's units reshard and the reference's gather for its pass over the batch
(FTFC's anchor runs it inside the loss, sharded like the policy's forward). What stays whole on
every rank: the gathered weights during rollouts, and a reference whose weights are in several
dtypes (`shard_reference`).

Not combined with LoRA, a method's weight average (Flow-GRPO's EMA), pipelined or remote
rollout engines, or optim.shard_state (`check` refuses them). Filler passes count in a
backend's cost counters (cost/train_rows, cost/model_evaluations).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mmrl.core import distributed
from mmrl.core.config import ConfigError
from mmrl.core.device import module_device


def check(cfg, placement: str) -> None:
    """The settings FSDP is built for here; a ConfigError names any other."""
    if getattr(cfg.model, "lora", None) is not None:
        raise ConfigError("optim.fsdp shards full fine-tuning; with model.lora the frozen base needs no "
                          "optimizer state (set optim.fsdp=false, or model.lora=null)")
    if getattr(cfg.method, "ema", None) is not None:
        raise ConfigError("optim.fsdp cannot keep method.ema's average of the weights (it would be whole on "
                          "every rank): set method.ema=null, or optim.fsdp=false")
    if placement != "inline":
        raise ConfigError("optim.fsdp rolls out with the trainer's own gathered weights: set "
                          "rollout.scheduler.mode=sync and rollout.engine=hf (pipelined or remote engines "
                          "hold whole copies of their own)")
    if cfg.optim.shard_state:
        raise ConfigError("optim.fsdp already shards AdamW's moments: leave optim.shard_state false")
    if _fsdp_module() is None:
        raise ConfigError(f"optim.fsdp needs torch>=2.8 (FSDP2's fully_shard with summed gradients); this is "
                          f"torch {torch.__version__}: upgrade torch, or set optim.fsdp=false")


def _fsdp_module() -> type | None:
    """FSDP2's FSDPModule, or None on a torch too old for Sharded: FSDPModule is public from torch
    2.6 and set_force_sum_reduction_for_comms from 2.8. Nothing is sharded there (check refuses)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule if hasattr(FSDPModule, "set_force_sum_reduction_for_comms") else None


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, innermost first (FSDP wants children sharded before parents)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not found:  # no declared block type: the elements of the outermost ModuleLists (the layers)
        inside: set[int] = set()
        for lst in model.modules():  # parents before children
            if isinstance(lst, nn.ModuleList) and id(lst) not in inside:
                for m in lst:
                    if any(True for _ in m.parameters()):
                        found.append(m)
                        inside.update(id(x) for x in m.modules())
    return found[::-1]


class Sharded:
    """`model`, fully sharded across the process group in place (its class becomes FSDP<name>)."""

    def __init__(self, model: nn.Module, *, frozen: bool = False):
        """`frozen`: a model that never trains (the KL reference): its shards keep its dtype."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        device = module_device(model)
        if torch.distributed.get_backend() == "nccl" and device.type != "cuda":
            raise ConfigError("optim.fsdp under NCCL (a GPU launch) needs the model on the GPU: set model.device=cuda")
        # the model's device, not the first accelerator FSDP would pick (a CPU model on a GPU machine)
        mesh = init_device_mesh(device.type, (distributed.world_size(),))
        self.model = model
        self.dtypes = {k: v.dtype for k, v in model.state_dict().items()}  # what checkpoints hold
        low = {p.dtype for p in model.parameters()} - {torch.float32}
        if len(low) > 1:
            raise ConfigError(f"optim.fsdp: the model holds weights in several dtypes ({sorted(map(str, low))})")
        # float32 shards (the master weights); forwards in the model's dtype
        policy = MixedPrecisionPolicy(param_dtype=next(iter(low), None), reduce_dtype=torch.float32)
        cast = (lambda m: None) if frozen else _to_float32
        # float32 a block at a time, each sharded before the next is cast: never the whole model in
        # float32 on one rank
        for block in _blocks(model):
            cast(block)
            fully_shard(block, mesh=mesh, mp_policy=policy)
        cast(model)  # what is left: embeddings, norms, the output layer
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # FSDP takes the first unit to run a forward as the root; a rollout may first call a block
        # alone (a vision tower encoding images): make the whole model the root now
        model._get_fsdp_state()._lazy_init()
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.blocks = [u for u in self.units if u is not model]  # FSDP keeps the root whole after forward
        for unit in self.units:
            # gradients summed over ranks, not averaged: the trainer's loss is already the global
            # mini-batch's (its normaliser summed over ranks), as distributed.sum_gradients assumes
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-scaled one
        self._depth = 0

    @contextlib.contextmanager
    def gathered(self):
        """Every rank (a collective): the whole weights stay in every unit until the end, so
        forwards in between (rollouts, evaluation, any number per rank) need no collectives."""
        self._depth += 1
        if self._depth == 1:
            for unit in self.units:
                unit.unshard()
            for unit in self.blocks:
                unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for unit in self.blocks:
                    unit.set_reshard_after_forward(True, recurse=False)
                for unit in self.units:
                    unit.reshard()

    # ---------------------------------------------------------------- checkpoints (collectives)

    @staticmethod
    def whole(t, keep: bool = True):
        """A sharded tensor whole, on the CPU (every rank: an all-gather), or None where not `keep`
        (ranks other than the writer drop it at once); others as they are."""
        if _fsdp_module() is None:  # torch < 2.8: nothing is sharded (and torch 2.4 has no public DTensor)
            return t
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            return t
        full = t.full_tensor()
        return full.cpu() if keep else None

    def whole_state(self, params: list[nn.Parameter], keep: bool) -> tuple[dict, list] | None:
        """On the ranks that `keep` it (every rank calls): the model's state_dict whole and in its
        own dtypes, and the float32 wholes of `params` (its trainable weights), each tensor
        gathered once. Tied weights (an output layer sharing the embedding) stay one tensor, so
        save_pretrained writes them once, as without FSDP."""
        # tied entries are one parameter under two names (the same on every rank, unlike memory addresses)
        owner = {name: id(p) for name, p in self.model.named_parameters(remove_duplicate=False)}
        sd = self.model.state_dict()
        full = {}  # owner -> the whole tensor as stored (float32 for the sharded weights)
        for k, v in sd.items():
            if owner.get(k, k) not in full:
                full[owner.get(k, k)] = self.whole(v.detach(), keep)
        if not keep:
            return None
        cast: dict = {}
        state = {k: cast.setdefault(owner.get(k, k), full[owner.get(k, k)].to(self.dtypes.get(k, v.dtype)))
                 for k, v in sd.items()}
        return state, [full[id(p)] for p in params]

    @contextlib.contextmanager
    def writable(self, state: dict[str, torch.Tensor]):
        """save_pretrained (HF and diffusers alike) reads model.state_dict(), which FSDP answers
        with shards: for the time of a write it answers with `state`, the whole weights."""
        self.model.state_dict = lambda *args, **kwargs: dict(state)
        try:
            yield
        finally:
            del self.model.state_dict

    def optimizer_state(self, optimizer, keep: bool) -> dict | None:
        """optimizer.state_dict() with every moment whole, on the ranks that `keep` it (every rank calls)."""
        sd = optimizer.state_dict()
        state = {i: {k: self.whole(v, keep) for k, v in slots.items()} for i, slots in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]} if keep else None

    @staticmethod
    def shard_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole tensor `t` shaped like the sharded parameter `p`."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(p, DTensor) or t.shape != p.shape:
            return t
        return distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)

    @torch.no_grad()
    def load_params(self, params: list[nn.Parameter], whole: list[torch.Tensor]) -> None:
        for p, t in zip(params, whole):
            p.copy_(self.shard_like(t, p))

    def load_optimizer_state(self, optimizer, params: list[nn.Parameter], state: dict) -> None:
        """A whole state_dict (as optimizer_state wrote it) into the sharded optimizer."""
        for i, slots in state["state"].items():
            p = params[int(i)]
            for k, v in slots.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    slots[k] = self.shard_like(v, p)
        optimizer.load_state_dict(state)


def shard_reference(reference, model: nn.Module) -> Sharded | None:
    """The KL reference's model (`reference.model`, a frozen copy) sharded like the policy's, its
    shards in its own dtype; None where there is none to shard: no reference, one that is the
    policy's own model, or one holding several dtypes (FSDP gathers one dtype per unit)."""
    ref = getattr(reference, "model", None)
    if not isinstance(ref, nn.Module) or ref is model or len({p.dtype for p in ref.parameters()}) != 1:
        return None
    return Sharded(ref, frozen=True)


def _to_float32(module: nn.Module) -> None:
    """The module's own unsharded parameters in float32, in place (the sharded ones already are)."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        if not isinstance(p, DTensor) and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded by optim.fsdp (its forwards are collectives outside `gathered`)."""
    cls = _fsdp_module()
    return cls is not None and isinstance(model, cls)


def checksum(params: list[nn.Parameter]) -> float:
    """Sum of |w| over the whole sharded weights (every rank calls; all get it)."""
    from torch.distributed.tensor import DTensor

    local = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().abs().sum()) for p in params)
    return distributed.sum_scalar(local)


def filler_passes(micros: int, rows: int) -> int:
    """How many forward-backward passes of no weight this rank adds so that every rank makes
    as many as the rank with the most micro-batches (a collective). Every rank raises alike
    where one that needs such a pass has no `rows` to make it with."""
    counts = distributed.gather_objects((micros, rows))
    most = max(m for m, _ in counts)
    stuck = [r for r, (m, n) in enumerate(counts) if m < most and n == 0]
    if stuck:
        raise RuntimeError(f"optim.fsdp: rank {stuck[0]} has no rows to join the other ranks' forward passes")
    return most - micros
