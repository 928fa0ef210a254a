"""Checkpoints (mmrl/core/checkpoint.py): atomic writes, pruning, failure handling,
exact optimizer / RNG round trips through the on-disk format, weight loading."""

import ast
import errno
import inspect
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import mmrl.core.checkpoint as ckpt
from mmrl.core.checkpoint import (
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_module_weights,
    load_optimizer_state,
    load_rng_state,
    optimizer_state,
    rank_rng_state,
    ranks_rng_state,
    rng_state,
    save_checkpoint,
    save_module,
    step_dir,
)


def write_marker(text: str):
    """A write_model that writes one small file, so the test can tell checkpoints apart."""

    def write(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "marker.txt").write_text(text)

    return write


def save(root, step, text=None, keep_last=2, tensors=None, state=None):
    return save_checkpoint(
        root,
        step,
        write_marker(text if text is not None else f"step {step}"),
        tensors if tensors is not None else {"t": torch.full((2,), float(step))},
        state if state is not None else {"step": step},
        keep_last=keep_last,
    )


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-")))


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def assert_state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------- layout and listing


def test_save_checkpoint_layout_and_contents(tmp_path):
    root = tmp_path / "checkpoints"  # does not exist yet: created
    path = save_checkpoint(
        root,
        3,
        write_marker("hello"),
        {"a": torch.arange(4, dtype=torch.float32).view(2, 2).t()},  # non-contiguous
        {"step": 3, "lr": [1e-5], "note": "x"},
    )
    assert path == root / "step-00000003" == step_dir(root, 3)
    assert sorted(p.name for p in path.iterdir()) == sorted(["model", STATE_JSON, STATE_TENSORS])
    assert (path / "model" / "marker.txt").read_text() == "hello"
    tensors, state = load_checkpoint(path)
    assert state == {"step": 3, "lr": [1e-5], "note": "x"}
    assert torch.equal(tensors["a"], torch.tensor([[0.0, 2.0], [1.0, 3.0]]))
    assert json.loads((path / STATE_JSON).read_text()) == state
    assert leftovers(root) == []


def test_list_and_latest(tmp_path):
    root = tmp_path / "ck"
    assert list_checkpoints(root) == [] and latest_checkpoint(root) is None  # missing dir
    for step in (10, 2, 7):  # saved out of order; listing is by step
        save(root, step, keep_last=10)
    assert list_checkpoints(root) == [
        (2, root / "step-00000002"),
        (7, root / "step-00000007"),
        (10, root / "step-00000010"),
    ]
    assert latest_checkpoint(root) == root / "step-00000010"


def test_keep_last_prunes_oldest(tmp_path):
    root = tmp_path / "ck"
    for step in range(1, 6):
        save(root, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]
    save(root, 6, keep_last=1)
    assert [s for s, _ in list_checkpoints(root)] == [6]


def test_partial_dirs_ignored_and_cleaned(tmp_path):
    root = tmp_path / "ck"
    save(root, 1)
    # a crash mid-write: the .tmp dir of step 2, with everything but the JSON
    tmp = root / ".tmp-step-00000002-deadbeef"
    (tmp / "model").mkdir(parents=True)
    (tmp / STATE_TENSORS).write_bytes(b"partial")
    # a step dir without trainer_state.json (incomplete) and unrelated names
    incomplete = root / "step-00000003"
    (incomplete / "model").mkdir(parents=True)
    (root / "step-4").mkdir()  # not 8 digits
    (root / "notes.txt").write_text("x")

    assert list_checkpoints(root) == [(1, root / "step-00000001")]
    assert latest_checkpoint(root) == root / "step-00000001"

    clean_partial(root)
    assert not tmp.exists()
    assert incomplete.is_dir()  # ignored, not removed
    assert list_checkpoints(root) == [(1, root / "step-00000001")]
    assert load_checkpoint(root / "step-00000001")[1] == {"step": 1}
    clean_partial(tmp_path / "missing")  # no error on a missing root


def test_resave_same_step_replaces(tmp_path):
    root = tmp_path / "ck"
    save(root, 4, text="first", state={"v": 1})
    path = save(root, 4, text="second", state={"v": 2})
    assert (path / "model" / "marker.txt").read_text() == "second"
    assert load_checkpoint(path)[1] == {"v": 2}
    assert list_checkpoints(root) == [(4, path)]
    assert leftovers(root) == []


# ---------------------------------------------------------------------------- failed writes


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
    ],
    ids=["enospc", "permission"],
)
def test_failed_write_keeps_previous_checkpoint(tmp_path, exc):
    root = tmp_path / "ck"
    prev = save(root, 1, text="good", state={"step": 1})

    def failing(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "half.bin").write_bytes(b"x" * 10)
        raise exc

    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, 2, failing, {"t": torch.zeros(1)}, {"step": 2})
    msg = str(info.value)
    assert str(root / "step-00000002") in msg
    assert exc.strerror in msg
    assert isinstance(info.value.__cause__, OSError)
    assert leftovers(root) == []
    assert list_checkpoints(root) == [(1, prev)]
    tensors, state = load_checkpoint(prev)
    assert state == {"step": 1} and torch.equal(tensors["t"], torch.tensor([1.0, 1.0]))
    assert (prev / "model" / "marker.txt").read_text() == "good"


def test_failed_resave_keeps_the_same_step(tmp_path):
    root = tmp_path / "ck"
    prev = save(root, 5, text="good", state={"v": 1})

    def failing(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError):
        save_checkpoint(root, 5, failing, {}, {"v": 2})
    assert leftovers(root) == []
    assert load_checkpoint(prev)[1] == {"v": 1}
    assert (prev / "model" / "marker.txt").read_text() == "good"


def test_failed_tensor_write_is_a_checkpoint_error(tmp_path):
    root = tmp_path / "ck"
    prev = save(root, 1)

    def model_then_block(path: Path) -> None:
        path.mkdir(parents=True)
        (path.parent / STATE_TENSORS).mkdir()  # save_file now hits EISDIR, a real I/O error

    try:
        with pytest.raises(CheckpointError):
            save_checkpoint(root, 2, model_then_block, {"t": torch.zeros(1)}, {"step": 2})
    finally:
        assert list_checkpoints(root) == [(1, prev)]
    assert leftovers(root) == []


def test_failed_swap_on_resave_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    final = save(root, 3, text="good", state={"v": 1})
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(CheckpointError):
        save(root, 3, text="new", state={"v": 2})
    monkeypatch.undo()
    assert list_checkpoints(root) == [(3, final)]  # put back before the error, not only by the next clean_partial
    clean_partial(root)  # what a resuming run does first
    assert list_checkpoints(root) == [(3, final)]
    assert load_checkpoint(final)[1] == {"v": 1}


def test_load_checkpoint_missing_files(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "step-00000001"))):
        load_checkpoint(tmp_path / "step-00000001")


def test_load_checkpoint_bad_json(tmp_path):
    path = save(tmp_path, 1)
    (path / STATE_JSON).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_load_checkpoint_corrupt_tensors(tmp_path):
    path = save(tmp_path, 1)
    (path / STATE_TENSORS).write_bytes(b"garbage garbage garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


# ---------------------------------------------------------------------------- optimizer state


def adamw_setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    return model, opt


def adamw_step(model, opt, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def test_optimizer_state_round_trip_through_disk(tmp_path):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=g) for _ in range(4)]
    ys = [torch.randn(5, 3, generator=g) for _ in range(4)]

    model, opt = adamw_setup(0)
    for x, y in zip(xs[:3], ys[:3]):
        adamw_step(model, opt, x, y)
    tensors, meta = optimizer_state(opt)
    assert set(tensors) == {
        f"optim.{i}.{n}" for i in (0, 1) for n in ("step", "exp_avg", "exp_avg_sq")
    }
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path, 3, write_marker(""), tensors, {"optimizer": meta})

    # a fresh model with different init and a fresh optimizer, restored from disk
    model2, opt2 = adamw_setup(99)
    model2.load_state_dict(weights)
    loaded, state = load_checkpoint(path)
    load_optimizer_state(opt2, loaded, state["optimizer"])
    assert opt2.param_groups[0]["lr"] == 1e-2 and tuple(opt2.param_groups[0]["betas"]) == (
        0.8,
        0.95,
    )
    for p in model2.parameters():
        assert float(opt2.state[p]["step"]) == 3.0

    adamw_step(model, opt, xs[3], ys[3])
    adamw_step(model2, opt2, xs[3], ys[3])
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    # sanity: the step did change the weights, so equality means something
    assert not torch.equal(model.weight, weights["weight"])


def test_optimizer_state_of_fresh_optimizer(tmp_path):
    _, opt = adamw_setup(0)
    tensors, meta = optimizer_state(opt)
    assert tensors == {} and meta["scalars"] == {}
    json.dumps(meta)  # JSON-able
    _, opt2 = adamw_setup(0)
    load_optimizer_state(opt2, tensors, json.loads(json.dumps(meta)))
    assert len(opt2.state) == 0


# ---------------------------------------------------------------------------- RNG state


def draw_all(gen: torch.Generator):
    return (
        torch.rand(5),
        torch.randn(3, generator=gen),
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [float(np.random.randn())],
    )


def test_rng_state_round_trip_through_disk(tmp_path):
    gen = torch.Generator().manual_seed(123)
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    # leave cached Gaussians behind: Python's gauss_next and NumPy's has_gauss are part of the state
    random.gauss(0, 1)
    np.random.randn()
    torch.randn(3, generator=gen)
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1

    tensors, meta = rng_state({"sampler": gen})
    path = save_checkpoint(tmp_path, 1, write_marker(""), tensors, {"rng": meta})
    expected = draw_all(gen)

    # scramble every RNG, then restore from disk
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    gen.manual_seed(999)
    draw_all(gen)
    loaded, state = load_checkpoint(path)
    load_rng_state(loaded, state["rng"], {"sampler": gen})
    got = draw_all(gen)

    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert got[2] == expected[2]
    assert got[3] == expected[3]


def test_each_ranks_rng_state_is_kept_and_a_new_rank_takes_rank_zeros_with_a_warning(tmp_path):
    states = []
    for seed in (1, 2):  # two ranks' RNGs
        torch.manual_seed(seed)
        states.append(rng_state({"rollout": torch.Generator().manual_seed(seed)}))
    tensors, meta = ranks_rng_state(states)
    path = save_checkpoint(tmp_path, 1, write_marker(""), tensors, {"rng": meta})
    loaded, state = load_checkpoint(path)
    for rank in (0, 1):
        mine, mine_meta, own = rank_rng_state(loaded, state["rng"], rank, 2)
        assert own and torch.equal(mine["rng.rollout"], states[rank][0]["rng.rollout"])
        assert torch.equal(mine["rng.torch"], states[rank][0]["rng.torch"]) and mine_meta["python"] == states[rank][1]["python"]
    with pytest.warns(UserWarning, match="written by 2 process.* resumes on 3"):
        rank_rng_state(loaded, state["rng"], 0, 3)
    third, _, own = rank_rng_state(loaded, state["rng"], 2, 3)  # a rank it did not have: rank 0's global RNGs,
    assert not own and torch.equal(third["rng.torch"], states[0][0]["rng.torch"])  # not its generators
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rank_rng_state(*rng_state({}), 0, 1)  # one process's checkpoint, resumed on one


# ---------------------------------------------------------------------------- model weights


def test_load_module_weights_tiny_llama(tmp_path):
    src = tiny_llama(0)
    assert src.lm_head.weight is src.model.embed_tokens.weight
    src.save_pretrained(tmp_path / "m")
    dst = tiny_llama(1)
    assert not torch.equal(dst.model.embed_tokens.weight, src.model.embed_tokens.weight)
    before = dst.model.embed_tokens.weight
    load_module_weights(dst, tmp_path / "m")
    assert dst.model.embed_tokens.weight is before  # in place, not replaced
    assert dst.lm_head.weight is dst.model.embed_tokens.weight  # still tied
    assert_state_dicts_equal(src, dst)
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst(ids).logits)


def test_checkpoint_model_dir_loads_with_from_pretrained(tmp_path):
    src = tiny_llama(0)
    path = save_checkpoint(tmp_path, 1, src.save_pretrained, {}, {"step": 1})
    again = LlamaForCausalLM.from_pretrained(path / "model")
    assert_state_dicts_equal(src, again)


def test_load_module_weights_shape_mismatch_names_key(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    wider = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight"):
        load_module_weights(wider, tmp_path / "m")
    # Shapes are checked before any copy: the model is untouched, not half loaded.
    for k, v in wider.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_load_module_weights_unexpected_key(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_file(
        {"weight": torch.zeros(2, 2), "bias": torch.zeros(2), "extra": torch.zeros(1)},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(CheckpointError, match="extra"):
        load_module_weights(model, tmp_path)


def test_load_module_weights_missing_key(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="bias"):
        load_module_weights(model, tmp_path)


def test_load_module_weights_no_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))):
        load_module_weights(torch.nn.Linear(2, 2), tmp_path)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([2.0]))


def test_save_module_round_trip(tmp_path):
    torch.manual_seed(0)
    src = Tied()
    src.scale.fill_(3.0)
    save_module(src, tmp_path / "w")
    assert (tmp_path / "w" / "model.safetensors").is_file()
    torch.manual_seed(1)
    dst = Tied()
    assert not torch.equal(dst.emb.weight, src.emb.weight)
    load_module_weights(dst, tmp_path / "w")
    assert_state_dicts_equal(src, dst)
    assert dst.head.weight is dst.emb.weight
    assert float(dst.scale) == 3.0


# ---------------------------------------------------------------------------- no pickle


def test_checkpoint_module_never_unpickles():
    # Look at the code, not the prose: the docstring may say "unpickles".
    tree = ast.parse(inspect.getsource(ckpt))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
            imported |= {a.name for a in node.names}
    assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "load"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {(ast.unparse(n.value), n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "pickle" not in names
    assert ("torch", "load") not in attrs
    assert not any(
        attr in ("load", "loads") and value in ("pickle", "torch") for value, attr in attrs
    )
    code = ast.unparse(tree)  # docstrings survive unparse, so check only outside them
    assert "torch.load(" not in code and "pickle." not in code


def test_clean_partial_restores_a_checkpoint_caught_between_the_two_renames(tmp_path):
    """A crash after `step-X -> .old-step-X-*` and before the new copy moved in:
    the .old copy is the only one left, and clean_partial puts it back."""
    root = tmp_path / "ck"
    save(root, 4, "original")
    os.replace(root / "step-00000004", root / ".old-step-00000004-abcd1234")
    assert list_checkpoints(root) == []
    clean_partial(root)
    assert [s for s, _ in list_checkpoints(root)] == [4]
    assert (root / "step-00000004" / "model" / "marker.txt").read_text() == "original"
    assert leftovers(root) == []


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """Re-saving an older step while newer ones exist keeps it (keep_last counts it)."""
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        save(root, step, keep_last=2)
    path = save(root, 3, "again", keep_last=2)
    assert path.is_dir() and (path / "model" / "marker.txt").read_text() == "again"
    assert [s for s, _ in list_checkpoints(root)] == [3, 6]


def test_keep_last_beyond_the_checkpoints_on_disk_deletes_none(tmp_path):
    """keep_last larger than what is on disk prunes nothing (the count to delete is never negative)."""
    root = tmp_path / "ck"
    for step in range(1, 5):
        save(root, step, keep_last=5)
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3, 4]


def test_clean_partial_drops_the_old_copy_once_the_new_one_moved_in(tmp_path):
    """A crash after both renames of a re-save, before the old copy was deleted: the step holds
    the new checkpoint, and clean_partial removes the .old copy, not the new one."""
    root = tmp_path / "ck"
    save(root, 4, "new")
    old = root / ".old-step-00000004-abcd1234"  # the previous copy, renamed aside
    (old / "model").mkdir(parents=True)
    (old / "model" / "marker.txt").write_text("original")
    (old / STATE_JSON).write_text("{}")
    clean_partial(root)
    assert [s for s, _ in list_checkpoints(root)] == [4]
    assert (root / "step-00000004" / "model" / "marker.txt").read_text() == "new"
    assert leftovers(root) == []


def test_only_the_main_rank_warns_of_another_number_of_processes(tmp_path):
    states = [rng_state({"rollout": torch.Generator().manual_seed(s)}) for s in (1, 2)]
    tensors, meta = ranks_rng_state(states)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rank in (1, 2):  # resumed on 3: the other ranks stay quiet (one warning per run)
            rank_rng_state(tensors, meta, rank, 3)


def test_a_model_directory_with_safetensors_beside_pickled_weights_is_taken(tmp_path):
    """Only pickled-only directories are refused: many hub repositories ship both formats."""
    from mmrl.core.config import ConfigError

    both = tmp_path / "both"
    save_module(torch.nn.Linear(2, 2), both)
    (both / "pytorch_model.bin").write_bytes(b"pickle")
    ckpt.refuse_pickled_weights(both)
    (both / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="pickled weights only"):
        ckpt.refuse_pickled_weights(both)


# ---------------------------------------------------------------------------- mutation audit


def test_a_copied_step_directory_with_a_suffix_is_neither_listed_nor_pruned(tmp_path):
    """Only exact `step-<8 digits>` names are checkpoints: a user's copy such as
    `step-00000001.bak` (complete, with trainer_state.json) must not be resumed from as
    step 1, nor deleted by keep_last pruning (the name pattern is anchored at the end)."""
    root = tmp_path / "ck"
    save(root, 1)
    backup = root / "step-00000001.bak"
    os.replace(root / "step-00000001", backup)
    for step in (2, 3, 4):
        save(root, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [3, 4]
    assert load_checkpoint(backup)[1] == {"step": 1}  # still there


def test_an_old_entry_that_names_no_checkpoint_is_removed_not_renamed(tmp_path):
    """clean_partial moves an `.old-*` copy back only when its name is a checkpoint's; any
    other `.old-*` entry is removed, never renamed into some new name beside the checkpoints."""
    root = tmp_path / "ck"
    save(root, 1)
    (root / ".old-notes-abcd1234").mkdir()
    clean_partial(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_optimizer_slots_with_dots_in_their_names_round_trip():
    """The split into tensors and JSON keys slots as `optim.<idx>.<name>` / `<idx>.<name>`;
    a slot name that holds a dot (custom optimizers) must come back under the same index and name."""
    sd = {"state": {3: {"a.b": torch.ones(2), "c.d": 0.5}}, "param_groups": [{"params": [3]}]}
    tensors, meta = optimizer_state(None, sd)
    back = ckpt.optimizer_state_dict(tensors, json.loads(json.dumps(meta)))
    assert set(back["state"]) == {3} and back["state"][3]["c.d"] == 0.5
    assert torch.equal(back["state"][3]["a.b"], torch.ones(2))


def test_every_cuda_devices_rng_state_is_saved_and_restored_in_device_order(monkeypatch):
    """The CUDA generators are part of the RNG state (a GPU run's sampling draws from them);
    on a CPU-only machine the CUDA calls are faked so the save and restore branches still run."""
    states = [torch.tensor([d, d], dtype=torch.uint8) for d in range(12)]  # device 2 before 10
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    tensors, meta = rng_state({})
    load_rng_state(tensors, json.loads(json.dumps(meta)), {})
    assert [s.tolist() for s in restored] == [s.tolist() for s in states]


def test_weights_in_place_from_a_smaller_model_are_refused(tmp_path):
    """load_weights_in_place must refuse a directory that fills only part of the model
    (keys missing, none unexpected), not leave the missing layers at their old values."""
    tiny_llama(0).save_pretrained(tmp_path / "one_layer")
    two = LlamaForCausalLM(LlamaConfig(**{**tiny_llama(0).config.to_dict(), "num_hidden_layers": 2}))
    before = {k: v.clone() for k, v in two.state_dict().items()}
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.load_weights_in_place(two, tmp_path / "one_layer")
    assert all(torch.equal(v, before[k]) for k, v in two.state_dict().items())  # layer 0 not copied either


def test_weights_in_place_of_other_shapes_are_refused_and_copy_nothing(tmp_path):
    config = tiny_llama(0).config.to_dict()
    LlamaForCausalLM(LlamaConfig(**{**config, "vocab_size": config["vocab_size"] + 2})).save_pretrained(tmp_path / "w")
    model = tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"do not fit the model: shapes \['model.embed_tokens.weight \("):
        ckpt.load_weights_in_place(model, tmp_path / "w")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_with_three_ranks_each_rank_gets_its_own_rng_state(tmp_path):
    """rank_rng_state keeps only this rank's `rank<r>.` keys: with three ranks, rank 1 must not
    pick up rank 2's state (whose keys also end in `rng.*`) after the round trip through disk."""
    states = [rng_state({"rollout": torch.Generator().manual_seed(seed)}) for seed in (1, 2, 3)]
    path = save_checkpoint(tmp_path, 1, write_marker(""), *ranks_rng_state(states))
    loaded, meta = load_checkpoint(path)
    for rank in (1, 2):
        mine, _, own = rank_rng_state(loaded, meta, rank, 3)
        assert own and set(mine) == set(states[rank][0])
        assert torch.equal(mine["rng.rollout"], states[rank][0]["rng.rollout"])


def test_weights_in_place_from_a_pickled_only_directory_are_refused_by_name(tmp_path):
    """load_weights_in_place (LoRA merges) refuses a pickled-only directory with the same
    clear message as every other loader, before transformers is asked to read it."""
    from mmrl.core.config import ConfigError

    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match="pickled weights only"):
        ckpt.load_weights_in_place(tiny_llama(0), tmp_path)


def test_save_creates_the_checkpoint_root_and_its_missing_parents(tmp_path):
    """The first checkpoint of a run may come before anything created the output directory:
    save_checkpoint creates the whole path, not only its last component."""
    root = tmp_path / "run" / "checkpoints"
    assert save(root, 1) == root / "step-00000001" and list_checkpoints(root) == [(1, root / "step-00000001")]


def test_a_checkpoint_pruned_when_the_process_dies_mid_delete_is_never_listed(tmp_path, monkeypatch):
    """keep_last pruning renames a checkpoint out of the step-* names before deleting it: killed
    after its model/ is gone but before trainer_state.json is (faked here by an rmtree that dies
    half-way), the old step is not listed as complete, and clean_partial removes what is left."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, write_marker(str(step)), {}, {"step": step}, keep_last=2)
    real = shutil.rmtree

    def dies_half_way(path, ignore_errors=False):
        real(Path(path) / "model")
        raise KeyboardInterrupt  # stands for the kill: nothing after it runs

    monkeypatch.setattr(ckpt.shutil, "rmtree", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, write_marker("3"), {}, {"step": 3}, keep_last=2)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    clean_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


def test_prune_keeps_the_newest_keep_last_and_the_spare_apart_from_them(tmp_path):
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        save(root, step, keep_last=10)
    ckpt.prune(root, keep_last=4, step=3)  # more than on disk: the count to delete is never negative
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]
    save(root, 4, keep_last=10)
    ckpt.prune(root, keep_last=1, step=4, spare=2)  # the newest one, and the spare one counted apart
    assert [s for s, _ in list_checkpoints(root)] == [2, 4]
    ckpt.prune(root, keep_last=1, step=4)  # the spare among the newest (it is the step): nothing more kept
    assert [s for s, _ in list_checkpoints(root)] == [4]
