"""``python -m space.train --config configs/train/smollm2_frozen_base_cpu.yaml [--key value ...]``"""
from __future__ import annotations

import sys

from ..config import parse_train_args
from .run import run_sft


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_train_args(argv)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"space-train: error: {e}")
    run_sft(*args)


if __name__ == "__main__":
    main()
