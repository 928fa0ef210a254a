"""The benchmark scripts' command lines (benchmarks/*.py): a bad input ends in one `error:` line
and exit status 2 (benchmarks/bench_cli.py), not a traceback."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

from mmrl.core.config import ConfigError
from mmrl.core.rewards import import_python_file
from mmrl.core.trainer import OutputDirError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def bench(name: str):
    return import_python_file(BENCH / f"{name}.py", f"bench_{name}")


def test_every_script_ends_through_bench_cli():
    """A script whose __main__ block calls main() itself prints a traceback on a missing config."""
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' in text:
            assert "raise SystemExit(bench_cli.run(main))" in text, path.name


def test_user_errors_are_one_error_line_and_exit_2(capsys):
    cli = bench("bench_cli")

    def bad_config():
        raise ConfigError("config file 'configs/dllm/nosuch.yaml' does not exist")

    assert cli.run(bad_config) == 2
    assert capsys.readouterr().err == "error: config file 'configs/dllm/nosuch.yaml' does not exist\n"

    def taken():
        raise OutputDirError("runs/x/diffu_grpo-seed0 already holds checkpoints of a run; pass --resume ...")

    assert cli.run(taken) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runs/x/diffu_grpo-seed0 already holds") and "give another --out" in err
    assert cli.run(lambda: 0) == 0 and cli.run(lambda: None) == 0

    def bug():
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        cli.run(bug)


def test_a_missing_method_config_is_an_error_line(capsys):
    """dllm_learning.py --methods nosuch: the config file it names, before anything trains."""
    main = bench("dllm_learning").main
    assert bench("bench_cli").run(lambda: main(["--methods", "nosuch", "--seeds", "0", "--steps", "1"])) == 2
    assert re.fullmatch(r"error: config file '.*configs/dllm/nosuch\.yaml' does not exist\n", capsys.readouterr().err)


def test_script_own_checks_are_error_lines(tmp_path, capsys):
    """Checks the scripts made with SystemExit(text) (exit status 1) are user errors too."""
    cli = bench("bench_cli")
    ftfc = bench("ftfc_effective_reward").main
    assert cli.run(lambda: ftfc([str(tmp_path)])) == 2
    assert capsys.readouterr().err == f"error: no trainer_state.json in {tmp_path}: give a checkpoint directory of an FTFC run\n"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"method": {"step": 3}}))
    assert cli.run(lambda: ftfc([str(tmp_path)])) == 2
    assert "holds no FTFC pool (method state keys: ['step'])" in capsys.readouterr().err
    dllm = bench("dllm_methods")
    args = argparse.Namespace(methods=["nosuch"])
    assert cli.run(lambda: dllm.compare(args, ["tracerl", "slim_rl"], "tracerl", "best")) == 2
    assert capsys.readouterr().err == "error: --methods: nosuch not in this comparison (tracerl, slim_rl)\n"


def test_reuse_of_an_unfinished_run_is_an_error_line(tmp_path, capsys):
    """diffusion_methods.py --reuse on a run that has metrics but no summary.json (still going or
    stopped): mmrl's ValueError names the folder; here it is an error line, not a traceback."""
    run = tmp_path / "flow_grpo-seed0"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/total": 0.5}) + "\n")
    main = bench("diffusion_methods").main
    argv = ["--methods", "flow_grpo", "--seeds", "0", "--steps", "1", "--reuse", "--out", str(tmp_path)]
    assert bench("bench_cli").run(lambda: main(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run} has metrics but no summary.json")


@pytest.mark.parametrize("script,argv,message", [
    ("vlm_shared_images", ["--batches", "0"], "--batches and --repeats must be >= 1, got 0 and 3"),
    ("update_cost", ["--repeats", "0"], "--repeats, --rollouts and --threads must be >= 1, got 0, 3 and 1"),
    ("cast_attention_layers", ["--prompts", "0"], "--prompts must be >= 1, got 0"),
    ("breakdown", ["dllm", "--samples", "-1"], "--samples must be >= 0 (0: greedy only), got -1"),
    ("dllm_split_gap", ["--problems", "-5"], "--problems must be >= 1, got -5"),
    ("logprob_memory", ["--rows", "-1"], "--rows, --tokens, --vocab and --chunk must be >= 1, got -1, 1024"),
    ("diffusion_cost", ["--repeats", "0"], "--repeats and --group must be >= 1, got 0 and 8"),
    ("diffusion_cost", ["--batch", "12"], "--batch (12) must be a multiple of --group (8)"),
    ("master_weights", ["--backends", "dllm", "--steps", "1", "2"], "--steps: give one count, or one per backend"),
    ("diffusion_methods", ["--window", "0"], "--steps and --window must be >= 1, got 30 and 0"),
    ("diffusion_methods", ["--steps", "0"], "--steps and --window must be >= 1, got 0 and 5"),
])
def test_counts_out_of_range_are_usage_errors(script, argv, message, monkeypatch, capsys):
    """A zero or negative count was a StatisticsError / IndexError / a child process's traceback
    after the model was built, or (diffusion_cost --batch 12) timed 8 images and reported 12;
    master_weights --steps 1 2 with one backend dropped the 2 without a word."""
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])  # logprob_memory and master_weights read sys.argv
    main = bench(script).main
    with pytest.raises(SystemExit) as e:
        main(argv) if "argv" in main.__code__.co_varnames else main()
    assert e.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_fsdp_configs_names_a_config_it_cannot_place(tmp_path, monkeypatch, capsys):
    """fsdp_configs.py picks the backend by the config's folder (configs/<backend>/): a missing
    file, or one elsewhere, was a KeyError traceback from each of its two processes."""
    main = bench("fsdp_configs").main
    elsewhere = tmp_path / "my.yaml"
    elsewhere.write_text("seed: 0\n")
    for path in ("configs/dllm/nosuch.yaml", str(elsewhere)):
        monkeypatch.setattr("sys.argv", ["fsdp_configs.py", path])
        with pytest.raises(SystemExit) as e:
            main()
        assert e.value.code == 2
        assert f"error: {path}: not a config file in a folder named for its backend (configs/vlm/" in capsys.readouterr().err


def test_fastrl_table_says_which_runs_made_it(tmp_path, monkeypatch, capsys):
    """benchmarks/fastrl.py's table named the base method only: not the seed, steps, lr or the
    overrides, so two tables from two seeds could not be told apart."""
    bench_fastrl = bench("fastrl")
    arm = {"curve": [(0, 0.0, 0.3), (5, 9.0, 0.5)], "final": 0.5, "train_seconds": 9.0, "rollout": 6.0,
           "reward": 0.0, "update": 3.0, "samples": 320, "pruned": 0, "group_sizes": [8]}
    monkeypatch.setattr(bench_fastrl, "run", lambda base, fastrl, args, out: arm)
    assert bench_fastrl.main(["--bases", "grpo", "--seed", "3", "--steps", "5", "--out", str(tmp_path),
                              "--set", "method.kl.beta=0.01"]) == 0
    out = capsys.readouterr().out
    assert (f"seed 3, 5 steps, lr 0.001, held-out accuracy every 10 steps on 100 items, 160 training items, "
            f"--set method.kl.beta=0.01; runs in {tmp_path}\n| base | target acc |") in out
    assert "| grpo | 0.500 | 9 / 9 | 1.00x | 0.500 / 0.500 |" in out


def test_dllm_samplers_quick_keeps_explicit_counts(monkeypatch, capsys):
    """dllm_samplers.py --quick --problems 100 ran 40 problems (--quick overwrote the flag)."""
    samplers = bench("dllm_samplers")
    seen = []
    row = {"strategy": "ar", "pass@1": 0.5, "pass@8": 0.75, "NFE": 8.0, "greedy accuracy": 0.5, "greedy NFE": 8.0}
    monkeypatch.setattr(samplers, "table", lambda args: seen.append((args.problems, args.n)) or [row])
    for argv, counts in ((["--quick", "--problems", "100"], (100, 8)), (["--quick"], (40, 8)), ([], (200, 16)),
                         (["--n", "4"], (200, 4))):
        assert samplers.main(argv) == 0
        assert seen.pop() == counts
        assert f"arith, {counts[0]} held-out problems, n={counts[1]} answers each" in capsys.readouterr().out


SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_the_whole_docstring(script, monkeypatch, capsys):
    """--help of most scripts showed the docstring's first paragraph only: not its example
    commands, quick settings or how to read the table (dllm_methods' stopped at "one run per
    comparison:"); and where --out writes was not said."""
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--help"])
    module = bench(script)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"]) if "argv" in module.main.__code__.co_varnames else module.main()
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for paragraph in module.__doc__.split("\n\n"):
        assert " ".join(paragraph.split()).replace("\\\\", "\\") in text
    if "--out OUT" in text and "runs/" in module.__doc__ + text:
        assert "(default: the repository's runs/" in text


def test_vlm_learning_sh_checks_its_arguments_before_training(tmp_path):
    """vlm_learning.sh took --help for OUT_DIR: it made a folder named after dirname's usage
    text and a --help.seed0.log in the current directory, then trained; a seed typo in the last
    seed failed only after the others had trained. `mmrl` here is a stub that records a call."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mmrl").write_text("#!/bin/sh\ntouch \"$(dirname \"$0\")/called\"\nexit 1\n")
    (tmp_path / "bin" / "mmrl").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}

    def sh(*args):
        return subprocess.run(["bash", str(BENCH / "vlm_learning.sh"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=10, check=False)

    r = sh("--help")
    assert r.returncode == 0 and "bash benchmarks/vlm_learning.sh [OUT_DIR [SEED ...]]" in r.stdout
    r = sh("runs/x", "0", "1,2")
    assert r.returncode == 2
    assert r.stderr.startswith("error: seed '1,2' is not a non-negative integer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # nothing written, nothing trained
    assert not (tmp_path / "bin" / "called").exists()


class Stop(Exception):
    pass


def test_scheduler_and_vs_trl_quick_keep_explicit_counts(monkeypatch, capsys):
    """scheduler.py --quick --seeds 1 2 ran seed 0, and vs_trl.py --quick --steps 5 ran 10 steps:
    --quick overwrote the flags given with it."""
    sched = bench("scheduler")

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(sched.tempfile, "TemporaryDirectory", stop)  # right after the header line
    for argv, said in ((["--quick", "--seeds", "1", "2"], "4 steps, seeds [1, 2]"), (["--quick"], "4 steps, seeds [0]"),
                       ([], "12 steps, seeds [0, 1, 2]"), (["--quick", "--steps", "6"], "6 steps, seeds [0]")):
        with pytest.raises(Stop):
            sched.main(argv)
        assert said in capsys.readouterr().out
    monkeypatch.undo()  # the tempfile module is vs_trl's too
    trl = bench("vs_trl")
    seen = []
    monkeypatch.setattr(trl.backend, "build_task", lambda cfg: None)
    monkeypatch.setattr(trl.importlib.util, "find_spec", lambda name: object())  # as if the bench extra were there
    monkeypatch.setattr(trl, "mmrl_run", lambda steps, *a: seen.append(steps) or stop())
    for argv, steps in ((["--quick", "--steps", "5"], 5), (["--quick"], 10), ([], 100)):
        with pytest.raises(Stop):
            trl.main(argv)
        assert seen.pop() == steps
    with pytest.raises(SystemExit) as e:
        trl.main(["--steps", "0"])
    assert e.value.code == 2 and "error: --steps must be >= 1, got 0" in capsys.readouterr().err


def test_dllm_tables_say_what_they_were_measured_on(monkeypatch, capsys):
    """dllm_conventions.py and dllm_split_gap.py printed a bare table: not the number of problems,
    their seed or the samples, so a row could not be matched to its command."""
    def stop(*a, **k):
        raise Stop

    conv, gap = bench("dllm_conventions"), bench("dllm_split_gap")
    monkeypatch.setattr(conv.backend, "build", stop)  # the model: after the header
    with pytest.raises(Stop):
        conv.main(["--problems", "7", "--samples", "3", "--seed", "5", "--set", "rollout.temperature=0.5"])
    assert capsys.readouterr().out.startswith("arith: 7 held-out problems (seed 5), greedy and 3 sampled answers "
                                              "each, sampler settings of ")
    with pytest.raises(Stop):
        gap.main(["--problems", "9", "--seed", "4", "--digits", "1"])
    assert capsys.readouterr().out.startswith("arith, 1-digit operands: 9 problems per split (seed 4), greedy "
                                              "accuracy\n\n| model | train split |")


def test_vs_trl_without_its_extra_stops_before_training(monkeypatch, capsys):
    """vs_trl.py imported trl and datasets only for its second side: without the bench extra it
    trained the mmrl side for --steps, then failed with ModuleNotFoundError."""
    trl = bench("vs_trl")
    monkeypatch.setattr(trl.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(trl, "mmrl_run", lambda *a: pytest.fail("trained before checking the extra"))
    assert trl.main(["--quick"]) == 3
    assert capsys.readouterr().err == 'error: vs_trl.py needs trl and datasets, the bench extra: pip install -e ".[bench]"\n'


def test_fsdp_configs_set_takes_one_override(monkeypatch, capsys):
    """fsdp_configs.py --set a=1 configs/dllm/x.yaml: --set (nargs="*") swallowed the config, so
    the script ran every config in configs/ with the path as an override, failing in each rank."""
    main = bench("fsdp_configs").main
    monkeypatch.setattr("sys.argv", ["fsdp_configs.py", "--set", "nosuch"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "error: --set takes KEY=VALUE, got 'nosuch'" in capsys.readouterr().err
    # the config after --set is a config again: checked (and refused here) as one
    monkeypatch.setattr("sys.argv", ["fsdp_configs.py", "--set", "seed=1", "configs/dllm/nosuch.yaml"])
    with pytest.raises(SystemExit):
        main()
    assert "error: configs/dllm/nosuch.yaml: not a config file" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--methods", "flow_grpo", "ftfc", "--only", "fftc:train.max_steps=100"],
     "--only names fftc, not in --methods (flow_grpo ftfc)"),
    (["--methods", "flow_grpo", "cast", "--divergences", "kl"],
     "--divergences runs FTFC once per divergence: include ftfc in --methods"),
])
def test_diffusion_methods_refuses_settings_for_a_method_not_run(argv, message, capsys):
    """A typo in --only's method, or --divergences without ftfc, was ignored: the run went ahead
    without the override it was given."""
    with pytest.raises(SystemExit) as e:
        bench("diffusion_methods").main(argv)
    assert e.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_vlm_methods_table_says_its_learning_rate(tmp_path, monkeypatch, capsys):
    """vlm_methods.py trains at optim.lr=1e-3 whatever the config says; neither --help nor the
    table said so, nor the steps and overrides behind the table."""
    vm = bench("vlm_methods")
    summary = {"eval_before": {"accuracy": 0.3, "sampled_accuracy": 0.2}, "train_seconds": 5.0,
               "eval_after": {"accuracy": 0.4, "sampled_accuracy": 0.3}, "config": {"optim": {"lr": 0.001}}}
    monkeypatch.setattr(vm, "run", lambda *a: json.loads(json.dumps(summary)))
    assert vm.main(["--methods", "grpo", "--seeds", "0", "--steps", "7", "--out", str(tmp_path),
                    "--set", "task.num_eval=50"]) == 0
    out = capsys.readouterr().out
    assert f"\n7 steps, optim.lr 0.001, --set task.num_eval=50; runs in {tmp_path}\n| method | seed |" in out
    assert "| grpo | 0 | 0.300 -> 0.400 | 0.200 -> 0.300 | 5 |" in out
    assert "trains at optim.lr=1e-3" in " ".join(vm.__doc__.split())


def test_training_tables_name_the_command_that_made_them(tmp_path, monkeypatch, capsys):
    """dllm_learning.py, vlm_axpo.py and diffusion_methods.py printed seeds in the table but not
    the steps or the --set overrides (RESULTS.md's runs differ by those): the table now follows
    the command line that made it."""
    before = {"accuracy": 0.2, "format": 1.0, "sampled_accuracy": 0.1, "atom_accuracy": 0.3, "exist": 0.5,
              "colour": 0.4, "count": 0.2, "relation": 0.1, "prompt_accuracy": 0.0}
    summary = {"eval_before": before, "eval_after": before, "train_seconds": 3.0,
               "config": {"rollout": {"eval_samples": 4}}, "decoded_tokens": 10, "resampled": 0}
    rows = [{"step": 1, "reward/total": 0.5, "time/step": 1.0}]
    for name, argv in (("dllm_learning", ["--methods", "diffu_grpo", "--seeds", "0", "--steps", "2"]),
                       ("vlm_axpo", ["--arms", "grpo", "--seeds", "0", "--steps", "2"]),
                       ("diffusion_methods", ["--methods", "flow_grpo", "--steps", "2"])):
        module = bench(name)
        result = (summary, rows) if name == "diffusion_methods" else summary
        monkeypatch.setattr(module, "run", lambda *a, result=result, **k: result)
        argv = [*argv, "--out", str(tmp_path), "--set", "optim.lr=1e-4"]
        assert module.main(argv) == 0
        line = f"\nfrom: python benchmarks/{name}.py {' '.join(argv)}\n| "
        assert line in capsys.readouterr().out, name


def test_diffusion_methods_table_shows_a_metric_summary_json_holds_as_null(tmp_path, monkeypatch, capsys):
    """A held-out set with no relational prompt has no relation accuracy: summary.json holds null,
    and the table's f-string raised TypeError after every run had trained. It shows "-"."""
    dm = bench("diffusion_methods")
    before = {"atom_accuracy": 0.3, "exist": 0.5, "colour": 0.4, "count": 0.2, "relation": None,
              "prompt_accuracy": 0.0, "hard/atom_accuracy": 0.2, "hard/prompt_accuracy": None}
    summary = {"eval_before": before, "eval_after": {**before, "atom_accuracy": 0.4}, "train_seconds": 3.0}
    monkeypatch.setattr(dm, "run", lambda *a, **k: (summary, [{"step": 1, "reward/total": 0.5, "time/step": 1.0}]))
    assert dm.main(["--methods", "flow_grpo", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| flow_grpo | 0 | 0.300 -> 0.400 | 0.500 -> 0.500 | 0.400 -> 0.400 | 0.200 -> 0.200 | - -> - |" in out
