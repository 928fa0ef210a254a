#!/usr/bin/env bash
# The GPU checks (tests/gpu: each backend training and evaluating with model.device=cuda, and
# the vLLM engines on the bundled tiny Qwen2.5-VL) and the figures they measure (vLLM throughput,
# training seconds per step on the CPU and the GPU). For a CUDA machine with mmrl and vllm already
# installed (no network needed); at most 9.5 minutes (7 for the checks, 2.5 for the speed figures).
#   bash benchmarks/gpu_check.sh            # MMRL_TEST_VLLM_SERVER=1 adds the `vllm serve` test
set -uo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
try:
    import vllm
    print("vllm", vllm.__version__)
except ImportError as e:
    print("vllm missing:", e)
PY
out=$(mktemp)
# correctness first (each backend on cuda, the vLLM engines), then the speed figures with what is left
MMRL_BENCH_OUT="$out" timeout 420 python -m pytest -q -rs tests/gpu -p no:cacheprovider \
    --ignore=tests/gpu/test_device_speed.py
rc=$?
MMRL_BENCH_OUT="$out" timeout 150 python -m pytest -q -rs tests/gpu/test_device_speed.py -p no:cacheprovider
speed=$?
[ $rc -eq 0 ] && rc=$speed
echo "--- figures (JSON lines) ---"
cat "$out"
rm -f "$out"
exit $rc
