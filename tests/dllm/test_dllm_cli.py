"""`dllm-rl` (train, eval, sample) end to end on the tiny model, in process (typer's
CliRunner): the run's files, a loadable checkpoint, --resume reproducing the uninterrupted
run bit for bit, pass@k from eval, and user errors as one clean paragraph."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dllm_rl.cli import app
from dllm_rl.tiny import CHARSET

STEP2 = "checkpoints/step-00000002/model/model.safetensors"
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "dllm"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def ok(result):
    assert result.exit_code == 0, (result.output[-2000:], result.exception)
    return result


@pytest.fixture(scope="module")
def full_run(small_sets, tmp_path_factory):
    """diffu-GRPO (the default method, ppo_epochs 2), 2 steps straight."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("dllm_cli") / "full"
        ok(invoke("train", "--max-steps", 2, "--output-dir", out, *small_sets))
    finally:
        torch.set_num_threads(n)
    return out


def test_train_writes_summary_metrics_curve_and_a_loadable_checkpoint(full_run, small_sets, tmp_path):
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["method"]["type"] == "diffu_grpo"
    for key in ("eval_before", "eval_after"):
        assert 0 <= summary[key]["accuracy"] <= 1
        assert summary[key]["nfe"] == 8  # low_confidence, 4 steps per block of 4: one token per step
    rows = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/updates"] == 2 for r in rows)
    assert (full_run / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (full_run / STEP2).is_file()
    r = ok(invoke("eval", "--checkpoint", full_run, *small_sets, "--set", f"output_dir={tmp_path / 'e'}"))
    (metrics,) = json_lines(r.stdout)
    # the checkpoint's weights evaluate as the trained model did at the end of the run (greedy);
    # eval adds pass@1..16 from 16 samples per problem, which the run's evaluations leave out
    assert {k: metrics[k] for k in summary["eval_after"]} == pytest.approx(summary["eval_after"])
    assert set(metrics) - set(summary["eval_after"]) == {f"pass@{k}" for k in range(1, 17)} | {"sampled_nfe"}
    r = ok(invoke("eval", "--checkpoint", full_run, *small_sets, "--set", "rollout.eval_samples=0",
                  "--set", f"output_dir={tmp_path / 'e'}"))
    assert json_lines(r.stdout) == [pytest.approx(summary["eval_after"])]  # 0: greedy only


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(full_run, small_sets, tmp_path):
    split = tmp_path / "split"
    ok(invoke("train", "--max-steps", 1, "--output-dir", split, *small_sets))
    ok(invoke("train", "--max-steps", 2, "--output-dir", split, "--resume", *small_sets))
    assert (split / STEP2).read_bytes() == (full_run / STEP2).read_bytes()
    full = [json.loads(line) for line in (full_run / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(full, resumed):
        assert a["loss/total"] == b["loss/total"] and a["reward/total"] == b["reward/total"]


def test_pipelined_rollouts_train_on_the_shared_scheduler(small_sets, tmp_path):
    """Complete-group pipelining with a background engine (its own copy of the weights): the
    estimator's old log-probs are computed by the engine, and each round trains."""
    out = tmp_path / "pipelined"
    ok(invoke("train", "--max-steps", 2, "--output-dir", out, *small_sets,
              "--set", "rollout.scheduler.mode=pipelined", "--set", "train.ppo_epochs=2"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/updates"] == 2 and r["rollout/groups"] == 2 for r in rows)
    assert all(0 <= r["time/waiting_ratio"] <= 1 and r["rollout/staleness"] <= 1 for r in rows)
    assert (out / STEP2).is_file()


@pytest.mark.parametrize("strategy", ["low_confidence", "fork"])
def test_eval_reports_pass_at_k_and_sampled_nfe(small_sets, tmp_path, strategy):
    r = ok(invoke("eval", *small_sets, "--set", "rollout.eval_samples=4", "--set", f"rollout.strategy={strategy}",
                  "--set", f"output_dir={tmp_path}"))
    (m,) = json_lines(r.stdout)
    assert {k for k in m if k.startswith("pass@")} == {f"pass@{k}" for k in (1, 2, 3, 4)}  # k = 1..n, n = 4
    curve = [m[f"pass@{k}"] for k in (1, 2, 3, 4)]
    assert 0 <= curve[0] and curve == sorted(curve) and curve[-1] <= 1  # pass@k grows with k
    assert {"accuracy", "reward", "nfe", "sampled_nfe"} <= set(m)
    if strategy == "low_confidence":
        assert m["nfe"] == m["sampled_nfe"] == 8
    else:  # fork commits at least one token per step and stops a block once it is filled
        assert 2 <= m["nfe"] <= 8 and 2 <= m["sampled_nfe"] <= 8


def test_a_config_files_eval_samples_overrides_evals_default(small_sets, tmp_path):
    """`eval` samples 16 answers unless told otherwise; a config file telling it wins."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  eval_samples: 2\n")
    r = ok(invoke("eval", "-c", cfg, *small_sets, "--set", f"output_dir={tmp_path}"))
    (m,) = json_lines(r.stdout)
    assert {k for k in m if k.startswith("pass@")} == {"pass@1", "pass@2"}


def test_eval_strategy_scores_a_fork_run_with_the_ar_decoder(small_sets, tmp_path):
    """rollout.eval_strategy: ForkGRPO's config (fork rollouts) evaluated with `ar` scores
    exactly as AR-GRPO's config does, greedy and sampled; without it, fork decodes."""
    sets = [arg for kv in zip(small_sets[::2], small_sets[1::2]) if "dynamic_sampling" not in kv[1]
            for arg in kv]  # (diffu-GRPO's option; the fork methods skip zero-std groups anyway)
    # lambda low enough that fork commits in parallel even on the random model
    sets += ["--set", "rollout.eval_samples=4", "--set", "rollout.threshold=0.02", "--set", f"output_dir={tmp_path}"]
    fork_as_ar = ok(invoke("eval", "-c", CONFIGS / "fork_grpo.yaml", *sets, "--set", "rollout.eval_strategy=ar"))
    ar = ok(invoke("eval", "-c", CONFIGS / "ar_grpo.yaml", *sets))
    fork = ok(invoke("eval", "-c", CONFIGS / "fork_grpo.yaml", *sets))
    (a,), (b,), (f,) = (json_lines(r.stdout) for r in (fork_as_ar, ar, fork))
    assert a == b and a["nfe"] == a["sampled_nfe"] == 8  # ar: one token per step
    assert f["nfe"] < 8


def test_sample_prints_json_lines(small_sets, tmp_path):
    r = ok(invoke("sample", *small_sets, "--prompt", "12+3=", "--num", 3, "--set", f"output_dir={tmp_path}"))
    rows = json_lines(r.stdout)
    assert len(rows) == 3 and all(row["prompt"] == "12+3=" and row["nfe"] == 8 for row in rows)
    assert all(set(row["completion"]) <= set(CHARSET) for row in rows)
    # no --prompt: the first 2 held-out problems, scored by the task's atoms
    rows = json_lines(ok(invoke("sample", *small_sets, "--num", 2, "--set", f"output_dir={tmp_path}")).stdout)
    assert len(rows) == 4 and all({"gold", "reward", "atoms"} <= set(row) for row in rows)
    assert set(rows[0]["atoms"]) == {"format", "answer"}


def test_sample_scores_a_prompt_in_the_tasks_format(small_sets, tmp_path):
    """A --prompt that states an arith problem gets its exact answer and the task's atoms;
    other text is sampled unscored."""
    rows = json_lines(ok(invoke("sample", *small_sets, "--prompt", "12+3=", "--prompt", "1+2+3=", "--num", 2,
                                "--set", f"output_dir={tmp_path}")).stdout)
    assert [row["prompt"] for row in rows] == ["12+3="] * 2 + ["1+2+3="] * 2
    assert all(row["gold"] == "15" and set(row["atoms"]) == {"format", "answer"} for row in rows[:2])
    assert all(row["atoms"]["answer"] == float(row["completion"].strip() == "15") for row in rows[:2])
    assert all("gold" not in row and "reward" not in row for row in rows[2:])


def test_sample_greedy_is_evals_greedy_answer(small_sets, make_run, tmp_path):
    """--greedy: one answer per prompt, the one held-out evaluation decodes (temperature 0)."""
    rows = json_lines(ok(invoke("sample", *small_sets, "--greedy", "--set", f"output_dir={tmp_path}")).stdout)
    assert len(rows) == 2 and all({"gold", "reward", "atoms"} <= set(row) for row in rows)
    _, policy, task = make_run()
    result, _ = policy.decode([p.prompt for p in task.eval_problems[:2]], None, temperature=0.0)
    assert [row["completion"] for row in rows] == policy.answer_text(result.completion)
    again = json_lines(ok(invoke("sample", *small_sets, "--greedy", "--set", f"output_dir={tmp_path}",
                                 "--set", "seed=7")).stdout)
    assert again == rows  # no draw: the seed changes nothing
    r = invoke("sample", *small_sets, "--greedy", "--num", 3, "--set", f"output_dir={tmp_path}")
    assert r.exit_code == 2 and "--greedy decodes one answer per prompt" in r.stderr


def test_sample_takes_prompts_longer_than_the_tasks(small_sets, make_run, tmp_path):
    """A --prompt may be as long as the model's context allows, not only as the task's prompts;
    the wider left padding leaves another prompt's answers exactly as they were."""
    from dllm_rl.backend import fit_prompts

    long = "123456789+987654321="  # 20 tokens; the task's prompts have at most 6
    rows = json_lines(ok(invoke("sample", *small_sets, "--prompt", long, "--prompt", "12+3=", "--num", 1,
                                "--set", f"output_dir={tmp_path}")).stdout)
    assert [row["prompt"] for row in rows] == [long, "12+3="]
    _, policy, _ = make_run()
    wide = fit_prompts(policy, [long])
    assert (policy.prompt_length, wide.prompt_length) == (6, 20)
    assert fit_prompts(policy, ["12+3="]) is policy
    runs = [p.decode(["12+3=", "7*8="], torch.Generator().manual_seed(0), temperature=0.7)[0].completion
            for p in (policy, wide)]
    assert torch.equal(*runs)
    r = invoke("sample", *small_sets, "--prompt", "1" * 95 + "=", "--set", f"output_dir={tmp_path}")
    assert r.exit_code == 2 and "exceed the model's context of 96 positions" in r.stderr


def test_sample_with_a_character_outside_the_vocabulary_is_a_clean_error(small_sets, tmp_path):
    r = invoke("sample", *small_sets, "--prompt", "Hello=", "--set", f"output_dir={tmp_path}")
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)  # not a traceback
    assert "--prompt: prompt 'Hello=' cannot be encoded" in r.stderr and "Traceback" not in r.output


def test_sample_refuses_an_empty_prompt(small_sets, tmp_path):
    """`--prompt "$Q"` with Q unset sampled from nothing and printed empty completions."""
    r = invoke("sample", *small_sets, "--prompt", "1+1=", "--prompt", " ", "--set", f"output_dir={tmp_path}")
    assert r.exit_code == 2 and "--prompt: prompt 2 of 2 is empty" in r.stderr and "Traceback" not in r.output


def test_bad_config_is_one_paragraph_naming_gen_length(small_sets, tmp_path):
    r = invoke("train", *small_sets, "--set", "rollout.gen_length=7", "--output-dir", tmp_path / "x")
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    message = r.stderr.strip()
    assert "\n" not in message and message.startswith("error:")
    assert "rollout: gen_length (7) must be divisible by block_length (4)" in message  # no "Value error, "
    assert not (tmp_path / "x").exists()  # nothing was built or written


def test_train_says_how_many_steps_did_not_update(small_sets, tmp_path):
    """SLIM-RL's band with no room ([1, 1]: only all-right groups) on the random tiny model drops
    every group: the run finishes, says so once per run, and counts the steps."""
    sets = [arg for kv in zip(small_sets[::2], small_sets[1::2]) if "dynamic_sampling" not in kv[1]
            for arg in kv]
    r = ok(invoke("train", "-c", CONFIGS / "slim_rl.yaml", "--max-steps", 2, "--output-dir", tmp_path, *sets,
                  "--set", "method.accuracy_band=[1.0,1.0]", "--set", "rollout.strategy=tau_budget"))
    assert "2 of 2 steps did not update" in " ".join(r.output.split())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_without_update"] == 2


def test_eval_and_sample_score_the_configs_own_atoms(small_sets, tmp_path):
    """An atom added by reward.atoms is scored in held-out evaluation and by `sample`, as in training."""
    (tmp_path / "atoms.py").write_text("def short(sample):\n    return float(len(sample.completion) < 3)\n")
    atom = ["--set", f'reward.atoms=["{tmp_path / "atoms.py"}:short"]', "--set", f"output_dir={tmp_path / 'run'}"]
    (metrics,) = json_lines(ok(invoke("eval", *small_sets, *atom, "--set", "rollout.eval_samples=0")).stdout)
    assert 0.0 <= metrics["short"] <= 1.0 and {"format", "accuracy"} <= set(metrics)
    rows = json_lines(ok(invoke("sample", *small_sets, *atom, "--num", 1)).stdout)
    assert rows and all(set(row["atoms"]) == {"format", "answer", "short"} for row in rows)


def test_max_new_tokens_is_gen_length_and_a_setting_of_it_is_said_to_be_ignored():
    """The core's max_new_tokens (Dr.GRPO's length constant) is the dLLM's gen_length; a user's
    own other value is ignored with a warning, and config dumps leave it out."""

    from dllm_rl import backend
    from dllm_rl.config import DLLMRolloutConfig, DLLMTrainConfig
    from mmrl.core.config import load_config

    with pytest.warns(UserWarning, match=r"rollout.max_new_tokens \(32\) is not a dLLM setting") as record:
        cfg = load_config(DLLMTrainConfig, None, ["rollout.max_new_tokens=32"], defaults=backend.DEFAULT_CONFIG)
    assert cfg.rollout.max_new_tokens == cfg.rollout.gen_length == 8
    assert [r.filename for r in record] == [__file__]  # the caller's line, not pydantic's BaseModel.__init__
    with pytest.warns(UserWarning, match=r"max_new_tokens \(4\) is not a dLLM setting") as record:
        DLLMRolloutConfig(max_new_tokens=4)  # a section built directly: the same attribution
    assert [r.filename for r in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(DLLMTrainConfig, None, ["rollout.gen_length=16", "rollout.steps=16"],
                          defaults=backend.DEFAULT_CONFIG)
    assert cfg.rollout.max_new_tokens == 16 and "max_new_tokens" not in cfg.model_dump()["rollout"]


def test_sample_scores_a_prompt_of_the_jsonl_files(small_sets, tmp_path):
    """A jsonl task's --prompt that is one of its files' prompts is scored against that line's
    answer (a jsonl prompt has no format to parse: it was sampled unscored); other text is not."""
    (tmp_path / "t.jsonl").write_text('{"prompt": "12+7=", "answer": 19, "source": "quiz"}\n')
    (tmp_path / "e.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "12+7=", "answer": 19}\n')
    sets = [a for flag, kv in zip(small_sets[::2], small_sets[1::2]) if not kv.startswith("task.num_")
            for a in (flag, kv)]  # jsonl uses every line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = ok(invoke("sample", *sets, "--set", "task.type=jsonl", "--set", f"task.train_path={tmp_path / 't.jsonl'}",
                      "--set", f"task.eval_path={tmp_path / 'e.jsonl'}", "--prompt", "12+7=", "--prompt", "12+8=",
                      "--greedy", "--set", f"output_dir={tmp_path}"))
    rows = json_lines(r.stdout)
    assert [row["prompt"] for row in rows] == ["12+7=", "12+8="]
    assert rows[0]["gold"] == "19" and rows[0]["atoms"] == {"answer": float(rows[0]["completion"].strip() == "19")}
    assert "gold" not in rows[1]
    # the eval file repeats a training prompt: a warning about held-out accuracy, which eval
    # reports and sample does not (it was printed by every sample too)
    assert [str(w.message) for w in caught if "held-out" in str(w.message)] == []


def test_export_of_a_jsonl_run_needs_not_its_data_files(tiny_dllm, tmp_path):
    """export decodes nothing: a run's checkpoint exports where its task.train_path and
    task.eval_path are gone (a run copied to another machine); before, it stopped naming them."""
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from dllm_rl.models import load_mask_predictor
    from mmrl.core.config import load_config

    cfg = load_config(DLLMTrainConfig, None, [f"model.path={tiny_dllm}", "task.num_train=4", "task.num_eval=2"],
                      defaults=backend.DEFAULT_CONFIG)
    policy, _ = backend.build(cfg)
    policy.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "run.yaml").write_text(f"model: {{path: {tiny_dllm}}}\n"
                                       "task: {type: jsonl, train_path: gone/train.jsonl, eval_path: gone/eval.jsonl}\n")
    r = ok(invoke("export", "--checkpoint", tmp_path / "ckpt", "--config", tmp_path / "run.yaml", "-o", tmp_path / "out"))
    assert f"wrote {tmp_path / 'out'}" in " ".join(r.output.split())
    loaded = load_mask_predictor(tmp_path / "out")
    for (name, want), got in zip(policy.model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(want, got), name


def test_sample_decodes_in_batches_of_eval_batch_size(small_sets, make_run, monkeypatch):
    """`sample --num 5` of 2 prompts was one batch of 10 rows whatever rollout.eval_batch_size
    said (hundreds of rows at a large --num: an 8B model's logits fill a GPU); it decodes in
    batches as eval does, and greedily gives eval's answers."""
    from dllm_rl import backend
    from dllm_rl.policy import DLLMPolicy

    cfg, policy, task = make_run("rollout.eval_batch_size=3")
    sizes = []
    decode = DLLMPolicy.decode
    monkeypatch.setattr(DLLMPolicy, "decode", lambda self, texts, *a, **k: sizes.append(len(texts)) or
                        decode(self, texts, *a, **k))
    rows = backend.sample(cfg, policy, task, ["12+3=", "1+1="], 5)
    assert sizes == [3, 3, 3, 1] and [r["prompt"] for r in rows] == ["12+3="] * 5 + ["1+1="] * 5
    sizes.clear()
    greedy = backend.sample(cfg, policy, task, [p.prompt for p in task.eval_problems[:4]], 1, greedy=True)
    assert sizes == [3, 1]
    assert [r["completion"] for r in greedy] == task.answers(policy, task.eval_problems[:4], 0.0)[0]


def test_sampled_answers_do_not_depend_on_eval_batch_size(small_sets, make_run):
    """`sample --num 4` drew one batch's noise from one generator, so an answer changed with
    rollout.eval_batch_size; each answer now has its own generator (seed, prompt, answer), as
    sampled evaluation does."""
    from dllm_rl import backend

    answers = []
    for size in (1, 3, 8):
        cfg, policy, task = make_run(f"rollout.eval_batch_size={size}")
        rows = backend.sample(cfg, policy, task, ["12+3=", "1+1="], 4)
        answers.append([r["completion"] for r in rows])
    assert answers[0] == answers[1] == answers[2]
    assert len(set(answers[0][:4])) > 1  # sampled: a prompt's answers differ, so the check has teeth
