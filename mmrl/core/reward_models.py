"""Learned reward models as reward atoms: a local sequence classifier scores each text sample.

The RLHF reward of TRL's and verl's recipes, for the text backends (the VLM's question and
answer, the dLLM's problem and answer; images are not shown to it). A reward model is any
transformers `AutoModelForSequenceClassification` directory with one output (num_labels 1:
the score is that logit), loaded with from_pretrained from local files. In a config:

    reward:
      atoms:
        - {reward_model: models/my-rm, weight: 0.5, name: rm, batch_size: 16}

What it reads: the sample's prompt and completion as a user turn and an assistant turn of
the reward model's chat template, when its tokenizer has one (reward models are trained on
conversations), else `template` ("{prompt}\\n{completion}" by default). A text longer than
`max_length` (default: the model's limit) keeps its end, where the answer is, and a warning
counts such texts once. Texts go `batch_size` at a time, padded on the right (whatever the
tokenizer's side) with an attention mask, and each is scored at its own last token: the padding
id is one that no text of the batch holds, so a tokenizer whose pad token is its end-of-sequence
token (or that has none) still batches, and a text that ends with that token is read at it. Atoms on the same directory (with the same dtype and device) share one copy
of the model. Refused when the spec loads: a checkpoint lacking weights the classifier needs
(its score head would start random), NaN or inf weights, a max_length past the model's positions.
"""

from __future__ import annotations

import re
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mmrl.core.device import model_device
from mmrl.core.rewards import RewardAtom, Sample, spec_file

DTYPES = {None: torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEC_KEYS = ("reward_model", "name", "weight", "parents", "device", "batch_size", "max_length", "dtype", "template")


def sequence_classifier_config(path: str | Path, what: str):
    """The config of a local AutoModelForSequenceClassification directory, checked before any
    weights load (ValueError naming `what`)."""
    from mmrl.core.config import remote_code_maps

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{what} {str(path)!r}: no config.json there (a from_pretrained directory is needed)")
    # Security: a scorer never runs a directory's own code (no config key opts in, as
    # model.trust_remote_code does for the policy); transformers would ask on a terminal instead
    # ("Do you wish to run the custom code? [y/N]"), mid-run, and run it on a "y".
    maps = remote_code_maps(path)
    if maps:
        raise ValueError(f"{what} {str(path)!r} ships its own Python code (auto_map in {', '.join(maps)}); mmrl "
                         "never runs a scorer's code: use a classifier of an architecture transformers has built in")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    archs = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{what} {str(path)!r} is not a sequence classifier (architectures: {archs})")
    return config


def load_sequence_classifier(path: str | Path, config, dtype: torch.dtype = torch.float32,
                             what: str = "sequence classifier"):
    """(model in eval mode, tokenizer) of a directory whose `config` was checked. Weights the
    checkpoint lacks are a ValueError naming `what`: transformers would start them random (a
    base model whose config was edited to name a classifier gets a random score head, and
    scores that change from one load to the next), with a load report easily missed in a log."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, use_safetensors=True, output_loading_info=True, trust_remote_code=False)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"{what} {str(path)!r}: its checkpoint lacks {', '.join(missing[:4])}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                         + " (missing weights start random: is it a base model rather than a trained classifier?)")
    return model.eval(), AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def text_limit(model, tokenizer) -> int:
    """The longest input the model takes: its position limit or the tokenizer's, else 512."""
    limits = [getattr(model.config, "max_position_embeddings", None), tokenizer.model_max_length]
    return min([int(n) for n in limits if n is not None and n < 1e9] or [512])


def _check_template(template: str) -> None:
    """A str.format template with {prompt} and {completion} and no other field, checked now
    rather than when the first rollout is scored (literal braces are written {{ and }})."""
    import string

    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:  # a lone { or }
        raise ValueError(f"template {template!r}: {e} (write a literal brace as {{{{ or }}}})") from e
    if fields != {"prompt", "completion"}:
        other = sorted(fields - {"prompt", "completion"})
        raise ValueError(f"template must contain {{prompt}} and {{completion}} and no other field, got {template!r}"
                         + (f" (fields {other}; write a literal brace as {{{{ or }}}})" if other else ""))


_PAD_LOCK = threading.Lock()  # see RewardModel.__call__
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (path, dtype, device, _stamp) -> model


def _stamp(path: str | Path) -> tuple:
    """The names, sizes and modification times of a model directory's files."""
    stats = [(f.name, f.stat()) for f in Path(path).iterdir() if f.is_file()]
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def _device(spec) -> torch.device:
    """A spec's `device`, in words that name that key: model_device's name model.device."""
    if not (isinstance(spec, str) and re.fullmatch(r"cpu|auto|cuda(:\d+)?", spec)):  # "gpu" was an IndexError
        raise ValueError(f"device must be cpu, auto, cuda or cuda:N, got {spec!r}")
    try:
        return model_device(spec, make_current=False)
    except ValueError as e:
        raise ValueError(str(e).replace(f"model.device {spec}", f"device {spec}", 1)
                         .replace("use model.device=", "use device ")) from None


def _count(v) -> bool:
    """An integer >= 1 (a bool is an int in Python, and YAML reads `yes` as true)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


class RewardModel:
    """Scores text samples with a one-output sequence classifier (see the module docstring)."""

    def __init__(self, path: str | Path, *, device: str = "cpu", batch_size: int = 16,
                 max_length: int | None = None, dtype: str | None = None, template: str | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if not _count(batch_size):
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if template is not None:
            _check_template(template)
        if max_length is not None and not _count(max_length):
            raise ValueError(f"max_length must be an integer >= 1 (or None: the model's limit), got {max_length!r}")
        self.path = str(path)
        config = sequence_classifier_config(path, "reward model")
        if config.num_labels != 1:
            raise ValueError(f"reward model {self.path!r} has {config.num_labels} outputs; a reward "
                             "model has one (num_labels 1), whose logit is the score")
        # past its position table a model fails at the first long text, after a rollout, with
        # "IndexError: index out of range in self" (GPT-2's absolute positions)
        positions = getattr(config, "max_position_embeddings", None)
        if max_length is not None and positions is not None and max_length > positions:
            raise ValueError(f"max_length {max_length} is more than reward model {self.path!r} takes "
                             f"(max_position_embeddings {positions})")
        self.device = _device(device)
        # One model however many atoms use it (two templates, two weights): a second copy of a 7B
        # reward model is 14 GB more. Shared while one of them lives; the key has the files' times,
        # so a directory saved over since loads afresh.
        key = (str(Path(path).resolve()), DTYPES[dtype], str(self.device), _stamp(path))
        model = _LOADED.get(key)
        if model is None:
            model, self.tokenizer = load_sequence_classifier(path, config, DTYPES[dtype], "reward model")
            model = model.to(self.device)  # then checked there (a GPU reads 16 GB in a blink)
            # NaN or inf weights (a diverged or badly converted checkpoint) score every sample nan:
            # say so now, naming the tensor, rather than as a failed atom after the first rollout
            broken = next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)
            if broken is not None:
                raise ValueError(f"reward model {self.path!r}: its weights hold NaN or inf values ({broken})")
            _LOADED[key] = model
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        self.model = model
        self.max_length = max_length or text_limit(model, self.tokenizer)
        self.tokenizer.truncation_side = "left"  # keep the completion's end
        self.template = template
        # a chat template writes the special tokens itself (a second BOS changes the score)
        self.chat = template is None and bool(self.tokenizer.chat_template)
        self.batch_size = batch_size
        self.warned = False

    def text(self, sample: Sample) -> str:
        if not isinstance(sample.prompt, str) or not isinstance(sample.completion, str):
            raise TypeError("a reward model scores text: the sample's prompt and completion must be "
                            f"strings, got {type(sample.prompt).__name__} and {type(sample.completion).__name__}")
        if self.chat:
            turns = [{"role": "user", "content": sample.prompt},
                     {"role": "assistant", "content": sample.completion}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return (self.template or "{prompt}\n{completion}").format(prompt=sample.prompt,
                                                                   completion=sample.completion)

    def _pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input_ids [B, T], attention_mask [B, T], the pad id) of a batch's token ids, padded on
        the right, whatever the tokenizer's own side (a generator's is often left): left padding
        shifts a shorter text's positions, which changes its score under absolute position
        embeddings (GPT-2, BERT). A sequence classifier reads the last token that is not its
        config's pad id, so the pad id is one that no text holds: the tokenizer's pad token where
        none does, else the smallest id none does (padding with an end-of-sequence token that a
        text ends with would have it read at the token before)."""
        present = {t for row in ids for t in row}
        pad = self.tokenizer.pad_token_id
        if pad is None or pad in present:
            pad = next(t for t in range(len(present) + 1) if t not in present)
        width = max(map(len, ids))
        input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
        return input_ids, mask, pad

    @torch.no_grad()
    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        texts = [self.text(s) for s in samples]
        out, cut = [], 0
        special = {"add_special_tokens": not self.chat}
        for i in range(0, len(texts), self.batch_size):
            chunk = texts[i: i + self.batch_size]
            ids = self.tokenizer(chunk, truncation=True, max_length=self.max_length, **special)["input_ids"]
            cut += sum(len(row) > self.max_length for row in self.tokenizer(chunk, **special)["input_ids"])  # to warn
            input_ids, mask, pad = self._pad(ids)
            with _PAD_LOCK:  # the pad id is the shared model's config: one batch at a time sets and reads it
                self.model.config.pad_token_id = pad
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
            out += logits[:, 0].float().cpu().tolist()
        if cut and not self.warned:
            warnings.warn(f"reward model {self.path!r}: {cut} of {len(texts)} texts were longer than "
                          f"max_length {self.max_length} and lost their beginning (warned once)", stacklevel=2)
            self.warned = True
        return out


def reward_model_atom(path: str | Path, *, name: str = "reward_model", weight: float = 1.0,
                      parents: Sequence[str] | str = (), **kwargs: Any) -> RewardAtom:
    """A batched atom scoring each sample with the reward model in `path` (RewardModel's
    keyword arguments: device, batch_size, max_length, dtype, template)."""
    RewardAtom(name, len, weight=weight, parents=parents)  # a bad name, weight or parents: before minutes of loading
    scorer = RewardModel(path, **kwargs)
    return RewardAtom(name, scorer, weight=weight, parents=parents, batched=True)


def atom_from_spec(spec: Mapping, index: int, base_dir: str | Path | None, device: str | None,
                   dtype: str | None = None) -> RewardAtom:
    """A `reward.atoms` entry {reward_model: DIR, ...}; a relative DIR resolves against base_dir
    (the config's directory), and `device` and `dtype` are the defaults where the entry names none
    (a float32 reward model beside a bfloat16 policy held twice the memory it needed)."""
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"reward spec {index} ({spec['reward_model']}): unknown keys {unknown} "
                         f"(allowed: {', '.join(SPEC_KEYS)})")
    path = spec_file(str(spec["reward_model"]), base_dir)
    kwargs = {k: spec[k] for k in SPEC_KEYS[1:] if k in spec}
    kwargs.setdefault("device", device or "cpu")
    kwargs.setdefault("dtype", dtype)
    try:
        return reward_model_atom(path, **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"reward spec {index} ({spec['reward_model']}): {e}") from e
