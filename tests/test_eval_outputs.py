"""What a held-out evaluation leaves beside its metrics (mmrl.core.held_out): one JSONL row per
item (which items a checkpoint gets wrong), from `eval` and from a training run's evaluations,
and its progress on stderr; and metrics that do not depend on the evaluation's batch size."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
import toy  # the toy backend (tests/toy.py)
from typer.testing import CliRunner

from mmrl.core.batch import RolloutBatch
from mmrl.core.cli import BackendSpec, make_app
from mmrl.core.config import TrainConfig, load_config
from mmrl.core.held_out import EvalProgress, write_rows
from mmrl.core.rewards import Reward, reward_atom
from mmrl.core.trainer import Trainer

runner = CliRunner()
app = make_app(BackendSpec(modality="toy", title="toy", command="toy-rl", module="toy"))


class Counted:
    """An EvalProgress stand-in that records expect() and advance() calls."""

    def __init__(self):
        self.expected, self.advanced = [], []

    def expect(self, n):
        self.expected.append(n)

    def advance(self, n):
        self.advanced.append(n)


# ------------------------------------------------------------------ dLLM

class Decoder:
    """A stand-in dLLM policy: greedy[q] at temperature 0, else the next of sampled[q]; NFE 4."""

    def __init__(self, greedy, sampled=None):
        self.greedy, self.sampled, self.drawn = greedy, sampled or {}, {}
        self.model = torch.nn.Linear(1, 1)

    def decode(self, prompts, generator, temperature, strategy=None):
        texts = []
        for q in prompts:
            if temperature == 0.0:
                texts.append(self.greedy[q])
            else:
                j = self.drawn[q] = self.drawn.get(q, -1) + 1
                texts.append(self.sampled[q][j])
        return SimpleNamespace(completion=texts, nfe=torch.full((len(prompts),), 4)), None

    def answer_text(self, completion):
        return list(completion)


def test_dllm_rows_hold_each_problems_greedy_answer_scores_and_sampled_scores():
    """3 problems, 2 samples each, batches of 2. Greedy 2 (right), 5, 6 (right): correct 1, 0, 1;
    total = correct + 0.5 short (every answer is short): 1.5, 0.5, 1.5. Progress: 3 greedy
    decodes (2 + 1), then 6 sampled ones (2 + 2 + 2)."""
    from dllm_rl.task import DLLMTask
    from dllm_rl.tasks import Problem

    correct = reward_atom("correct")(lambda s: float(s.completion == s.meta["answer"]))
    short = reward_atom("short", weight=0.5)(lambda s: float(len(s.completion) < 3))
    problems = [Problem(f"{a}+{a}=", str(2 * a), str(2 * a), {"answer": str(2 * a)}) for a in (1, 2, 3)]
    task = DLLMTask("arith", problems, problems, Reward([correct, short]), answer_atom="correct",
                    rollout=SimpleNamespace(eval_strategy=None, temperature=0.7), batch_size=2, eval_samples=2)
    policy = Decoder({"1+1=": "2", "2+2=": "5", "3+3=": "6"},
                     {"1+1=": ["2", "0"], "2+2=": ["4", "4"], "3+3=": ["0", "0"]})
    rows, progress = [], Counted()
    out = task.evaluate(policy, progress=progress, rows=rows)
    assert out["accuracy"] == pytest.approx(2 / 3)
    assert rows == [
        {"prompt": "1+1=", "answer": "2", "completion": "2", "nfe": 4.0, "scores": {"correct": 1.0, "short": 1.0},
         "total": 1.5, "sampled_correct": [1.0, 0.0]},
        {"prompt": "2+2=", "answer": "4", "completion": "5", "nfe": 4.0, "scores": {"correct": 0.0, "short": 1.0},
         "total": 0.5, "sampled_correct": [1.0, 1.0]},
        {"prompt": "3+3=", "answer": "6", "completion": "6", "nfe": 4.0, "scores": {"correct": 1.0, "short": 1.0},
         "total": 1.5, "sampled_correct": [0.0, 0.0]}]
    assert (progress.expected, progress.advanced) == ([3, 6], [2, 1, 2, 2, 2])
    policy.drawn.clear()
    assert task.evaluate(policy) == out  # without them, the same metrics


def test_dllm_metrics_and_answers_greedy_and_sampled_do_not_depend_on_eval_batch_size(one_thread):
    """The tiny model on 6 problems of different lengths (so a batch pads them differently),
    decoded 1, 3 and 8 at a time, 3 samples each: the same greedy answers, the same sampled
    answer scores, and the same metrics (pass@k included). Each answer's noise comes from its
    own generator, seeded by (problem, sample): one generator for the batch drew other samples
    at each size (pass@1 0.22 at size 1, 0.17 at size 3)."""
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig

    # the bundled model, which answers some right (a random one gets every sample wrong); the
    # threshold strategy, under which rows take different numbers of steps
    cfg = load_config(DLLMTrainConfig, None, ["task.num_train=8", "task.num_eval=6", "rollout.eval_samples=3",
                                              "rollout.strategy=threshold"], defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    assert len({len(p.prompt) for p in task.eval_problems}) > 1
    seen = []
    for size in (1, 3, 8):
        task.batch_size, rows = size, []
        with torch.no_grad():
            out = task.evaluate(policy, rows=rows)
            seen.append((out, [(r["completion"], r[f"sampled_{task.answer_atom}"]) for r in rows]))
    assert seen[0] == seen[1] == seen[2] and len(seen[0][1]) == 6
    assert "pass@3" in seen[0][0] and len({str(s) for _, s in seen[0][1]}) > 1  # samples differ between problems


# ------------------------------------------------------------------ VLM

class Answerer:
    """A stand-in VLM policy: greedy[question] greedily, sampled[question] (k answers) sampled."""

    def __init__(self, greedy, sampled=None):
        self.greedy, self.sampled = greedy, sampled or {}

    def greedy_batches(self, items, max_new_tokens, batch_size, stop):
        from mmrl.vlm.policy import to_sample

        return [RolloutBatch(group_ids=torch.arange(len(items)),
                             samples=[to_sample(it, self.greedy[it.question]) for it in items])]

    def generate(self, items, k, rollout, generator):
        from mmrl.vlm.policy import to_sample

        samples = [to_sample(it, a) for it in items for a in self.sampled[it.question][:k]]
        return RolloutBatch(group_ids=torch.arange(len(items)).repeat_interleave(k), samples=samples)


def test_vlm_rows_hold_each_items_question_answer_completion_scores_and_sampled_answers():
    """Two held-out items (a generated one names its kind, a data file's its line) and one "ood"
    item (its split named); answer 1 when right, format 1 for a non-empty answer at weight 0.5.
    With 2 samples the held-out items' rows get their sampled answer scores. Batches of 1: the
    progress counts 2 + 1 greedy decodes, then 2 x 2 sampled ones."""
    from mmrl.vlm.task import VLMTask
    from mmrl.vlm.tasks.shapes_qa import QAItem

    answer = reward_atom("answer")(lambda s: float(s.completion == s.meta["answer"]))
    form = reward_atom("format", weight=0.5)(lambda s: float(bool(s.completion)))
    held = [QAItem([], "How many?", "2", meta={"kind": "count"}), QAItem([], "Colour?", "red", where="qa.jsonl, line 3")]
    ood = [QAItem([], "Shape?", "circle", meta={"kind": "shape_of"})]
    task = VLMTask("qa", held, held, Reward([answer, form]), max_new_tokens=4, batch_size=1,
                   rollout=SimpleNamespace(stop=None), eval_samples=2, extra_eval={"ood": ood})
    policy = Answerer({"How many?": "2", "Colour?": "", "Shape?": "square"},
                      {"How many?": ["2", "3"], "Colour?": ["red", "red"]})
    rows, progress = [], Counted()
    out = task.evaluate(policy, progress=progress, rows=rows)
    assert out["accuracy"] == 0.5 and out["ood/accuracy"] == 0.0 and out["sampled_accuracy"] == 0.75
    assert rows == [
        {"question": "How many?", "answer": "2", "kind": "count", "completion": "2",
         "scores": {"answer": 1.0, "format": 1.0}, "total": 1.5, "sampled_answer": [1.0, 0.0]},
        {"question": "Colour?", "answer": "red", "where": "qa.jsonl, line 3", "completion": "",
         "scores": {"answer": 0.0, "format": 0.0}, "total": 0.0, "sampled_answer": [1.0, 1.0]},
        {"split": "ood", "question": "Shape?", "answer": "circle", "kind": "shape_of", "completion": "square",
         "scores": {"answer": 0.0, "format": 1.0}, "total": 0.5}]
    assert (progress.expected, progress.advanced) == ([2, 1, 4], [1, 1, 1, 2, 2])


# ------------------------------------------------------------------ diffusion

def test_vlm_metrics_greedy_and_sampled_do_not_depend_on_eval_batch_size(one_thread):
    """The bundled VLM on 5 held-out items, 2 samples each, at eval_batch_size 1, 3 and 8 (1, 1
    and 4 items a sampled batch, so prompts of different lengths pad differently): the same
    greedy and sampled answer scores and metrics. Each sample draws from its own generator
    (RowSampler); generate's own draw took a batch's noise at once, and sampled_accuracy moved
    with the size (0.5 at sizes 1 and 3, 0.3 at 8)."""
    from mmrl.vlm import backend

    cfg = load_config(backend.CONFIG_CLASS, defaults=backend.DEFAULT_CONFIG,
                      overrides=["task.num_eval=5", "rollout.eval_samples=2", "rollout.max_new_tokens=16"])
    policy, task = backend.build(cfg)
    seen = []
    for size in (1, 3, 8):
        task.batch_size, rows = size, []
        with torch.no_grad():
            seen.append((task.evaluate(policy, rows=rows), [(r["completion"], r["sampled_answer"]) for r in rows]))
    assert seen[0] == seen[1] == seen[2] and len(seen[0][1]) == 5 and "sampled_accuracy" in seen[0][0]


def test_sample_generators_take_any_seed():
    """`dllm-rl sample --set seed=20250101` raised ValueError (Overflow when unpacking long long):
    (seed, item, sample) past 2**64 is taken modulo 2**64; below, the seeds are as before."""
    from mmrl.core.held_out import sample_generators

    p = 1_000_003
    assert [g.initial_seed() for g in sample_generators(2, 2, 7)] == [(7 * p + i) * p + j for i in (0, 1) for j in (0, 1)]
    for seed in (20250101, 2**70, -1):
        seeds = [g.initial_seed() for g in sample_generators(3, 2, seed)]
        assert len(set(seeds)) == 6 and all(0 <= s < 2**64 for s in seeds)


def test_row_sampler_draws_each_row_from_its_own_generator_within_top_p():
    """RowSampler, generate's sampling step with a generator per row: a row's draw is the same
    alone or beside another row; it returns 0 at the drawn token, -inf elsewhere; and draws
    follow softmax(scores / T) cut to top_p. Scores log(0.5, 0.3, 0.2) at T = 1, top_p 0.7:
    0.5 + 0.3 reach 0.7, so tokens 0 and 1 are drawn at 0.5 / 0.8 = 0.625 and 0.375, token 2 never."""
    from mmrl.vlm.policy import RowSampler

    scores = torch.tensor([0.5, 0.3, 0.2]).log()
    rollout = SimpleNamespace(temperature=1.0, top_p=0.7)

    def sampler(*seeds):
        return RowSampler([torch.Generator().manual_seed(s) for s in seeds], rollout.temperature, rollout.top_p, "cpu")

    pair, alone = sampler(1, 2), sampler(2)
    ids = torch.zeros(2, 1, dtype=torch.long)
    for _ in range(5):  # row 1's t-th draw alone = its t-th draw beside row 0
        both = pair(ids, scores.repeat(2, 1))
        assert torch.equal(both[1], alone(ids[:1], scores[None])[0])
        assert (both == 0).sum(-1).tolist() == [1, 1] and both.isneginf().sum().item() == 4
    drawn = sampler(*range(4000))(torch.zeros(4000, 1, dtype=torch.long), scores.repeat(4000, 1)).argmax(-1)
    freq = torch.bincount(drawn, minlength=3) / 4000.0
    assert freq[2] == 0 and abs(freq[0] - 0.625) < 0.03  # 3 standard errors: sqrt(0.625 * 0.375 / 4000) = 0.0077


def test_diffusion_rows_hold_each_images_prompt_seed_and_atom_verdicts():
    """A renderer that draws each prompt's own scene but a blank one for "three yellow
    triangles": the first prompt's atoms all pass, the second's all fail (the scene of "a red
    circle" has no triangle: exist fails, and gates colour and count). An unparsed prompt gets
    the reward's scores instead (unparsed=zero: 0). Batches of 2: progress 2 + 1."""
    from diffusion_rl.task import DiffusionTask
    from diffusion_rl.tasks.shapes_geneval import make_scene, render, reward_atoms

    class Renderer:
        def sample_images(self, prompts, seeds, num_steps):
            return [render(make_scene(p if p == "a red circle" else "a red circle", seed=s)) for p, s in zip(prompts, seeds)]

    prompts = ["a red circle", "three yellow triangles", "a photo of a cat"]
    with pytest.warns(UserWarning, match="no held-out prompt"):
        task = DiffusionTask("shapes", prompts, prompts, Reward(reward_atoms(unparsed="zero")))
    rows, progress = [], Counted()
    out = task.evaluate(Renderer(), batch_size=2, progress=progress, rows=rows)
    assert out["prompt_accuracy"] == 0.5
    assert rows[0] == {"prompt": "a red circle", "seed": 0, "prompt_correct": True, "atoms": {
        "exist[circle]": 1.0, "colour[red circle]": 1.0, "count[red circle]=1": 1.0}}
    assert rows[1]["seed"] == 1 and not rows[1]["prompt_correct"] and set(rows[1]["atoms"].values()) == {0.0}
    assert rows[2]["prompt"] == "a photo of a cat" and "atoms" not in rows[2] and rows[2]["total"] == 0.0
    assert set(rows[2]["scores"]) == set(task.reward.names)
    assert (progress.expected, progress.advanced) == ([3], [2, 1])


# ------------------------------------------------------------------ the trainer and `eval`

class RowsTask(toy.ToyTask):
    """The toy task, whose evaluation also gives one row per digit and counts its progress."""

    def evaluate(self, policy, progress=None, rows=None):
        out = super().evaluate(policy)
        if progress is not None:
            progress.expect(10)
            progress.advance(10)
        if rows is not None:
            rows += [{"prompt": d, "total": float("nan") if d == 9 else 0.1} for d in range(10)]
        return out


toy_build = toy.build


def rows_build(cfg):
    policy, _ = toy_build(cfg)
    return policy, RowsTask()


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_training_run_writes_each_held_out_evaluations_rows_under_eval_and_says_where(tmp_path, capsys):
    """Before training (step 0), at train.eval_every (step 1) and after (step 2): eval/step-N.jsonl,
    named in the evaluation's line on stderr with the count of generations."""
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[
        f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.eval_every=1", "logging.progress=true"])
    Trainer(cfg, *rows_build(cfg)).train()
    written = sorted(p.name for p in (tmp_path / "run" / "eval").iterdir())
    assert written == ["step-0.jsonl", "step-1.jsonl", "step-2.jsonl"]
    assert read(tmp_path / "run" / "eval" / "step-1.jsonl")[8:] == [{"prompt": 8, "total": 0.1},
                                                                    {"prompt": 9, "total": None}]  # NaN: null
    err = capsys.readouterr().err
    assert "held-out evaluation at step 1: 10 generations, " in err
    assert f"per-item rows in {tmp_path / 'run' / 'eval' / 'step-1.jsonl'}" in err


def test_eval_writes_its_rows_to_out_or_beside_the_run_and_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "build", rows_build)
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", "--max-steps", "2", "-o", str(run)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["eval", "--checkpoint", str(run)])
    assert result.exit_code == 0, result.output
    default = run / "eval" / "checkpoint-step-00000002.jsonl"
    assert len(read(default)) == 10 and f"per-item rows in {default}" in result.stderr
    assert json.loads(result.stdout) == json.loads((run / "summary.json").read_text())["eval_after"]

    mine = tmp_path / "mine.jsonl"
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "-o", str(mine)])
    assert result.exit_code == 0 and read(mine) == read(default)
    result = runner.invoke(app, ["eval", "-s", f"output_dir={tmp_path / 'base'}"])  # the config's model
    assert result.exit_code == 0 and (tmp_path / "base" / "eval" / "eval.jsonl").is_file()


@pytest.mark.parametrize("out, needle", [("", "was the variable it names unset?"), (".", "not a directory"),
                                         ("a-file/rows.jsonl", "cannot write there (FileExistsError")])
def test_eval_refuses_an_out_that_is_no_file_before_building_the_model(tmp_path, monkeypatch, out, needle):
    monkeypatch.setattr(toy, "build", lambda cfg: pytest.fail("built"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    result = runner.invoke(app, ["eval", "-o", out])
    assert result.exit_code == 2 and "--out" in result.output and needle in result.output, result.output


def test_rows_that_cannot_be_written_are_warned_of_and_the_metrics_kept(tmp_path):
    cfg = load_config(TrainConfig, defaults=toy.DEFAULT_CONFIG, overrides=[f"output_dir={tmp_path / 'run'}"])
    (tmp_path / "a-file").write_text("")
    trainer = Trainer(cfg, *rows_build(cfg), training=False)
    with pytest.warns(UserWarning, match="per-item rows were not written to .*a-file/rows.jsonl"):
        assert "accuracy" in trainer.evaluate(rows_path=tmp_path / "a-file" / "rows.jsonl")
    assert "per-item rows" not in trainer.eval_said


def test_rows_are_written_whole_or_not_at_all(tmp_path):
    """A row that cannot be written (here a generator that fails half-way) leaves the earlier
    file as it was, and no temporary file; float32 scores read as their shortest decimals."""
    path = write_rows(tmp_path / "eval" / "step-0.jsonl", [{"total": float(torch.tensor(0.1))}])
    assert read(path) == [{"total": 0.1}]

    def failing():
        yield {"total": 1.0}
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_rows(path, failing())
    assert read(path) == [{"total": 0.1}] and sorted(p.name for p in path.parent.iterdir()) == ["step-0.jsonl"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only_and_where_logging_progress_is_on(monkeypatch):
    for tty, enabled, drawn in ((True, True, True), (True, False, False), (False, True, False)):
        err = Terminal() if tty else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        bar = EvalProgress(enabled)
        bar.expect(5)
        bar.advance(3)
        bar.close()
        assert bar.done == 3
        assert ("held-out evaluation" in err.getvalue()) is drawn, (tty, enabled, err.getvalue())
        assert "3/5" in err.getvalue() or not drawn


def test_sampled_evaluation_draws_at_rollout_eval_temperature_and_training_does_not(one_thread):
    """rollout.eval_temperature sets the held-out samples' temperature (pass@k at 0.5 while
    training samples at 1); unset, they draw at rollout.temperature as before. VLM: generate gets
    a rollout at that temperature; dLLM: the sampled answers are decoded at it, greedy at 0."""
    from dllm_rl.task import DLLMTask
    from mmrl.core.held_out import eval_temperature
    from mmrl.vlm.config import VLMRolloutConfig
    from mmrl.vlm.task import VLMTask
    from mmrl.vlm.tasks.shapes_qa import QAItem

    assert eval_temperature(VLMRolloutConfig()) == 1.0
    assert eval_temperature(VLMRolloutConfig(temperature=0.8, eval_temperature=0.5)) == 0.5
    with pytest.raises(ValueError, match="eval_temperature"):
        VLMRolloutConfig(eval_temperature=0)

    answer = reward_atom("answer")(lambda s: float(s.completion == s.meta["answer"]))
    held = [QAItem([], "How many?", "2")]
    seen = []

    class Spy(Answerer):
        def generate(self, items, k, rollout, generator):
            seen.append(rollout.temperature)
            return super().generate(items, k, rollout, generator)

    for rollout in (VLMRolloutConfig(temperature=0.8), VLMRolloutConfig(temperature=0.8, eval_temperature=0.5)):
        task = VLMTask("qa", held, held, Reward([answer]), max_new_tokens=4, rollout=rollout, eval_samples=2)
        task.evaluate(Spy({"How many?": "2"}, {"How many?": ["2", "3"]}))
    assert seen == [0.8, 0.5]

    from dllm_rl.config import DLLMRolloutConfig
    from dllm_rl.tasks import Problem

    temps = []

    class Stand(DLLMTask):  # answers "2" to everything, recording the temperature asked for
        def answers(self, policy, problems, temperature, generator=None, progress=None):
            temps.append(temperature)
            return ["2"] * len(problems), torch.ones(len(problems))

    ok = reward_atom("answer")(lambda s: float(s.completion == "2"))
    problems = [Problem("1+1=", "2", "2", {})]
    policy = SimpleNamespace(model=torch.nn.Linear(1, 1))
    for rollout in (DLLMRolloutConfig(temperature=0.8), DLLMRolloutConfig(temperature=0.8, eval_temperature=0.25)):
        Stand("arith", problems, problems, Reward([ok]), answer_atom="answer", rollout=rollout,
              eval_samples=2).evaluate(policy)
    assert temps == [0.0, 0.8, 0.0, 0.25]
