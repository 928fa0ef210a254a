"""The demo app's own logic, no model and no training: what a sample shows, which run each tab
uses, how the handlers read their inputs (held-out items, seeds, the decoder, the run tab).
The comparisons are replaced by recorders, so these tests check what the handlers hand them and
what they make of the answer; tests/demo/test_demo_functions.py runs them on real tiny runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from mmrl.demo import app
from mmrl.demo.app import Demo, atoms_html, samples_html
from mmrl.demo.compare import Shown
from mmrl.demo.runs import RunInfo

gr = pytest.importorskip("gradio")


def make_run(path: Path, rollout: str = "{gen_length: 8}") -> RunInfo:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"rollout: {rollout}\n")  # gen_length: a dLLM run
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/total": 0.5}) + "\n")
    return RunInfo.load(path)


def fake_pair(path="run", **task) -> SimpleNamespace:
    """A ModelPair stand-in: get(which) -> (policy, task), run.path and run.config."""
    return SimpleNamespace(run=SimpleNamespace(path=Path(path), config={"task": {"type": "arith"}}),
                           get=lambda which: (None, SimpleNamespace(**task)))


@pytest.fixture
def fns():
    """(demo, handlers by name) over fake pairs: nothing is loaded or trained."""
    demo = Demo([], train_missing=False)
    handlers = {bf.fn.__name__: bf.fn for bf in app.build_app(demo).fns.values() if bf.fn is not None}
    return demo, handlers


@pytest.fixture
def recorded(monkeypatch):
    """calls[name] = the arguments each compare_* got; each answers one Shown per side."""
    calls: dict[str, tuple] = {}

    def recorder(name):
        def compare(*args):
            calls[name] = args
            return {w: [Shown(w, Image.new("RGB", (4, 4)) if name == "diffusion" else w, {}, 1.0)]
                    for w in ("before", "after")}
        return compare

    for name in ("vlm", "diffusion", "dllm"):
        monkeypatch.setattr(app, f"compare_{name}", recorder(name))
    return calls


# ------------------------------------------------------------------ what a sample shows


def test_an_atom_passes_from_one_half_and_a_partial_score_shows_its_value():
    page = atoms_html(Shown("s", "x", {"half": 0.5, "low": 0.25, "one": 1.0, "zero": 0.0}, None))
    assert 'atom-ok">half: &#10003; (0.50)' in page  # 0.5 counts as passed, and is not 0 or 1
    assert 'atom-bad">low: &#10007; (0.25)' in page
    assert 'atom-ok">one: &#10003;</span>' in page and 'atom-bad">zero: &#10007;</span>' in page
    assert page.endswith("<b>total n/a</b>")  # no total: no reward could be computed
    assert atoms_html(Shown("s", "x", {}, 2 / 3)).endswith("<b>total 0.667</b>")


def test_a_text_sample_is_escaped_an_image_sample_has_no_text_and_the_order_is_shown():
    text = samples_html([Shown("seed <1>", "<b>19</b>", {}, 1.0, order="<span class='tok'>1</span>",
                               extra={"len": "<2>"})], "text")
    assert "<pre style='margin:.2em 0'>&lt;b&gt;19&lt;/b&gt;</pre>" in text and "<b>19</b>" not in text
    assert "<b>seed &lt;1&gt;</b> <small>len &lt;2&gt;</small>" in text
    assert "<div>denoising order: <span class='tok'>1</span></div>" in text  # the order is HTML we made
    image = samples_html([Shown("seed 0", Image.new("RGB", (4, 4)), {}, 1.0)], "image")
    assert "<pre" not in image and "denoising order" not in image  # the gallery shows the image


# ------------------------------------------------------------------ which run each tab uses


def test_the_last_run_of_a_modality_is_the_one_its_tab_uses(tmp_path):
    first, last = make_run(tmp_path / "first"), make_run(tmp_path / "last")
    demo = Demo([first, last], train_missing=False)
    assert demo.chosen["dllm"] == last.path
    assert demo.chosen["vlm"] == app.default_run_dir("vlm")  # a modality without --run: its default


def test_a_users_run_without_a_checkpoint_is_said_on_the_page(tmp_path, fns):
    demo, handlers = fns
    demo.chosen["dllm"] = make_run(tmp_path / "mine").path  # still going: no checkpoint yet
    with pytest.raises(gr.Error, match="mine has no checkpoint yet; pass --run DIR"):
        handlers["dllm_run"]("12+7=", 1, 0, "fork")


def test_the_runs_tab_lists_each_run_once(tmp_path):
    run = make_run(tmp_path / "mine")
    dropdown = next(b for b in app.build_app(Demo([run], train_missing=False)).blocks.values()
                    if getattr(b, "elem_id", None) == "run-dir")
    paths = [c[0] for c in dropdown.choices]
    assert paths[0] == str(run.path) and paths.count(str(run.path)) == 1
    assert sorted(paths[1:]) == sorted(str(app.default_run_dir(m)) for m in ("vlm", "diffusion"))


# ------------------------------------------------------------------ held-out items


def test_held_out_items_are_drawn_in_turn_and_wrap_around(fns):
    demo, handlers = fns
    demo.pairs["dllm"] = fake_pair(eval_problems=[SimpleNamespace(prompt="1+1="), SimpleNamespace(prompt="2+2=")])
    demo.pairs["diffusion"] = fake_pair(eval_prompts=["a red circle", "a blue square"])
    assert handlers["dllm_new"](0) == ("1+1=", 1) and handlers["dllm_new"](1) == ("2+2=", 2)
    assert handlers["dllm_new"](2) == ("1+1=", 3)  # past the last one: the first again
    assert handlers["diffusion_new"](1) == ("a blue square", 2)
    assert handlers["diffusion_new"](2) == ("a red circle", 3)


def test_a_held_out_question_is_asked_with_its_answer_until_it_is_edited(fns, recorded):
    from mmrl.vlm.tasks.shapes_qa import QAItem

    demo, handlers = fns
    items = [QAItem([Image.new("RGB", (8, 8), c)], f"What colour is it? ({c})", c) for c in ("red", "blue")]
    demo.pairs["vlm"] = fake_pair(eval_items=items)
    image, question, next_index, current = handlers["vlm_new"](0)
    assert (question, next_index, current) == (items[0].question, 1, 0)
    handlers["vlm_run"](image, question, current, 2, 0)
    assert recorded["vlm"][1] is items[0] and recorded["vlm"][2:] == (2, 0)  # the answer is known: scored
    handlers["vlm_run"](image, "How many circles?", current, 1, 0)  # the user typed another question
    asked = recorded["vlm"][1]
    assert asked.question == "How many circles?" and asked.answer == ""
    handlers["vlm_run"](image, items[0].question, -1, 1, 0)  # an uploaded image (-1): never the held-out one
    assert recorded["vlm"][1] is not items[0] and recorded["vlm"][1].answer == ""


# ------------------------------------------------------------------ seeds, numbers, the decoder


def test_diffusion_seeds_are_split_on_commas_and_spaces_and_default_to_zero(fns, recorded):
    demo, handlers = fns
    demo.pairs["diffusion"] = fake_pair()
    g_before, g_after, h_before, h_after = handlers["diffusion_run"]("a red circle", "3, 1 4,5")
    assert recorded["diffusion"][1:] == ("a red circle", [3, 1, 4, 5])
    assert [label for _, label in g_before] == ["before: total 1.0"]  # each side its own gallery
    assert [label for _, label in g_after] == ["after: total 1.0"]
    assert "<b>before</b>" in h_before and "<b>after</b>" in h_after
    handlers["diffusion_run"]("a red circle", "  ")
    assert recorded["diffusion"][2] == [0]
    with pytest.raises(gr.Error, match="seeds must be integers separated by commas; got '1, x'"):
        handlers["diffusion_run"]("a red circle", "1, x")


def test_a_seed_and_a_sample_count_of_zero_are_accepted(fns, recorded):
    demo, handlers = fns
    demo.pairs["dllm"] = fake_pair(eval_problems=[])
    handlers["dllm_run"]("12+7=", 0, 0, "fork")
    assert recorded["dllm"][2:] == (0, 0, "fork")
    with pytest.raises(gr.Error, match="samples must be at least 0; got -1"):
        handlers["dllm_run"]("12+7=", -1, 0, "fork")


def test_a_seed_no_generator_takes_is_named_not_an_overflow(fns, recorded):
    # a seed past 2**63 - 1 reached the page as "Overflow when unpacking long long"
    demo, handlers = fns
    demo.pairs["dllm"] = fake_pair(eval_problems=[])
    demo.pairs["diffusion"] = fake_pair()
    handlers["dllm_run"]("12+7=", 1, 2**63 - 1, "fork")
    assert recorded["dllm"][3] == 2**63 - 1
    with pytest.raises(gr.Error, match=f"seed must be at most {2**63 - 1}; got {2**63}"):
        handlers["dllm_run"]("12+7=", 1, 2**63, "fork")
    handlers["diffusion_run"]("a red circle", f"-1, {2**63 - 1}")
    assert recorded["diffusion"][2] == [-1, 2**63 - 1]
    with pytest.raises(gr.Error, match=f"each seed must be at most {2**63 - 1}; got {10**23}"):
        handlers["diffusion_run"]("a red circle", f"1, {10**23}")


def test_a_held_out_problem_keeps_its_answer_and_an_empty_decoder_is_the_runs(fns, recorded):
    demo, handlers = fns
    held = SimpleNamespace(prompt="12+7=", answer="19")
    demo.pairs["dllm"] = fake_pair(eval_problems=[held])
    handlers["dllm_run"]("12+7=\n", 1, 0, "")  # a trailing newline from the text box
    assert recorded["dllm"][1] is held and recorded["dllm"][4] is None  # "": the run's own decoder


# ------------------------------------------------------------------ the run tab


def test_the_run_tab_with_no_path_shows_nothing_and_an_unreadable_one_says_why(fns, monkeypatch):
    _, handlers = fns
    assert handlers["run_view"]("") == (None, "")
    assert handlers["run_view"](None) == (None, "")

    def unreadable(path):  # a disk error, or a file the user may not read
        raise PermissionError(13, "Permission denied", f"{path}/config.yaml")

    monkeypatch.setattr(app.RunInfo, "load", unreadable)
    with pytest.raises(gr.Error, match="Permission denied: 'runs/x/config.yaml'"):
        handlers["run_view"]("runs/x")


def test_the_run_tab_shows_numeric_metrics_and_not_flags_or_text(tmp_path, fns):
    _, handlers = fns
    run = make_run(tmp_path / "run")
    (run.path / "summary.json").write_text(json.dumps({
        "eval_before": {"accuracy": 0.25, "note": "text", "n": 4},
        "eval_after": {"accuracy": 0.5, "n": True}}))
    _, table = handlers["run_view"](str(run.path))
    assert "<tr><td>accuracy</td><td>0.25</td><td>0.5</td></tr>" in table
    assert "<tr><td>n</td><td>4</td><td>n/a</td></tr>" in table  # a flag is no number
    assert "note" not in table
