"""Atomic checkpoints and exact resume.

Layout of one checkpoint, `<output_dir>/checkpoints/step-00000004/`:
    model/                    the policy's save_pretrained (safetensors, from_pretrained layout)
    trainer_state.safetensors optimizer tensors and RNG states
    trainer_state.json        everything else: step, optimizer hyper-parameters,
                              LR schedule, Python/NumPy RNG, data position, eval_before

A checkpoint is written into a temporary sibling directory and renamed into
place only once every file is flushed: a crash mid-write leaves at most a
`.tmp-*` directory, which is ignored and cleaned, never a half checkpoint.
Nothing here unpickles: tensors come from safetensors, the rest from JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError

from mmrl.core.faults import crash_point  # tests' kill -9 points (a no-op unless MMRL_CRASH_AT)

# torch (and safetensors.torch) are imported in the functions that use them: `runs` and
# `config --checkpoint` read the layout alone (list_checkpoints, step_dir), and importing torch
# took seconds of them (tests/test_cli_imports.py)
if TYPE_CHECKING:
    import torch

STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""


class UnreadableError(CheckpointError):
    """Weights files missing or cut short (not weights that do not fit the model)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and (d / STATE_JSON).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(
    root: str | Path,
    step: int,
    write_model: Callable[[Path], None],
    tensors: dict[str, torch.Tensor],
    state: dict[str, Any],
    keep_last: int = 2,
    spare: int | None = None,
) -> Path:
    """Write checkpoint `step` atomically; then delete all but the newest `keep_last`, and
    checkpoint `spare` (the best one, mmrl.core.best), which counts apart from them."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        write_model(tmp / "model")
        crash_point("checkpoint-write", step)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / STATE_TENSORS)
        # The JSON goes last: list_checkpoints counts a directory only once it exists.
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=1), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (after a resume): swap, never delete first
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)  # put the previous copy back before reporting
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        crash_point("after-checkpoint", step)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or e
        raise CheckpointError(
            f"could not write checkpoint {final}: {reason}; the previous checkpoint is intact"
        ) from e
    prune(root, keep_last, step, spare)
    return final


def prune(root: str | Path, keep_last: int, step: int, spare: int | None = None) -> None:
    """Delete all checkpoints but `step` (the one just written), the newest keep_last - 1 others,
    and `spare` (the best one, mmrl.core.best), which counts apart from them."""
    others = [d for n, d in list_checkpoints(root) if n not in (step, spare)]
    for old_dir in others[: max(0, len(others) - (keep_last - 1))]:
        _delete(old_dir)


def _delete(d: Path) -> None:
    """Delete checkpoint `d` so that a kill mid-way never leaves it listed half deleted: one
    atomic rename out of the step-* names first (clean_partial removes what is left of it)."""
    gone = d.parent / f".tmp-pruned-{d.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(d, gone)
    except OSError:
        return  # kept whole, and complete
    shutil.rmtree(gone, ignore_errors=True)


def clean_partial(root: str | Path) -> None:
    """Remove temporary directories left by a crash mid-write."""
    root = Path(root)
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if d.name.startswith(".old-"):
            # A crash between the two renames of a re-save: the old copy is the checkpoint.
            final = root / d.name[len(".old-"):].rsplit("-", 1)[0]
            if STEP_DIR.match(final.name) and not final.exists():
                os.replace(d, final)
                continue
        if d.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(d, ignore_errors=True)


def save_file(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """safetensors.torch.save_file, imported at its first use (see above); a name of this module,
    where the fault tests make a write fail."""
    from safetensors.torch import save_file as save

    save(tensors, str(path))


def load_file(path: str | Path) -> dict[str, torch.Tensor]:
    """safetensors.torch.load_file, imported at its first use (see above)."""
    from safetensors.torch import load_file as load

    return load(str(path))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    try:
        state = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
        tensors = load_file(path / STATE_TENSORS)
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from e
    return tensors, state


# --------------------------------------------------------------------------- model weights


def save_module(module: torch.nn.Module, path: Path) -> None:
    """Weights of a plain nn.Module as `model.safetensors` (tied tensors stored once)."""
    from safetensors.torch import save_model

    path.mkdir(parents=True, exist_ok=True)
    save_model(module, str(path / "model.safetensors"))


def load_module_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Load `model.safetensors` (or its shards) written by save_pretrained / save_module,
    in place. Keys the file lacks must be tied to keys it has; unknown keys are errors."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnreadableError(f"no .safetensors weights in {path}")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            loaded.update(load_file(f))
        except (OSError, SafetensorError) as e:
            raise UnreadableError(f"weights file {f} is unreadable: {e}") from e
    own = module.state_dict()
    unexpected = sorted(set(loaded) - set(own))
    if unexpected:
        raise CheckpointError(f"weights in {path} do not fit the model: unexpected keys {unexpected[:5]}")
    by_ptr = {}
    for k, v in own.items():
        by_ptr.setdefault(v.untyped_storage().data_ptr(), []).append(k)
    for keys in by_ptr.values():
        if not any(k in loaded for k in keys):
            raise CheckpointError(f"weights in {path} lack {keys[0]!r}")
    for k, v in loaded.items():  # check every shape before touching the model
        if own[k].shape != v.shape:
            raise CheckpointError(
                f"weights in {path}: {k!r} has shape {tuple(v.shape)}, model has {tuple(own[k].shape)}"
            )
    with torch.no_grad():
        for k, v in loaded.items():
            own[k].copy_(v)


# --------------------------------------------------------------------------- optimizer and RNG


def optimizer_state(optimizer: torch.optim.Optimizer, sd: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict (`sd`, else the optimizer's) into safetensors-able tensors and JSON."""
    import torch

    sd = optimizer.state_dict() if sd is None else sd
    tensors, scalars = {}, {}
    for idx, slots in sd["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"optim.{idx}.{name}"] = value
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    optimizer.load_state_dict(optimizer_state_dict(tensors, meta))


def optimizer_state_dict(tensors: dict, meta: dict) -> dict:
    """The optimizer state_dict that optimizer_state split into tensors and JSON."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state(generators: dict[str, torch.Generator]) -> tuple[dict[str, torch.Tensor], dict]:
    """Every RNG the run draws from: torch's global one, the given generators, Python, NumPy."""
    import torch

    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    tensors.update({f"rng.{name}": g.get_state() for name, g in generators.items()})
    np_state = np.random.get_state()
    meta = {
        "python": _to_json(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *map(_to_json, np_state[2:])],
    }
    return tensors, meta


def ranks_rng_state(states: list[tuple[dict, dict]]) -> tuple[dict[str, torch.Tensor], dict]:
    """rng_state() of every rank (rank order) as one checkpoint's: rank 0's under the plain keys,
    as one process writes them; rank r's tensors as "rank<r>.rng.*", its meta in meta["ranks"]."""
    tensors, meta = dict(states[0][0]), dict(states[0][1])
    for r, (t, m) in enumerate(states[1:], 1):
        tensors.update({f"rank{r}.{k}": v for k, v in t.items()})
        meta.setdefault("ranks", {})[str(r)] = m
    meta["world_size"] = len(states)
    return tensors, meta


def rank_rng_state(tensors: dict, meta: dict, rank: int, world: int) -> tuple[dict, dict, bool]:
    """This rank's (tensors, meta, whether they are its own) of a checkpoint's RNG state. A
    rank the checkpoint did not have (another number of processes) gets rank 0's global RNGs,
    not its generators (it keeps its own seed's), and the main rank warns: the rollouts then
    differ from a run that was not interrupted."""
    saved = meta.get("world_size", 1)
    if saved != world and rank == 0:
        warnings.warn(f"the checkpoint was written by {saved} process(es) and resumes on {world}: the ranks' "
                      "random draws differ from an uninterrupted run's", stacklevel=3)
    if rank == 0:
        return tensors, meta, True
    if str(rank) not in meta.get("ranks", {}):
        return tensors, meta, False
    prefix = f"rank{rank}."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, meta["ranks"][str(rank)], True


def load_rng_state(tensors: dict, meta: dict, generators: dict[str, torch.Generator]) -> None:
    import torch

    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng.cuda.")),
                                       key=lambda k: int(k.rsplit(".", 1)[1]))]  # device 2 before 10
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    for name, g in generators.items():
        g.set_state(tensors[f"rng.{name}"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _to_json(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_to_json(v) for v in x]
    return x


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")  # torch.save files: loading one unpickles, which can run code


def refuse_pickled_weights(directory: str | Path, what: str = "") -> None:
    """A model directory whose weights are pickled only (pytorch_model.bin and kin, no
    safetensors) is refused with what to do: every loader here reads safetensors alone
    (from_pretrained(use_safetensors=True)), since unpickling a file can run its code."""
    root = Path(directory)
    if not root.is_dir() or any(root.glob("*.safetensors")):
        return
    pickled = sorted(f.name for pattern in PICKLED for f in root.glob(pattern))
    if pickled:
        from mmrl.core.config import ConfigError

        raise ConfigError(f"{what}{': ' if what else ''}{root} holds pickled weights only ({', '.join(pickled[:3])}); mmrl loads "
                          "safetensors alone, since unpickling a file can run code. Convert them where you trust "
                          "them: from_pretrained(...) then save_pretrained(..., safe_serialization=True)")


def load_weights_in_place(model, path: str | Path) -> None:
    """Copy the from_pretrained weights in `path` into `model` (a transformers model), in
    place, so an optimizer holding its parameters keeps them. transformers renames keys
    between a module and its file (e.g. Qwen-VL's "model.language_model.*" is saved as
    "model.*"), so the file is read through from_pretrained, not as a raw state dict."""
    refuse_pickled_weights(path)
    fresh = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype, use_safetensors=True)
    theirs, ours = fresh.state_dict(), model.state_dict()
    # all checked before anything is copied: a refusal leaves the model as it was
    missing, unexpected = [k for k in ours if k not in theirs], [k for k in theirs if k not in ours]
    if missing or unexpected:
        raise CheckpointError(f"weights in {path} do not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    shapes = [f"{k} {tuple(theirs[k].shape)} for {tuple(t.shape)}" for k, t in ours.items() if theirs[k].shape != t.shape]
    if shapes:
        raise CheckpointError(f"weights in {path} do not fit the model: shapes {shapes[:3]}")
    model.load_state_dict(theirs)
