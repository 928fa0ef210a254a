"""Build a tiny, randomly initialised Qwen VL checkpoint offline (see mmrl/vlm/tiny.py).

python scripts/build_tiny_vlm.py --family qwen2_5_vl --out assets/tiny-qwen2_5_vl --seed 0
"""

from __future__ import annotations

import argparse

from mmrl.vlm.tiny import FAMILIES, build_tiny_vlm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=2)
    args = parser.parse_args(argv)
    path = build_tiny_vlm(
        args.family,
        args.out,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vision_depth=args.vision_depth,
    )
    print(path)


if __name__ == "__main__":
    main()
