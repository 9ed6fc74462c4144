"""Plot per-offset mask accuracy (mask_acc_j) and the losses from a training log_history.json
(``space-train`` writes the same figure as ``training_curves.png``; this redraws it, e.g. with
training tokens on the x axis).

    python scripts/plot_mask_accuracy.py runs/smollm2_frozen_base/log_history.json docs/mask_accuracy.png
    python scripts/plot_mask_accuracy.py LOG PNG --tokens-per-epoch 412000 --tokens-before 780000

With ``--tokens-per-epoch`` (real tokens of one pass over the training set) the x axis is training
tokens (epoch x tokens per epoch, plus ``--tokens-before`` for a run that continued another).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from space.cli import console, output_file
from space.train.curves import plot_training_curves


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_history", type=Path, help="a Trainer log_history.json")
    p.add_argument("png", type=output_file, help="the figure to write")
    p.add_argument("--tokens-per-epoch", type=int, default=0, help="x axis in training tokens (default 0: optimizer steps)")
    p.add_argument("--tokens-before", type=int, default=0, help="tokens trained before this run (warm start; default 0)")
    a = p.parse_args(argv)
    if a.tokens_per_epoch < 0 or a.tokens_before < 0:
        p.error("--tokens-per-epoch and --tokens-before must be >= 0")
    if a.tokens_before and not a.tokens_per_epoch:  # the x axis is optimizer steps then: it was dropped unsaid
        p.error("--tokens-before shifts a training-tokens axis: give --tokens-per-epoch too")
    try:
        history = json.loads(a.log_history.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        p.error(f"{a.log_history}: not JSON ({e.msg}); is this a Trainer log_history.json?")
    if not isinstance(history, list):
        p.error(f"{a.log_history}: not a list of log entries; is this a Trainer log_history.json?")
    try:
        offsets = plot_training_curves(history, a.png, a.tokens_per_epoch, a.tokens_before)
    except ValueError as e:
        p.error(f"{a.log_history}: {e}")
    last = [h for h in history if "mask_loss" in h][-1]
    print(f"wrote {a.png}: final accuracy " + ", ".join(f"j={j}: {last.get(f'mask_acc_{j}', 0):.3f}" for j in offsets))


if __name__ == "__main__":
    console("plot_mask_accuracy", main)()
