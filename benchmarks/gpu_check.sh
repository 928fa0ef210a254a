#!/usr/bin/env bash
# The GPU checks (tests/gpu: each backend training and evaluating with model.device=cuda, and
# the vLLM engines on the bundled tiny Qwen2.5-VL) and the throughput figures they measure. For a CUDA machine with mmrl and vllm already
# installed (no network needed); about 3-5 minutes, well inside a 10-minute limit.
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
MMRL_BENCH_OUT="$out" timeout 570 python -m pytest -q -rs tests/gpu -p no:cacheprovider
rc=$?
echo "--- figures (JSON lines) ---"
cat "$out"
rm -f "$out"
exit $rc
