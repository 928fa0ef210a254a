"""Partial credit for arith answers, as an extra reward atom (RESULTS.md, the dLLM section):

    --set 'reward.atoms=[{"path":"../../benchmarks/atoms/arith_digits.py:digits","weight":0.5,"parents":["format"]}]'

with diffu-GRPO or TraceRL (configs/dllm/; a relative path starts at the config's folder).
"""

from dllm_rl.tasks.arith import parse_integer


def digits(sample) -> float:
    """Share of the answer's digits (aligned from the units digit) and its sign that are right."""
    got = parse_integer(sample.completion)
    if got is None:
        return 0.0
    want = int(sample.meta["answer"])
    a, b = str(abs(got))[::-1], str(abs(want))[::-1]
    n = max(len(a), len(b))
    hits = sum(i < len(a) and i < len(b) and a[i] == b[i] for i in range(n))
    return (hits + ((got < 0) == (want < 0))) / (n + 1)
