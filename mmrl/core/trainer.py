"""The one RL loop, shared by every modality.

    for step:
        batch = scheduler.next_groups()       # complete groups, scored, with advantages; the
                                              # method's group hooks ran (drop + refill, extra
                                              # samples, prune)
        for epoch, mini-batch:                # ppo_epochs x mini_batches optimizer steps
            for micro-batch:                  # gradient accumulation
                method.loss(policy, micro, adv, denom).backward()
            clip, optimizer step, LR schedule
        log; evaluate; checkpoint

With rollout.scheduler.mode=pipelined the first epoch streams instead: each group
is trained on (forward and backward) as it arrives from the engines, and the
optimizer steps once U groups are in (mmrl.core.pipeline).

The backend supplies the policy and task (mmrl.core.protocols); the method
supplies advantages and loss (mmrl.core.method); everything else is here.
Resuming from a checkpoint reproduces the uninterrupted run exactly on a CPU:
every RNG the loop draws from, the data position, the optimizer and the method's
own state (Method.state_dict) are saved, and evaluation runs with the training RNGs
set aside.

Averaged weights: a method may keep a moving average of the trainable weights
(Flow-GRPO's EMA) by having `weight_average(params)` return an object with
`update(params)`, `applied(params)` (a context that puts the average into the
parameters and restores them), `state_dict()` -> (tensors, JSON) and
`load_state_dict(tensors, JSON)`. The loop updates it after every optimizer step;
evaluation (and its sample grids) runs with the average applied; a checkpoint's
model/ then holds the average, and its trainer state the raw weights and the
average, which resuming restores. Rollouts and gradients always use the raw weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import signal
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError

from mmrl.core import checkpoint as ckpt
from mmrl.core import distributed, fsdp, provenance
from mmrl.core.batch import RolloutBatch
from mmrl.core.best import BestCheckpoint
from mmrl.core.config import ConfigError, OptimConfig, TrainConfig, check_built, dump_yaml
from mmrl.core.device import fork_rng, module_device
from mmrl.core.faults import crash_point  # tests' kill -9 points (a no-op unless MMRL_CRASH_AT)
from mmrl.core.held_out import EvalProgress, takes, write_rows
from mmrl.core.logging import (
    CURVE,
    METRICS,
    RunLogger,
    nulled,
    plot_reward_curve,
    read_finished_run,
    read_metrics,
    write_atomically,
)
from mmrl.core.losses import DENOM_SHARES
from mmrl.core.master import MasterWeights, release
from mmrl.core.memory import update_mode
from mmrl.core.method import build_method, checked_loss
from mmrl.core.overlong import overlong_atom
from mmrl.core.pipeline import PipelinedScheduler, build_engines, check_config, placement
from mmrl.core.rewards import Reward, load_atoms
from mmrl.core.runconfig import absolute_paths, bundled_model_note, upgraded
from mmrl.core.scheduler import PromptStream, SyncScheduler
from mmrl.core.stop import SignalStop, StoppedBySignal


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite training, nothing to resume); the message says why."""


class MethodError(TrainingError):
    """A method's hook returned what the loop cannot use (mmrl.core.method.checked_loss and
    checked_advantages): the message names the hook and what it must return."""


class OutputDirError(TrainingError, ckpt.CheckpointError):
    """The output directory does not fit the request: nothing to --resume, or a finished
    run's checkpoints that a fresh run would mix with its own. A user error (CLI exit 2)."""


def check_output_dir(out: str | Path, resume: bool) -> Path | None:
    """The checkpoint --resume starts from (None for a fresh run); an OutputDirError where
    there is none to resume, or where a fresh run would write beside an earlier run's."""
    if Path(out).exists() and not Path(out).is_dir():
        raise OutputDirError(f"the output directory {out} is a file; choose another --output-dir")
    checkpoints = Path(out) / "checkpoints"
    if resume:
        path = ckpt.latest_checkpoint(checkpoints)
        if path is None:
            raise OutputDirError(f"--resume: no complete checkpoint in {checkpoints}")
        return path
    if ckpt.list_checkpoints(checkpoints):
        raise OutputDirError(f"{out} already holds checkpoints of a run; pass --resume to continue it "
                             "or choose another --output-dir")
    return None


# what every checkpoint's trainer_state.json holds (Trainer._write; keys added later are read with a default)
STATE_KEYS = ("step", "bad_steps", "eval_before", "optimizer", "lr_scheduler", "rng", "data")


def running_start(out: str | Path) -> str | None:
    """Why `out` cannot be trained now, where an earlier start of it still runs on this host (its
    environment.json entry has no ending and its process is alive); None where none does or this
    cannot be told (another host; no process start time, as off Linux, where a reused PID would
    refuse the run for good). Two starts at once would train the same steps into one
    metrics.jsonl and checkpoints/, and the second's clean-up of half-written checkpoints
    deletes the one the first is writing."""
    entry = provenance.last_start(out)
    if (entry is None or "ended" in entry or entry.get("pid") == os.getpid() or entry.get("pid_started") is None
            or provenance.alive(entry) is not True):
        return None
    return (f"{out} is being trained by process {entry['pid']} on this host (started {entry.get('started')} at "
            f"step {entry.get('step')}); wait for it to end, or stop it (its checkpoints stay), then start again")


def _older_checkpoint_note(path: Path) -> str:
    """What to do about a damaged newest checkpoint `path`: remove it to resume from the one
    before it (--resume never skips one silently: the steps after the older one train again)."""
    older = [d for _, d in ckpt.list_checkpoints(path.parent) if d != path]
    if older:
        return f"; remove it to resume from {older[-1].name} (the steps after it train again)"
    return "; it is the run's only checkpoint: start the run afresh in another --output-dir"


def resume_command(out: str | Path, command: str = "") -> str:
    """The command line that resumes the run in `out` (`--resume` alone resumes the default
    output directory, not this one); `command`: the CLI's name, where known."""
    return f"{command + ' ' if command else ''}train -o {shlex.quote(str(out))} --resume"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_factor(cfg: OptimConfig, total: int):
    """Multiplier of the base LR after `n` optimizer steps: linear warm-up, then the schedule."""

    warmup = cfg.warmup(total)  # a warmup_ratio is of the whole run's count, also on --resume

    def factor(n: int) -> float:
        if n < warmup:
            return (n + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (n - warmup) / max(1, total - warmup))
        decay = 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor


class Trainer:
    """The one RL loop over a backend's policy and task (README "The Python API"):

        policy, task = backend.build(cfg)
        summary = Trainer(cfg, policy, task).train()     # .train(resume=True) is --resume

    It trains `policy` in place, so a second Trainer on the same policy starts from the
    weights the first left (build the policy again for an independent run), and it seeds
    Python's, NumPy's and torch's global generators with cfg.seed."""

    def __init__(self, cfg: TrainConfig, policy, task, output_dir: str | Path | None = None, backend=None,
                 engines: list | None = None, training: bool = True):
        """`backend`: the backend module (its `build_engine` makes engines of its own, e.g. vLLM).
        `engines`: rollout engines to use instead of those the config describes (not inline).
        `training=False`: only to evaluate (the eval verb), so the settings that only training
        refuses (one sample per group, float16 weights) are let through."""
        check_built(cfg)  # a config changed after it was built (model_copy) is validated again
        self.cfg = cfg
        self.out = Path(output_dir or cfg.output_dir)
        self.policy = policy
        self.task = task
        distributed.init()
        self.world = distributed.world_size()
        if self.world > 1:
            _check_data_parallel(cfg, self.world)
        check_config(cfg, self.world, training)
        seed_everything(cfg.seed)
        self.reward = with_config_atoms(task, cfg)
        if training:
            check_weights(self.reward)
        self.method = build_method(cfg, self.reward)
        # built before the model is sharded (a copy of the whole starting weights)
        self.reference = policy.reference() if self.method.needs_reference else None
        self.method.reference = self.reference
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.device = module_device(policy.model)
        if torch.cuda.is_available() and all(p.device.type == "cpu" for p in policy.model.parameters()):
            warnings.warn("a GPU is present but the model is on the CPU (model.device cpu, the default): "
                          "set model.device=auto or cuda to train on the GPU", stacklevel=2)
        # every parameter, frozen ones too: LoRA keeps its adapters in float32 over a float16 base,
        # whose backward without loss scaling flushes small gradients to 0 before the adapters
        if training and any(p.dtype == torch.float16 for p in policy.model.parameters()):
            raise ConfigError("model.dtype float16 cannot train here: without loss scaling float16 underflows, "
                              "AdamW's second moments on float16 weights, and the backward through a float16 "
                              "base under LoRA adapters (train in bfloat16 or float32; float16 is fine for eval "
                              "and sample)")
        if not self.params:
            raise TrainingError("the policy has no trainable parameters (requires_grad is False everywhere)")
        self.sharded = None  # optim.fsdp: the model sharded over the ranks (mmrl.core.fsdp); no effect in one process
        self.sharded_reference = None  # and the KL reference, which then passes here, not in the scheduler
        if cfg.optim.fsdp and training and self.world == 1:
            warnings.warn("optim.fsdp shards the model over data-parallel processes; with one process it stays "
                          "whole (launch with torchrun or accelerate launch)", stacklevel=2)
        if cfg.optim.fsdp and training and self.world > 1:
            fsdp.check(cfg, placement(cfg) if engines is None else "engines")
            if hasattr(policy, "check_sharded"):  # what a backend's sharded model cannot train on
                policy.check_sharded(task.train_prompts())
            self.sharded = fsdp.Sharded(policy.model)
            self.params = [p for p in policy.model.parameters() if p.requires_grad]  # the shards
            self.sharded_reference = fsdp.shard_reference(self.reference, policy.model)
        oc = cfg.optim
        # under FSDP the float32 shards are the master weights
        self.master = MasterWeights(self.params) if oc.master_weights and training and self.sharded is None else None
        if training and self.master is None:  # gradients stay on the parameters (an older trainer's
            release(self.params)                # copies stop taking them); eval allocates no copies
        low = [p for p in self.params if p.dtype in (torch.bfloat16, torch.float16)]
        if training and not oc.master_weights and self.sharded is None and low and oc.lr > 0:
            # the one setting that makes a bfloat16 full fine-tune a near no-op, so said once
            warnings.warn(f"optim.master_weights is off and {len(low)} trainable parameters are {low[0].dtype}: "
                          f"AdamW steps them in that precision, where most updates at lr {oc.lr:g} round away "
                          "(mmrl.core.master); leave it on unless that is what you measure", stacklevel=2)
        # What the optimizer steps and where gradients land: float32 copies of bfloat16 weights
        self.opt_params = self.master.masters if self.master is not None else self.params
        # e.g. Flow-GRPO's EMA (usually None), of the float32 copies: a bfloat16 average would
        # round away most of each small step toward the weights
        self.ema = self.method.weight_average(self.opt_params)
        self.optimizer = distributed.adamw(self.opt_params, lr=oc.lr, betas=oc.betas, eps=oc.eps,
                                           weight_decay=oc.weight_decay, shard=oc.shard_state)
        self.updates = updates = cfg.train.max_steps * cfg.train.ppo_epochs * cfg.train.mini_batches
        warmup = oc.warmup(updates)
        if training and 0 < updates <= warmup:  # e.g. a short trial run of a long run's config
            setting = f"optim.warmup_ratio {oc.warmup_ratio}" if oc.warmup_ratio else f"optim.warmup_steps {warmup}"
            warnings.warn(f"{setting} spans the whole run ({updates} optimizer steps: "
                          f"train.max_steps x ppo_epochs x mini_batches): the learning rate rises to lr x "
                          f"{updates}/{warmup} at most"
                          + (f" and the {oc.schedule} decay never starts" if oc.schedule != "constant" else ""),
                          stacklevel=2)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(oc, updates))
        # rollouts and mini-batch shuffles: each rank its own (it rolls out its own prompts)
        self.generator = torch.Generator().manual_seed(distributed.rank_seed(cfg.seed))
        self.stream = PromptStream(task.train_prompts(), cfg.seed)
        if placement(cfg) == "inline" and engines is None:
            self.scheduler = SyncScheduler(cfg, policy, self.stream, self.reward, self.method, self.generator,
                                           self.reference if self.sharded_reference is None else None)
        else:
            self.scheduler = PipelinedScheduler(
                cfg, engines or build_engines(cfg, policy, backend), self.stream, self.reward, self.method, self.generator,
                policy.model, self.reference,
            )
        self.num_generations = cfg.rollout.num_generations  # G; a method may change it per epoch
        self.group_epoch = 0
        self.step = 0
        self.bad_steps = 0
        self.warned_empty = False  # "every group was dropped" is warned once; the summary counts them
        self.eval_before: dict[str, float] | None = None
        self.saved_step: int | None = None
        self._loaded_config: dict | None = None  # the config of the checkpoint resumed from
        # wall seconds of training: the earlier starts' up to the checkpoint resumed from (its
        # "seconds"), and this start's since _since; summary.json's train_seconds
        self.seconds_before, self._since = 0.0, time.perf_counter()
        self.best = BestCheckpoint(self.out, cfg.train.best_metric, cfg.train.best_mode)
        self._before_rollout: tuple | None = None  # (generator state, stream state) during a rollout
        self._updating = False

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    # ------------------------------------------------------------------ the run

    def _keep_changed_config(self, config: dict[str, Any]) -> None:
        """On --resume: where the config differs from the run's config.yaml in more than its
        length, keep that record as config.before-step-N.yaml and say what changed. A second
        resume from step N compares with that record, the config that trained up to N (not the
        config.yaml of the attempt in between), and keeps it."""
        kept = self.out / f"config.before-step-{self.step}.yaml"
        path = kept if kept.is_file() else self.out / "config.yaml"
        whose, record = "the run's", "The earlier config.yaml is"
        if path.is_file():
            text = path.read_text()
        elif self._loaded_config is not None:  # config.yaml lost (checkpoints/ copied alone): the checkpoint's
            text = dump_yaml(absolute_paths(self._loaded_config, self.cfg.base_dir), sort_keys=False)
            whose, record = "the checkpoint's (the run's config.yaml is missing)", "The checkpoint's settings are"
        else:
            return
        # an older mmrl's defaults left out as build_config left them out (runconfig.upgraded)
        changed = [c for c in config_changes(upgraded(yaml.safe_load(text) or {}), config,  # a run's folder is itself
                                             default=lambda key: field_default(self.cfg, key))
                   if not c.startswith(("train.max_steps:", "output_dir:"))]
        if changed:
            kept.write_text(text)
            warnings.warn(f"--resume at step {self.step} with settings that differ from {whose}: "
                          f"{'; '.join(changed)}. {record} kept as {kept.name}", stacklevel=3)

    def _keep_finished_summary(self) -> None:
        """On --resume of a finished run (its max_steps raised): its summary.json, with the final
        evaluation of its last step (which no metrics row holds), is kept as summary.step-N.json."""
        path = self.out / "summary.json"
        try:
            steps = int(json.loads(path.read_text(encoding="utf-8"))["steps"])
        except (OSError, ValueError, KeyError, TypeError):  # none, or not one this trainer wrote
            return
        kept = self.out / f"summary.step-{steps}.json"
        if not kept.exists():
            path.replace(kept)

    def seconds(self) -> float:
        """Wall seconds of training so far: a resumed run's earlier starts count up to the
        checkpoint it resumed from (a killed start's steps after it were trained again)."""
        return self.seconds_before + time.perf_counter() - self._since

    def _starts(self) -> list[dict]:
        """environment.json's entries (mmrl.core.provenance), for summary.json; [] where unreadable."""
        try:
            entries = json.loads((self.out / provenance.ENVIRONMENT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def train(self, resume: bool = False) -> dict[str, Any]:
        """Evaluate, train train.max_steps steps, evaluate again; the summary.json it writes:
        `eval_before` and `eval_after` (held-out metrics), `steps`, `checkpoint` (the final
        weights' directory), `final_metrics` (the last step's metrics.jsonl row), `config`.
        `resume`: go on from the newest complete checkpoint in the output directory (an
        OutputDirError where there is none); without it, a directory that holds a run's
        checkpoints is an OutputDirError."""
        tc = self.cfg.train
        # the main rank looks, every rank refuses (the others would wait for it in a collective)
        running = distributed.gather_objects(running_start(self.out) if distributed.is_main() else None)[0]
        if running is not None:
            raise OutputDirError(running)
        path = check_output_dir(self.out, resume)
        if path is not None:
            self.load(path)
            if distributed.is_main():
                print(f"resuming at step {self.step} from {path}", file=sys.stderr, flush=True)
            if self.step >= tc.max_steps:
                warnings.warn(f"--resume: the run is at step {self.step} and train.max_steps is {tc.max_steps}: "
                              "nothing to train (raise --max-steps to go on)", stacklevel=2)
            self.best.resume(self.step)
        main = distributed.is_main()
        if main:
            ckpt.clean_partial(self.checkpoint_dir)
            self.out.mkdir(parents=True, exist_ok=True)
            if path is None:
                self.best.start_fresh()
            else:
                self._adopt_best()
            config = absolute_paths(self.cfg.model_dump(mode="json"), self.cfg.base_dir)  # readable from anywhere
            config["output_dir"] = str(self.out.resolve())  # "-o run" and "-o /abs/run" are one run
            if resume:
                self._keep_changed_config(config)
                self._keep_finished_summary()
            (self.out / "config.yaml").write_text(dump_yaml(config, sort_keys=False))
            provenance.record(self.out, self.step, self.world)  # the code and libraries of this start
        self._since = time.perf_counter()
        wandb = self.cfg.logging.wandb
        logger = RunLogger(
            self.out, total_steps=tc.max_steps, start_step=self.step,
            tensorboard=self.cfg.logging.tensorboard, progress=self.cfg.logging.progress,
            keep_samples=self.cfg.logging.keep_last_samples,
            wandb=wandb.model_dump() if wandb.enabled else None, config=config,
        ) if main else None
        self._unlogged = None  # a finished step's metrics until they are logged
        trained = False
        signalled = None  # SIGTERM / SIGUSR1 (mmrl.core.stop): the step it came in is finished and saved
        preempted = None  # that signal, once its step is saved: the W&B run is preempted, not failed
        try:
            with SignalStop() as stop:
                if self.eval_before is None:
                    self.eval_before = self._evaluate_noted(logger, "before training", samples_tag="before")
                    if logger is not None:
                        logger.held_out(0, self.eval_before)
                self.best.check(self.eval_before)
                signalled = self._train_steps(logger, stop)
            if self.saved_step != self.step and (signalled is None or self.step > 0):
                self.save()
            trained, preempted = signalled is None, signalled
        except Exception as e:
            self._save_after_failure(e, logger, self._unlogged)
            self._ended(e)
            raise
        except KeyboardInterrupt as e:
            self._ended(e)
            raise
        finally:
            if logger is not None:
                logger.close()
                if not trained:  # stopped by an error, Ctrl-C or a signal: the W&B run says so
                    logger.finish(None, failed=preempted is None, signum=preempted)
            if isinstance(self.scheduler, PipelinedScheduler):
                self.scheduler.close()
        if signalled is not None:
            self._ended(f"stopped by {signal.Signals(signalled).name}")
            raise self._stopped(signalled)
        try:
            return self._finish(logger)
        except BaseException as e:  # the final evaluation failed, or Ctrl-C: the W&B run says so
            if logger is not None:
                logger.finish(None, failed=True)
            self._ended(e)
            raise

    def _ended(self, how: str | BaseException) -> None:
        """environment.json: how this start ended (mmrl.core.provenance.ended), from the main rank."""
        if isinstance(how, KeyboardInterrupt):
            how = "interrupted"
        elif isinstance(how, BaseException):
            how = f"error: {type(how).__name__}: {how}"
        if distributed.is_main():
            provenance.ended(self.out, how, self.step)

    def _train_steps(self, logger: RunLogger | None, stop: SignalStop) -> int | None:
        """Steps up to train.max_steps, or until a signal: then the signal's number."""
        tc = self.cfg.train
        while self.step < tc.max_steps:
            if (signum := stop.requested()) is not None:  # every rank, before each step: they stop together
                return signum
            metrics = self._unlogged = self.train_step(logger)
            self.step += 1
            evaluated = None
            if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.max_steps:
                evaluated = self._evaluate_noted(logger, f"at step {self.step}")
                metrics.update({f"eval/{k}": v for k, v in evaluated.items()})
            metrics = distributed.combine_metrics(metrics, self.method.count_metrics)  # every rank: a collective
            if logger is not None:
                logger.log(self.step, metrics)
            self._unlogged = None
            if not metrics.get("train/bad_step"):
                if tc.save_every and self.step % tc.save_every == 0:
                    self.save()
                if evaluated is not None and self._improves(evaluated):
                    self._save_best(evaluated)
        return None

    def _stopped(self, signum: int) -> StoppedBySignal:
        name, tc = signal.Signals(signum).name, self.cfg.train
        if self.step == 0:
            return StoppedBySignal(f"stopped by {name} before the first step; nothing was trained or saved (start "
                                   "the run again)", signum, 0, None)
        where = ckpt.step_dir(self.checkpoint_dir, self.step)
        return StoppedBySignal(f"stopped by {name} after step {self.step} of {tc.max_steps}; checkpoint {where} "
                               f"holds it: `{resume_command(self.out)}` goes on from there", signum, self.step, where)

    def _finish(self, logger: RunLogger | None) -> dict[str, Any]:
        """After the last step: the final evaluation, the best checkpoint, summary.json."""
        eval_after = self._evaluate_noted(logger, "after training", samples_tag="after")
        if self._improves(eval_after):  # the final step, saved above
            self._save_best(eval_after)
        checksums = (distributed.weights_checksum(self.params) if self.sharded is None
                     else [fsdp.checksum(self.params)] * self.world)  # the ranks share one model
        if logger is None:  # not the main rank
            return {"eval_before": self.eval_before, "eval_after": eval_after, "steps": self.step}
        if len(set(checksums)) > 1:  # the ranks' updates were meant to be one: something made them differ
            warnings.warn(f"the {self.world} processes end with different weights (sum |w| per rank: "
                          f"{checksums}); summary.json records them", stacklevel=3)
        logger.held_out(self.step, eval_after)
        self._ended("finished")  # before summary.json and report.html, which shows it
        summary = self.write_summary(eval_after, self.seconds(), checksums)
        logger.finish(summary)
        return summary

    def train_step(self, logger: RunLogger | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        costs = getattr(self.policy, "step_costs", None)  # a backend's own compute counters
        if costs is not None:
            costs()  # drop what evaluations and earlier work ran
        self.policy.model.eval()  # no dropout: the ratio is exactly 1 on-policy
        self.method.step = self.step
        self._update_group_size()
        if getattr(self.scheduler, "pipelined", False):
            batch, metrics = self.streamed_step()
        else:
            # where the prompts and the rollout generator stood: a run that fails in this rollout
            # (a reward atom or a tool that raises) saves its finished steps from here
            self._before_rollout = (self.generator.get_state(), self.stream.state_dict())
            with self.gathered():
                batch, metrics = self.scheduler.next_groups(self.step, self.num_generations)
            self._sharded_reference_pass(batch)
            self._before_rollout = None
            wait = time.perf_counter() - t0
            crash_point("rollout", self.step + 1)
            if batch is not None:
                batch = batch.onto(self.device)  # from a remote engine it is on the CPU
                t1 = time.perf_counter()
                self._updating = True  # weights and optimizer change: no saving from a failure in here
                metrics.update(self.update(batch))
                self._updating = False
                metrics["time/update"] = time.perf_counter() - t1
                metrics.update(_waiting(wait, metrics["time/update"]))
                metrics["time/round"] = time.perf_counter() - t0  # rollout start to train end
                metrics.setdefault("time/publish", 0.0)  # inline: the engine is the trainer's model
                metrics["rollout/staleness"] = self.step - batch.policy_version
        if costs is not None:
            metrics.update(costs())
        if batch is None:
            if not self.warned_empty:  # a filter can empty many steps: say it once, count them all
                warnings.warn(f"step {self.step + 1}: every group was dropped; no update (later such steps "
                              "are logged as train/skipped and counted in summary.json)", stacklevel=2)
                self.warned_empty = True
            metrics["train/skipped"] = 1.0
            metrics["time/step"] = time.perf_counter() - t0  # its rollouts cost time too
            return metrics
        metrics["rollout/group_size"] = self.num_generations
        metrics["time/step"] = time.perf_counter() - t0
        every = self.cfg.train.log_samples_every
        if logger is not None and every and (self.step + 1) % every == 0:
            logger.samples(self.step + 1, sample_rows(batch))
        return metrics

    def update(self, batch: RolloutBatch, epochs: int | None = None, first_epoch: int = 0) -> dict[str, float]:
        """`epochs` (default ppo_epochs) x mini_batches optimizer steps on one batch, with
        gradient accumulation; the passes are numbered from `first_epoch` (method.epoch)."""
        epochs = self.cfg.train.ppo_epochs if epochs is None else epochs
        sums: dict[str, float] = defaultdict(float)
        tally = {"updates": 0, "bad": 0, "passes": 0}
        self._passes(batch, epochs, first_epoch, sums, tally)
        return self._update_metrics(batch, sums, tally, max(1, tally["passes"]))

    def _passes(self, batch: RolloutBatch, epochs: int, first_epoch: int, sums: dict, tally: dict) -> None:
        """The optimizer steps of `update`, their metrics summed into `sums` and `tally`."""
        tc = self.cfg.train
        n = len(batch)
        for e in range(epochs):
            self.method.epoch = first_epoch + e
            order = torch.randperm(n, generator=self.generator) if tc.mini_batches > 1 else torch.arange(n)
            for mini_idx in order.tensor_split(tc.mini_batches):
                if len(mini_idx) == 0 and self.world == 1:
                    continue  # with several processes an empty share still joins the step's collectives
                tally["passes"] += 1  # the loss metrics are means over the mini-batches that ran
                mini = batch.select(mini_idx)
                denom = self.method.loss_denominator(mini)
                if denom is not None:  # the global mini-batch's normaliser (an empty share adds nothing)
                    denom = distributed.sum_scalar(denom if len(mini) else 0.0)
                self.optimizer.zero_grad(set_to_none=True)
                loss_value = 0.0
                micros = torch.arange(len(mini)).split(tc.micro_batch_size or len(mini)) if len(mini) else ()
                if self.sharded is not None:  # every rank runs the sharded forwards alike
                    self._filler_passes(batch, len(micros), denom)
                for micro_idx in micros:
                    micro = mini.select(micro_idx)
                    share = len(micro) / len(mini)
                    with update_mode(self.policy.model):  # training mode where checkpointing needs it
                        out = checked_loss(self.method, self.method.loss(self.policy, micro, micro.advantages, denom=denom))
                        # With a (global) mini-batch denominator the micro losses already sum to
                        # the mini-batch loss; without one each is its own mean and is weighted.
                        loss = out.loss if denom is not None else out.loss * share / self.world
                        loss.backward()
                    loss_value += float(loss.detach())
                    for k, v in out.metrics.items():  # a share of the global term: the ranks' mean x world is their sum
                        if not _extremum(sums, k, v):
                            sums[k] += v * self.world if denom is not None and k in DENOM_SHARES else v * share
                self._optimizer_step(loss_value, sums, tally)

    def _filler_passes(self, batch: RolloutBatch, micros: int, denom: float | None) -> None:
        """Under FSDP each forward and backward gathers and reduces weights with every rank: a
        rank with fewer micro-batches in this mini-batch (pruning, an uneven split) runs the
        difference on one of its rows with the loss times 0, adding nothing to the gradient."""
        try:
            extra = fsdp.filler_passes(micros, len(batch))
        except RuntimeError as e:  # on every rank alike
            raise TrainingError(f"{e} (a method's pruning left none)") from e
        for _ in range(extra):
            row = batch.select(torch.arange(1))
            with update_mode(self.policy.model):
                out = checked_loss(self.method, self.method.loss(self.policy, row, row.advantages, denom=denom))
                (out.loss * 0.0).backward()

    def streamed_step(self) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Pipelined: train on each group as it arrives; step the optimizer every U groups.
        A mini-batch's loss normaliser is only known once its last group is in, so each
        micro-batch backpropagates its loss sum (denom 1) and the gradients are divided
        by the mini-batch's normaliser before the step: the same update as the sync path."""
        tc = self.cfg.train
        t0 = time.perf_counter()
        rnd, publish = self.scheduler.start_round(self.step, self.num_generations)
        groups: list[RolloutBatch] = []
        sums: dict[str, float] = defaultdict(float)
        tally = {"updates": 0, "bad": 0, "passes": 0}
        acc = {"denom": 0.0, "loss": 0.0, "groups": 0, "shares": {}}
        busy, stale = 0.0, 0
        self.optimizer.zero_grad(set_to_none=True)
        self.method.epoch = 0
        for group in rnd:
            crash_point("rollout", self.step + 1)
            group = group.onto(self.device)
            t = time.perf_counter()
            stale = max(stale, self.step - group.policy_version)
            if self.reference is not None:
                with torch.no_grad():
                    self.method.annotate_reference(self.reference, group)
            self._accumulate(group, acc, sums)
            groups.append(group)
            if acc["groups"] == self.scheduler.u:
                self._finish_minibatch(acc, sums, tally)
            busy += time.perf_counter() - t
        t = time.perf_counter()
        if acc["groups"]:
            self._finish_minibatch(acc, sums, tally)
        metrics = dict(rnd.metrics)
        if not groups:
            return None, metrics
        batch = RolloutBatch.concat(groups)
        total = len(batch)
        # The streamed epoch's loss metrics are means over the round; as the sync path sums one
        # mean per mini-batch, it counts once per mini-batch it stepped on (mini_batches, or
        # fewer when fewer groups came). Later epochs need the whole round (as in sync mode);
        # one tally for all, so a bad update in any epoch marks the step bad.
        streamed = tally["passes"]
        sums = defaultdict(float, {(k.removeprefix("w:")): (v / total * streamed if k.startswith("w:") else v)
                                   for k, v in sums.items()})
        if tc.ppo_epochs > 1:
            self._passes(batch, tc.ppo_epochs - 1, 1, sums, tally)
        metrics.update(self._update_metrics(batch, sums, tally, max(1, tally["passes"])))
        busy += time.perf_counter() - t
        metrics.update(_waiting(rnd.wait_seconds, busy))
        metrics.update({"time/update": busy, "time/publish": publish, "rollout/staleness": stale,
                        "time/round": time.perf_counter() - t0,
                        "time/engine_busy": rnd.engine_busy()})
        metrics["rollout/groups"] = batch.num_groups
        metrics["rollout/samples"] = total
        return batch, metrics

    def _accumulate(self, group: RolloutBatch, acc: dict, sums: dict) -> None:
        size = self.cfg.train.micro_batch_size or len(group)
        for idx in torch.arange(len(group)).split(size):
            micro = group.select(idx)
            denom = self.method.loss_denominator(micro)
            with update_mode(self.policy.model):  # training mode where checkpointing needs it
                out = checked_loss(self.method, self.method.loss(self.policy, micro, micro.advantages,
                                                                 denom=None if denom is None else 1.0))
                loss = out.loss if denom is not None else out.loss * len(micro)  # a sum either way
                loss.backward()
            acc["denom"] += denom if denom is not None else len(micro)
            acc["loss"] += float(loss.detach())
            for k, v in out.metrics.items():
                if _extremum(sums, k, v):
                    continue
                if denom is not None and k in DENOM_SHARES:  # a sum (denom 1): normalised as the gradient is
                    acc["shares"][k] = acc["shares"].get(k, 0.0) + v
                else:
                    sums["w:" + k] += v * len(micro)  # sample-weighted; divided by the round's size
        acc["groups"] += 1

    def _finish_minibatch(self, acc: dict, sums: dict, tally: dict) -> None:
        denom = max(acc["denom"], 1e-12)
        for p in self.opt_params:
            if p.grad is not None:
                p.grad.div_(denom)
        self._optimizer_step(acc["loss"] / denom, sums, tally)
        tally["passes"] += 1
        for k, v in acc["shares"].items():
            sums[k] += v / denom  # the mini-batch's term, as the sync path sums one per mini-batch
        acc.update(denom=0.0, loss=0.0, groups=0, shares={})
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, loss_value: float, sums: dict, tally: dict) -> None:
        """Sum gradients over processes, clip, and step unless the loss or gradient is not finite."""
        if self.sharded is None:  # FSDP's backward has reduce-scattered them already
            distributed.sum_gradients(self.opt_params)
        loss_value = distributed.sum_scalar(loss_value)  # every rank decides alike
        norm = torch.nn.utils.clip_grad_norm_(self.opt_params, self.cfg.optim.max_grad_norm or float("inf"))
        grad_norm = float(fsdp.Sharded.whole(norm))  # of the whole gradient, under FSDP too
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            tally["bad"] += 1
            return
        sums["optim/lr"] += self.optimizer.param_groups[0]["lr"]  # the lr this update uses, before the schedule moves
        self.optimizer.step()
        if self.master is not None:
            self.master.push()
        crash_point("update", self.step + 1)
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update(self.opt_params)
        tally["updates"] += 1
        sums["loss/total"] += loss_value
        sums["loss/grad_norm"] += grad_norm

    def _update_metrics(self, batch: RolloutBatch, sums: dict, tally: dict, passes: int) -> dict[str, float]:
        tc = self.cfg.train
        updates, bad = tally["updates"], tally["bad"]
        metrics = {k: v / passes for k, v in sums.items() if not k.startswith("x:")}
        metrics.update({k.removeprefix("x:"): v for k, v in sums.items() if k.startswith("x:")})
        for k in ("loss/total", "loss/grad_norm"):
            metrics[k] = sums.get(k, 0.0) / updates if updates else float("nan")
        # the lr the step's updates used (their mean), not the schedule's next one (get_last_lr
        # after the step: one update late); with none, the lr a skipped update would have used
        metrics["optim/lr"] = sums["optim/lr"] / updates if updates else self.optimizer.param_groups[0]["lr"]
        metrics["train/updates"] = updates
        metrics["reward/advantage_abs"] = float(batch.advantages.abs().mean())
        metrics.update(self.method.batch_metrics(batch))
        if bad:
            self.bad_steps += 1
            metrics["train/bad_step"] = 1.0
            warnings.warn(
                f"step {self.step + 1}: {bad} update(s) had a non-finite loss or gradient and were skipped",
                stacklevel=2,
            )
            if self.bad_steps >= tc.max_bad_steps:
                raise TrainingError(
                    f"stopping: {self.bad_steps} steps in a row had a non-finite loss or gradient "
                    f"(train.max_bad_steps={tc.max_bad_steps}); the last good checkpoint is in "
                    f"{self.checkpoint_dir}"
                )
        else:
            self.bad_steps = 0
        return metrics

    def _update_group_size(self) -> None:
        """FastRL's adaptive rollout sampling: the method may set G as each data epoch begins."""
        epoch = self.stream.position // len(self.stream.prompts)
        if epoch != self.group_epoch:
            g = int(self.method.group_size(epoch, self.num_generations))
            if g < 1:
                raise TrainingError(f"method.group_size returned {g} for epoch {epoch}; a group needs >= 1 sample")
            self.num_generations, self.group_epoch = g, epoch

    def evaluate(self, samples_tag: str | None = None, rows_path: str | Path | None = None,
                 nested: bool = False) -> dict[str, float]:
        """Held-out metrics, with every training RNG set aside (so evaluating never
        changes the training trajectory, and a resumed run matches an uninterrupted one).
        With `samples_tag`, a task that has `save_samples` (image tasks) also writes its
        fixed-seed sample grid into <output>/samples/ under that tag (before / after).
        A task whose evaluate takes `progress` shows its items' progress (mmrl.core.held_out;
        `nested`: under the training bar), and one that takes `rows` has its per-item rows
        written to `rows_path` (JSONL). `eval_said` then says in a phrase how many generations
        took how long and where their rows are."""
        py_state, np_state = random.getstate(), np.random.get_state()
        evaluate, extra = self.task.evaluate, {}
        bar = EvalProgress(self.cfg.logging.progress and distributed.is_main(), nested=nested)
        if takes(evaluate, "progress"):
            extra["progress"] = bar
        if rows_path is not None and takes(evaluate, "rows"):
            extra["rows"] = rows = []
        try:
            with fork_rng(self.policy.model), torch.no_grad(), self.averaged_weights(), self.gathered():
                self.policy.model.eval()
                result = evaluate(self.policy, **extra)
                if samples_tag and distributed.is_main() and hasattr(self.task, "save_samples"):
                    self.task.save_samples(self.policy, self.out / "samples", samples_tag)
        finally:
            bar.close()
            random.setstate(py_state)
            np.random.set_state(np_state)
        here = "" if self.world == 1 else " on this rank"  # each rank counts its share
        said = f"{bar.done} generations{here}, " if bar.done else ""
        self.eval_said = f"{said}{bar.seconds:.1f} s"
        if "rows" in extra and distributed.is_main():  # every rank holds every row: the main rank writes them
            try:
                self.eval_said += f"; per-item rows in {write_rows(rows_path, rows)}"
            except OSError as e:  # a by-product: the metrics (a long evaluation's) are kept
                warnings.warn(f"the held-out evaluation's per-item rows were not written to {rows_path} "
                              f"({type(e).__name__}: {e})", stacklevel=2)
        return {k: float(v) for k, v in result.items()}

    def _evaluate_noted(self, logger: RunLogger | None, when: str, samples_tag: str | None = None) -> dict[str, float]:
        """evaluate(), said on the progress's stderr as it starts and ends: on a large model it
        takes minutes, which looked like a hang before the first step. Its per-item rows go to
        <output>/eval/step-N.jsonl (step 0: before training)."""
        if logger is not None:
            logger.note(f"held-out evaluation {when} ...")
        t0 = time.perf_counter()
        self.eval_said = None
        result = self.evaluate(samples_tag=samples_tag, rows_path=self.out / "eval" / f"step-{self.step}.jsonl",
                               nested=logger is not None)
        if logger is not None:
            took = time.perf_counter() - t0
            logger.pause(took)  # the pace of the steps is the steps' own
            logger.note(f"held-out evaluation {when}: {self.eval_said or f'{took:.1f} s'}")
        return result

    def _save_after_failure(self, error: Exception, logger: RunLogger | None, unlogged: dict | None) -> None:
        """A run stopped by an error outside the update (a reward atom or tool that raises, an
        evaluation that fails) keeps the steps it finished since the last checkpoint: they are
        saved as one, from where the failed step started (its prompts and rollout generator), so
        that --resume once the cause is fixed goes on as if it had not failed. Not where the
        weights may be half updated or half written, with several processes (the others may be
        waiting in a collective), or with pipelined rollouts (engines that ran ahead)."""
        if (self._updating or self.step == 0 or self.saved_step == self.step or self.world > 1
                or getattr(self.scheduler, "pipelined", False)
                or isinstance(error, ckpt.CheckpointError | TrainingError)):  # the trainer's own stops
            return
        if self._before_rollout is not None:
            self.generator.set_state(self._before_rollout[0])
            self.stream.load_state_dict(self._before_rollout[1])
        try:
            if unlogged is not None and logger is not None:  # an evaluation failed after the step
                logger.log(self.step, unlogged)
            path = self.save()
        except Exception as e:  # noqa: BLE001 -- the run's own error is the one raised
            warnings.warn(f"after {type(error).__name__}, the finished step {self.step} could not be saved: "
                          f"{type(e).__name__}: {e}", stacklevel=3)
            return
        where = f"in step {self.step + 1}" if unlogged is None else f"in the evaluation after step {self.step}"
        warnings.warn(f"{type(error).__name__} stopped the run {where}; the steps finished before it are saved "
                      f"as checkpoint {path}: `{resume_command(self.out)}` goes on from there", stacklevel=3)

    def _sharded_reference_pass(self, batch: RolloutBatch | None) -> None:
        """Under FSDP, the scheduler's last stage, the KL reference's pass (as SyncScheduler._prepare
        makes it), once the policy's weights are sharded again: the two are never whole at once.
        Every rank gathers the reference, with or without a batch (a collective)."""
        if self.sharded_reference is None:
            return
        with self.sharded_reference.gathered(), torch.no_grad():
            if batch is not None:
                self.method.annotate_reference(self.reference, batch)

    def gathered(self):
        """Under FSDP, a context with the whole weights in every rank's model (a collective), for
        forwards that ranks make in different numbers (rollouts, evaluation); else a no-op."""
        return self.sharded.gathered() if self.sharded is not None else contextlib.nullcontext()

    def averaged_weights(self):
        """A context with the method's averaged weights in the model (a no-op without one)."""
        return self.ema.applied(self.params) if self.ema is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path | None:
        distributed.gather_optimizer_state(self.optimizer)  # every rank, before the main one writes
        whole = self._whole_state()  # every rank (FSDP: all-gathers); None without FSDP
        # every rank's RNGs: the ranks draw from theirs as their own prompts need (an agent's
        # turns, pruned batches), so they part after the first step
        rngs = distributed.gather_objects(ckpt.rng_state({"rollout": self.generator}))
        # FSDP: the model's own weights whole while the main rank writes, as save_pretrained reads
        # their dtype (gathered after _whole_state, as FSDP's state_dict() reshards)
        with self.gathered():
            return self._write(whole, rngs)

    def _improves(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best checkpoint's. The main rank keeps the record (it writes
        the checkpoints) and decides for every rank, as saving is a collective."""
        return bool(distributed.gather_objects(self.best.improves(metrics))[0])

    def _adopt_best(self) -> None:
        """On --resume (main rank): the resumed checkpoint's evaluation, logged in metrics.jsonl,
        competes for the best (BestCheckpoint.adopt: a kill may have come between its checkpoint
        and best.json), and so do the earlier checkpoints' (where BestCheckpoint.resume dropped a
        best.json that named a step after the resumed one); a best it replaces is pruned, as in
        _save_best."""
        if not self.best.enabled:
            return
        try:
            rows = read_metrics(self.out / METRICS)
        except ValueError:  # RunLogger, next, says which line is bad
            return
        last = {r.get("step"): r for r in rows}  # each step's last row
        adopted = [self.best.adopt(n, last.get(n), d) for n, d in ckpt.list_checkpoints(self.checkpoint_dir)]
        if any(adopted):
            ckpt.prune(self.checkpoint_dir, self.cfg.train.keep_last, self.step, self.best.step)

    def _save_best(self, metrics: dict[str, float]) -> None:
        """This step's checkpoint (written now unless it is already) is the best by train.best_metric."""
        if self.saved_step != self.step:
            self.save()  # every rank: a collective
        if distributed.is_main():
            self.best.update(self.step, metrics, ckpt.step_dir(self.checkpoint_dir, self.step))
            ckpt.prune(self.checkpoint_dir, self.cfg.train.keep_last, self.step)  # the best it replaced

    def _write(self, whole: dict | None, rngs: list) -> Path | None:
        if not distributed.is_main():  # the main rank writes what every rank holds
            self.saved_step = self.step
            return None
        params = whole["params"] if whole else self.params
        if not all(bool(torch.isfinite(p).all()) for p in params):
            raise TrainingError(f"step {self.step}: the weights are not finite; no checkpoint was written")
        opt_tensors, opt_meta = ckpt.optimizer_state(self.optimizer, whole and whole["optimizer"])
        rng_tensors, rng_meta = ckpt.ranks_rng_state(rngs)
        state = {
            "step": self.step,
            "bad_steps": self.bad_steps,
            "eval_before": self.eval_before,
            "seconds": self.seconds(),
            "optimizer": opt_meta,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": rng_meta,
            "data": self.stream.state_dict(),
            "group_size": {"num_generations": self.num_generations, "epoch": self.group_epoch,
                           "configured": self.cfg.rollout.num_generations},
            "method": self.method.state_dict(),
            "config": self.cfg.model_dump(mode="json"),
        }
        tensors = {**opt_tensors, **rng_tensors, **(self.master.state_dict() if self.master is not None else {})}
        write_model = self.policy.save_pretrained
        if whole:  # the float32 weights, as master weights are saved; model/ from the whole state
            tensors.update({f"master.{i}": p for i, p in enumerate(params)})

            def write_model(path):
                with self.sharded.writable(whole["model"]):
                    self.policy.save_pretrained(path)
        if self.ema is not None:  # model/ holds the average; the raw weights go here, for --resume
            ema_tensors, state["ema"] = self.ema.state_dict()
            tensors.update(ema_tensors)
            tensors.update({f"weights.{i}": p for i, p in enumerate(self.params)})

            def write_model(path):
                with self.averaged_weights():
                    self.policy.save_pretrained(path)

        path = ckpt.save_checkpoint(
            self.checkpoint_dir, self.step, write_model, tensors, state, keep_last=self.cfg.train.keep_last,
            spare=self.best.step,
        )
        self.saved_step = self.step
        return path

    def _whole_state(self) -> dict | None:
        """Under FSDP, what a checkpoint holds, gathered whole (every rank calls; the main rank
        keeps it): the model's state_dict, the float32 trainable weights, AdamW's state."""
        if self.sharded is None:
            return None
        keep = distributed.is_main()
        gathered = self.sharded.whole_state(self.params, keep)
        optimizer = self.sharded.optimizer_state(self.optimizer, keep)
        return {"model": gathered[0], "params": gathered[1], "optimizer": optimizer} if keep else None

    def _load_sharded(self, path: Path, tensors: dict) -> None:
        """Under FSDP: each rank takes its shard of the float32 weights a checkpoint holds."""
        whole = [tensors.get(f"master.{i}") for i in range(len(self.params))]
        if any(t is None or t.shape != p.shape for t, p in zip(whole, self.params)):
            raise TrainingError(f"--resume: {path} holds no float32 copy of each trainable weight (it was saved "
                                "without optim.fsdp, and in float32): resume it with optim.fsdp=false")
        self.sharded.load_params(self.params, whole)

    def load(self, path: Path) -> None:
        try:
            tensors, state = ckpt.load_checkpoint(path)
            missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
            if missing:  # a file edited or replaced by hand: _write always writes each
                raise ckpt.CheckpointError(f"checkpoint {path} is unreadable: its {ckpt.STATE_JSON} lacks "
                                           f"{', '.join(missing)}")
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(f"{e}{_older_checkpoint_note(path)}") from e
        # The KL reference stays as built in __init__: the starting weights, not the checkpoint's.
        if self.sharded is not None:
            self._load_sharded(path, tensors)
        else:
            # model/ deleted or cut short by hand (a crash never leaves such a checkpoint listed)
            def damaged(what: str) -> ckpt.CheckpointError:
                return ckpt.CheckpointError(f"checkpoint {path} is damaged: its model/ {what}{_older_checkpoint_note(path)}")

            if not (path / "model").is_dir():  # from_pretrained would take the path for a hub name
                raise damaged("is missing")
            try:
                self.policy.load_weights(path / "model")
            except (OSError, SafetensorError, ckpt.UnreadableError) as e:
                raise damaged(f"does not load ({type(e).__name__}: {e})") from e
            except (ConfigError, ckpt.CheckpointError) as e:  # weights of another shape: perhaps an older mmrl's run
                note = bundled_model_note(self.cfg.model.path, path / "model", resume=True)
                raise type(e)(f"--resume: {e}{note}") from e
        self._load_averaged(path, tensors, state)
        if self.master is not None:  # the float32 copies as saved; else the loaded weights
            self.master.pull()
            self.master.load_state_dict(tensors)
        optimizer_state = ckpt.optimizer_state_dict(tensors, state["optimizer"])
        if self.sharded is not None:  # whole moments in the checkpoint: each rank takes its shard
            self.sharded.load_optimizer_state(self.optimizer, self.params, optimizer_state)
        else:
            self.optimizer.load_state_dict(optimizer_state)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._apply_optim_config()
        rng, rng_meta, own = ckpt.rank_rng_state(tensors, state["rng"], distributed.rank(), self.world)
        ckpt.load_rng_state(rng, rng_meta, {"rollout": self.generator} if own else {})
        self.stream.load_state_dict(state["data"])
        if "group_size" in state:
            g = state["group_size"]
            # the saved G is the method's (FastRL's ARS) where it set one; else the config's, now this one's
            if g["num_generations"] != g.get("configured"):  # set by the method, or saved before "configured"
                self.num_generations = g["num_generations"]
            self.group_epoch = g["epoch"]
        self.method.load_state_dict(state.get("method", {}))
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        self.eval_before = state["eval_before"]
        self.seconds_before = float(state.get("seconds", 0.0))  # none in a checkpoint before 2026-12-07
        self.saved_step = self.step
        self._loaded_config = state.get("config")  # what trained up to here, for --resume's comparison

    def _apply_optim_config(self) -> None:
        """The loaded optimizer and schedule state carry the run's earlier lr, weight decay,
        betas and eps: a resume with other values (which --resume warns of, and records in
        config.yaml) trains with the new ones, at the schedule's current step. With the same
        values this changes nothing."""
        oc, groups = self.cfg.optim, self.optimizer.param_groups
        saved_lr, saved_base = self.lr_scheduler.get_last_lr()[0], self.lr_scheduler.base_lrs[0]
        lr = oc.lr * self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)  # as LambdaLR computes it
        if oc.lr == saved_base and not math.isclose(lr, saved_lr, rel_tol=1e-9, abs_tol=1e-15):
            # A new optim.lr is said with the other changed settings; a new train.max_steps (which that
            # comparison leaves out: extending a run) stretches a decaying schedule, and the lr jumps.
            warnings.warn(f"--resume at optimizer step {self.lr_scheduler.last_epoch}: the learning rate goes from "
                          f"{saved_lr:.4g} (the checkpoint's schedule) to {lr:.4g}, as the {oc.schedule} schedule now "
                          f"spans {self.updates} optimizer steps (train.max_steps x ppo_epochs x mini_batches)",
                          stacklevel=3)
        for group in groups:
            group.update(lr=lr, weight_decay=oc.weight_decay, betas=tuple(oc.betas), eps=oc.eps, initial_lr=oc.lr)
        self.lr_scheduler.base_lrs = [oc.lr] * len(groups)
        self.lr_scheduler._last_lr = [lr] * len(groups)

    def _load_averaged(self, path: Path, tensors: dict, state: dict) -> None:
        """After an averaged run's model/ (the average) is loaded: the raw weights and the average."""
        if "ema" not in state:
            if self.ema is not None:
                raise TrainingError(f"--resume: {path} was saved without averaged weights, but the method "
                                    "keeps them (e.g. method.ema); resume with the run's own config")
            return
        raw = [tensors.get(f"weights.{i}") for i in range(len(self.params))]
        if any(r is None or r.shape != p.shape for r, p in zip(raw, self.params)):
            raise TrainingError(f"--resume: the raw weights saved in {path} do not fit the model's "
                                f"{len(self.params)} trainable parameters")
        with torch.no_grad():
            for p, r in zip(self.params, raw):
                p.copy_(r)
        if self.ema is not None:
            try:
                self.ema.load_state_dict(tensors, state["ema"])
            except ValueError as e:
                raise TrainingError(f"--resume: {path}: {e}") from e

    # ------------------------------------------------------------------ outputs

    def write_summary(self, eval_after: dict[str, float], seconds: float,
                      checksums: list[float] | None = None) -> dict[str, Any]:
        # read once, for summary.json, reward_curve.png and report.html alike: a parse of a
        # 100,000-step metrics.jsonl takes seconds
        rows = read_metrics(self.out / METRICS)
        starts = self._starts()
        summary = {
            # a metric without data (NaN: no held-out item had it) is null, as `eval` prints it: NaN is not JSON
            "eval_before": nulled(self.eval_before),
            "eval_after": nulled(eval_after),
            "steps": self.step,
            "steps_without_update": sum(1 for r in rows if r.get("train/skipped")),
            "checkpoint": str(ckpt.step_dir(self.checkpoint_dir, self.step) / "model"),
            "final_metrics": nulled(rows[-1]) if rows else {},  # its "nan" texts null, as eval_* hold them
            "train_seconds": seconds,  # over every start (self.seconds), evaluations and saves included
            # every step's own time (time/step), over all the starts of a resumed run
            "step_seconds": sum(r["time/step"] for r in rows if isinstance(r.get("time/step"), int | float)),
            "started": starts[0].get("started") if starts else None,  # the run's first start (UTC)
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "starts": len(starts),  # 1, plus each --resume (environment.json has each one's command and versions)
            # the start that finished it; under torchrun, the launcher's line (the workers' lacks it)
            "command": _command_line(starts[-1].get("launcher") or starts[-1].get("command")) if starts else None,
            "processes": self.world,
            "weights_checksums": checksums,
            "best": self.best.record,
            "config": self.cfg.model_dump(mode="json"),
        }
        write_atomically(self.out / "summary.json", json.dumps(summary, indent=2, default=str))
        plot_reward_curve(self.out / METRICS, self.out / CURVE, rows=rows)
        try:  # the one-page report; a finished run must not fail on it
            from mmrl.demo.report import write_report

            write_report(self.out, rows)
        except Exception as e:  # noqa: BLE001 -- reported, the summary and weights are already written
            warnings.warn(f"{self.out}: report.html not written: {type(e).__name__}: {e}", stacklevel=2)
        return summary


def _extremum(sums: dict, key: str, value: float) -> bool:
    """A minimum or maximum metric (loss/ratio_min, loss/ratio_max) is the step's extreme over
    its micro-batches, mini-batches and epochs, as distributed.combine_metrics takes it over the
    ranks, kept in `sums` as "x:<key>"; a mean of the micro-batches' extremes moved with
    train.micro_batch_size. False for any other metric."""
    pick = distributed.extreme(key)
    if pick is None:
        return False
    slot = "x:" + key
    sums[slot] = value if slot not in sums else pick(sums[slot], value)
    return True


def _command_line(argv: Any) -> str | None:
    """environment.json's command as one line to paste into a shell; `python -m dllm_rl` ran
    it where argv[0] is the package's __main__.py (a path that runs nothing as typed)."""
    if not isinstance(argv, list) or not argv:
        return None
    argv = [str(a) for a in argv]
    if len(argv) > 1 and Path(argv[0]).name.startswith("python") and Path(argv[1]).name in ("torchrun", "accelerate"):
        argv = argv[1:]  # a launcher's script run by the interpreter: as it was typed
    first = Path(argv[0])
    head = ["python", "-m", first.parent.name] if first.name == "__main__.py" else [argv[0]]
    return shlex.join(head + argv[1:])


def config_changes(before: dict, after: dict, prefix: str = "", default=None) -> list[str]:
    """Dotted keys whose values differ between two config dumps, "key: old -> new". With
    `default(key)` (the setting's default, as in a config dump), a key that `before` lacks (a
    setting added since that config was written) counts only where `after` sets it otherwise."""
    out = []
    for k in sorted(set(before) | set(after)):
        a, b = before.get(k), after.get(k)
        if k not in before and default is not None:
            if isinstance(b, dict):
                out += config_changes({}, b, f"{prefix}{k}.", default)
                continue
            if b == default(f"{prefix}{k}"):
                continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.", default)
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def read_reused_run(out: str | Path, cfg: TrainConfig) -> tuple[dict, list[dict]] | None:
    """read_finished_run(out) for a benchmark's --reuse, checked against the config it would
    train with now: a run made with other settings (seed, steps, model, a --set) is a
    ValueError naming them, not a row tabled beside runs it does not compare with. The output
    directory and logging settings are not compared; a setting added since the run counts only
    where this config sets it otherwise than its default."""
    done = read_finished_run(out)
    if done is None or "config" not in done[0]:
        return done
    now = cfg.model_dump(mode="json")
    then = {k: v for k, v in done[0]["config"].items() if k not in ("output_dir", "logging")}
    changes = config_changes(then, {k: v for k, v in now.items() if k not in ("output_dir", "logging")},
                             default=lambda key: field_default(cfg, key))
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise ValueError(f"--reuse: {out} was made with other settings: {'; '.join(changes[:3])}{more}; "
                         "remove it to train it again, or give the settings it was made with")
    return done


def field_default(cfg, key: str):
    """The default of a dotted config key, as a config dump writes it (a unique object where
    the key names no field with a default)."""
    from pydantic import BaseModel, TypeAdapter

    obj, *path, name = [cfg, *key.split(".")]
    for part in path:
        obj = getattr(obj, part, None)
    field = type(obj).model_fields.get(name) if isinstance(obj, BaseModel) else None
    if field is None or field.is_required():
        return object()
    return TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")


def _waiting(wait: float, busy: float) -> dict[str, float]:
    """The trainer's time in a step: waiting for rollouts vs training (RolloutPipe's waiting ratio)."""
    return {"time/trainer_wait": wait, "time/trainer_busy": busy,
            "time/waiting_ratio": wait / (wait + busy) if wait + busy > 0 else 0.0}


def _check_data_parallel(cfg: TrainConfig, world: int) -> None:
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be a multiple "
                          f"of the number of processes ({world})")


# Held-out evaluation logs each atom's mean under the atom's bare name, beside metrics of its
# own: a config atom named like one of them would overwrite it in the eval log. A task names
# its metrics (`metric_names`, `metric_prefixes`); these are for a task that does not.
EVAL_METRIC_NAMES = ("reward", "accuracy")
EVAL_METRIC_PREFIXES = ()


def combined_reward(task_reward: Reward, cfg: TrainConfig, metric_names: Sequence[str] = EVAL_METRIC_NAMES,
                    metric_prefixes: Sequence[str] = EVAL_METRIC_PREFIXES) -> Reward:
    """The task's atoms plus the config's extra atoms (and DAPO's "overlong" atom with
    reward.overlong), under the config's error policy. A config atom may not take the name of
    one of the task's evaluation metrics."""
    rc = cfg.reward
    atoms = list(task_reward.atoms)
    if rc.atoms:
        try:
            # a reward model's defaults: the policy's device and dtype (TRL loads one with the policy's
            # init kwargs; a float32 one beside a bfloat16 policy held twice the memory it needs)
            extra = load_atoms(rc.atoms, base_dir=cfg.base_dir, device=cfg.model.device, dtype=cfg.model.dtype)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"reward.atoms: {e}") from e
        task_names = [a.name for a in atoms]
        for a in extra:
            if a.name in task_names:  # Reward() would only say "duplicate name"
                raise ConfigError(f"reward.atoms: atom name {a.name!r} is taken by one of the task's atoms "
                                  f"({', '.join(task_names)}); give the spec another 'name'")
            if a.name in metric_names or a.name.startswith(tuple(metric_prefixes)):
                raise ConfigError(f"reward.atoms: atom name {a.name!r} is taken by an evaluation metric "
                                  f"(held-out evaluation logs each atom's mean under its name); rename the atom")
        atoms += extra
    if rc.overlong is not None:
        ol = rc.overlong
        atoms.append(overlong_atom(ol.max_len or cfg.rollout.max_new_tokens, ol.buffer, ol.penalty))
    try:
        return Reward(atoms, on_error=rc.on_error, timeout=rc.timeout, max_stuck=rc.max_stuck)
    except ValueError as e:  # e.g. a config atom named like a task atom
        raise ConfigError(f"reward.atoms: {e}") from e


def check_weights(reward: Reward) -> None:
    """Training needs an atom that weighs: with every weight 0 the total is 0 for every sample, so
    every advantage is 0 and a run would spend its compute learning nothing (as with one sample
    per group). Evaluation and `sample` may still report such atoms' values."""
    if not any(a.weight for a in reward.atoms):
        raise ConfigError(f"every reward atom has weight 0 ({', '.join(reward.names)}): the reward's total is 0 for "
                          "every sample, so every advantage is 0 and nothing is learnt; give at least one atom a "
                          "nonzero weight (reward.atoms' weight; the image backend's task.atom_weights)")


def with_config_atoms(task, cfg: TrainConfig) -> Reward:
    """The run's reward (combined_reward), made the task's too, so that held-out evaluation and
    `sample` score what training scores. The task's own reward is kept as `task.base_reward`,
    so a second trainer on the same task adds the config's atoms once. A task.reward set since
    (from Python, between two trainers: `task.reward = Reward([...])`) is the new base; it was
    dropped without a word for the earlier base."""
    base = task.reward
    if getattr(task, "base_reward", None) is not None and task.reward is getattr(task, "run_reward", None):
        base = task.base_reward  # the reward an earlier trainer made: start again from the task's own
    reward = combined_reward(base, cfg, getattr(task, "metric_names", EVAL_METRIC_NAMES),
                             getattr(task, "metric_prefixes", EVAL_METRIC_PREFIXES))
    task.base_reward, task.reward, task.run_reward = base, reward, reward
    return reward


def sample_rows(batch: RolloutBatch) -> list[dict[str, Any]]:
    """One row per sample for a sample table: prompt, completion, atoms, total, advantage."""
    atoms = batch.scores.per_sample() if batch.scores is not None else [{}] * len(batch)
    totals = batch.scores.totals() if batch.scores is not None else [None] * len(batch)
    adv = batch.advantages
    rows = []
    for i, s in enumerate(batch.samples):
        rows.append({
            "group": int(batch.group_ids[i]),
            "prompt": _show(s.prompt),
            "completion": _show(s.completion),
            "reward": totals[i],
            "atoms": atoms[i],
            "advantage": None if adv is None else float(adv[i].float().mean()),
        })
    return rows


def _show(x: Any) -> Any:
    if isinstance(x, (str, int, float)) or x is None:
        return x
    if torch.is_tensor(x):  # before the image test: a tensor has .size and .mode methods too
        return x.tolist() if x.numel() <= 512 else f"<tensor {tuple(x.shape)}>"
    if hasattr(x, "size") and hasattr(x, "mode"):  # a PIL image
        return f"<image {x.size[0]}x{x.size[1]} {x.mode}>"
    text = repr(x)
    return text if len(text) <= 2000 else text[:2000] + "..."
