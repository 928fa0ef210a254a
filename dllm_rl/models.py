"""Loading masked-diffusion language models ("mask predictors") from a local directory.

A mask predictor maps a sequence in which some positions hold the mask token to logits over
the vocabulary at every position, [B, L] -> [B, L, V]; samplers and log-probabilities
(`dllm_rl/samplers.py`, `dllm_rl/logprob.py`) only need that. `MaskPredictor` gives every
supported family that one call, `forward(input_ids, prompt_length=..., valid=...)`, and hides
how each family is run:

    kind        loaded with                                   attention        logits
    masked_lm   AutoModelForMaskedLM (BERT, ModernBERT, ...)  full             as is
    llada       AutoModelForCausalLM (or AutoModel, remote)   full             as is
    dream       AutoModelForCausalLM (or AutoModel, remote)   full             shifted right by one
    sdar        AutoModelForCausalLM (or AutoModel, remote)   block_causal     as is

LLaDA (Nie et al. 2025, "Large Language Diffusion Models") is a Llama-style decoder trained
without a causal mask; Dream (Ye et al. 2025, "Dream 7B") starts from Qwen2.5 and keeps its
next-token head, so the logit for position i is read at position i - 1 ("shift_logits");
SDAR (Cheng et al. 2025) is block diffusion: attention is causal between blocks of
`block_length` response tokens and bidirectional inside a block.

How the family is run is stated in a sidecar file, `dllm.json`, in the model directory:

    {"kind": "llada" | "dream" | "sdar" | "masked_lm", "mask_token_id": int,
     "attention": "full" | "block_causal", "block_length": int | null,
     "shift_logits": bool, "trust_remote_code": bool}

Arguments of `load_mask_predictor` override the sidecar; without either, the kind is guessed
from the config (model_type llada / dream / sdar, or a masked-LM architecture). The sidecar's
"trust_remote_code" only records that the checkpoint needs it: remote code runs only when the
caller (the config's model.trust_remote_code) says so.

Attention is always given to the model as a 4D boolean mask [B, 1, L, L] (True = may attend),
which transformers >= 5 passes through unchanged (eager attention gets the equivalent additive
float mask). Position ids are counted over valid tokens only, so a left-padded prompt sees the
same positions as the unpadded one.

Nothing is ever downloaded: the path must be a directory on disk.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mmrl.core.checkpoint import refuse_pickled_weights
from mmrl.core.device import module_device
from mmrl.core.runconfig import model_dir_note

__all__ = [
    "ATTENTIONS",
    "KINDS",
    "SIDECAR",
    "DllmSpec",
    "MaskPredictor",
    "block_ids",
    "build_attention_mask",
    "load_mask_predictor",
    "position_ids_from_valid",
    "read_sidecar",
]

SIDECAR = "dllm.json"
KINDS = ("llada", "dream", "sdar", "masked_lm")
ATTENTIONS = ("full", "block_causal")
# What each kind means when the sidecar and the arguments say nothing more.
_KIND_ATTENTION = {"llada": "full", "dream": "full", "sdar": "block_causal", "masked_lm": "full"}
_KIND_SHIFT = {"llada": False, "dream": True, "sdar": False, "masked_lm": False}
# config.model_type (lower case) of the released remote-code checkpoints -> kind.
_MODEL_TYPE_KIND = {"llada": "llada", "dream": "dream", "sdar": "sdar"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- the sidecar


@dataclass(frozen=True)
class DllmSpec:
    """The contents of `dllm.json`: how to run the checkpoint as a mask predictor."""

    kind: str
    """One of KINDS."""
    mask_token_id: int
    """Id of the mask token; must be < the model's vocabulary size."""
    attention: str = "full"
    """"full" (bidirectional) or "block_causal" (SDAR-style block diffusion)."""
    block_length: int | None = None
    """Response tokens per block; required for "block_causal", None otherwise."""
    shift_logits: bool = False
    """Dream-style: the logit for position i is the model's output at position i - 1."""
    trust_remote_code: bool = False
    """Informational: the checkpoint needs its own Python code to load."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTIONS}")
        if not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool):
            raise ValueError(f"mask_token_id must be an integer, got {self.mask_token_id!r}")  # noqa: TRY004 -- a bad config value
        bad_block = not isinstance(self.block_length, int) or self.block_length < 1
        if self.attention == "block_causal" and bad_block:
            raise ValueError(
                f"attention 'block_causal' needs a positive integer block_length, "
                f"got {self.block_length!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, directory: str | os.PathLike) -> Path:
        """Write `dllm.json` into `directory`; returns its path."""
        path = Path(directory) / SIDECAR
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def read_sidecar(directory: str | os.PathLike) -> dict | None:
    """The raw dict of `directory/dllm.json`, or None when there is none.
    ValueError naming the file when it is not a JSON object with known keys."""
    path = Path(directory) / SIDECAR
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004 -- a bad file
    known = set(DllmSpec.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known keys: {sorted(known)}")
    if "kind" in data and data["kind"] not in KINDS:
        raise ValueError(f"{path}: kind {data['kind']!r} is not one of {KINDS}")
    if "attention" in data and data["attention"] not in ATTENTIONS:
        raise ValueError(f"{path}: attention {data['attention']!r} is not one of {ATTENTIONS}")
    # JSON types, before they are used: "false" is a true string, and 2.9 an id only once truncated
    for key, ok, want in (("mask_token_id", _is_int, "an integer"), ("block_length", _is_int, "an integer or null"),
                          ("shift_logits", _is_bool, "true or false"), ("trust_remote_code", _is_bool, "true or false")):
        if key in data and not (ok(data[key]) or (key == "block_length" and data[key] is None)):
            raise ValueError(f"{path}: {key} must be {want}, got {data[key]!r}")
    return data


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


# --------------------------------------------------------------------------- masks


def block_ids(length: int, prompt_length: int, block_length: int, *, device=None) -> Tensor:
    """[L] long: -1 for prompt positions (i < prompt_length), else (i - prompt_length) // block_length."""
    pos = torch.arange(length, device=device)
    return torch.where(
        pos < prompt_length,
        torch.full_like(pos, -1),
        torch.div(pos - prompt_length, block_length, rounding_mode="floor"),
    )


def build_attention_mask(
    valid: Tensor, *, prompt_length: int, attention: str = "full", block_length: int | None = None
) -> Tensor:
    """Bool [B, 1, L, L], True where query i may attend to key j.

    valid: Bool [B, L], False at padding (left padding of the prompt).
    "full": every query attends to every valid key.
    "block_causal": the prompt is block -1 and attends only to the prompt; response position i
    is in block (i - prompt_length) // block_length and attends to the prompt, the earlier
    blocks and its own block (valid keys only).
    Every query attends at least to itself, so rows of padding never softmax over nothing.
    """
    _, length = valid.shape
    allowed = valid[:, None, None, :].expand(-1, 1, length, -1)  # [B, 1, L, L]
    if attention == "block_causal":
        if block_length is None or block_length < 1:
            raise ValueError(f"block_causal attention needs block_length >= 1, got {block_length}")
        blk = block_ids(length, prompt_length, block_length, device=valid.device)
        allowed = allowed & (blk[None, :] <= blk[:, None])[None, None]  # key block <= query block
    elif attention != "full":
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    return allowed | eye[None, None]


def position_ids_from_valid(valid: Tensor) -> Tensor:
    """Long [B, L]: the index of each token among its row's valid tokens (cumsum - 1, >= 0),
    so a left-padded row's real tokens get the positions of the unpadded row."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------- the wrapper


class MaskPredictor(nn.Module):
    """A transformers model run as a masked-diffusion mask predictor.

    `model` holds every trainable parameter (the wrapper adds none); `forward` returns
    float32 logits [B, L, V] for every position.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        kind: str,
        mask_token_id: int,
        attention: str | None = None,
        block_length: int | None = None,
        shift_logits: bool | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        spec = DllmSpec(
            kind=kind,
            mask_token_id=int(mask_token_id),
            attention=attention or _KIND_ATTENTION.get(kind, "full"),
            block_length=block_length,
            shift_logits=_KIND_SHIFT.get(kind, False) if shift_logits is None else shift_logits,
            trust_remote_code=bool(trust_remote_code),
        )
        self.model = model
        self.tokenizer = tokenizer
        self.kind = spec.kind
        self.attention = spec.attention
        self.block_length = spec.block_length
        self.shift_logits = spec.shift_logits
        self.trust_remote_code = spec.trust_remote_code
        config = getattr(model, "config", None)
        self.max_length = _first_int(
            config, "max_position_embeddings", "max_sequence_length", "n_positions"
        )
        vocab = self.vocab_size
        if not 0 <= spec.mask_token_id < vocab:
            raise ValueError(
                f"mask_token_id {spec.mask_token_id} is not in the model's vocabulary "
                f"(vocab_size {vocab}: ids 0..{vocab - 1})"
            )
        self.mask_token_id = spec.mask_token_id
        self.pad_token_id = _token_id(tokenizer, config, "pad_token_id")
        self.eos_token_id = _token_id(tokenizer, config, "eos_token_id")
        impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
        if impl.startswith("flash"):
            raise ValueError(
                f"attn_implementation {impl!r} cannot take the custom 4D attention masks that "
                "masked diffusion needs; use 'sdpa' or 'eager'"
            )
        self._additive_mask = impl == "eager"
        params = inspect.signature(model.forward).parameters
        self._pass_position_ids = "position_ids" in params
        self._pass_use_cache = "use_cache" in params
        # LLaDA's remote code reads a 4D mask from `attention_bias` (bool: True = attend);
        # its `attention_mask` is 2D only.
        self._mask_kwarg = (
            "attention_bias"
            if "attention_bias" in params and getattr(config, "model_type", "") == "llada"
            else "attention_mask"
        )

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (the last dim of the logits)."""
        try:
            out = self.model.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            out = None
        weight = getattr(out, "weight", None)
        if isinstance(weight, Tensor):
            return int(weight.shape[0])
        return int(self.model.config.vocab_size)

    @property
    def spec(self) -> DllmSpec:
        return DllmSpec(
            kind=self.kind,
            mask_token_id=self.mask_token_id,
            attention=self.attention,
            block_length=self.block_length,
            shift_logits=self.shift_logits,
            trust_remote_code=self.trust_remote_code,
        )

    def answer_ids(self, answers: Sequence[str], gen_length: int) -> Tensor:
        """[B, gen_length] tokens of each answer followed by <eos> to the end: the layout of an
        RL completion, and of the targets of supervised training (as in LLaDA's SFT, the <eos>
        filler is an answer token like any other). On the model's device."""
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id to pad answers with")
        out = torch.full((len(answers), gen_length), self.eos_token_id, dtype=torch.long)  # filled on the CPU
        for i, answer in enumerate(answers):
            row = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            if len(row) >= gen_length:
                raise ValueError(
                    f"answer {answer!r} does not fit gen_length {gen_length} with its <eos>"
                )
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out.to(module_device(self.model))

    def attention_mask(self, valid: Tensor, prompt_length: int) -> Tensor:
        """Bool [B, 1, L, L] for this model's attention (see `build_attention_mask`)."""
        return build_attention_mask(
            valid, prompt_length=prompt_length, attention=self.attention,
            block_length=self.block_length,
        )  # fmt: skip

    def forward(
        self, input_ids: Tensor, *, prompt_length: int, valid: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, L] (prompt then response), valid Bool [B, L] (False = padding; None =
        all valid) -> float32 logits [B, L, V]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        length = input_ids.shape[1]
        if not 0 <= prompt_length <= length:
            raise ValueError(f"prompt_length {prompt_length} is outside [0, {length}]")
        if self.max_length is not None and length > self.max_length:
            raise ValueError(
                f"sequence length {length} exceeds the model's context {self.max_length}"
            )
        if valid is None:
            valid = torch.ones_like(input_ids, dtype=torch.bool)
        elif valid.shape != input_ids.shape:
            raise ValueError(
                f"valid has shape {tuple(valid.shape)}, input_ids {tuple(input_ids.shape)}"
            )
        valid = valid.to(device=input_ids.device, dtype=torch.bool)
        mask = self.attention_mask(valid, prompt_length)
        if self._additive_mask:
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        kwargs = {self._mask_kwarg: mask}
        if self._pass_position_ids:
            kwargs["position_ids"] = position_ids_from_valid(valid)
        if self._pass_use_cache:
            kwargs["use_cache"] = False
        out = self.model(input_ids=input_ids, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        if self.shift_logits:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits.float()

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Model (safetensors), tokenizer and `dllm.json` into `path`, loadable with
        `load_mask_predictor(path)`."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        self.spec.write(out)
        return out


# --------------------------------------------------------------------------- loading


def load_mask_predictor(
    path: str | os.PathLike,
    *,
    kind: str | None = None,
    mask_token_id: int | None = None,
    attention: str | None = None,
    block_length: int | None = None,
    shift_logits: bool | None = None,
    trust_remote_code: bool = False,
    dtype: str = "float32",
    attn_implementation: str | None = None,
) -> MaskPredictor:
    """A `MaskPredictor` from a local from_pretrained directory.

    Each setting comes from, in order: the argument, `dllm.json` (attention, block_length and
    shift_logits only when its kind is the resolved kind), the kind's default (table in the
    module docstring). Without a sidecar and without `kind`, the kind is guessed from the
    config. mask_token_id: argument, sidecar, the tokenizer's mask token, config.mask_token_id.
    `trust_remote_code` runs the directory's own Python code; a directory that needs it
    (auto_map in config.json / tokenizer_config.json) raises ValueError while it is False.
    Errors (ValueError, OSError) name the path.
    """
    from transformers import AutoConfig, AutoTokenizer

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model path {str(root)!r} is not a directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"model path {str(root)!r} has no config.json; is it a from_pretrained directory?"
            f"{model_dir_note(root)}"
        )
    raw_config = _read_json(config_file)
    auto_map = dict(raw_config.get("auto_map") or {})
    needs_code = bool(auto_map) or _tokenizer_needs_code(root)
    if needs_code and not trust_remote_code:
        raise ValueError(
            f"the model in {root} ships its own Python code (auto_map in its config); loading it "
            "runs that code. Set model.trust_remote_code=true if you trust it "
            "(load_mask_predictor(..., trust_remote_code=True))."
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    if trust_remote_code and needs_code:
        warnings.warn(f"trust_remote_code is on: running the Python code in {root}", stacklevel=2)

    sidecar = read_sidecar(root) or {}
    try:
        config = AutoConfig.from_pretrained(root, **remote)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{config_file}: could not be read as a model config: {e}") from e

    if kind is None:
        kind = sidecar.get("kind") or _guess_kind(config, auto_map, root)
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    same_kind = sidecar.get("kind") == kind
    if attention is None:
        attention = sidecar.get("attention") if same_kind else None
        attention = attention or _KIND_ATTENTION[kind]
    if shift_logits is None:
        shift_logits = sidecar.get("shift_logits") if same_kind else None
        shift_logits = _KIND_SHIFT[kind] if shift_logits is None else shift_logits
    if block_length is None and attention == "block_causal":
        block_length = (sidecar.get("block_length") if same_kind else None) or _first_int(
            config, "block_length", "block_size"
        )
        if block_length is None:
            raise ValueError(
                f"{root}: block_causal attention needs block_length (config: model.block_length; or put it in {SIDECAR})"
            )
    elif block_length is not None and attention != "block_causal":
        warnings.warn(f"model.block_length {block_length} is not used: the {kind} model's attention is {attention!r}; "
                      "the attention block applies to block_causal (sdar) models", stacklevel=2)
        block_length = None  # not kept in the spec (nor written to a saved dllm.json) either

    try:
        tokenizer = AutoTokenizer.from_pretrained(root, **remote)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{root}: could not load the tokenizer: {e}") from e

    if _token_id(tokenizer, config, "eos_token_id") is None:  # before the weights, as the mask token below
        raise ValueError(
            f"{root}: no end-of-text token: the tokenizer has no eos_token (tokenizer_config.json) and "
            "config.json no eos_token_id; every answer ends with it and is padded with it to gen_length. "
            "Set eos_token in tokenizer_config.json (a BERT-style tokenizer's \"[SEP]\" serves)"
        )
    given = mask_token_id
    if mask_token_id is None:
        mask_token_id = sidecar.get("mask_token_id")
    if mask_token_id is None:
        mask_token_id = getattr(tokenizer, "mask_token_id", None)
    if mask_token_id is None:
        mask_token_id = getattr(config, "mask_token_id", None)
    if mask_token_id is None:
        raise ValueError(
            f"{root}: no mask token id: the tokenizer has no mask token and neither {SIDECAR} "
            "nor the config (model.mask_token_id) gives one"
        )
    mask_token_id = int(mask_token_id)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and not 0 <= mask_token_id < vocab:  # fail before loading weights
        raise ValueError(
            f"{root}: mask_token_id {mask_token_id} is not in the model's vocabulary "
            f"(vocab_size {vocab}: ids 0..{vocab - 1})"
        )
    known = sidecar.get("mask_token_id", getattr(tokenizer, "mask_token_id", None))
    if given is not None and known is not None and mask_token_id != int(known):
        warnings.warn(f"model.mask_token_id {mask_token_id} is not the model's own mask token ({known}, from "
                      f"{SIDECAR if 'mask_token_id' in sidecar else 'the tokenizer'}): the model was trained to "
                      "fill that one", stacklevel=2)

    model_cls = _model_class(kind, auto_map)
    load_kwargs = {"dtype": _DTYPES[dtype], "use_safetensors": True, **remote}  # never unpickle
    if attn_implementation is not None:
        load_kwargs["attn_implementation"] = attn_implementation
    refuse_pickled_weights(root)  # the caller names model.path
    try:
        model, info = model_cls.from_pretrained(root, output_loading_info=True, **load_kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"{root}: could not load the model as {kind!r} with {model_cls.__name__}: {e}"
        ) from e
    except RuntimeError as e:  # transformers' shape check: config.json does not fit the weights
        if "mismatch" not in str(e):
            raise
        raise ValueError(f"{root}: the weights do not fit config.json (tensor shapes differ; "
                         f"the load report above lists them): {e}") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # config.json asks for weights the checkpoint lacks: they would be random
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{root}: the weights do not fit config.json: {len(missing)} weight(s) it needs "
                         f"are missing from the checkpoint ({', '.join(missing[:5])}{more}); "
                         "transformers would initialise them at random")
    model.eval()
    return MaskPredictor(
        model,
        tokenizer,
        kind=kind,
        mask_token_id=mask_token_id,
        attention=attention,
        block_length=block_length,
        shift_logits=shift_logits,
        trust_remote_code=needs_code,
    )


# --------------------------------------------------------------------------- helpers


def _guess_kind(config, auto_map: dict, root: Path) -> str:
    from transformers import MODEL_FOR_MASKED_LM_MAPPING

    model_type = str(getattr(config, "model_type", "") or "").lower()
    if model_type in _MODEL_TYPE_KIND:
        return _MODEL_TYPE_KIND[model_type]
    if "AutoModelForMaskedLM" in auto_map or type(config) in MODEL_FOR_MASKED_LM_MAPPING:
        return "masked_lm"
    raise ValueError(
        f"{root}: cannot tell how to run model_type {model_type!r} as a mask predictor: it is "
        f"not a masked LM (AutoModelForMaskedLM) and has no {SIDECAR}. Set model.kind to one of "
        f"{KINDS} (or write {SIDECAR} into the directory)."
    )


def _model_class(kind: str, auto_map: dict):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    if kind == "masked_lm":
        return AutoModelForMaskedLM
    if auto_map and "AutoModelForCausalLM" not in auto_map and "AutoModel" in auto_map:
        return AutoModel  # LLaDA / Dream register their LM-head class under AutoModel
    return AutoModelForCausalLM


def _tokenizer_needs_code(root: Path) -> bool:
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return False
    data = _read_json(path)
    return bool(isinstance(data, dict) and data.get("auto_map"))


def _read_json(path: Path):
    """The parsed file; ValueError naming it when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file: {e}") from e


def _first_int(config, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _token_id(tokenizer, config, name: str) -> int | None:
    for source in (tokenizer, config):
        value = getattr(source, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
