"""Peak memory and time of the training log-probabilities at a real vocabulary, plain against
chunked (model.logprob_chunk, mmrl.core.logprob): bfloat16 logits [N, T, V] as a model's output
layer gives them, log-probs of random targets, a weighted sum, backward. Each form runs in a
fresh process, and its peak resident memory (VmHWM, reset once the inputs exist) less the
memory held before is what the log-prob computation adds (the logits' gradient included).

    python benchmarks/logprob_memory.py                       # N 2, T 1024, V 151936 (Qwen2.5), sliced
    python benchmarks/logprob_memory.py --contiguous          # a contiguous [N, T, V]
    python benchmarks/logprob_memory.py --chunk 512 --rows 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak() -> None:
    """Linux: the peak resident size starts again from the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one(rows: int, tokens: int, vocab: int, chunk: int | None, sliced: bool) -> dict:
    import torch

    from mmrl.core.logprob import token_logprobs

    torch.manual_seed(0)
    if sliced:  # as the VLM passes them: out.logits[:, :-1] of the kept positions, not contiguous
        full = torch.randn(rows, tokens + 1, vocab, dtype=torch.bfloat16).requires_grad_()
        logits = full[:, :-1]
    else:
        full = logits = torch.randn(rows, tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows, tokens))
    weights = torch.randn(rows, tokens)
    reset_peak()  # creating the inputs had its own peak
    base = status_bytes("VmRSS")
    t0 = time.perf_counter()
    logp = token_logprobs(logits, targets, 1.0, chunk=chunk)
    (logp * weights).sum().backward()
    seconds = time.perf_counter() - t0
    added = status_bytes("VmHWM") - base  # before the check below makes a float32 copy of the gradient
    grad_norm = float(full.grad.float().norm())
    return {"chunk": chunk, "sliced": sliced, "added_peak_bytes": added, "seconds": seconds,
            "logits_bytes": logits.numel() * 2, "grad_norm": grad_norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--contiguous", action="store_true",
                    help="contiguous logits (default: a [:, :-1] slice, as the VLM and dLLM pass them)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process's own run
    args = ap.parse_args()
    if min(args.rows, args.tokens, args.vocab, args.chunk) < 1:  # else each child process fails with a traceback
        ap.error(f"--rows, --tokens, --vocab and --chunk must be >= 1, got {args.rows}, {args.tokens}, {args.vocab} "
                 f"and {args.chunk}")
    if args.one is not None:
        print(json.dumps(one(args.rows, args.tokens, args.vocab, None if args.one == "plain" else args.chunk,
                             not args.contiguous)))
        return
    rows = []
    for form in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--one", form, "--rows", str(args.rows), "--tokens",
                              str(args.tokens), "--vocab", str(args.vocab), "--chunk", str(args.chunk),
                              *(["--contiguous"] if args.contiguous else [])],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    plain, chunked = rows
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"peak_ratio_chunked_over_plain": round(chunked["added_peak_bytes"] / plain["added_peak_bytes"], 3),
                      "time_ratio_chunked_over_plain": round(chunked["seconds"] / plain["seconds"], 3),
                      "grad_norm_relative_difference": abs(chunked["grad_norm"] - plain["grad_norm"]) / plain["grad_norm"]}))


if __name__ == "__main__":
    import bench_cli

    raise SystemExit(bench_cli.run(main))
