"""The dLLM synthetic tasks (dllm_rl/tasks): arith and 4x4 sudoku generators, splits, atoms."""

import operator
import re
import warnings

import pytest
import torch

from dllm_rl.tasks import CHARSET, MAX_CHARS, TASKS, Problem, arith, get_task, split_of, sudoku
from mmrl.core.rewards import Sample

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arith_score(completion, answer):
    s = arith.arith_reward().score([Sample("x=", completion, {"answer": answer})])
    return s.values[0].tolist(), float(s.total[0])


# ---------------------------------------------------------------------------- arith generation


def test_arith_deterministic_and_prefix_stable():
    a = arith.sample_problems(40, seed=3)
    assert a == arith.sample_problems(40, seed=3)
    assert a[:10] == arith.sample_problems(10, seed=3)  # one stream: longer extends shorter
    assert [p.prompt for p in a] != [p.prompt for p in arith.sample_problems(40, seed=4)]


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_arith_splits_disjoint(digits):
    train = {
        p.prompt for s in range(3) for p in arith.sample_problems(500, s, "train", digits=digits)
    }
    held = {
        p.prompt for s in range(3) for p in arith.sample_problems(200, s, "eval", digits=digits)
    }
    assert train and held and not train & held
    assert all(split_of("arith", q) == "eval" for q in held)


@pytest.mark.parametrize(
    "kwargs", [{}, {"digits": 1}, {"digits": 3, "mul_digits": 2}, {"digits": arith.MAX_DIGITS}]
)
def test_arith_answers_charset_and_length(kwargs):
    digits = kwargs.get("digits", 2)
    mul_digits = kwargs.get("mul_digits", digits)
    seen_ops, negative = set(), False
    for p in arith.sample_problems(300, 0, **kwargs):
        m = re.fullmatch(r"(0|[1-9][0-9]*)([-+*])(0|[1-9][0-9]*)=", p.prompt)
        assert m, p.prompt
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        width = mul_digits if op == "*" else digits
        assert a < 10**width and b < 10**width
        assert p.answer == p.reference == p.meta["answer"] == str(OPS[op](a, b))
        assert (p.meta["a"], p.meta["op"], p.meta["b"]) == (a, op, b)
        assert set(p.prompt + p.reference) <= set(CHARSET)
        assert len(p.prompt) + len(p.reference) <= MAX_CHARS
        seen_ops.add(op)
        negative |= p.answer.startswith("-")
    assert seen_ops == {"+", "-", "*"} and negative


def test_arith_multiplication_sizes():
    # digits=2: both 2x1 and 2x2-digit products occur
    sizes = {
        (len(str(p.meta["a"])), len(str(p.meta["b"])))
        for p in arith.sample_problems(300, 0, ops=("*",))
    }
    assert {(2, 1), (2, 2), (1, 2), (1, 1)} <= sizes


def test_arith_bad_arguments():
    with pytest.raises(ValueError, match="digits"):
        arith.sample_problems(3, 0, digits=0)
    with pytest.raises(ValueError, match="ops"):
        arith.sample_problems(3, 0, ops=("/",))
    with pytest.raises(ValueError, match="split"):
        arith.sample_problems(3, 0, split="test")


# ---------------------------------------------------------------------------- arith atoms


@pytest.mark.parametrize(
    "completion, answer, values",
    [
        ("82", "82", [1.0, 1.0]),  # exact
        (" 82\n", "82", [1.0, 1.0]),  # surrounding whitespace allowed
        ("082", "82", [1.0, 1.0]),  # integer match: a leading zero is the same integer
        ("83", "82", [1.0, 0.0]),  # wrong digit
        ("12", "-12", [1.0, 0.0]),  # missing '-'
        ("-12", "-12", [1.0, 1.0]),
        ("-12", "12", [1.0, 0.0]),  # extra '-'
        ("82 ok", "82", [0.0, 0.0]),  # extra text: format fails, answer gated to 0
        ("82=82", "82", [0.0, 0.0]),
        ("8 2", "82", [0.0, 0.0]),
        ("+82", "82", [0.0, 0.0]),
        ("--12", "12", [0.0, 0.0]),
        ("", "82", [0.0, 0.0]),
    ],
)
def test_arith_atoms(completion, answer, values):
    got, total = arith_score(completion, answer)
    assert got == values
    assert total == pytest.approx(0.1 * values[0] + 1.0 * values[1])  # weights 0.1, 1.0


def test_arith_reward_names_and_accuracy():
    assert arith.arith_reward().names == ["format", "answer"]
    probs = [
        Problem("37+45=", "82", "82", {"answer": "82"}),
        Problem("7-19=", "-12", "-12", {"answer": "-12"}),
    ]
    assert arith.accuracy(probs, ["82", "-12"]) == 1.0
    assert arith.accuracy(probs, ["82", "12"]) == 0.5  # missing '-'
    assert arith.accuracy(probs, ["82 ", "-12 is it"]) == 0.5  # bad format -> answer gated
    with pytest.raises(ValueError):
        arith.accuracy(probs, ["82"])


# ---------------------------------------------------------------------------- sudoku solver

SOLUTION = "1234|3412|2143|4321"
PUZZLE = "1204|0012|2100|4320"  # blanks: (0,2) (1,0) (1,1) (2,2) (2,3) (3,3)


def test_all_grids():
    grids = sudoku.all_grids()
    assert len(grids) == 288 == len(set(grids))  # the known count of 4x4 sudoku grids
    assert all(sudoku.count_satisfied(g) == 12 for g in grids)
    assert sudoku.from_rows(SOLUTION) in grids


def test_from_rows_takes_rows_or_16_flat_cells_and_nothing_between():
    flat = "1234341221434321"
    assert sudoku.from_rows(SOLUTION) == sudoku.from_rows(SOLUTION + "=") == sudoku.from_rows(flat) == flat
    for bad in ("1|234|3412|2143|4321", "1234||3412|2143|4321", "12343412|2143|4321", "1234|3412|2143|4321|",
                "1234|3412|2143|432", "1234|3412|2143|4325"):
        with pytest.raises(ValueError, match="not a 4x4 sudoku"):
            sudoku.from_rows(bad)


def test_solve_hand_puzzles():
    # row 0 "12_4" -> 3, row 3 "432_" -> 1; row 1 "__12": column 0 holds 1,2,4 -> 3, then 4;
    # row 2 "21__": column 2 holds 3,1,2 -> 4, then 3. Unique.
    assert sudoku.solve(PUZZLE + "=") == [SOLUTION]
    # rows 2-3 blank: columns need {2,4},{1,3},{2,4},{1,3}; row 2 picks column 0 and 1
    # (2 x 2 ways), the rest follows: 4 solutions.
    assert sudoku.solve("1234|3412|0000|0000") == [
        "1234|3412|2143|4321",
        "1234|3412|2341|4123",
        "1234|3412|4123|2341",
        "1234|3412|4321|2143",
    ]
    assert len(sudoku.solve("0" * 16)) == 288
    assert sudoku.solve("1100|0000|0000|0000") == []  # two 1s in row 0
    with pytest.raises(ValueError):
        sudoku.solve("1234|5678")


# ---------------------------------------------------------------------------- sudoku generation


def test_sudoku_deterministic_and_prefix_stable():
    a = sudoku.sample_problems(30, seed=1)
    assert a == sudoku.sample_problems(30, seed=1)
    assert a[:7] == sudoku.sample_problems(7, seed=1)
    assert [p.prompt for p in a] != [p.prompt for p in sudoku.sample_problems(30, seed=2)]


def test_sudoku_splits_disjoint():
    train = {p.prompt for s in range(3) for p in sudoku.sample_problems(400, s, "train")}
    held = {p.prompt for s in range(3) for p in sudoku.sample_problems(100, s, "eval")}
    assert len(held) > 50 and not train & held
    assert all(split_of("sudoku", q) == "eval" for q in held)


@pytest.mark.parametrize("blanks", [(4, 10), 12, (0, 2)])
def test_sudoku_puzzles_unique_and_well_formed(blanks):
    lo, hi = (blanks, blanks) if isinstance(blanks, int) else blanks
    seen = set()
    for p in sudoku.sample_problems(200 if blanks == (4, 10) else 20, 0, blanks=blanks):
        assert re.fullmatch(r"[0-4]{4}(\|[0-4]{4}){3}=", p.prompt)
        assert p.prompt == p.meta["puzzle"] + "="
        assert sudoku.solve(p.prompt) == [p.reference]  # exactly one solution, the reference
        assert p.answer == p.reference == p.meta["answer"]
        k = p.prompt.count("0")
        assert k == p.meta["blanks"] and lo <= k <= hi
        assert set(p.prompt + p.reference) <= set(CHARSET)
        assert len(p.prompt) + len(p.reference) <= MAX_CHARS
        seen.add(k)
    if blanks == (4, 10):
        assert seen == set(range(4, 11))


def test_sudoku_bad_blanks():
    for bad in (13, (5, 4), (-1, 3)):
        with pytest.raises(ValueError, match="blanks"):
            sudoku.sample_problems(2, 0, blanks=bad)


# ---------------------------------------------------------------------------- sudoku atoms


def sudoku_score(completion, puzzle=PUZZLE, answer=SOLUTION):
    s = sudoku.sudoku_reward().score(
        [Sample(puzzle + "=", completion, {"puzzle": puzzle, "answer": answer})]
    )
    return s.values[0].tolist(), float(s.total[0])


@pytest.mark.parametrize(
    "completion, values",
    [
        # [format, givens, constraints, solved]
        (SOLUTION, [1, 1, 1, 1]),
        (" 1234|3412|2143|4321\n", [1, 1, 1, 1]),
        # wrong digit in blank (3,3): row 3, column 3 and box 3 broken -> 9/12
        ("1234|3412|2143|4322", [1, 1, 9 / 12, 0]),
        # swap blanks (1,0)<->(1,1), same row and box: columns 0 and 1 broken -> 10/12
        ("1234|4312|2143|4321", [1, 1, 10 / 12, 0]),
        # swap blanks (0,2)<->(2,2), same column, boxes 1 and 3: rows 0, 2 and boxes 1, 3
        # broken -> 8/12
        ("1244|3412|2133|4321", [1, 1, 8 / 12, 0]),
        # digits 1<->2 relabelled: a valid grid (12/12) that changes the given 1 at (0,0)
        ("2134|3421|1243|4312", [1, 0, 1, 0]),
        # malformed: gated, children 0 (and never called: _grid would raise)
        ("1234|3412|2143", [0, 0, 0, 0]),
        ("1234|3412|2143|4325", [0, 0, 0, 0]),
        ("1234|3412|2143|4320", [0, 0, 0, 0]),
        ("1234 3412 2143 4321", [0, 0, 0, 0]),
        ("1234|3412|2143|4321|", [0, 0, 0, 0]),
        ("1234|3412|2143|4321 ok", [0, 0, 0, 0]),
        ("12343412|2143|4321", [0, 0, 0, 0]),
        ("", [0, 0, 0, 0]),
    ],
)
def test_sudoku_atoms(completion, values):
    got, total = sudoku_score(completion)
    assert got == pytest.approx(values)
    weights = [0.1, 0.2, 0.3, 1.0]
    assert total == pytest.approx(sum(w * v for w, v in zip(weights, values)))


def test_sudoku_swapped_pair_total_by_hand():
    # 0.1 (format) + 0.2 (givens) + 0.3 * 8/12 (constraints) + 0 (solved) = 0.5
    assert sudoku_score("1244|3412|2133|4321")[1] == pytest.approx(0.5)


def test_sudoku_accuracy():
    probs = sudoku.sample_problems(4, 0)
    refs = [p.reference for p in probs]
    assert sudoku.accuracy(probs, refs) == 1.0
    assert sudoku.accuracy(probs, refs[:2] + ["1111|1111|1111|1111", "nope"]) == 0.5


# ---------------------------------------------------------------------------- registry


@pytest.mark.parametrize("name", ["arith", "sudoku"])
def test_registry(name):
    task = get_task(name)
    assert task is TASKS[name] and task.name == name
    probs = task.sample_problems(6, 0, "eval")
    samples = [task.to_sample(p, p.reference) for p in probs]
    scores = task.reward().score(samples)
    assert task.success_atom in scores.names
    assert scores.values.min() == 1.0  # the reference earns every atom
    assert task.accuracy(probs, [p.reference for p in probs]) == 1.0
    assert task.accuracy(probs, ["?"] * len(probs)) == 0.0


@pytest.mark.parametrize("name", ["arith", "sudoku"])
def test_parse_problem_recovers_every_generated_problem(name):
    task = get_task(name)
    for p in task.sample_problems(30, 0, "eval"):
        assert task.parse_problem(p.prompt) == p


@pytest.mark.parametrize("name, prompt", [
    ("arith", "12+3"), ("arith", "012+3="), ("arith", "1+2+3="), ("arith", " 12+3="), ("arith", "1" * 10 + "+1="),
    ("sudoku", "1204|0012|2100|4320"), ("sudoku", "1205|0012|2100|4320="),
    ("sudoku", "0000|0000|0000|0000="),  # 288 solutions: "solved" has no one answer
    ("sudoku", "1100|0000|0000|0000="),  # none
])
def test_parse_problem_refuses_other_text(name, prompt):
    assert get_task(name).parse_problem(prompt) is None


def test_unknown_task():
    with pytest.raises(ValueError, match="arith, sudoku"):
        get_task("gsm8k")


@pytest.mark.parametrize("answer, reversed_", [("184", "481"), ("-12", "-21"), ("7", "7"), ("-120", "-021"), ("0", "0")])
def test_arith_reverse_digits(answer, reversed_):
    assert arith.reverse_digits(answer) == reversed_
    assert arith.reverse_digits(arith.reverse_digits(answer)) == answer
    # the answer atom accepts the reversed form only where it reads as the same integer
    got, _ = arith_score(reversed_, answer)
    assert got[1] == float(arith.parse_integer(reversed_) == int(answer))


def test_heldout_accuracy_is_exact_share():
    """105 right of 200 is 0.525, not float32's 0.52499998 (which misses a 0.525 target)."""
    from dllm_rl.task import DLLMTask

    problems = arith.sample_problems(200, seed=0, split="eval")
    task = DLLMTask("arith", problems, problems, arith.arith_reward(), answer_atom="answer",
                    rollout=None)
    texts = [p.reference if i < 105 else "x" for i, p in enumerate(problems)]
    task.answers = lambda policy, probs, temperature, generator=None, progress=None: (texts, torch.full((200,), 8))
    m = task._evaluate(policy=None)
    assert m["accuracy"] == 0.525 and float(torch.tensor([1.0] * 105 + [0.0] * 95).mean()) != 0.525


# ---------------------------------------------------------------------------- jsonl (users' own problems)


def test_jsonl_problems_their_fields_and_the_answer_atom(tmp_path):
    from dllm_rl.tasks import jsonl

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "12+7=", "answer": 19}\n\n'
                    '{"prompt": "opposite of up:", "answer": "down", "reference": "down", "source": "quiz"}\n')
    a, b = jsonl.load_problems(path)
    assert (a.prompt, a.answer, a.reference, a.meta) == ("12+7=", "19", "19", {"answer": "19"})
    assert b.meta == {"source": "quiz", "answer": "down"}
    scores = jsonl.jsonl_reward().score([jsonl.to_sample(a, " 19\n"), jsonl.to_sample(a, "190"),
                                         jsonl.to_sample(b, "Down")])
    assert scores.names == ["answer"] and scores.total.tolist() == [1.0, 0.0, 0.0]  # case counts
    assert jsonl.accuracy([a, b], ["19", "down"]) == 1.0
    assert get_task("jsonl").success_atom == "answer" and jsonl.parse_problem("12+7=") is None


@pytest.mark.parametrize("line, where", [
    ('{"answer": 1}', "line 1, field 'prompt': missing"),
    ('{"prompt": 5, "answer": 1}', "field 'prompt': must be a string, got a number"),
    ('{"prompt": "  ", "answer": 1}', "field 'prompt': is empty"),
    ('{"prompt": "1=", "answer": true}', "field 'answer': must be a string or a number, got a boolean"),
    ('{"prompt": "1=", "answer": ""}', "field 'answer': is empty"),
    ('{"prompt": "1=", "answer": 1, "reference": ""}', "field 'reference': must be a non-empty string"),
    ('["1=", 1]', "line 1: expected a JSON object, got a list"),
    ('{"prompt": "1=", "answer": 1', "line 1: invalid JSON"),
    ("", "empty dataset"),
    # a float whose text is not the number written: 1e30 read as "1000000000000000019884624838656"
    ('{"prompt": "1=", "answer": 1e30}', "field 'answer': the number 1e+30 has no exact plain text"),
    ('{"prompt": "1=", "answer": 1e-7}', "field 'answer': the number 1e-07 has no exact plain text"),
    ('{"prompt": "1=", "answer": 9007199254740993.0}', "field 'answer': the number 9007199254740992.0 has no"),
])
def test_jsonl_bad_lines_name_the_file_line_and_field(tmp_path, line, where):
    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import DatasetError

    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=re.escape(where)) as e:
        jsonl.load_problems(path)
    assert str(path) in str(e.value)


def test_jsonl_task_config_needs_both_files_and_only_jsonl_reads_them():
    from dllm_rl.config import DLLMTaskConfig

    assert DLLMTaskConfig(type="jsonl", train_path="a.jsonl", eval_path="b.jsonl").train_path == "a.jsonl"
    with pytest.raises(ValueError, match="jsonl needs task.train_path and task.eval_path"):
        DLLMTaskConfig(type="jsonl", train_path="a.jsonl")
    with pytest.raises(ValueError, match="task.eval_path is read by task.type jsonl only"):
        DLLMTaskConfig(type="sudoku", eval_path="b.jsonl")
    with pytest.raises(ValueError, match="jsonl takes none"):
        DLLMTaskConfig(type="jsonl", train_path="a", eval_path="b", options={"digits": 2})


def test_jsonl_reference_of_spaces_is_refused_and_the_answer_compares_stripped(tmp_path):
    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import DatasetError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1=", "answer": 1, "reference": "  "}\n')
    with pytest.raises(DatasetError, match="line 1, field 'reference': must be a non-empty string"):
        jsonl.load_problems(path)
    path.write_text('{"prompt": "12+7=", "answer": " 19 "}\n')
    (p,) = jsonl.load_problems(path)
    assert p.answer == " 19 "  # kept as written; the atom strips both sides
    assert jsonl.jsonl_reward().score([jsonl.to_sample(p, "19"), jsonl.to_sample(p, "18")]).total.tolist() == [1.0, 0.0]


def test_jsonl_answer_outside_the_models_characters_is_refused_before_training(tmp_path):
    """With a reference of its own, a line's answer is checked too: an answer the model cannot
    write would score 0 on every sample."""
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError, load_config

    (tmp_path / "t.jsonl").write_text('{"prompt": "opposite of up:", "answer": "Down", "reference": "down"}\n')
    cfg = load_config(DLLMTrainConfig, overrides=["task.type=jsonl", f"task.train_path={tmp_path / 't.jsonl'}",
                                                  f"task.eval_path={tmp_path / 't.jsonl'}"])
    with pytest.raises(ConfigError, match=r"cannot encode the answer 'Down' of 'opposite of up:'.*: 'D' \(U\+0044\) "
                                          r"at character 1 has no token \(the tiny"):  # not "Missing \[UNK\] token"
        backend.build(cfg)


def test_a_prompt_the_tokenizer_cannot_encode_names_the_character(make_run):
    from dllm_rl.policy import PromptError

    _, policy, _ = make_run()
    with pytest.raises(PromptError, match=r"prompt 'caf\u00e9 2\+2=' cannot be encoded by the model's tokenizer: "
                                          r"'\u00e9' \(U\+00E9\) at character 4 has no token"):
        policy.encode_prompts(["caf\u00e9 2+2="])


# ---------------------------------------------------------------------------- audit: what the suite let through


def test_split_of_holds_out_a_tenth_of_prompts_per_task():
    # 1024 prompts "a+b=" (a, b < 32): a tenth of them (sd ~0.009) is "eval", and the hash
    # reads the task's name too, so another task splits the same prompts another way
    prompts = [f"{a}+{b}=" for a in range(32) for b in range(32)]
    share = sum(split_of("arith", q) == "eval" for q in prompts) / len(prompts)
    assert 0.07 < share < 0.13
    assert any(split_of("arith", q) != split_of("sudoku", q) for q in prompts)


def test_success_atoms_are_the_right_answer_atoms():
    # what eval accuracy and SLIM-RL count: a well-formed wrong answer is not a success
    # (arith "83" for 82 passes "format"; a valid grid that is not the solution earns
    # "constraints" 12/12 but not "solved")
    for name, atom, reference, wrong, problem in [
        ("arith", "answer", "82", "83", Problem("37+45=", "82", "82", {"answer": "82"})),
        ("sudoku", "solved", SOLUTION, "2134|3421|1243|4312",
         Problem(PUZZLE + "=", SOLUTION, SOLUTION, {"puzzle": PUZZLE, "answer": SOLUTION})),
    ]:
        task = get_task(name)
        assert task.success_atom == atom
        scores = task.reward().score([task.to_sample(problem, reference), task.to_sample(problem, wrong)])
        assert scores.values[:, scores.names.index(task.success_atom)].tolist() == [1.0, 0.0]
        assert task.accuracy([problem, problem], [reference, wrong]) == 0.5


def test_module_parse_problem_dispatches_on_the_task_name():
    from dllm_rl.tasks import parse_problem

    assert parse_problem("arith", "37+45=").answer == "82"
    assert parse_problem("sudoku", PUZZLE + "=").answer == SOLUTION
    assert parse_problem("gsm8k", "37+45=") is None
    assert parse_problem("sudoku", "37+45=") is None


def test_get_task_of_an_unhashable_name_is_a_value_error():
    with pytest.raises(ValueError, match="arith, sudoku"):
        get_task(["arith"])


def test_accuracy_counts_an_atom_of_exactly_one_half_as_a_success():
    from dllm_rl.tasks import atom_accuracy

    # rows 4/4; columns 0/4; boxes 0 and 1 hold 1-4, boxes 2 ({1,2}) and 3 ({3,4}) do not: 6/12
    problem = Problem(PUZZLE + "=", SOLUTION, SOLUTION, {"puzzle": PUZZLE, "answer": SOLUTION})
    assert atom_accuracy(sudoku.sudoku_reward(), "constraints", [problem], ["1234|3412|1234|1234"]) == 1.0
    assert atom_accuracy(sudoku.sudoku_reward(), "constraints", [problem], ["1111|2222|3333|4444"]) == 0.0  # 4/12


def test_accuracy_of_no_problems_is_refused():
    with pytest.raises(ValueError, match="empty"):
        arith.accuracy([], [])
    with pytest.raises(ValueError, match="empty"):
        sudoku.accuracy([], [])


def test_atoms_name_a_completion_that_is_not_text_and_a_missing_meta_field():
    from mmrl.core.rewards import RewardError

    with pytest.raises(RewardError, match="decoded completion text"):
        arith.arith_reward().score([Sample("1+1=", [2], {"answer": "2"})])
    with pytest.raises(RewardError, match="decoded completion text"):
        sudoku.sudoku_reward().score([Sample(PUZZLE + "=", [1, 2], {"puzzle": PUZZLE, "answer": SOLUTION})])
    with pytest.raises(RewardError, match="sample.meta must hold 'answer'"):
        arith.arith_reward().score([Sample("1+1=", "2", {"a": 1})])


# ---------------------------------------------------------------------------- audit: arith


def test_arith_nine_digit_operands_parse_and_score():
    # (10^9 - 1)^2 = 10^18 - 2 * 10^9 + 1 = 999999998000000001: MAX_DIGITS (9) digits per
    # operand are a problem of the task, and its 18-digit answer scores
    p = arith.parse_problem("999999999*999999999=")
    assert p is not None and p.answer == "999999998000000001"
    assert arith_score("999999998000000001", p.answer)[0] == [1.0, 1.0]
    assert arith.parse_problem("1+1111111111=") is None  # a 10-digit second operand
    assert len(arith.sample_problems(2, 0, digits=9)) == 2
    with pytest.raises(ValueError, match="digits"):
        arith.sample_problems(2, 0, digits=10)


def test_arith_operands_cover_zero_and_each_digit_counts_bounds():
    # _operand draws a digit count d in 1..max_digits, then a value in 0..9 (d = 1) or
    # 10^(d-1)..10^d - 1: a rng that records its ranges and answers with the bound asked
    class Bound:
        def __init__(self, pick):
            self.pick, self.calls = pick, []

        def randint(self, lo, hi):
            self.calls.append((lo, hi))
            return self.pick(lo, hi)

    low = Bound(lambda lo, hi: lo)
    assert arith._operand(low, 3) == 0 and low.calls == [(1, 3), (0, 9)]
    high = Bound(lambda lo, hi: hi)
    assert arith._operand(high, 3) == 999 and high.calls == [(1, 3), (100, 999)]
    two = Bound(lambda lo, hi: 2 if (lo, hi) == (1, 3) else lo)
    assert arith._operand(two, 3) == 10 and two.calls == [(1, 3), (10, 99)]


def test_arith_solve_refuses_an_unknown_operator():
    with pytest.raises(ValueError, match="unknown operator"):
        arith.solve(6, "/", 3)


@pytest.mark.parametrize("kwargs", [{"ops": ()}, {"digits": 2.0}, {"mul_digits": 0}, {"digits": True}])
def test_arith_more_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="ops" if "ops" in kwargs else "digits"):
        arith.sample_problems(3, 0, **kwargs)


def test_no_problems_is_an_empty_list_and_a_negative_count_is_refused():
    assert arith.sample_problems(0, 0) == [] and sudoku.sample_problems(0, 0) == []
    for module in (arith, sudoku):
        with pytest.raises(ValueError, match="n must be >= 0"):
            module.sample_problems(-1, 0)


# ---------------------------------------------------------------------------- audit: sudoku


def test_sudoku_default_blanks_are_four_to_ten():
    assert {p.meta["blanks"] for p in sudoku.sample_problems(200, 0)} == set(range(4, 11))


def test_sudoku_refuses_a_short_grid_and_a_second_equals_sign():
    for text in ("1234|3412", "1204|0012|2100|4320==", "1204|0012|2100|43200"):
        with pytest.raises(ValueError, match="not a 4x4 sudoku"):
            sudoku.solve(text)


def test_sudoku_blanks_must_be_integers_up_to_twelve():
    for bad in ((2.5, 4), (4, 10.0), (10, 13), True, (True, 4)):  # a bool is no count
        with pytest.raises(ValueError, match=r"integer|<= 12"):
            sudoku.sample_problems(2, 0, blanks=bad)


def test_sudoku_blanking_skips_a_cell_that_would_admit_a_second_solution():
    # cells blanked in order 0, 1, 2, ...: after row 0 and cells 4, 5, blanking cell 6 leaves
    # "0000|0002|2143|4321", where row 0 must be (1 or 3, 2, 3 or 1, 4) and row 1 (3 or 1,
    # 4, 1 or 3, 2): two solutions, so cell 6 keeps its 1 and the pass goes on to later cells
    class InOrder:
        def shuffle(self, cells):
            pass

    puzzle = sudoku._blank(InOrder(), sudoku.from_rows(SOLUTION), 7)
    assert puzzle is not None and puzzle.count("0") == 7
    assert puzzle[:6] == "000000" and puzzle[6] == "1"
    assert sudoku.solve(puzzle) == [SOLUTION]


def test_sudoku_atoms_called_alone_refuse_a_malformed_grid():
    # gated by "format" inside a Reward; called on their own they raise rather than score
    sample = Sample(PUZZLE + "=", "1234|3412|2143", {"puzzle": PUZZLE, "answer": SOLUTION})
    for atom in (sudoku.givens_atom, sudoku.constraints_atom, sudoku.solved_atom):
        with pytest.raises(ValueError, match="not a 4x4 grid"):
            atom(sample)


def test_an_integer_past_pythons_digit_limit_is_well_formed_and_wrong():
    """5000 nines are one integer (format 1) and not the answer (answer 0); int() of them would
    raise past Python's 4300-digit limit, failing the atom instead of scoring it."""
    scores = arith.arith_reward().score([Sample("1+0=", "9" * 5000, {"answer": "1"})])
    assert scores.values.tolist() == [[1.0, 0.0]]
    assert arith.parse_integer("9" * 5000) is None and arith.parse_integer(" -12 ") == -12


# ---------------------------------------------------------------------------- audit: DLLMTask's held-out evaluation


class _Decoder:
    """A stand-in dLLM policy: the greedy answer to prompt q is greedy[q]; its j-th sampled
    answer sampled[q][j]; each answer's NFE is nfe[q]. It records (rows, temperature,
    strategy, model.training) of every decode call."""

    def __init__(self, greedy, nfe, sampled=None):
        self.greedy, self.nfe, self.sampled = greedy, nfe, sampled
        self.model = torch.nn.Linear(1, 1)
        self.calls, self.drawn = [], {}

    def decode(self, prompts, generator, temperature, strategy=None):
        from types import SimpleNamespace

        self.calls.append((len(prompts), temperature, strategy, self.model.training))
        if temperature == 0.0:
            texts = [self.greedy[q] for q in prompts]
        else:
            texts = []
            for q in prompts:
                j = self.drawn[q] = self.drawn.get(q, -1) + 1
                texts.append(self.sampled[q][j])
        return SimpleNamespace(completion=texts, nfe=torch.tensor([self.nfe[q] for q in prompts])), None

    def answer_text(self, completion):
        return list(completion)


def _dllm_reward():
    """correct: 1 for the answer, 0.5 for "half", else 0; short: 1 for an answer under 3 characters."""
    from mmrl.core.rewards import Reward, reward_atom

    correct = reward_atom("correct")(lambda s: 1.0 if s.completion == s.meta["answer"] else
                                     0.5 if s.completion == "half" else 0.0)
    short = reward_atom("short", weight=0.5)(lambda s: float(len(s.completion) < 3))
    return Reward([correct, short])


PROBLEMS = [Problem("1+1=", "2", "ref 2", {"answer": "2"}), Problem("2+2=", "4", "ref 4", {"answer": "4"}),
            Problem("3+3=", "6", "ref 6", {"answer": "6"})]


def _dllm_task(eval_samples=0, batch_size=128):
    from types import SimpleNamespace

    from dllm_rl.task import DLLMTask

    rollout = SimpleNamespace(eval_strategy="ar", temperature=0.7)
    return DLLMTask("arith", PROBLEMS, PROBLEMS, _dllm_reward(), answer_atom="correct", rollout=rollout,
                    batch_size=batch_size, eval_samples=eval_samples)


def test_a_dllm_task_needs_both_training_and_held_out_problems():
    from dllm_rl.task import DLLMTask

    for train, evaluation in (([], PROBLEMS), (PROBLEMS, [])):
        with pytest.raises(ValueError, match="needs training and held-out problems"):
            DLLMTask("arith", train, evaluation, _dllm_reward(), answer_atom="correct", rollout=None)


def test_a_dllm_task_from_python_takes_problems_or_jsonl_like_dicts():
    """From Python a task's problems may be Problems or dicts read as JSONL lines; anything
    else is a ValueError (TypeError for the wrong kind of item) naming the item (a dict was `'dict' object has no attribute 'prompt'`
    inside the backend, a number answer the tokenizer's error)."""
    from dllm_rl.task import DLLMTask

    def task(train):
        return DLLMTask("mine", train, PROBLEMS, _dllm_reward(), answer_atom="correct", rollout=None)

    made = task([{"prompt": "1+1=", "answer": 2, "source": "quiz"}, PROBLEMS[0]])
    first = made.train[0]
    assert (first.prompt, first.answer, first.reference) == ("1+1=", "2", "2")  # a number answer as text
    assert first.meta == {"source": "quiz", "answer": "2"} and made.train[1] is PROBLEMS[0]
    for train, message in (
        ([PROBLEMS[0], {"answer": "2"}], "task 'mine': train item 1, field 'prompt': "),
        ([Problem("1+1=", 2, "2")], "train item 0: Problem.answer must be a non-empty string, got 2"),
        ([Problem("", "2", "2")], "train item 0: Problem.prompt must be a non-empty string"),
        (["1+1="], "train item 0 is a str: give a dllm_rl.tasks.Problem or a dict"),
    ):
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            task(train)


def test_greedy_evaluation_by_hand_in_batches_in_eval_mode():
    """Greedy answers 2 (right), 5 (wrong), "half" to 3 problems: accuracy (the correct atom)
    (1 + 0 + 0.5) / 3 = 0.5; short (1 + 1 + 0) / 3; reward (1.5 + 0.5 + 0.5) / 3 = 5/6;
    nfe (4 + 6 + 8) / 3 = 6. Batches of 2: decode calls of 2 then 1 row, at temperature 0
    with rollout.eval_strategy, with the model in eval mode, and its mode restored after."""
    task = _dllm_task(batch_size=2)
    policy = _Decoder({"1+1=": "2", "2+2=": "5", "3+3=": "half"}, {"1+1=": 4, "2+2=": 6, "3+3=": 8})
    out = task.evaluate(policy)
    assert out == pytest.approx({"reward": 5 / 6, "nfe": 6.0, "accuracy": 0.5, "short": 2 / 3})
    assert policy.calls == [(2, 0.0, "ar", False), (1, 0.0, "ar", False)]
    assert policy.model.training
    policy.model.eval()
    task.evaluate(policy)
    assert not policy.model.training


def test_pass_at_k_over_sampled_answers_by_hand():
    """n = 4 samples each. 1+1=: right once (c = 1); 2+2=: never (c = 0); 3+3=: "half" twice
    and right once (c = 3: an atom of 0.5 is a success).
    pass@1 = (1/4 + 0 + 3/4) / 3 = 1/3; pass@2 = (1 - C(3,2)/C(4,2) + 0 + 1) / 3 = 1/2;
    pass@3 = (1 - C(3,3)/C(4,3) + 0 + 1) / 3 = 7/12; pass@4 = (1 + 0 + 1) / 3 = 2/3."""
    task = _dllm_task(eval_samples=4)
    sampled = {"1+1=": ["2", "3", "3", "3"], "2+2=": ["1", "1", "1", "1"], "3+3=": ["half", "half", "6", "0"]}
    policy = _Decoder({"1+1=": "2", "2+2=": "4", "3+3=": "6"}, {"1+1=": 4, "2+2=": 6, "3+3=": 11}, sampled)
    out = task.evaluate(policy)
    assert {k: v for k, v in out.items() if k.startswith("pass@")} == pytest.approx(
        {"pass@1": 1 / 3, "pass@2": 1 / 2, "pass@3": 7 / 12, "pass@4": 2 / 3})
    assert out["sampled_nfe"] == pytest.approx(7.0) and out["accuracy"] == 1.0  # (4 + 6 + 11) / 3
    assert policy.calls[-1] == (12, 0.7, "ar", False)  # the 4 copies of each problem, at the rollout temperature


def test_one_sample_per_problem_reports_pass_at_1():
    task = _dllm_task(eval_samples=1)
    policy = _Decoder({"1+1=": "2", "2+2=": "4", "3+3=": "6"}, dict.fromkeys(("1+1=", "2+2=", "3+3="), 2),
                      {"1+1=": ["2"], "2+2=": ["0"], "3+3=": ["0"]})
    out = task.evaluate(policy)
    assert out["pass@1"] == pytest.approx(1 / 3) and "pass@2" not in out


def test_save_samples_writes_the_first_count_greedy_answers_with_the_gold_answer(tmp_path):
    import json

    task = _dllm_task()
    policy = _Decoder({"1+1=": "2", "2+2=": "5", "3+3=": "6"}, {"1+1=": 4, "2+2=": 6, "3+3=": 8})
    path = task.save_samples(policy, tmp_path / "out", "before", count=2)
    assert path == tmp_path / "out" / "samples_before.json"
    assert json.loads(path.read_text()) == [{"prompt": "1+1=", "answer": "2", "completion": "2", "nfe": 4.0},
                                            {"prompt": "2+2=", "answer": "4", "completion": "5", "nfe": 6.0}]


def test_save_samples_right_after_evaluate_takes_its_greedy_answers_instead_of_decoding_again(tmp_path):
    """The trainer saves the samples just after evaluating, under the same weights: the first 2 of
    the evaluation's 3 greedy answers, with no decode of their own, the same rows as a fresh
    decode; taken once (a second save decodes again), and never for another policy."""
    import json

    task = _dllm_task()
    answers = ({"1+1=": "2", "2+2=": "5", "3+3=": "6"}, {"1+1=": 4, "2+2=": 6, "3+3=": 8})
    policy = _Decoder(*answers)
    task.evaluate(policy)
    first = task.save_samples(policy, tmp_path, "before", count=2)
    assert [n for n, *_ in policy.calls] == [3]
    again = task.save_samples(policy, tmp_path, "again", count=2)
    assert [n for n, *_ in policy.calls] == [3, 2]
    assert json.loads(first.read_text()) == json.loads(again.read_text()) == [
        {"prompt": "1+1=", "answer": "2", "completion": "2", "nfe": 4.0},
        {"prompt": "2+2=", "answer": "4", "completion": "5", "nfe": 6.0}]
    other = _Decoder(*answers)
    task.evaluate(policy)
    task.save_samples(other, tmp_path, "other", count=2)
    assert [n for n, *_ in other.calls] == [2]


def test_heldout_reward_and_nfe_are_exact_shares():
    """Reward 1 on 105 of 200 problems and NFE 1 on the same 105 (else 0): reward and nfe 0.525,
    float64 means as accuracy's, not float32's 0.52499998."""
    from mmrl.core.rewards import Reward, reward_atom

    task = _dllm_task()
    task.eval_problems = [Problem(f"{i}=", "a", "a", {"answer": "a"}) for i in range(200)]
    task.reward = Reward([reward_atom("correct")(lambda s: float(s.completion == s.meta["answer"]))])
    task.answers = lambda policy, probs, temperature, generator=None, progress=None: (
        ["a" if i < 105 else "b" for i in range(200)], torch.tensor([1.0] * 105 + [0.0] * 95))
    out = task._evaluate(policy=None)
    assert out["reward"] == 0.525 and out["nfe"] == 0.525 and out["accuracy"] == 0.525


def test_jsonl_file_at_fault_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """A missing eval_path (or a bad line) is found in a second: before, the model loaded first
    (minutes for an 8B one) and only then was the file read."""
    from dllm_rl import backend, models
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError, load_config

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the task's files were read")

    monkeypatch.setattr(models, "load_mask_predictor", no_loading)
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n')
    cfg = load_config(DLLMTrainConfig, overrides=["task.type=jsonl", f"task.train_path={tmp_path / 't.jsonl'}",
                                                  f"task.eval_path={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(ConfigError, match=r"nope.jsonl: cannot read the file: No such file"):
        backend.build(cfg)


def test_jsonl_task_warns_that_the_generators_sizes_and_seed_are_not_used():
    """task.num_train=8 with jsonl trained on every line, without a word: it is said now (a
    warning, as a run's config.yaml holds every key, the defaults included, which pass quietly)."""
    from dllm_rl.config import DLLMTaskConfig

    files = {"type": "jsonl", "train_path": "a.jsonl", "eval_path": "b.jsonl"}
    with pytest.warns(UserWarning, match=r"task.num_train \(8\), task.seed \(3\) are for the arith and sudoku "
                                         r"generators; task.type jsonl uses every line"):
        DLLMTaskConfig(**files, num_train=8, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DLLMTaskConfig(**files, num_train=4000, num_eval=200, seed=0)  # the defaults, as config.yaml writes them
        DLLMTaskConfig(type="arith", num_train=8, seed=3)


@pytest.mark.parametrize("line, needle", [
    ({"prompt": "1+" * 80 + "1=", "answer": 81},  # 162 tokens: over the context of 96
     r"\(longest prompt: '1\+1\+.*\.\.\..*1\+1=' \(162 characters\) in \S*t.jsonl, line 2\)"),
    ({"prompt": "What?", "answer": 2}, r"cannot encode the prompt 'What\?' in \S*t.jsonl, line 2: "),
    ({"prompt": "1+1=", "answer": "2" * 20}, r"'2{20}' in \S*t.jsonl, line 2 is 20 tokens, 21 with its <eos>"),
])
def test_jsonl_prompt_or_answer_the_model_cannot_take_is_named_by_file_and_line(tmp_path, capsys, line, needle):
    """A prompt too long for the context, with a character the tokenizer lacks, or an answer
    over gen_length: the error names its file and line (it named the text alone, which in a file
    of thousands is a search), and cuts a long prompt's middle (it printed all of it) without
    transformers' warning about its length first."""
    import json

    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError, load_config

    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n' + json.dumps(line) + "\n")
    cfg = load_config(DLLMTrainConfig, overrides=["task.type=jsonl", f"task.train_path={tmp_path / 't.jsonl'}",
                                                  f"task.eval_path={tmp_path / 't.jsonl'}"])
    with pytest.raises(ConfigError, match=needle) as e:
        backend.build(cfg)
    assert len(str(e.value)) < 400
    assert "Token indices sequence length" not in "".join(capsys.readouterr())


def test_jsonl_held_out_prompts_seen_in_training_and_prompts_with_two_answers_are_warned(tmp_path):
    """A held-out prompt that is also a training prompt (its accuracy is then not held out), and
    one prompt given two answers, each passed without a word; exact repeats stay quiet."""
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from dllm_rl.tasks import jsonl
    from mmrl.core.config import load_config

    (tmp_path / "train.jsonl").write_text('{"prompt": "3+4=", "answer": 7}\n{"prompt": "1+1=", "answer": 2}\n'
                                          '{"prompt": "3+4=", "answer": "8"}\n{"prompt": "1+1=", "answer": 2}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "2+2=", "answer": 4}\n{"prompt": "1+1=", "answer": 2}\n')
    cfg = load_config(DLLMTrainConfig, overrides=["task.type=jsonl", f"task.train_path={tmp_path / 'train.jsonl'}",
                                                  f"task.eval_path={tmp_path / 'eval.jsonl'}"])
    with pytest.warns(UserWarning) as caught:
        task = backend.build_task(cfg)  # as train, eval and sample build it
    train, evaluation = task.train, task.eval_problems
    overlap, clash = (str(w.message) for w in caught)
    assert overlap.startswith("1 of the 2 held-out problems has a training problem's prompt (the first: '1+1=', ")
    assert "eval.jsonl, line 2; " in overlap and "train.jsonl, line 2)" in overlap
    assert clash.startswith("1 problem repeats a prompt with another answer (the first: '3+4=', answer '7' on ")
    assert "train.jsonl, line 1; '8' on " in clash and "train.jsonl, line 3)" in clash
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jsonl.check_overlap(train[1:2] * 2, evaluation[:1])


def test_jsonl_files_joined_with_their_byte_order_marks_read_every_line(tmp_path):
    """`cat a.jsonl b.jsonl` of two files saved with a BOM puts one at the start of a line inside:
    it was "invalid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)", advice that fits no
    file; a BOM opening any line is read as the one opening the file is. CRLF ends are read too."""
    from dllm_rl.tasks import jsonl

    bom = "\ufeff".encode()
    (tmp_path / "p.jsonl").write_bytes(bom + b'{"prompt": "1+1=", "answer": 2}\r\n' + bom + b'{"prompt": "1+2=", "answer": 3}\r\n')
    assert [(p.prompt, p.answer, p.where[-6:]) for p in jsonl.load_problems(tmp_path / "p.jsonl")] == [
        ("1+1=", "2", "line 1"), ("1+2=", "3", "line 2")]


def test_jsonl_lines_ending_in_a_lone_cr_are_lines(tmp_path):
    """A file saved with old Mac line ends (CR alone) read as one line: "invalid JSON: Extra
    data at column 33"; its lines are read, and an error names the line an editor shows."""
    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import DatasetError

    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": 2}\r{"prompt": "1+2=", "answer": 3}\r')
    assert [(p.prompt, p.where[-6:]) for p in jsonl.load_problems(tmp_path / "p.jsonl")] == [
        ("1+1=", "line 1"), ("1+2=", "line 2")]
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": 2}\r\r{"prompt": "1+2=", "answer": 3,}\r')
    with pytest.raises(DatasetError, match=r"p.jsonl, line 3: invalid JSON"):
        jsonl.load_problems(tmp_path / "p.jsonl")
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": 2}\r{"prompt": "\xff"}\r')
    with pytest.raises(DatasetError, match=r"p.jsonl, line 2: not valid UTF-8"):
        jsonl.load_problems(tmp_path / "p.jsonl")


def test_an_option_the_generator_does_not_take_is_named_with_those_it_takes():
    """task.options {difficulty: 2} read as Python's "sample_problems() got an unexpected keyword
    argument 'difficulty'", which named no option the generator takes."""
    from dllm_rl import backend
    from dllm_rl.config import DLLMTrainConfig
    from mmrl.core.config import ConfigError

    cfg = DLLMTrainConfig(task={"type": "arith", "num_train": 2, "num_eval": 2, "options": {"difficulty": 2}})
    with pytest.raises(ConfigError, match=r"^task.options: arith cannot use \{'difficulty': 2\}: unknown option "
                                          r"'difficulty' \(the arith generator takes digits, mul_digits, ops\)$"):
        backend.build_task(cfg)
    with pytest.raises(ValueError, match=r"^unknown options 'digits', 'blank' \(the sudoku generator takes blanks\)$"):
        get_task("sudoku").sample_problems(2, 0, "train", digits=2, blank=3)
    assert get_task("sudoku").sample_problems(2, 0, "train", blanks=4) == sudoku.sample_problems(2, 0, "train", blanks=4)


def test_held_out_problems_that_are_mostly_repeats_are_warned_of():
    """1-digit arith holds 32 held-out prompts: task.num_eval=200 drew each about 6 times and
    reported accuracy over "200 problems" without a word. Training draws repeat quietly (RL on a
    repeated problem is meant), and so do held-out sets with most of their prompts distinct."""
    from mmrl.core.jsonl import HeldOutWarning

    with pytest.warns(HeldOutWarning, match=r"^200 held-out arith problems drawn \(task.num_eval\) hold only 32 "
                                            r"distinct prompts \(options \{'digits': 1\} leave few in the held-out "
                                            r"split\), so held-out accuracy counts each about 6 times"):
        problems = get_task("arith").sample_problems(200, 0, "eval", digits=1)
    assert problems == arith.sample_problems(200, 0, "eval", digits=1)  # the same draws, said of
    with pytest.warns(HeldOutWarning, match=r"hold only 26 distinct prompts \(options \{'blanks': 0\}"):
        get_task("sudoku").sample_problems(200, 0, "eval", blanks=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_task("arith").sample_problems(200, 0, "eval")  # 166 distinct
        get_task("arith").sample_problems(400, 0, "train", digits=1)
        get_task("arith").sample_problems(1, 0, "eval", digits=1)


def test_a_json_array_or_pretty_printed_objects_are_named_as_not_json_lines(tmp_path):
    """A .json file (one array of the problems) or objects pretty-printed over several lines
    read as "invalid JSON: Expecting value at column 2", as if the data were broken; the error
    now says what layout the file has. A broken line of a JSON-lines file gets no such hint."""
    import json

    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import DatasetError

    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}]
    array = r"line 1: invalid JSON: Expecting value at column 2 \(the file is one JSON array of 2 objects, not JSON lines"
    spread = r"line 1: invalid JSON: .*\(an object spread over several lines: JSON lines hold each object on one"
    cases = [(json.dumps(rows, indent=2), array),
             (json.dumps(rows), r"line 1: expected a JSON object, got a list \(the file is one JSON array of 2"),
             ("\n".join(json.dumps(r, indent=1) for r in rows), spread),
             ('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=",\n "answer": 4}\n', r"line 2: .*\(an object spread"),
             ('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4\n', r"line 2: invalid JSON: [^(]*$"),
             ('["1=", 1]\n', r"line 1: expected a JSON object, got a list$")]
    for text, message in cases:
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(DatasetError, match=message):
            jsonl.load_problems(tmp_path / "p.jsonl")


def test_a_missing_prompt_or_answer_names_the_keys_the_line_has():
    """{"Prompt": ...} or {"question": ..., "solution": ...} read as "field 'prompt': missing",
    the key the line does have (a capital, another name) left for the user to spot."""
    from dllm_rl.task import problems_of

    capital = r"field 'prompt': missing \(each line needs a prompt and an answer, named in lower case; the keys given: "
    for item, message in [({"Prompt": "1+1=", "answer": 2}, capital + r"'Prompt', 'answer'\)$"),
                          ({"prompt": "1+1=", "solution": 2}, r"field 'answer': .*the keys given: 'prompt', 'solution'"),
                          ({}, r"field 'prompt': .*the keys given: none\)$")]:
        with pytest.raises(ValueError, match=message):
            problems_of("mine", "train", [item])


def test_jsonl_reference_may_be_a_number_as_the_answer_may(tmp_path):
    """{"answer": 19, "reference": 19} was refused ("must be a non-empty string, got a number")
    where the answer beside it took the same number; it is read as the answer is."""
    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import DatasetError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "12+7=", "answer": 19, "reference": 19}\n{"prompt": "9*9=", "answer": "81", '
                    '"reference": 81.0}\n')
    assert [(p.answer, p.reference) for p in jsonl.load_problems(path)] == [("19", "19"), ("81", "81")]
    for value, message in [("1e30", r"field 'reference': the number 1e\+30 has no exact .* write the reference as"),
                           ("[19]", r"field 'reference': must be a string or a number, got a list"),
                           ('""', r"field 'reference': must be a non-empty string, got ''")]:
        path.write_text(f'{{"prompt": "1=", "answer": 1, "reference": {value}}}\n')
        with pytest.raises(DatasetError, match=message):
            jsonl.load_problems(path)


def test_one_jsonl_file_as_training_and_held_out_problems_is_said_to_be_one_file(tmp_path):
    """The warning named the same file and line twice ("t.jsonl, line 1; t.jsonl, line 1"),
    which read as a typo; it now says that the two keys name one file."""
    from dllm_rl.tasks import jsonl
    from mmrl.core.jsonl import HeldOutWarning

    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4}\n')
    problems = jsonl.load_problems(tmp_path / "t.jsonl")
    with pytest.warns(HeldOutWarning, match=r"^2 of the 2 held-out problems have a training problem's prompt \(the "
                                            r"first: '1\+1=', \S*t.jsonl, line 1, the training file itself: "
                                            r"task.eval_path is task.train_path\): held-out accuracy counts"):
        jsonl.check_overlap(problems, jsonl.load_problems(tmp_path / "t.jsonl"))
