"""Plot per-offset mask accuracy (mask_acc_j) and the mask loss from a training log_history.json.

    python scripts/plot_mask_accuracy.py runs/smollm2_frozen_base/log_history.json docs/mask_accuracy.png
    python scripts/plot_mask_accuracy.py LOG PNG --tokens-per-epoch 412000 --tokens-before 780000

With ``--tokens-per-epoch`` (real tokens of one pass over the training set) the x axis is training
tokens (epoch x tokens per epoch, plus ``--tokens-before`` for a run that continued another).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_history", type=Path)
    p.add_argument("png", type=Path)
    p.add_argument("--tokens-per-epoch", type=int, default=0, help="x axis in training tokens (0: optimizer steps)")
    p.add_argument("--tokens-before", type=int, default=0, help="tokens trained before this run (warm start)")
    a = p.parse_args(argv)
    history = [h for h in json.loads(a.log_history.read_text()) if "mask_loss" in h]
    if not history:
        p.error(f"{a.log_history}: no training log with mask_loss")
    if a.tokens_per_epoch:
        steps, xlabel = [a.tokens_before + h["epoch"] * a.tokens_per_epoch for h in history], "training tokens"
    else:
        steps, xlabel = [h["step"] for h in history], "optimizer step"
    offsets = sorted({int(k.rsplit("_", 1)[1]) for h in history for k in h if k.startswith("mask_acc_")})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for j in offsets:
        ax1.plot(steps, [h.get(f"mask_acc_{j}") for h in history], label=f"offset {j}")
    ax1.set(xlabel=xlabel, ylabel="top-1 accuracy", title="mask accuracy per offset j")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [h["mask_loss"] for h in history], color="#c44e52")
    ax2.set(xlabel=xlabel, ylabel="cross-entropy", title="mask loss")
    fig.tight_layout()
    a.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}: final accuracy " + ", ".join(f"j={j}: {history[-1].get(f'mask_acc_{j}', 0):.3f}" for j in offsets))


if __name__ == "__main__":
    main()
