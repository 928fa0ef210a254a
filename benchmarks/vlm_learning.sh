#!/usr/bin/env bash
# The main job (`mmrl train`, embedded default: bundled tiny Qwen2.5-VL, shapes-qa, GRPO)
# over seeds 0, 1, 2 (or the ones given); prints held-out accuracy (greedy and sampled)
# before and after. Each seed's run goes to OUT_DIR/seedS (default: the repository's
# runs/vlm-learning), its log to OUT_DIR.seedS.log beside it.
#   bash benchmarks/vlm_learning.sh [OUT_DIR [SEED ...]]
set -euo pipefail
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  # an option here was taken for OUT_DIR (--help made folders named after dirname's usage)
  -*) echo "error: unknown option $1; OUT_DIR comes first, then the seeds" >&2; usage >&2; exit 2 ;;
esac
out=${1:-"$(cd "$(dirname "$0")/.." && pwd)/runs/vlm-learning"}
seeds=("${@:2}")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do  # all checked first: a typo in the last seed stopped the job after the others trained
  [[ $seed =~ ^[0-9]+$ ]] || { echo "error: seed '$seed' is not a non-negative integer (seeds are separate words: 0 1 2)" >&2; exit 2; }
done
mkdir -p -- "$(dirname -- "$out")"  # each seed's log is written beside OUT_DIR
for seed in "${seeds[@]}"; do
  start=$(date +%s)
  mmrl train --seed "$seed" --output-dir "$out/seed$seed" > "$out.seed$seed.log" 2>&1 || { cat -- "$out.seed$seed.log"; exit 1; }
  python - "$out/seed$seed/summary.json" "$seed" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
b, a = s["eval_before"], s["eval_after"]
print(f"seed {sys.argv[2]}: greedy accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}, "
      f"sampled accuracy {b.get('sampled_accuracy', float('nan')):.3f} -> {a.get('sampled_accuracy', float('nan')):.3f}, "
      f"{s['steps']} steps, {sys.argv[3]} s wall")
PY
done
