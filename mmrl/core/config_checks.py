"""What `train` refuses of a config as a whole (check_config), and where its rollouts run
(placement): apart from mmrl.core.pipeline, which imports torch, so that `config` checks a
config in a second, not after torch's import (tests/test_cli_imports.py). The pipeline
re-exports both."""

from __future__ import annotations

from mmrl.core.config import ConfigError, TrainConfig


def check_config(cfg: TrainConfig, world: int, training: bool = True) -> None:
    sc, tc = cfg.rollout.scheduler, cfg.train
    if training and cfg.rollout.num_generations < 2:  # a valid rollout setting (SFT and sampling use it), not a training one
        raise ConfigError("rollout.num_generations must be at least 2 to train: every method compares a sample "
                          "with the others of its group (advantages, FTFC's tilt), so with one sample per group "
                          "every advantage is 0 and nothing is learnt from the reward")
    if cfg.rollout.engine != "hf" and placement(cfg) == "inline":
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r} runs as a worker: "
                          "rollout.scheduler.placement cannot be inline")
    if sc.mode == "pipelined":
        if placement(cfg) == "inline":
            raise ConfigError("rollout.scheduler.placement=inline cannot pipeline: the engine must run beside "
                              "the trainer (thread, process or remote)")
        if cfg.rollout.prompts_per_step % tc.mini_batches:
            raise ConfigError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be a multiple of "
                              f"train.mini_batches ({tc.mini_batches}) in pipelined mode (whole groups per step)")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.num_generations // max(1, world)  # a process's, a step
    if training and sc.mode == "sync" and tc.mini_batches > samples:
        # the empty mini-batches are skipped: fewer optimizer steps than the lr schedule counts
        raise ConfigError(f"train.mini_batches ({tc.mini_batches}) is more than the samples each process trains on "
                          f"in a step (rollout.prompts_per_step x num_generations"
                          f"{f' / {world} processes' if world > 1 else ''} = {samples}): the rest would be empty "
                          f"and skipped, and the learning-rate schedule would count optimizer steps that never "
                          f"come; set train.mini_batches to at most {samples}")
    adv = getattr(cfg.method, "advantage", None)
    whole_round = ("method.advantage.scale=batch" if getattr(adv, "scale", None) == "batch" else
                   "method.adv_std=global" if getattr(cfg.method, "adv_std", None) == "global" else None)
    if whole_round and placement(cfg) != "inline":
        # engines beside the trainer complete groups one at a time, so each is normalised alone
        raise ConfigError(f"{whole_round} needs the whole round at once: it runs with the inline "
                          f"scheduler only (here rollout.scheduler.placement is {placement(cfg)!r}; use "
                          "rollout.scheduler.mode=sync with placement inline and engine hf)")
    if placement(cfg) == "remote" and not sc.servers:
        raise ConfigError("rollout.scheduler.placement=remote needs rollout.scheduler.servers (a list of URLs)")
    if placement(cfg) == "remote":
        # A server holds the weights of the one engine that publishes to it: a second engine on it
        # would get 409s (its weights replaced by the other's) and be dropped mid-round.
        seen: dict[str, int] = {}
        for i, url in enumerate(sc.servers):
            key = url.removeprefix("vllm+").rstrip("/")
            if key in seen:
                raise ConfigError(f"rollout.scheduler.servers[{i}] is {url!r} again (as servers[{seen[key]}]): a "
                                  "server serves one engine; start one server per engine, or list it once")
            seen[key] = i
    if placement(cfg) != "inline" and world > 1:
        raise ConfigError("rollout.scheduler.placement other than inline with several trainer processes "
                          "is not supported yet")


def placement(cfg: TrainConfig) -> str:
    sc = cfg.rollout.scheduler
    if sc.placement != "auto":
        return sc.placement
    # An engine other than the policy's own generate always runs as a worker.
    return "thread" if sc.mode == "pipelined" or cfg.rollout.engine != "hf" else "inline"
