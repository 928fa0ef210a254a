#!/usr/bin/env bash
# The main job (`mmrl train`, embedded default: bundled tiny Qwen2.5-VL, shapes-qa, GRPO)
# over seeds 0, 1, 2 (or the ones given); prints held-out accuracy (greedy and sampled)
# before and after.
#   bash benchmarks/vlm_learning.sh [OUT_DIR [SEED ...]]
set -euo pipefail
out=${1:-runs/vlm-learning}
mkdir -p "$(dirname "$out")"  # each seed's log is written beside OUT_DIR
seeds=("${@:2}")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do
  start=$(date +%s)
  mmrl train --seed "$seed" --output-dir "$out/seed$seed" > "$out.seed$seed.log" 2>&1 || { cat "$out.seed$seed.log"; exit 1; }
  python - "$out/seed$seed/summary.json" "$seed" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
b, a = s["eval_before"], s["eval_after"]
print(f"seed {sys.argv[2]}: greedy accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}, "
      f"sampled accuracy {b.get('sampled_accuracy', float('nan')):.3f} -> {a.get('sampled_accuracy', float('nan')):.3f}, "
      f"{s['steps']} steps, {sys.argv[3]} s wall")
PY
done
