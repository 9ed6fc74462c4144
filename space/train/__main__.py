"""``python -m space.train --config configs/train/smollm2_frozen_base_cpu.yaml [--key value ...]``"""
from __future__ import annotations

from pathlib import Path

from ..cli import console


def main(argv: list[str] | None = None) -> Path | None:
    """Parse and check the arguments, then train; returns the artifact directory (main process).

    Raises:
        ValueError, FileNotFoundError: a bad config, argument, dataset or checkpoint to resume.
    """
    from ..config import parse_train_args  # here, not at the top: --help loads no model code
    from .run import run_sft

    return run_sft(*parse_train_args(argv))


cli = console("space-train", main, resumes=True)

if __name__ == "__main__":
    cli()
