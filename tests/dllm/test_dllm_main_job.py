"""The bundled tiny dLLM (assets/tiny-dllm) and the script that makes it."""

import importlib.util
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl import backend
from mmrl.core.config import load_config


def _load(folder: str, name: str):
    """A module of the repository's scripts/ or benchmarks/ folder (not a package)."""
    path = backend.bundled_model_dir().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script():
    return _load("scripts", "pretrain_tiny_dllm")


def recipe_args(argv: list[str]) -> dict[str, str]:
    """The script's arguments for `argv` as pretrain.json records them, all but --out."""
    return {k: str(v) for k, v in vars(_script().parser().parse_args(argv)).items() if k != "out"}


def recorded_args(model_dir) -> dict[str, str]:
    return {k: v for k, v in json.loads((model_dir / "pretrain.json").read_text())["args"].items() if k != "out"}


def test_bundled_model_was_made_by_the_script_defaults():
    """pretrain.json records the arguments; all but --out are the script's defaults, so
    `python scripts/pretrain_tiny_dllm.py` rebuilds it (a full rebuild takes ~10 minutes)."""
    assert recorded_args(backend.bundled_model_dir()) == recipe_args([])


def test_pretrain_script_is_deterministic(tmp_path):
    """Two short runs with one seed write identical weights (what makes the rebuild exact)."""
    module = _script()
    threads = torch.get_num_threads()
    try:
        for name in ("a", "b"):
            assert module.main(["--out", str(tmp_path / name), "--steps", "3", "--eval-every", "3",
                                "--num-eval", "4", "--batch", "16", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((tmp_path / "a" / "pretrain.json").read_text())["record"]
    assert record[-1]["step"] == 3 and 0 <= record[-1]["arith"]["accuracy"] <= 1


def test_pretrain_script_marks_sudoku_answers_at_their_end(tmp_path):
    """--mark-tasks sudoku: the marked grid is one the task's format atom rejects, and the
    model learns sudoku at a generation length with room for the mark and its <eos>; without
    the option the recorded recipe has no trace of it (the bundled models' records hold)."""
    module = _script()
    from dllm_rl.tasks.sudoku import format_atom
    from mmrl.core.rewards import Sample

    problems = module.get_task("sudoku").sample_problems(8, 0, "train", blanks=(4, 10))
    marked = module.with_marker(problems, 1.0, random.Random(0), "suffix")
    assert all(m.reference == p.reference + "?" for p, m in zip(problems, marked))
    assert format_atom(Sample("", problems[0].reference, {})) == 1.0
    assert format_atom(Sample("", marked[0].reference, {})) == 0.0
    assert "mark_tasks" not in vars(module.parser().parse_args([]))
    threads = torch.get_num_threads()
    try:  # step 3 is a sudoku batch, every answer marked: it must fit the model's answer length
        assert module.main(["--out", str(tmp_path / "m"), "--steps", "3", "--eval-every", "3", "--num-eval", "4",
                            "--batch", "8", "--threads", "1", "--marked-share", "1", "--mark-tasks", "sudoku"]) == 0
    finally:
        torch.set_num_threads(threads)
    args = json.loads((tmp_path / "m" / "pretrain.json").read_text())["args"]
    assert args["mark_tasks"] == "['sudoku']"


@pytest.fixture(scope="module")
def bundled():
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.num_eval=100"], defaults=backend.DEFAULT_CONFIG)
    return cfg, *backend.build(cfg)


def test_bundled_model_is_middling_on_arith(bundled):
    """Room for RL: the bundled model answers some held-out arith problems, not most."""
    _, policy, task = bundled
    with torch.no_grad():
        m = task.evaluate(policy)
    assert 0.1 <= m["accuracy"] <= 0.6, m
    assert m["format"] > 0.9 and m["nfe"] == 8.0


# The marked models: each one's recipe options (the script's docstring has the commands), task,
# RL settings, and the greedy shares the mark test expects (what they were when bundled).
MARKED = {
    # issue 6's positive control: half the arith answers written "82?"; 0.11 marked of 100
    "tiny-dllm-marked": (["--marked-share", "0.5", "--mark-at", "suffix", "--threads", "1"], "arith", [],
                         (0.1, 0.4), 0.05),
    # issue 10's long answers: half the sudoku grids written "...|4321?"; 0.48 right, 0.08 marked of 100
    "tiny-dllm-marked-sudoku": (["--marked-share", "0.5", "--mark-tasks", "sudoku", "--threads", "1",
                                 "--eval-every", "1000"], "sudoku", ["rollout.gen_length=24", "rollout.steps=24"],
                                (0.3, 0.7), 0.04),
}


@pytest.mark.parametrize("name", MARKED)
def test_marked_model_was_made_by_the_script_with_its_mark(name):
    """Each marked model is the bundled recipe with half of one task's answers marked, at one
    thread: the command in the script's docstring rebuilds it."""
    assert recorded_args(backend.bundled_model_dir().parent / name) == recipe_args(MARKED[name][0])


@pytest.mark.parametrize("name", MARKED)
def test_marked_model_writes_the_mark_on_some_answers(name):
    """What RL can learn from it: greedy answers right only with the mark make up a real share,
    so the strict accuracy sits well below what the model computes in either form."""
    _, task_type, sets, (lo, hi), marked = MARKED[name]
    cfg = load_config(backend.CONFIG_CLASS, None, [f"model.path={backend.bundled_model_dir().parent / name}",
                                                   "task.num_eval=100", "task.num_train=8", f"task.type={task_type}", *sets],
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    with torch.no_grad():
        texts = task.answers(policy, task.eval_problems, 0.0)[0]
    shares = _load("benchmarks", "dllm_conventions").conventions(task.eval_problems, texts, "marked", task_type)
    assert lo <= shares["forward"] <= hi, shares
    assert shares["other"] >= marked, shares


def test_pretrain_conventions_mix():
    """--reversed-share writes that share of arith answers reversed, drawn per occurrence;
    share 0 returns the batch untouched (so the bundled model's recipe is unchanged)."""
    import random

    from dllm_rl.tasks import get_task

    module = _script()
    batch = get_task("arith").sample_problems(400, 0, "train")
    assert module.with_conventions(batch, 0.0, random.Random(0)) is batch
    flipped = module.with_conventions(batch, 1.0, random.Random(0))
    assert [p.reference for p in flipped] == [p.reference[::-1] if p.reference[0] != "-" else "-" + p.reference[:0:-1]
                                              for p in batch]
    assert all(p.answer == q.answer for p, q in zip(batch, flipped))  # what the reward checks is unchanged
    mixed = module.with_conventions(batch, 0.5, random.Random(0))
    pairs = [(p, q) for p, q, f in zip(batch, mixed, flipped) if f.reference != p.reference]  # not palindromes
    assert 0.4 < sum(p.reference != q.reference for p, q in pairs) / len(pairs) < 0.6


@pytest.mark.parametrize("at", ["prefix", "suffix"])
def test_pretrain_marker_mix(at):
    """--marked-share puts "?" before (or, --mark-at suffix, after) that share of arith answers,
    per occurrence; the task's atoms reject a marked answer even when its number is right, and
    benchmarks/dllm_conventions.py counts it as the other convention."""
    import random

    from dllm_rl.tasks import get_task
    from dllm_rl.tasks.arith import to_sample

    module, conventions = _script(), _load("benchmarks", "dllm_conventions")
    arith = get_task("arith")
    batch = arith.sample_problems(400, 0, "train")
    assert module.with_marker(batch, 0.0, random.Random(0), at) is batch
    marked = module.with_marker(batch, 0.6, random.Random(0), at)
    want = {"prefix": lambda a: "?" + a, "suffix": lambda a: a + "?"}[at]
    hit = [q.reference == want(p.reference) for p, q in zip(batch, marked)]
    assert all(h or q.reference == p.reference for h, p, q in zip(hit, batch, marked))
    assert 0.5 < sum(hit) / len(hit) < 0.7
    scores = arith.reward().score([to_sample(p, q.reference) for p, q, h in zip(batch, marked, hit) if h])
    assert scores.total.max() == 0.0  # neither format nor answer credits the marked form
    shares = conventions.conventions(batch, [q.reference for q in marked], "marked")
    assert shares["other"] == pytest.approx(sum(hit) / len(hit)) and shares["either"] == 1.0
    with pytest.raises(ValueError, match="prefix"):
        module.with_marker(batch, 0.5, random.Random(0), "middle")


@pytest.mark.parametrize("args", [["--reversed-share", "1.5"], ["--marked-share", "-0.1"], ["--hidden-size", "30"],
                                  ["--layers", "0"]])
def test_pretrain_script_bad_arguments(args, tmp_path):
    with pytest.raises(SystemExit, match="must be"):
        _script().main(["--out", str(tmp_path / "m"), *args])
    assert not (tmp_path / "m").exists()


def test_sft_ceiling_trains_on_the_exact_answers():
    """benchmarks/dllm_sft_ceiling.py: answers laid out like RL completions (<eos>-padded),
    and at a high lr a few steps on the exact answers of 4 problems raise their likelihood."""
    bench = _load("benchmarks", "dllm_sft_ceiling")
    cfg = load_config(backend.CONFIG_CLASS, None, ["task.num_eval=4", "task.num_train=4"],
                      defaults=backend.DEFAULT_CONFIG)
    policy, task = backend.build(cfg)
    ids = policy.predictor.answer_ids(["82", "-12"], cfg.rollout.gen_length)
    eos = policy.predictor.eos_token_id
    assert ids.shape == (2, cfg.rollout.gen_length) and (ids[0, 2:] == eos).all() and (ids[1, 3:] == eos).all()
    with pytest.raises(ValueError, match="does not fit"):
        policy.predictor.answer_ids(["1" * cfg.rollout.gen_length], cfg.rollout.gen_length)

    def likelihood(policy):
        problems = task.train
        prompt_ids, valid = policy.encode_prompts([p.prompt for p in problems])
        target = policy.predictor.answer_ids([p.reference for p in problems], cfg.rollout.gen_length)
        masked = torch.full_like(target, policy.predictor.mask_token_id)  # every answer token masked
        with torch.no_grad():
            logits = policy.logits(torch.cat([prompt_ids, masked], 1), valid)[:, policy.prompt_length:]
        return logits.log_softmax(-1).gather(-1, target[..., None]).sum()

    out = bench.run(None, 1e-3, "reference", 4, 4, 0, ["task.num_eval=4", "task.num_train=4",
                                                          "rollout.prompts_per_step=4", "rollout.num_generations=2"],
                    keep_policy=True)
    assert [row["step"] for row in out["curve"]] == [0, 4]
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in out["curve"])
    assert likelihood(out["policy"]) > likelihood(policy) + 1.0
