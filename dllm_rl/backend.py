"""The diffusion-LLM backend as the CLI and the loop see it (mmrl.core.cli).

    CONFIG_CLASS    DLLMTrainConfig
    DEFAULT_CONFIG  the main job: the bundled tiny dLLM, arith, diffu-GRPO, on a CPU in minutes
    build(cfg)      -> (DLLMPolicy, DLLMTask)
    sample(...)     -> scored answers for `dllm-rl sample`
"""

from __future__ import annotations

import warnings
from pathlib import Path

from dllm_rl.config import CONFIG_CLASS, DEFAULT_CONFIG, EVAL_DEFAULTS, DLLMTrainConfig  # noqa: F401 -- the CLI's settings: torch-free there
from dllm_rl.policy import DLLMPolicy, PromptError, PromptTooLong, unencodable
from dllm_rl.task import DLLMTask
from dllm_rl.tasks import CHARSET
from mmrl.core.config import ConfigError, check_remote_code
from mmrl.core.device import model_device
from mmrl.core.held_out import sample_generators
from mmrl.core.lora import add_lora
from mmrl.core.memory import enable_gradient_checkpointing
from mmrl.core.runconfig import (
    bundled,
    model_dir_note,
    not_installed_note,
    resolve_dir,
    resolve_file,
)


def bundled_model_dir() -> Path:
    return bundled("tiny-dllm")


def build_task(cfg: DLLMTrainConfig) -> DLLMTask:
    from dllm_rl.tasks import get_task

    t = cfg.task
    spec = get_task(t.type)
    if t.type == "jsonl":
        from dllm_rl.tasks.jsonl import check_overlap, load_problems
        from mmrl.core.jsonl import DatasetError

        try:
            train = load_problems(resolve_file(t.train_path, cfg.base_dir))
            evaluation = load_problems(resolve_file(t.eval_path, cfg.base_dir))
        except DatasetError as e:
            raise ConfigError(f"task: {e}") from e
        check_overlap(train, evaluation)
    else:
        try:
            train = spec.sample_problems(t.num_train, t.seed, "train", **t.options)
            evaluation = spec.sample_problems(t.num_eval, t.seed, "eval", **t.options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"task.options: {t.type} cannot use {t.options}: {e}") from e
    return DLLMTask(t.type, train, evaluation, spec.reward(on_error=cfg.reward.on_error),
                    answer_atom=spec.success_atom, rollout=cfg.rollout,
                    batch_size=cfg.rollout.eval_batch_size, eval_samples=cfg.rollout.eval_samples)


# `serve` builds the policy with its task (mmrl.core.serve.served_policy): the prompt width is the
# task's longest prompt, and a trainer using the server computes log-probs at that width.
SERVE_READS_TASK = True


def build(cfg: DLLMTrainConfig):
    # The problems first: a data file that is missing or malformed is named in a second, not
    # after the model has loaded (minutes for an 8B one).
    task = build_task(cfg)
    return build_policy(cfg, task), task


def build_policy(cfg: DLLMTrainConfig, task: DLLMTask | None = None) -> DLLMPolicy:
    """The policy, its prompt width that of the task's longest prompt, after checking that the
    tokenizer encodes every prompt and answer and that they fit. No task (`export`, which
    decodes nothing): no prompt width, and the task's data files are not read."""
    import dllm_rl.methods  # noqa: F401  (registers diffu_grpo and tracerl)
    from dllm_rl.methods import estimator_for
    from dllm_rl.models import load_mask_predictor

    m = cfg.model
    path = resolve_dir(m.path, cfg.base_dir) if m.path else bundled_model_dir()  # config dir, cwd, repo
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a directory"
                          f"{not_installed_note(m.path or path) or model_dir_note(path) or ' (a from_pretrained model directory is expected)'}")
    check_remote_code(path, m.trust_remote_code)  # refuse, or name the directory whose code runs
    device = model_device(m.device)  # a GPU that is not there is a ConfigError before any loading
    try:
        with warnings.catch_warnings():  # the loader's own warning repeats the notice just printed
            warnings.filterwarnings("ignore", message="trust_remote_code is on", category=UserWarning)
            predictor = load_mask_predictor(path, kind=m.kind, mask_token_id=m.mask_token_id,
                                            block_length=m.block_length, trust_remote_code=m.trust_remote_code,
                                            dtype=m.dtype)
    except (OSError, ValueError) as e:  # the loader's messages mostly start with the directory: not twice
        raise ConfigError(f"model.path: cannot load {path}: {str(e).removeprefix(f'{path}: ')}") from e
    if predictor.attention == "block_causal" and predictor.block_length != cfg.rollout.block_length:
        # A block-diffusion model (SDAR) learned to fill one attention block at a time: decoding
        # blocks of another length run, but not as the model was trained, and silently so before.
        warnings.warn(f"rollout.block_length {cfg.rollout.block_length} differs from the attention block "
                      f"({predictor.block_length}) of the block-causal model in {path}: decoding blocks then "
                      f"span or split its attention blocks; set rollout.block_length: {predictor.block_length} "
                      "(and rollout.gen_length a multiple of it)", stacklevel=2)
    if m.lora is not None:  # before the policy, which keeps predictor.model
        predictor.model = add_lora(predictor.model, m.lora, seed=cfg.seed)
    # After LoRA, whose adapters are drawn on the CPU: a seed makes the same ones on any device.
    # Every copy of the policy (the reference, a pipelined engine's) is a deepcopy: it stays here.
    predictor.to(device)
    if m.gradient_checkpointing:
        enable_gradient_checkpointing(predictor.model)
    if task is None:
        try:
            return DLLMPolicy(predictor, cfg.rollout, 0, estimator_for(cfg), cfg.model.logprob_chunk)
        except PromptTooLong as e:
            raise ConfigError(f"rollout.gen_length: {e}") from e
    tok, vocab = predictor.tokenizer, predictor.vocab_size
    lengths = {}
    for p in task.train + task.eval_problems:  # every prompt and answer, before any rollout
        for text, kind in ((p.prompt, "prompt"), (p.reference, "reference answer"), (p.answer, "answer")):
            if text not in lengths:
                what = f"prompt {shown(text)}" if kind == "prompt" else f"{kind} {shown(text)} of {shown(p.prompt)}"
                try:
                    ids = token_ids(tok, text)
                except Exception as e:  # a fast tokenizer raises a bare Exception
                    raise ConfigError(f"task: the model's tokenizer cannot encode the {what}{at(p)}: "
                                      f"{unencodable(tok, text, e)} (the tiny "
                                      f"models' characters are dllm_rl.tasks.CHARSET: {CHARSET!r})") from e
                past = past_vocab(tok, ids, vocab)
                if past:
                    raise ConfigError(f"model.path: the tokenizer in {path} encodes the {what}{at(p)} {past}")
                lengths[text] = len(ids)
    longest = max(task.train + task.eval_problems, key=lambda p: lengths[p.prompt])
    prompt_length = lengths[longest.prompt]
    try:
        policy = DLLMPolicy(predictor, cfg.rollout, prompt_length, estimator_for(cfg), cfg.model.logprob_chunk)
    except PromptTooLong as e:
        raise ConfigError(f"rollout.gen_length / task: {e} (longest prompt: {shown(longest.prompt)}"
                          f"{at(longest)})") from e
    check_answer_room(task, tok, cfg.rollout)
    return policy


def count_tokens(tok, text: str) -> int:
    return len(token_ids(tok, text))


def token_ids(tok, text: str) -> list[int]:
    from transformers import PreTrainedTokenizerBase

    # verbose=False: a text over the tokenizer's model_max_length is ours to refuse, naming it;
    # transformers' own warning about it ("will result in indexing errors") came first.
    # A tokenizer of another kind (remote code, the tests' stand-ins) may not take the argument.
    quiet = {"verbose": False} if isinstance(tok, PreTrainedTokenizerBase) else {}
    return list(tok(text, add_special_tokens=False, **quiet)["input_ids"])


def past_vocab(tok, ids: list[int], vocab: int) -> str:
    """Why `ids` cannot go into the model ("" where they can): a token past its vocabulary, which
    the embedding has no row for. That was an IndexError (a device assert on a GPU) mid-rollout."""
    if not ids or max(ids) < vocab:
        return ""
    bad = max(ids)
    return (f"with token {bad} ({tok.convert_ids_to_tokens(bad)!r}), past the model's vocabulary of {vocab} ids: "
            "the tokenizer holds tokens the model has no embedding for. Tokens added to a tokenizer need the "
            "model's embeddings resized too (model.resize_token_embeddings(len(tokenizer)))")


def shown(text: str, limit: int = 80) -> str:
    """repr(text), its middle cut where longer than `limit`: a prompt of pages is named, not printed."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit // 2]}...{r[-(limit // 2 - 3):]} ({len(text)} characters)"


def at(problem) -> str:
    """Where a problem read from a file is (" in train.jsonl, line 3"); "" for a generated one."""
    return f" in {problem.where}" if problem.where else ""


def check_answer_room(task: DLLMTask, tok, rollout) -> None:
    """A ConfigError where the longest reference answer and its <eos> do not fit gen_length:
    no rollout could then be right on it (sudoku's 19-character grids at the default 8). It names
    that reference (and its file and line), or counts the references of that length and names
    the first three."""
    lengths, first = {}, {}
    for p in task.train + task.eval_problems:
        if p.reference not in lengths:
            lengths[p.reference], first[p.reference] = count_tokens(tok, p.reference), p
    need = max(lengths.values()) + 1
    if need > rollout.gen_length:
        longest = [text for text, n in lengths.items() if n == need - 1]  # ties: sudoku's grids all are
        if len(longest) == 1:
            which = f"{shown(longest[0])}{at(first[longest[0]])} is {need - 1} tokens, {need} with its <eos>"
        else:
            names = ", ".join(map(shown, longest[:3])) + (", ..." if len(longest) > 3 else "")
            which = f"{len(longest)} references ({names}) are {need - 1} tokens, {need} with their <eos>"
        raise ConfigError(
            f"rollout.gen_length ({rollout.gen_length}) cannot hold the task's answers: {which}. Set "
            f"rollout.gen_length to at least {need} (a multiple of rollout.block_length {rollout.block_length}, "
            "with rollout.steps to match)"
        )


def fit_prompts(policy: DLLMPolicy, prompts: list[str]) -> DLLMPolicy:
    """The policy, its prompt width raised to the longest of `prompts` where that is longer
    than the task's prompts (a --prompt may be any length the model's context holds). Wider
    left padding leaves the answers as they were: positions follow the valid tokens."""
    tok, width, longest = policy.predictor.tokenizer, policy.prompt_length, None
    for text in prompts:
        try:
            ids = token_ids(tok, text)
        except Exception:  # noqa: BLE001, S112  (encode_prompts names the prompt and the character)
            continue
        past = past_vocab(tok, ids, policy.predictor.vocab_size)
        if past:
            raise ConfigError(f"--prompt: the model's tokenizer encodes {shown(text)} {past}")
        n = len(ids)
        if n > width:
            width, longest = n, text
    if longest is None:
        return policy
    try:
        return DLLMPolicy(policy.predictor, policy.rollout, width, policy.estimator, policy.logprob_chunk)
    except PromptTooLong as e:
        raise ConfigError(f"--prompt: {e} (longest prompt: {shown(longest)})") from e


def sample(cfg: DLLMTrainConfig, policy: DLLMPolicy, task: DLLMTask, prompts: list[str], n: int,
           greedy: bool = False) -> list[dict]:
    """n answers (rollout temperature and strategy, seeded; in batches of rollout.eval_batch_size)
    to each --prompt or held-out problem; greedy: the one answer held-out evaluation decodes
    (temperature 0, rollout.eval_strategy where set). Held-out problems, and --prompt problems of the task (a jsonl file's prompt, with
    its answer and fields) or in its format ("12+3=", a sudoku with one solution), are scored
    by the task's atoms."""
    from dllm_rl.tasks import Problem, parse_problem

    known = {}  # a jsonl task's prompts have no format to parse: their answers are in the files
    for q in (*task.eval_problems, *task.train):
        known.setdefault(q.prompt, q)
    problems = ([known.get(p) or parse_problem(task.name, p) or Problem(p, "", "", {}) for p in prompts]
                or task.eval_problems[:2])
    policy = fit_prompts(policy, prompts)
    texts = [p.prompt for p in problems for _ in range(n)]
    # One CPU generator per answer, seeded by (seed, prompt, answer) alone, as sampled evaluation
    # draws: an answer does not depend on eval_batch_size or the prompts beside it. On a GPU each
    # seeds a GPU generator (samplers.decode). A seed fixes the answers on a device.
    gens = sample_generators(len(problems), n, cfg.seed)
    try:
        policy.encode_prompts(list(dict.fromkeys(texts)))  # every prompt checked before any decoding
    except PromptError as e:  # too long, or a character the tokenizer has no token for
        raise ConfigError(f"--prompt: {e}") from e
    answers, nfe = [], []
    # in batches of rollout.eval_batch_size, as eval decodes: --num 64 of a few prompts was one
    # batch of hundreds of rows, whose logits alone can fill a GPU at an 8B model's vocabulary
    for start in range(0, len(texts), cfg.rollout.eval_batch_size):
        chunk = texts[start:start + cfg.rollout.eval_batch_size]
        if greedy:
            result, _ = policy.decode(chunk, None, temperature=0.0, strategy=cfg.rollout.eval_strategy)
        else:
            result, _ = policy.decode(chunk, gens[start:start + len(chunk)], temperature=cfg.rollout.temperature)
        answers += policy.answer_text(result.completion)
        nfe += result.nfe.tolist()  # one copy from the model's device per batch, not one per row
    rows = []
    for k, (text, answer) in enumerate(zip(texts, answers)):
        problem = problems[k // n]
        row = {"prompt": text, "completion": answer, "nfe": int(nfe[k])}
        if problem.answer:
            from dllm_rl.policy import to_sample

            scores = task.reward.score([to_sample(problem, answer)])
            row.update({"gold": problem.answer, "reward": scores.totals()[0], "atoms": scores.per_sample()[0]})
        rows.append(row)
    return rows
