"""The command line shared by the three modalities: `train`, `eval`, `sample`, `serve`, `export`, `config`, `runs`.

Each entry point (mmrl, diffusion-rl, dllm-rl) is `make_app(spec)` with its
modality's `BackendSpec`. A backend is a module exposing
    CONFIG_CLASS     its TrainConfig subclass
    DEFAULT_CONFIG   the embedded default run (a dict, merged under --config)
    build(cfg)       -> (policy, task), the protocols of mmrl.core.protocols
and optionally `sample(cfg, policy, prompts, n) -> list[dict]` and `build_policy(cfg) -> policy`
(the policy without the task, for `export`: a run exported where its data files are not). User errors
(bad config, missing file, nothing to resume) print one paragraph and exit
non-zero; only bugs show a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import shlex
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from typer.core import TyperGroup

# Only modules that import no torch (nor transformers, diffusers) here: importing torch took
# seconds of the 4 that `--help`, `runs` and a mistyped flag made a user wait. Those that do
# (distributed, plugins, checkpoint, engine, rewards, serve, stop, trainer, the backends) are
# imported in the functions that use them (tests/test_cli_imports.py).
from mmrl.core.best import BEST, read_record
from mmrl.core.config import (
    ConfigError,
    TrainConfig,
    deep_merge,
    load_config,
    parse_override,
    read_config_file,
)
from mmrl.core.jsonl import HeldOutWarning
from mmrl.core.logging import nulled, quiet_library_bars, survive_reader_gone
from mmrl.core.runconfig import (
    RUN_CONFIG,
    bundled_model_note,
    code_named,
    read_run_config,
    resolve_config_file,
    run_dir_of,
)

err_console = Console(stderr=True)
console = Console()

MAX_SAMPLES = 1 << 16  # mmrl.core.serve.MAX_SAMPLES, serve --max-samples' default (tests/test_cli_imports.py)
MAX_CONNECTIONS = 32  # mmrl.core.serve.MAX_CONNECTIONS, serve --max-connections' default (tests/test_serve_limits.py)
# A line that names paths: never broken (a console 40 columns wide, or 80 in a log file, broke
# checkpoints/step-0000000 / 3/model across lines, which a copy or grep then missed); PLAIN also
# prints a "[" in a path or message as it is, not as rich markup.
LINE = {"highlight": False, "soft_wrap": True}
PLAIN = {**LINE, "markup": False}


@dataclass
class BackendSpec:
    modality: str  # "vlm", "diffusion", "dllm": the configs/ subdirectory
    title: str  # for help texts
    command: str  # the console script
    module: str  # the backend module, imported only when a verb runs
    # `sample --help`: which samples carry their reward atoms
    scored_prompts: str = "Held-out items, and --prompt prompts in the task's own format, carry their reward atoms."
    # a module with the backend's CONFIG_CLASS, DEFAULT_CONFIG (and EVAL_DEFAULTS) and no model
    # code: what `config` imports instead of `module` (torch and transformers took seconds of it)
    settings: str | None = None


class BackendUnavailable(RuntimeError):
    pass


def load_backend(spec: BackendSpec, settings_only: bool = False):
    """The backend module; with `settings_only`, its settings module where it names one."""
    module = spec.settings if settings_only and spec.settings else spec.module
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise BackendUnavailable(
                f"the {spec.title} backend ({module}) is not available yet in this version of mmrl"
            ) from None
        raise


def fail(message: str, code: int = 2) -> None:
    # escape: a message quoting a key like "images[0]" or "[red]" must not be read as rich markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class OnceGroup(TyperGroup):
    """The verbs' group, which refuses an option of one value given twice (`-c a.yaml -c b.yaml`,
    `-o a -o b`): click keeps the last without a word, so a run read one config file of two."""

    def parse_args(self, ctx, args):
        verb = next((a for a in args if not a.startswith("-")), None)  # the group takes no values
        cmd = self.get_command(ctx, verb) if verb is not None else None
        if cmd is not None:
            refuse_repeated_options(cmd, args[args.index(verb) + 1:])
        return super().parse_args(ctx, args)


def refuse_repeated_options(cmd, args: list[str]) -> None:
    options = [p for p in cmd.params if p.param_type_name == "option"]  # typer's own click or click's
    takes_value = {o for p in options if not p.is_flag for o in p.opts}
    once = {o: p for p in options if not (p.is_flag or p.multiple) for o in p.opts}
    given: dict[str, list[str]] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
        if name in takes_value and not eq:
            value = next(tokens, "")  # an option's value is not an option, even "-o" after --prompt
        if name in once:
            given.setdefault(name if len(once[name].opts) == 1 else "/".join(once[name].opts), []).append(value)
    for name, values in given.items():
        if len(values) > 1:
            hint = " (one config file a run: put the other's keys in it, or give them with --set)" \
                if "--config" in name else ""
            fail(f"{name} given {len(values)} times ({', '.join(values)}): it takes one value, and the command line "
                 f"would keep the last without a word; give it once{hint}")


def make_app(spec: BackendSpec) -> typer.Typer:
    app = typer.Typer(
        cls=OnceGroup,
        name=spec.command,
        help=f"RL fine-tuning of {spec.title} models with mmrl. "
        f"Runnable configs: configs/{spec.modality}/*.yaml; with no --config, `train` runs the "
        "embedded default (the bundled tiny model on its synthetic task, on a CPU, in minutes).",
        add_completion=False,
        no_args_is_help=True,
        rich_markup_mode="markdown",  # docstrings reflow: a single newline is not a line break
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    def build_config(config: Path | None, overrides: list[str], backend, verb: str = "train",
                     run: Path | None = None) -> TrainConfig:
        """defaults <- the run's config.yaml (mmrl.core.runconfig) <- the verb's defaults <- --config <- --set."""
        from mmrl.core import plugins

        cls = getattr(backend, "CONFIG_CLASS", TrainConfig)
        defaults = dict(getattr(backend, "DEFAULT_CONFIG", {}))
        defaults.setdefault("output_dir", f"runs/{spec.modality}-default")
        ran = read_run_config(run) if run is not None else {}
        if run is not None:
            defaults = deep_merge(defaults, {**ran, "output_dir": str(run)})  # where it is now
            code = code_named(ran)
            if code and verb in ("eval", "sample", "serve", "export"):  # perhaps someone else's run
                # said before it runs (as trust_remote_code is): a run's config.yaml is code, as a config file is
                err_console.print(f"notice: {run / RUN_CONFIG} names Python code that runs now: {'; '.join(code)} "
                                  f"(to load its weights alone, copy the checkpoint's model/ folder out of the run "
                                  f"and pass that)", **PLAIN)
        if verb == "eval":  # under the config file and --set: e.g. dllm's pass@k samples
            # but not over a run's own setting: a run that trained with eval_samples 4 logged pass@1..4
            # from 4 samples, which `eval --checkpoint RUN` then redrew from 16 (other numbers)
            defaults = deep_merge(defaults, _unset_in(getattr(backend, "EVAL_DEFAULTS", {}), ran))
        if config is not None:  # configs/<modality>/... from the repository where the working directory has none
            config = resolve_config_file(config)
        if backend is not None:  # a plugin's own method (and config class) before anything is validated
            cls = plugins.config_class(cls, config, overrides, defaults)
        try:
            # a config that fails says why, not which of its settings would have been ignored (a
            # VLM config given to dllm-rl warned of max_new_tokens before naming the right command)
            with warnings.catch_warnings(record=True) as said:
                cfg = load_config(cls, config, overrides, defaults=defaults)
            for w in said:  # it loads: what it said, as it said it
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            cfg.plugins = plugins.absolute(cfg.plugins, cfg.base_dir)  # e.g. for a process engine elsewhere
            return cfg
        except ConfigError as e:
            # a method of another modality (a run's, a config file's, a --set) fails on every key
            # that differs: name the command it is for instead
            what, method = method_given(run, config, overrides)
            if isinstance(method, str) and not method_fits(cls, method):
                other = command_of_method(method, spec.command)
                if other is not None:
                    raise ConfigError(f"{what}, a `{other}` method, not one of `{spec.command}`'s: run it with "
                                      f"`{other} {verb}` ({str(e).split('; ')[0]})") from None
                if what.startswith("the run"):  # not a misspelling of the user's: a plugin's, or another modality's
                    raise ConfigError(f"{what}, which is not one of `{spec.command}`'s: a run of another modality? "
                                      f"({str(e).split('; ')[0]})") from None
            if run is None:
                raise
            raise ConfigError(f"{e} (the run's settings come from {run / RUN_CONFIG})") from None

    def run_verb(fn, interrupted=lambda: "interrupted"):
        try:
            return fn()
        except KeyboardInterrupt:  # here: click's own handler would exit 130 without a word
            err_console.print(interrupted(), **PLAIN)
            raise typer.Exit(130) from None
        except BackendUnavailable as e:
            fail(str(e) + ".", code=3)
        except (ConfigError, FileNotFoundError) as e:  # first: the clauses below import torch (`runs /typo`)
            fail(str(e))
        except _stopped_by_signal() as e:  # a scheduler's SIGTERM / SIGUSR1: the finished steps are saved
            err_console.print(escape(str(e)), highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except user_errors() as e:
            fail(str(e))
        except _runtime_errors() as e:
            fail(str(e), code=1)

    def output_dir_of(config, overrides, backend, verb: str = "train") -> Path:
        """Where the run is, from --config and -o / --set output_dir= alone: the other overrides
        may name keys only the run's own config.yaml has (its method's variant, a plugin's)."""
        where = [o for o in overrides if o.partition("=")[0].strip() == "output_dir"]
        return Path(build_config(config, where, backend, verb).output_dir)

    def get_backend(config, overrides, verb: str = "train", checkpoint: Path | None = None, resume: bool = False,
                    builds: bool = True):
        """Validate the config even before the backend exists, so config errors show first.
        With --resume, or a --checkpoint inside a run, the run's config.yaml is the base. `builds`:
        the verb loads the model next (not `config`, which needs the backend's settings alone),
        whose libraries' bars are then set."""
        try:
            backend = load_backend(spec, settings_only=not builds)
        except BackendUnavailable:
            build_config(config, overrides, None)
            raise
        cfg = failed = None
        try:
            cfg = build_config(config, overrides, backend, verb)
        except ConfigError as e:
            if not resume and checkpoint is None:
                raise
            failed = e  # an override may name a key of the run's own method or task (its config.yaml below)
        out = cfg.output_dir if cfg is not None else output_dir_of(config, overrides, backend, verb)
        run = None
        if resume and (Path(out) / RUN_CONFIG).is_file():
            run = Path(out)
        elif checkpoint is not None and (found := best_alias(checkpoint)).exists():
            run = run_dir_of(found)
        if run is None and failed is not None:  # no run to take keys from: the default config's error stands
            raise failed
        if run is not None:
            from mmrl.core.launch import launched_main

            if checkpoint is not None and launched_main():  # once, not once per rank
                err_console.print(f"settings: the run's {run / RUN_CONFIG} (--config and --set override them)",
                                  **PLAIN)
            cfg = build_config(config, overrides, backend, verb, run)  # a run of another modality is refused here
        if checkpoint is not None:  # a wrong one named now, not after building the model (minutes for a large one)
            if verb == "train":  # `config --checkpoint`: only its settings are read
                if not best_alias(checkpoint).exists():
                    raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
            else:
                resolve_checkpoint(checkpoint)
        if builds:  # importing transformers (and diffusers) to do so costs `config` seconds otherwise
            quiet_library_bars(cfg.logging.progress, diffusers=spec.modality == "diffusion")
        return backend, cfg

    @app.command()
    def train(
        config: Path | None = typer.Option(None, "--config", "-c", help=(
            f"YAML config, e.g. `configs/{spec.modality}/<method>.yaml` (from the repository where the working "
            "directory has none); default: the embedded default run.")),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key: --set optim.lr=1e-5 (repeatable)."),
        # defaults are the config's (the embedded default's where no --config sets them): named, not shown
        max_steps: int | None = typer.Option(None, "--max-steps", help=(
            f"Training steps (train.max_steps); default: the config's (`{spec.command} config -k train` shows it).")),
        seed: int | None = typer.Option(None, "--seed", help="Seed of every RNG of the run; default: the config's "
                                        "seed, 0 unless it sets one."),
        # a str, not a Path: typer reads -o "" (an unset $OUT) as Path("."), the working directory
        output_dir: str | None = typer.Option(None, "--output-dir", "-o", metavar="DIR", help=(
            f"Where the run writes; default: the config's output_dir, else runs/{spec.modality}-default.")),
        save_every: int | None = typer.Option(None, "--save-every", help=(
            "Checkpoint every N steps (train.save_every); default: the config's, 0 unless it sets one: only the "
            "final step is saved, so an interrupted run has nothing to resume.")),
        resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint in the output directory."),
        auto_resume: bool = typer.Option(False, "--auto-resume", help=(
            "Continue as --resume where the output directory holds a complete checkpoint, else start afresh: "
            "one command for a job a cluster scheduler may requeue (its SIGTERM saves the step in progress).")),
    ):
        """Train: rollout -> reward -> advantage -> update; writes summary.json, metrics.jsonl,
        sample tables, reward_curve.png, report.html, environment.json, TensorBoard events and
        checkpoints into the output directory."""
        if output_dir is not None and not output_dir.strip():
            fail("--output-dir is empty: give a directory for the run (was the variable it names unset?)")
        overrides = list(set_) + _flag_overrides(
            {"train.max_steps": max_steps, "seed": seed, "output_dir": output_dir and Path(output_dir),
             "train.save_every": save_every}
        )

        started: list[TrainConfig] = []  # the run's config, once read: what Ctrl-C leaves depends on it

        def go():
            from mmrl.core import distributed
            from mmrl.core.checkpoint import latest_checkpoint
            from mmrl.core.pipeline import check_config
            from mmrl.core.trainer import Trainer, check_output_dir

            go_on = resume
            if auto_resume:
                if resume:
                    raise ConfigError("--resume and --auto-resume: give one (--auto-resume resumes where there is a "
                                      "checkpoint, and starts afresh where there is none)")
                out = output_dir_of(config, overrides, load_backend(spec))
                go_on = latest_checkpoint(out / "checkpoints") is not None
                if not go_on:
                    err_console.print(f"--auto-resume: no complete checkpoint in {out}; starting afresh", **PLAIN)
            backend, cfg = get_backend(config, overrides, resume=go_on)
            started.append(cfg)
            check_output_dir(cfg.output_dir, go_on)  # before the model is built
            check_config(cfg, world_size())  # the config as a whole, before the model too (the Trainer checks it again)
            source = f" ({config})" if config is not None else ""
            if distributed.launched_main():  # once, not once per rank
                console.print(f"[bold]{spec.command} train[/]: "
                              + escape(f"method {cfg.method.type}{source}, output {cfg.output_dir}"), **LINE)
            policy, task = backend.build(cfg)
            summary = Trainer(cfg, policy, task, backend=backend).train(resume=go_on)
            if distributed.is_main():
                print_eval(summary["eval_before"], summary["eval_after"], summary["steps"])
                if summary.get("steps_without_update"):
                    console.print(f"{summary['steps_without_update']} of {summary['steps']} steps did not update: "
                                  "their groups were all dropped (method's group filter)", **PLAIN)
                console.print(f"wrote {cfg.output_dir}/summary.json; checkpoint {summary['checkpoint']}", **PLAIN)
                if summary.get("best"):
                    b = summary["best"]
                    console.print(f"best checkpoint by held-out {b['metric']} ({b['value']:.4g}, step {b['step']}): "
                                  f"{b['checkpoint']}/model (--checkpoint {cfg.output_dir}/best)", **PLAIN)
                console.print(next_steps(spec.command, Path(cfg.output_dir)), **PLAIN)

        run_verb(go, lambda: interrupted_note(spec.command, started[0] if started else None))

    @app.command("eval")
    def evaluate(
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config of the run (task and model)."),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
        checkpoint: Path | None = typer.Option(None, "--checkpoint", help="A checkpoint's model directory, a run directory (its newest checkpoint) or RUN/best (train.best_metric's); default: the config's model."),
        out: str | None = typer.Option(None, "--out", "-o", metavar="FILE", help=(
            "Where the per-item rows go (JSONL: each held-out item's prompt, reference, response and atom "
            "scores); default: RUN/eval/checkpoint-step-N.jsonl for a run's checkpoint, else "
            "OUTPUT_DIR/eval/eval.jsonl.")),
    ):
        """Evaluate a model on the config's held-out task and print its metrics as JSON (stdout);
        each item's response and scores go to a JSONL file, named on stderr."""
        if out is not None and (not out.strip() or Path(out).is_dir()):
            fail(f"--out {out!r}: give a file for the per-item rows" + (" (was the variable it names unset?)"
                                                                         if not out.strip() else ", not a directory"))

        def go():
            from mmrl.core import distributed

            backend, cfg = get_backend(config, list(set_), "eval", checkpoint)
            if out is not None:  # a folder that cannot be made is said now, not after the evaluation
                try:
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f"--out {out}: cannot write there ({type(e).__name__}: {e})") from None
            policy, task = backend.build(cfg)
            if checkpoint is not None:
                load_checkpoint(policy, checkpoint, cfg.model.path)
                if distributed.launched_main():  # which step RUN or RUN/best is, beside the metrics (stdout: JSON alone)
                    err_console.print(f"evaluating {resolve_checkpoint(checkpoint)}", **PLAIN)
            from mmrl.core.trainer import Trainer

            trainer = Trainer(cfg, policy, task, output_dir=cfg.output_dir, training=False)
            metrics = trainer.evaluate(rows_path=Path(out) if out is not None else rows_file(cfg, checkpoint))
            if distributed.is_main():  # every rank holds the whole set's metrics: one line of them
                err_console.print(f"held-out evaluation: {trainer.eval_said}", **PLAIN)
                typer.echo(json.dumps(nulled(metrics)))  # NaN is not JSON: null where a metric has no data

        run_verb(go)

    @app.command(help=f"Sample a model and print one JSON line per sample. {spec.scored_prompts}")
    def sample(
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config of the run."),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
        checkpoint: Path | None = typer.Option(None, "--checkpoint", help="A checkpoint's model directory, a run directory (its newest checkpoint) or RUN/best."),
        prompt: list[str] = typer.Option([], "--prompt", "-p", metavar="TEXT", help="Prompt (repeatable); default: the first two held-out items."),
        num: int | None = typer.Option(None, "--num", "-n", min=1, help="Samples per prompt (default 4)."),
        greedy: bool = typer.Option(False, "--greedy", help="Decode greedily: one answer per prompt, as held-out "
                                    "evaluation decodes (language backends; diffusion samples are ODE draws already)."),
        image: list[Path] = typer.Option([], "--image", "-i", exists=True, dir_okay=False, metavar="FILE", help=(
            "An image the --prompt questions ask about (vision-language; one for every question, or one per question).")),
    ):
        def go():
            if greedy and (num or 1) > 1:
                raise ConfigError(f"--greedy decodes one answer per prompt, --num {num} draws {num} samples: give one or the other")
            blank = [i for i, p in enumerate(prompt, 1) if not p.strip()]
            if blank:  # most often an unset shell variable: `--prompt "$Q"`
                raise ConfigError(f"--prompt: prompt {blank[0]} of {len(prompt)} is empty; give the text to sample from")
            backend, cfg = get_backend(config, list(set_), "sample", checkpoint)
            if not hasattr(backend, "sample"):
                raise BackendUnavailable(f"`{spec.command} sample` is not available for this backend yet")
            if image and not prompt:
                raise ConfigError("--image needs the --prompt questions to ask about it")
            if image and len(image) not in (1, len(prompt)):
                raise ConfigError(f"--image: {len(image)} images for {len(prompt)} --prompt questions (give one "
                                  "image for them all, or one per question)")
            extra = {k: v for k, v in (("greedy", greedy), ("images", list(image))) if v}
            accepted = inspect.signature(backend.sample).parameters
            if greedy and "greedy" not in accepted:
                why = getattr(backend, "NO_GREEDY", "not available for this backend")
                raise BackendUnavailable(f"`{spec.command} sample --greedy`: {why}")
            if image and "images" not in accepted:
                raise BackendUnavailable(f"`{spec.command} sample --image`: this backend's prompts are text only")
            from mmrl.core.trainer import with_config_atoms

            with no_held_out_warnings():  # sample reports no held-out metric
                policy, task = backend.build(cfg)
            with_config_atoms(task, cfg)  # samples are scored as training scores them
            if checkpoint is not None:
                load_checkpoint(policy, checkpoint, cfg.model.path)
            for row in backend.sample(cfg, policy, task, list(prompt), 1 if greedy else num or 4, **extra):
                typer.echo(json.dumps(row, default=str))  # JSON lines

        run_verb(go)

    @app.command()
    def serve(
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config of the run (model and rollout)."),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
        checkpoint: Path | None = typer.Option(None, "--checkpoint", help="A checkpoint's model directory, a run directory (its newest checkpoint) or RUN/best."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; loopback by default. Any other address needs a token."),
        port: int = typer.Option(8400, "--port", help="Port to serve on; 0 picks a free one."),
        token: str | None = typer.Option(None, "--token", help="Require the header `Authorization: Bearer TOKEN` on every request "
                                         "(default: $MMRL_SERVE_TOKEN, which unlike this flag stays out of the process list)."),
        read_timeout: float = typer.Option(60.0, "--read-timeout", min=0.001,
                                           help="Seconds each read of a request may wait on the client before the "
                                                "server gives up on it (408)."),
        max_samples: int = typer.Option(MAX_SAMPLES, "--max-samples", min=1,
                                        help="Most samples one /generate may ask for, its requests' n summed "
                                             "(more is a 400 before the engine runs)."),
        max_connections: int = typer.Option(MAX_CONNECTIONS, "--max-connections", min=1,
                                            help="Requests served at once; as many more are answered 503 (busy), "
                                                 "and connections past those are closed."),
    ):
        """Serve the policy as a rollout engine over HTTP until interrupted (for RemoteEngine)."""

        def go():
            from mmrl.core.serve import (
                InsecureServeError,
                ServedPolicyEngine,
                check_bind,
                check_port,
                resolve_token,
                served_policy,
            )
            from mmrl.core.serve import serve as serve_engine

            secret = resolve_token(token)
            try:
                check_bind(host, secret)  # before building the model
            except InsecureServeError as e:
                fail(str(e))
            backend, cfg = get_backend(config, list(set_), "serve", checkpoint)
            try:
                check_port(host, port)  # the address is taken or not ours: said now, not after minutes of loading
            except OSError as e:
                fail(str(e))
            with no_held_out_warnings():  # serve reports no held-out metric
                policy = served_policy(backend, cfg)  # the model alone where the backend can: no data files read
            if checkpoint is not None:
                load_checkpoint(policy, checkpoint, cfg.model.path)
            try:
                serve_engine(ServedPolicyEngine(policy), type(cfg.rollout), host, port, token=secret,
                             read_timeout=read_timeout, max_samples=max_samples, rollout=cfg.rollout,
                             max_connections=max_connections,
                             ready=lambda url: console.print(f"serving the {spec.title} policy at {url}", **PLAIN))
            except OSError as e:  # the address is taken or not ours
                fail(f"cannot serve on {host}:{port}: {e.strerror or e}")

        run_verb(go)

    @app.command()
    def export(
        checkpoint: Path = typer.Option(..., "--checkpoint", help="A run directory (its newest checkpoint), RUN/best (train.best_metric's), a checkpoint or its model directory."),
        out: Path = typer.Option(..., "--out", "-o", help="The directory to write; a new or empty one."),
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config of the run; inside a run, its config.yaml is the base."),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
    ):
        """Write a checkpoint as a standalone model directory that transformers, diffusers or vLLM
        load without mmrl: a LoRA run's adapters merged into its base weights, with the processor or
        tokenizer (a dLLM's dllm.json; an image model's whole diffusers pipeline)."""

        def go():
            from mmrl.core.checkpoint import CheckpointError

            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise ConfigError(f"--out {out} is not a new or empty directory; export writes nothing over files")
            backend, cfg = get_backend(config, list(set_), "export", checkpoint)
            # export needs no task: where the backend can build its policy alone, the run's data
            # files need not be there (a run copied to another machine, its data left behind)
            policy = backend.build_policy(cfg) if hasattr(backend, "build_policy") else backend.build(cfg)[0]
            source = resolve_checkpoint(checkpoint)  # a run's newest checkpoint: found once, loaded and named
            load_checkpoint(policy, source, cfg.model.path)
            if not hasattr(policy, "export_pretrained"):
                raise BackendUnavailable(f"`{spec.command} export` is not available for this backend yet")
            partial = out.with_name(f".{out.name}.partial")  # written whole, then renamed: never half a model at --out
            shutil.rmtree(partial, ignore_errors=True)
            try:
                policy.export_pretrained(partial)
                partial.replace(out)  # an empty --out is replaced as well
            except OSError as e:  # a full disk, a read-only folder
                shutil.rmtree(partial, ignore_errors=True)
                raise CheckpointError(f"export to {out} failed, nothing was written there: {e}") from e
            console.print(f"wrote {out} (from {source})", **PLAIN)
            if hasattr(policy, "export_usage"):  # what the model's own library would not guess
                console.print(policy.export_usage(), **PLAIN)

        run_verb(go)

    @app.command("config")
    def show_config(
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config; default: the embedded default run."),
        set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override a key (repeatable)."),
        keys: str | None = typer.Option(None, "--keys", "-k", metavar="PART",
                                        help="Only this part, e.g. --keys rollout or --keys method."),
        checkpoint: Path | None = typer.Option(None, "--checkpoint", help="A run directory or checkpoint: its settings."),
    ):
        """Print the config a run would use (the embedded default, --config, --set) as YAML, every
        key with its description and value; it loads back as a --config file. Nothing is built."""

        def go():
            from mmrl.core.config_checks import check_config
            from mmrl.core.config_doc import commented_config

            _, cfg = get_backend(config, list(set_), "train", checkpoint, builds=False)
            typer.echo(commented_config(cfg, keys), nl=False)
            try:  # what train refuses of the config as a whole: shown, yet the dump is still printed to edit
                check_config(cfg, world_size())
            except ConfigError as e:
                err_console.print(f"warning: `{spec.command} train` refuses these settings: {escape(str(e))}",
                                  highlight=False, soft_wrap=True)

        run_verb(go)

    @app.command("runs")
    def list_runs(
        paths: list[Path] = typer.Argument(..., metavar="RUN_OR_FOLDER", help="Run directories, or directories that hold runs one level down."),
        group: bool = typer.Option(False, "--group", "-g", help="One row per configuration: runs whose configs "
                                   "differ only in seed (and output_dir, logging), with each metric's mean ± sample "
                                   "standard deviation after training and of its change."),
        metric: list[str] = typer.Option([], "--metric", "-m", help="A held-out metric to show (repeatable); default: all."),
        as_json: bool = typer.Option(False, "--json", help="JSON instead of a Markdown table."),
        plot: Path | None = typer.Option(None, "--plot", help="Also draw the runs into this image (curves.png): "
                                         "training reward per step, and the first --metric before, during and "
                                         "after training; one colour per run (with --group: per configuration, "
                                         "the mean over its seeds ± one sample standard deviation)."),
    ):
        """Finished runs side by side, as a Markdown table: held-out metrics before → after, steps,
        the best checkpoint and the training time; the settings that differ between runs label
        them. Runs of any modality; a run without summary.json is listed as unfinished."""

        def go():
            from mmrl.demo import plot as curves
            from mmrl.demo import table

            try:
                if plot is not None:  # before any run is read
                    curves.check_output(plot)
                runs = [table.load(p) for p in table.find(list(paths))]
                metrics = table.metric_names(runs, list(metric))
            except ValueError as e:
                raise ConfigError(str(e)) from None
            rows = (table.group_rows if group else table.run_rows)(runs, metrics)
            if as_json:
                typer.echo(json.dumps(rows, indent=1))
            else:
                typer.echo((table.markdown_groups if group else table.markdown_runs)(rows, metrics), nl=False)
            if plot is not None:
                shown = curves.metric_of(runs, metrics)
                try:
                    curves.draw((curves.group_series if group else curves.run_series)(runs, shown), shown, plot)
                except ValueError as e:  # the table is out; the figure could not be written
                    raise ConfigError(str(e)) from None

        run_verb(go)

    return app


# Each console script's config class, to name the command a run or config of another modality is for.
CONFIG_CLASSES = {"mmrl": ("mmrl.vlm.config", "VLMTrainConfig"),
                  "diffusion-rl": ("diffusion_rl.config", "DiffusionTrainConfig"),
                  "dllm-rl": ("dllm_rl.config", "DLLMTrainConfig")}


@contextlib.contextmanager
def no_held_out_warnings():
    """Building for a verb that reports no held-out metric (sample, serve): warnings about what
    those metrics measure (HeldOutWarning) would be noise there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeldOutWarning)
        yield


def world_size() -> int:
    """The trainer processes a launcher (torchrun, accelerate) starts, before any process group
    (a ConfigError for a WORLD_SIZE that no launcher set, before the model is built)."""
    from mmrl.core.launch import launched_world

    return launched_world()


def method_given(run: Path | None, config: Path | None, overrides: list[str]) -> tuple[str, Any]:
    """(who gave it, method.type) from the last --set of it, else the config file, else the run."""
    for item in reversed(overrides):
        if item.partition("=")[0].strip() == "method.type":
            method = parse_override(item)[1]
            return f"--set method.type asks for method {method!r}", method
    for what, read, where in ((f"{config} sets", _file_settings, config), (f"the run in {run} trains", read_run_config, run)):
        if where is not None:
            method = read(where).get("method")
            if isinstance(method, dict) and "type" in method:
                return f"{what} method {method['type']!r}", method["type"]
    return "", None


def _file_settings(config: Path) -> dict:
    """A config file's settings over its bases (`base:`), quietly: load_config said what it had to."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return read_config_file(config)


def method_fits(cls: type[TrainConfig], method: str) -> bool:
    try:
        load_config(cls, None, [], defaults={"method": {"type": method}})
    except ConfigError:
        return False
    return True


def command_of_method(method: str, this: str) -> str | None:
    """The other console script whose built-in methods include `method` (None: no such one)."""
    for command, (module, name) in CONFIG_CLASSES.items():
        try:
            if command != this and method_fits(getattr(importlib.import_module(module), name), method):
                return command
        except ImportError:  # a backend this installation lacks
            continue
    return None


def best_alias(path: Path) -> Path:
    """RUN/best, where RUN has no such directory but a best.json (train.best_metric) -> the
    checkpoint it names; any other path as is. CheckpointError where that checkpoint is gone."""
    from mmrl.core.checkpoint import CheckpointError, step_dir

    path = Path(path)
    record = path.parent / BEST
    if path.name != "best" or path.exists() or not record.is_file():
        return path
    try:
        step = read_record(record)["step"]
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {record} is unreadable ({e})") from None
    found = step_dir(path.parent / "checkpoints", step)
    if not (found / "model").is_dir():
        raise CheckpointError(f"checkpoint {path}: {record} names step {step}, but {found} is gone")
    return found


def resolve_checkpoint(path: Path) -> Path:
    """A run directory, or its checkpoints/ directory -> the newest checkpoint's model; RUN/best ->
    the best checkpoint's model (best_alias); a checkpoint -> its model; else as is."""
    from mmrl.core.checkpoint import CheckpointError, latest_checkpoint

    path = best_alias(path)
    if not path.exists():
        if path.name == "best" and (path.parent / RUN_CONFIG).is_file():  # a run with no best.json (best_alias)
            raise FileNotFoundError(
                f"checkpoint {path} does not exist: the run {path.parent} keeps no best checkpoint (its best.json "
                f"is written at an evaluation during training where train.best_metric is set); --checkpoint "
                f"{path.parent} takes its newest")
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; give a directory: a run, its checkpoints/, "
                              "one checkpoint or a model directory")
    if (path / "checkpoints").is_dir():  # a run
        root = path / "checkpoints"
    elif any(path.glob("step-*")):  # a run's checkpoints/ itself
        root = path
    elif (path / RUN_CONFIG).is_file() and not any(path.glob("*.safetensors")):
        # a run stopped before its first save (config.yaml is written at the start): said so, where
        # loading it as a model directory failed on a missing model.safetensors
        raise CheckpointError(f"{path} holds no complete checkpoint (a run that has saved no step yet)")
    else:
        root = None
    if root is not None:
        found = latest_checkpoint(root)
        if found is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return found / "model"
    if (path / "model").is_dir():
        return path / "model"
    return path


def rows_file(cfg: TrainConfig, checkpoint: Path | None) -> Path:
    """Where `eval` writes its per-item rows by default: beside the run's own held-out rows
    (RUN/eval/step-N.jsonl, which training writes) for one of its checkpoints, under a name of
    its own, since a --set may have changed what is evaluated; else in the config's output_dir."""
    if checkpoint is not None:
        model = resolve_checkpoint(checkpoint)
        run = run_dir_of(model)
        if run is not None and model.name == "model":
            return run / "eval" / f"checkpoint-{model.parent.name}.jsonl"
    return Path(cfg.output_dir) / "eval" / "eval.jsonl"


def load_checkpoint(policy, path: Path, model_path: str | None = "") -> None:
    """--checkpoint: the weights of `path` (see resolve_checkpoint) into the policy, or a
    CheckpointError naming the directory where they cannot be read or do not fit. `model_path`:
    the config's model.path the policy was built from (None: the bundled model, which an older
    mmrl's run may not fit; see bundled_model_note), "" where the caller does not say."""
    from mmrl.core.checkpoint import CheckpointError, UnreadableError

    model = resolve_checkpoint(path)
    check_model_type(policy, path, model)
    try:
        policy.load_weights(model)
    except UnreadableError:  # a damaged file, whatever model it is loaded into
        raise
    except (ConfigError, CheckpointError) as e:  # ours: already says what is wrong with the directory
        note = bundled_model_note(model_path, model) if model_path != "" else ""
        raise CheckpointError(f"--checkpoint {path}: {e}{note}") from e
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:  # from_pretrained's, on a wrong directory
        raise CheckpointError(f"--checkpoint {path}: cannot load this model's weights from {model} "
                              f"({type(e).__name__}: {e})") from e


def check_model_type(policy, path: Path, model: Path) -> None:
    """A model directory of another architecture (another backend's export: a dLLM's Llama for
    a Qwen-VL run) is named as such: loading it failed with `'dict' object has no attribute
    'to_dict'`, or listed as unexpected weights those of the model built from it."""
    from mmrl.core.checkpoint import CheckpointError

    ours = getattr(getattr(getattr(policy, "model", None), "config", None), "model_type", None)
    try:
        theirs = json.loads((model / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):  # none (a LoRA adapter, a diffusers pipeline), or not ours to judge
        return
    if isinstance(ours, str) and isinstance(theirs, str) and ours != theirs:
        raise CheckpointError(f"--checkpoint {path}: cannot load {model}: it holds a {theirs!r} model (its config.json), "
                              f"and the model it is loaded into is a {ours!r}: a checkpoint of another model or backend?")


def interrupted_note(command: str, cfg: TrainConfig | None) -> str:
    """What Ctrl-C in `train` leaves: the checkpoint to resume from and the command that does, or
    that there is none (the default run saves only at its end, so Ctrl-C at step 300 of 500 keeps
    nothing: "the newest checkpoint is kept, resume with --resume" then sent the user to an
    error). The command names the output directory: `--resume` alone resumes the default one."""
    from mmrl.core.checkpoint import latest_checkpoint
    from mmrl.core.trainer import resume_command

    if cfg is None:  # before the config was read: nothing was written
        return "interrupted"
    out = Path(cfg.output_dir)
    found = latest_checkpoint(out / "checkpoints")
    if found is not None:
        return (f"interrupted; the newest complete checkpoint, {found}, is kept: resume with "
                f"`{resume_command(out, command)}`")
    every = "" if cfg.train.save_every else (" (this run saves only at its end; --save-every N saves every N "
                                              "steps)")
    return f"interrupted before any checkpoint was saved{every}: nothing to resume; start again as before"


def next_steps(command: str, out: Path) -> str:
    """The lines that end `train`: where to look at the run and the verbs that use what it made
    (a first run ended on a checkpoint path and left the reader to find report.html and the
    other verbs in the README)."""
    run = shlex.quote(str(out))
    report = out / "report.html"
    look = f"see {report} (curves, samples, config) or `{command} runs {run}`; " if report.is_file() else ""
    return (f"{look}next: `{command} sample --checkpoint {run}`, `{command} eval --checkpoint {run}`, "
            f"`{command} export --checkpoint {run} -o DIR`")


def print_eval(before: dict[str, Any], after: dict[str, Any], steps: int) -> None:
    table = Table(title=f"held-out evaluation ({steps} step{'' if steps == 1 else 's'})")
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for k in sorted(set(before) | set(after)):
        table.add_row(k, _fmt(before.get(k)), _fmt(after.get(k)))
    # whole however narrow the console (COLUMNS=40, a log file's 80): rich cut a long name to
    # "consist…" and dropped the metric column altogether below ~25 columns; a terminal wraps it
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    Console(width=max(console.width, needed)).print(table)  # console.print(width=) is capped at its width


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def _unset_in(extra: dict[str, Any], given: Any) -> dict[str, Any]:
    """The keys of `extra` that `given` (a run's config) leaves unset, 0, null or empty."""
    given = given if isinstance(given, dict) else {}
    return {k: _unset_in(v, given.get(k)) if isinstance(v, dict) else v
            for k, v in extra.items() if isinstance(v, dict) or not given.get(k)}


def _flag_overrides(flags: dict[str, Any]) -> list[str]:
    # a path is a string even where YAML would read it otherwise (-o 2024, -o true, -o '#1')
    return [f"{k}={json.dumps(str(v)) if isinstance(v, Path) else v}" for k, v in flags.items() if v is not None]


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors of a user's input (a bad config, a missing file, nothing to resume): one
    `error:` paragraph and exit 2, no traceback. A function: most of their modules import torch."""
    from mmrl.core.checkpoint import CheckpointError
    from mmrl.core.engine import EngineError
    from mmrl.core.rewards import RewardError

    return (ConfigError, CheckpointError, RewardError, EngineError, FileNotFoundError)


def __getattr__(name: str) -> Any:
    """`from mmrl.core.cli import USER_ERRORS` (benchmarks/bench_cli.py) as when it was a constant."""
    if name == "USER_ERRORS":
        return user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _stopped_by_signal() -> type[BaseException]:
    from mmrl.core.stop import StoppedBySignal  # imports torch (mmrl.core.distributed)

    return StoppedBySignal


def _runtime_errors() -> tuple[type[BaseException], ...]:
    from mmrl.core.distributed import RankError
    from mmrl.core.trainer import TrainingError

    return (TrainingError, RankError)  # RankError: another rank's failure, which that rank reports too


def run(app: typer.Typer) -> None:
    """Entry point: run the app (a verb interrupted by Ctrl-C says so and exits 130).
    Warnings print as one "warning:" line: the source line they were raised from says
    nothing to a user. Where the console's reader goes away (`train | head`), every verb goes
    on without a word more on that stream (mmrl.core.logging.ReaderGoneSafe)."""
    warnings.formatwarning = _warning_line
    survive_reader_gone()
    app()


def _warning_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"
