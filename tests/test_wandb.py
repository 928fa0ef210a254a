"""Weights & Biases logging (logging.wandb, mmrl.core.wandb_run) on the toy backend: what reaches
W&B (through a stand-in module that records the calls), resume into the same W&B run, failures
on either side, and one real offline run where wandb is installed."""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import toy
from reliability.toy_cli import signalled_in_step_two
from typer.testing import CliRunner

from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import ConfigError, load_config
from mmrl.core.logging import read_metrics
from mmrl.core.stop import StoppedBySignal
from mmrl.core.trainer import Trainer

app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))
ON = ["--set", "logging.wandb.enabled=true"]


class FakeRun:
    def __init__(self, calls: list, fail_log_at: int | None):
        self.calls, self.fail_log_at, self.summary = calls, fail_log_at, {}

    def log(self, data: dict, step: int):
        if step == self.fail_log_at:
            raise ConnectionError("W&B is down")
        self.calls.append(("table", step, data["samples"]) if "samples" in data else ("log", step, data))

    def mark_preempting(self):
        self.calls.append(("preempting",))

    def finish(self, exit_code: int = 0):
        self.calls.append(("finish", exit_code, dict(self.summary)))


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module: `calls` records init, log and finish in order."""
    calls: list = []
    module = types.ModuleType("wandb")
    module.fail_log_at = None

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls, module.fail_log_at)

    module.init = init
    module.Table = lambda **kwargs: kwargs
    module.calls = calls
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def train(*args):
    result = CliRunner().invoke(app, ["train", "--set", "rollout.num_generations=2", "--set",
                                      "rollout.prompts_per_step=2", *args])
    return result.exit_code, result.output


def test_the_config_each_steps_metrics_and_the_held_out_summary_reach_wandb(tmp_path, fake_wandb):
    out = tmp_path / "run"
    code, text = train("--max-steps", "3", "-o", str(out), *ON, "--set", "logging.wandb.project=proj",
                       "--set", "logging.wandb.tags=[a,b]", "--set", "logging.wandb.mode=offline",
                       "--set", "train.log_samples_every=2")
    assert code == 0, text
    (step, table), = [c[1:] for c in fake_wandb.calls if c[0] == "table"]
    rows = [json.loads(line) for line in (out / "samples" / "step_00000002.jsonl").read_text().splitlines()]
    assert step == 2 and table["columns"][:3] == ["group", "prompt", "completion"] and table["allow_mixed_types"]
    assert [r[table["columns"].index("completion")] for r in table["data"]] == [r["completion"] for r in rows]
    assert [json.loads(r[table["columns"].index("atoms")]) for r in table["data"]] == [r["atoms"] for r in rows]
    (kind, init), *logs, finish = [c for c in fake_wandb.calls if c[0] != "table"]
    assert kind == "init"
    assert (init["project"], init["name"], init["tags"], init["mode"]) == ("proj", "run", ["a", "b"], "offline")
    assert init["dir"] == str(out) and init["resume"] == "allow"
    config = json.loads((out / "summary.json").read_text())["config"]
    assert init["config"]["optim"] == config["optim"] and init["config"]["output_dir"] == str(out.resolve())
    rows = read_metrics(out / "metrics.jsonl")
    # the held-out evaluations before and after training at steps 0 and 3, as TensorBoard has them
    assert [(c[0], c[1]) for c in logs] == [("log", 0), ("log", 1), ("log", 2), ("log", 3), ("log", 3)]
    (*_, before), *logs, (*_, after) = logs
    for (_, step, data), row in zip(logs, rows):
        assert data["reward/total"] == row["reward/total"] and data["loss/total"] == row["loss/total"]
        assert all(isinstance(v, float) for v in data.values())
    summary = json.loads((out / "summary.json").read_text())
    assert before == {f"eval/{k}": v for k, v in summary["eval_before"].items()} and "eval/accuracy" in before
    assert after == {f"eval/{k}": v for k, v in summary["eval_after"].items()}
    assert finish[:2] == ("finish", 0) and ("preempting",) not in fake_wandb.calls  # finished, not preempted
    assert finish[2]["eval_before/accuracy"] == summary["eval_before"]["accuracy"]
    assert finish[2]["eval_after/accuracy"] == summary["eval_after"]["accuracy"]
    assert json.loads((out / "wandb.json").read_text()) == {"id": init["id"], "project": "proj"}


def test_the_best_checkpoint_s_step_and_score_reach_the_wandb_summary(tmp_path, fake_wandb):
    out = tmp_path / "run"
    code, text = train("--max-steps", "4", "-o", str(out), *ON, "--set", "train.eval_every=2",
                       "--set", "train.best_metric=accuracy")
    assert code == 0, text
    best = json.loads((out / "best.json").read_text())
    assert "best checkpoint by held-out accuracy" in text and f"step {best['step']}" in text
    (finish,) = [c for c in fake_wandb.calls if c[0] == "finish"]
    assert (finish[2]["best/step"], finish[2]["best/value"]) == (best["step"], best["value"])


def test_resume_continues_the_same_wandb_run_and_a_fresh_run_starts_its_own(tmp_path, fake_wandb):
    out = tmp_path / "run"
    assert train("--max-steps", "2", "-o", str(out), *ON)[0] == 0
    code, text = train("--max-steps", "4", "-o", str(out), "--resume", *ON)
    assert code == 0, text
    first, again = (c[1]["id"] for c in fake_wandb.calls if c[0] == "init")
    assert first == again == json.loads((out / "wandb.json").read_text())["id"]
    # steps 0 and 2 (4 after the resume): the held-out evaluations before and after training
    assert [c[1] for c in fake_wandb.calls if c[0] == "log"] == [0, 1, 2, 2, 3, 4, 4]
    assert train("--max-steps", "1", "-o", str(tmp_path / "other"), *ON)[0] == 0
    assert [c[1]["id"] for c in fake_wandb.calls if c[0] == "init"][-1] != first


def wandb_trainer(tmp_path, max_steps: int) -> Trainer:
    cfg = load_config(toy.CONFIG_CLASS, None,
                      [f"output_dir={tmp_path / 'run'}", f"train.max_steps={max_steps}", "logging.wandb.enabled=true",
                       "rollout.num_generations=2", "rollout.prompts_per_step=2"], defaults=toy.DEFAULT_CONFIG)
    return Trainer(cfg, *toy.build(cfg))


def test_a_run_stopped_by_an_error_finishes_its_wandb_run_as_failed(tmp_path, fake_wandb, monkeypatch):
    trainer = wandb_trainer(tmp_path, max_steps=3)
    step = trainer.train_step

    def breaks_at_2(logger=None):
        if trainer.step == 1:
            raise RuntimeError("a tool broke")
        return step(logger)

    monkeypatch.setattr(trainer, "train_step", breaks_at_2)
    with pytest.raises(RuntimeError, match="a tool broke"), pytest.warns(UserWarning, match="stopped the run"):
        trainer.train()
    assert [c[:2] for c in fake_wandb.calls if c[0] != "init"] == [("log", 0), ("log", 1), ("finish", 1)]


def test_a_final_evaluation_that_fails_finishes_the_wandb_run_as_failed(tmp_path, fake_wandb, monkeypatch):
    trainer = wandb_trainer(tmp_path, max_steps=2)
    evaluate = trainer.evaluate

    def breaks_after(samples_tag=None, **kw):
        if samples_tag == "after":
            raise RuntimeError("the reward model is gone")
        return evaluate(samples_tag, **kw)

    monkeypatch.setattr(trainer, "evaluate", breaks_after)
    with pytest.raises(RuntimeError, match="the reward model is gone"):
        trainer.train()
    assert [c[:2] for c in fake_wandb.calls if c[0] != "init"] == [("log", 0), ("log", 1), ("log", 2), ("finish", 1)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1] if hasattr(signal, "SIGUSR1")
                         else [signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_run_stopped_by_a_scheduler_s_signal_is_preempted_in_wandb_not_failed(tmp_path, fake_wandb, signum):
    trainer = wandb_trainer(tmp_path, max_steps=4)
    step = trainer.train_step

    def signalled_in_2(logger=None):
        if trainer.step == 1:  # in step 2: it is finished and saved, then the run stops
            signal.raise_signal(signum)
        return step(logger)

    trainer.train_step = signalled_in_2
    with pytest.raises(StoppedBySignal):
        trainer.train()
    # W&B takes a preempting run that exits non-zero as preempted (and a sweep requeues it); the
    # exit code is the one the CLI ends with, 128 + the signal's number
    assert [c[:2] for c in fake_wandb.calls if c[0] != "init"] == [("log", 0), ("log", 1), ("log", 2), ("preempting",),
                                                                    ("finish", 128 + signum)]


def test_a_signal_that_ended_wandb_s_service_too_ends_the_run_in_a_fresh_one(tmp_path, fake_wandb):
    """SLURM signals every process of the job, W&B's service too, which ends at once: the log of
    the step finished after the signal fails on the lost connection. The W&B run is started again
    (same id), this start's steps are logged again from metrics.jsonl, then it is preempted."""
    fake_wandb.fail_log_at = 2  # the service is gone when step 2 is logged

    def teardown():  # of the lost service; the fresh one takes every step
        fake_wandb.calls.append(("teardown",))
        fake_wandb.fail_log_at = None

    fake_wandb.teardown = teardown
    trainer = wandb_trainer(tmp_path, max_steps=4)
    step = trainer.train_step

    def signalled_in_2(logger=None):
        if trainer.step == 1:
            signal.raise_signal(signal.SIGTERM)
        return step(logger)

    trainer.train_step = signalled_in_2
    with pytest.warns(UserWarning) as caught, pytest.raises(StoppedBySignal):
        trainer.train()
    (_, init), *calls = fake_wandb.calls
    assert init["resume"] == "allow"
    # step 0: the held-out evaluation before training, which metrics.jsonl lacks, logged again too
    assert [c[:2] for c in calls] == [("log", 0), ("log", 1), ("teardown",), ("init", init), ("log", 0), ("log", 1),
                                      ("log", 2), ("preempting",), ("finish", 143)]  # init again: the same W&B run
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    logged = [c[2] for c in calls if c[0] == "log"]
    assert logged[3:] == [{k: v for k, v in r.items() if k != "step"} for r in rows]  # as metrics.jsonl has them
    assert logged[0] == logged[2] and logged[1] == logged[3] and set(logged[0]) == {"eval/accuracy"}
    assert any("W&B's service was stopped by the signal too" in str(w.message) and "steps 1-2" in str(w.message)
               for w in caught)


def test_wandb_failing_mid_run_is_warned_once_and_the_run_goes_on(tmp_path, fake_wandb):
    fake_wandb.fail_log_at = 2
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="W&B logging stopped: ConnectionError: W&B is down"):
        code, text = train("--max-steps", "3", "-o", str(out), *ON)
    assert code == 0, text
    assert [c[:2] for c in fake_wandb.calls if c[0] != "init"] == [("log", 0), ("log", 1)]  # nothing after the failure
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]  # the run's own logs are whole


def test_wandb_missing_or_not_starting_is_one_error_before_any_step(tmp_path, monkeypatch, fake_wandb):
    def refuses(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    fake_wandb.init = refuses
    code, text = train("--max-steps", "2", "-o", str(tmp_path / "a"), *ON)
    text = " ".join(text.split())
    assert code == 2 and "W&B could not start: RuntimeError: api_key not configured" in text, text
    assert "logging.wandb.mode=offline" in text and "Traceback" not in text
    assert read_metrics(tmp_path / "a" / "metrics.jsonl") == []  # no step ran
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    code, text = train("--max-steps", "2", "-o", str(tmp_path / "b"), *ON)
    assert code == 2 and "pip install -e '.[wandb]'" in " ".join(text.split()), text
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config(overrides=["logging.wandb.mode=sometimes"])


def test_a_real_offline_wandb_run_is_written_under_the_output_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # W&B would wrap the process's stdout, which pytest captures
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="W&B logging stopped")  # a call real wandb refuses fails the run
        code, text = train("--max-steps", "2", "-o", str(out), *ON, "--set", "logging.wandb.mode=offline",
                           "--set", "train.log_samples_every=1")
    assert code == 0, text
    run_id = json.loads((out / "wandb.json").read_text())["id"]
    (folder,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    # protobuf records: their keys stand as bytes. W&B's service process may still be writing
    # them for a moment after finish() returns (seen on a loaded machine: only the header yet).
    path, deadline = folder / f"run-{run_id}.wandb", time.monotonic() + 60
    while b"eval_after/accuracy" not in (records := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"reward/total" in records and b"eval_after/accuracy" in records
    tables = sorted((folder / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 2  # steps 1 and 2
    table = json.loads(tables[0].read_text())
    rows = [json.loads(line) for line in (out / "samples" / "step_00000001.jsonl").read_text().splitlines()]
    assert table["columns"][:3] == ["group", "prompt", "completion"]
    assert sorted(map(str, (r[2] for r in table["data"]))) == sorted(str(r["completion"]) for r in rows)


# ------------------------------------------------------------------ WandbRun on its own (no training)

SETTINGS = {"project": "proj", "entity": "team", "group": None, "name": None, "tags": [], "mode": "offline"}


def test_only_a_resume_continues_the_recorded_wandb_run_and_new_ids_are_8_hex_digits(tmp_path, fake_wandb):
    from mmrl.core.wandb_run import WandbRun

    (tmp_path / "wandb.json").write_text(json.dumps({"id": "abcd1234", "project": "proj"}))
    assert WandbRun(SETTINGS, tmp_path, {}, resume=True).run is not None
    WandbRun(SETTINGS, tmp_path, {}, resume=False)  # a fresh run in the same directory: its own W&B run
    resumed, fresh = (c[1] for c in fake_wandb.calls if c[0] == "init")
    assert resumed["id"] == "abcd1234" and fresh["id"] != "abcd1234"
    assert len(fresh["id"]) == 8 and int(fresh["id"], 16) >= 0
    assert json.loads((tmp_path / "wandb.json").read_text()) == {"id": fresh["id"], "project": "proj"}
    assert fresh["tags"] is None and fresh["name"] == tmp_path.name  # no tags: None, as W&B wants


def test_a_wandb_record_that_is_not_an_object_starts_a_new_run_with_a_warning(tmp_path, fake_wandb):
    from mmrl.core.wandb_run import WandbRun

    (tmp_path / "wandb.json").write_text("[1, 2]")  # valid JSON, not {"id": ...}
    with pytest.warns(UserWarning, match="is not a W&B run record"):
        WandbRun(SETTINGS, tmp_path, {}, resume=True)
    (init,) = [c[1] for c in fake_wandb.calls if c[0] == "init"]
    assert len(init["id"]) == 8


def test_sample_tables_hold_nested_values_as_json_and_an_empty_one_is_not_logged(tmp_path, fake_wandb):
    from mmrl.core.wandb_run import WandbRun

    run = WandbRun(SETTINGS, tmp_path, {}, resume=False)
    run.samples(3, [])
    run.samples(4, [{"prompt": "p", "atoms": {"answer": 1.0}, "tools": ["calc"]}, {"prompt": "q", "reward": 0.5}])
    (table,) = [c for c in fake_wandb.calls if c[0] == "table"]
    assert table[1] == 4 and table[2]["columns"] == ["prompt", "atoms", "tools", "reward"]
    assert table[2]["data"] == [["p", '{"answer": 1.0}', '["calc"]', None], ["q", None, None, 0.5]]


def test_finish_sends_finite_held_out_metrics_and_train_seconds_then_nothing_more(tmp_path, fake_wandb):
    from mmrl.core.wandb_run import WandbRun

    run = WandbRun(SETTINGS, tmp_path, {}, resume=False)
    run.finish({"steps": 3, "train_seconds": 12.5, "eval_before": {"accuracy": 0.25, "loss": float("nan")},
                "eval_after": {"accuracy": 0.5, "note": "text"}})
    run.log(4, {"reward/total": 1.0})  # after finish: not sent to the finished W&B run
    run.finish(None)
    (finish,) = [c for c in fake_wandb.calls if c[0] == "finish"]
    assert finish == ("finish", 0, {"eval_before/accuracy": 0.25, "eval_after/accuracy": 0.5, "train_seconds": 12.5})
    assert [c for c in fake_wandb.calls if c[0] == "log"] == []


def test_a_real_offline_wandb_run_takes_a_signal_stop_s_preempting_mark(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from mmrl.core.wandb_run import WandbRun

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    run = WandbRun(SETTINGS, tmp_path, {}, resume=False)
    marked, mark = [], run.run.mark_preempting
    monkeypatch.setattr(run.run, "mark_preempting", lambda: (marked.append(True), mark())[1])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="W&B logging stopped")  # a call real wandb refuses
        run.finish(None, signum=signal.SIGTERM)
    assert marked == [True]  # wandb's own mark_preempting ran, then finish, and neither was refused


def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file (wandb.proto's Record), read as wandb-core writes
    them: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each a 7-byte header
    (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last part of a record) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, parts, records = path.read_bytes(), 7, [], []
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header: zeros
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            break
        parts, pos = ([] if kind in (1, 2) else parts) + [raw[pos + 7:pos + 7 + length]], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(b"".join(parts)))
    return records


@pytest.mark.slow  # a child process: ~10 s to import torch and start, then 2 steps of 2 s
def test_a_scheduler_s_sigterm_to_every_process_keeps_every_step_in_the_offline_wandb_run(tmp_path):
    """SLURM signals every process of the job step (its cgroup), wandb-core included, which ends
    at once on SIGTERM and takes with it what it had not written: the offline run folder kept its
    header alone, no step and no exit. Now the run ends in a fresh service: a run folder holding
    every step of the run, marked preempting, exit code 143."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_SILENT": "true", "TOY_ROLLOUT_SECONDS": "2", "OMP_NUM_THREADS": "1"}
    # WANDB_SERVICE: the service of this process's earlier W&B runs, which the child would use
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_SERVICE"):
        env.pop(key, None)
    script = Path(__file__).parent / "reliability" / "toy_cli.py"

    def send(run, children):
        assert any("wandb-core" in Path(f"/proc/{p}/cmdline").read_text() for p in children)
        for pid in [run.pid, *children]:  # wandb-core runs in a session of its own: not in our group
            os.kill(pid, signal.SIGTERM)

    returncode, stderr = signalled_in_step_two(
        [sys.executable, str(script), "train", "--max-steps", "1000", "--save-every", "0", "-o", str(out), *ON,
         "--set", "logging.wandb.mode=offline"], env, out, send)
    assert returncode == 143, stderr[-3000:]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == [1, 2]
    *_, folder = sorted((out / "wandb").glob("offline-run-*"))  # the newest: the fresh service's
    records = wandb_records(next(folder.glob("*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    # step 0: the held-out evaluation before training (eval/*), which metrics.jsonl leaves to summary.json
    assert [r.history.step.num for r in records if r.HasField("history")] == [0, *steps]
    assert "preempting" in kinds and [r.exit.exit_code for r in records if r.HasField("exit")] == [143]


def _wandb_run(tmp_path):
    from mmrl.core.wandb_run import WandbRun

    settings = {"project": "p", "entity": None, "group": None, "name": "r", "tags": [], "mode": "offline"}
    return WandbRun(settings, tmp_path, {}, resume=False)


def _fails_with(error):
    def log(*args, **kwargs):
        raise error

    return log


def test_only_a_lost_connection_to_wandb_s_service_starts_it_again_on_a_signal(tmp_path, fake_wandb):
    def teardown():  # the lost service's own teardown fails on its connection
        fake_wandb.calls.append(("teardown",))
        raise BrokenPipeError("the service is gone")

    fake_wandb.teardown = teardown
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    run = _wandb_run(tmp_path)
    run.run.log = _fails_with(ValueError("not a connection"))  # W&B refused a value: its service is fine
    with pytest.warns(UserWarning, match="W&B logging stopped: ValueError"):
        run.log(1, {"loss": 0.5})
    run.finish(None, signum=signal.SIGTERM)
    assert [c[0] for c in fake_wandb.calls] == ["init"]  # not started again, and nothing more sent
    fake_wandb.calls.clear()
    run = _wandb_run(tmp_path)
    run.run.log = _fails_with(BrokenPipeError("the service is gone"))
    with pytest.warns(UserWarning, match="W&B logging stopped: BrokenPipeError"):
        run.log(1, {"loss": 0.5})
    with pytest.warns(UserWarning) as caught:
        run.finish(None, signum=signal.SIGTERM)
    assert [c[:2] for c in fake_wandb.calls[1:]] == [("teardown",), ("init", fake_wandb.calls[0][1]),
                                                     ("log", 1), ("preempting",), ("finish", 143)]
    assert any("W&B was started again on the same run and steps 1-1" in str(w.message) for w in caught)


def test_wandb_that_cannot_start_again_after_its_service_was_lost_is_warned_of(tmp_path, fake_wandb):
    fake_wandb.teardown = lambda: None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    run = _wandb_run(tmp_path)
    run.run.log = _fails_with(ConnectionResetError("the service is gone"))
    fake_wandb.init = _fails_with(RuntimeError("no service"))
    with pytest.warns(UserWarning, match="W&B logging stopped: ConnectionResetError"):
        run.log(1, {"loss": 0.5})
    with pytest.warns(UserWarning) as caught:
        run.finish(None, signum=signal.SIGUSR1)
    assert any("W&B could not be started again after its service was lost: RuntimeError: no service"
               in str(w.message) for w in caught)
    assert [c[0] for c in fake_wandb.calls] == ["init"]  # the first; nothing went to the lost run


def test_a_start_that_logged_no_step_logs_none_again_in_a_fresh_service(tmp_path, fake_wandb):
    """A resumed start signalled before its first step: the earlier starts' steps in
    metrics.jsonl are already in the W&B run and are not sent again."""
    fake_wandb.teardown = lambda: None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2)))
    run = _wandb_run(tmp_path)
    run.run.mark_preempting = _fails_with(BrokenPipeError("the service is gone"))
    with pytest.warns(UserWarning) as caught:
        run.finish(None, signum=signal.SIGTERM)
    assert [c[:2] for c in fake_wandb.calls[1:]] == [("init", fake_wandb.calls[0][1]), ("preempting",), ("finish", 143)]
    assert any("W&B was started again on the same run and no steps of this start" in str(w.message) for w in caught)
