"""Plot per-offset mask accuracy (mask_acc_j) and the mask loss from a training log_history.json.

    python scripts/plot_mask_accuracy.py runs/smollm2_frozen_base/log_history.json docs/mask_accuracy.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit(__doc__)
    history = [h for h in json.loads(Path(argv[0]).read_text()) if "mask_loss" in h]
    if not history:
        sys.exit(f"{argv[0]}: no training log with mask_loss")
    steps = [h["step"] for h in history]
    offsets = sorted({int(k.rsplit("_", 1)[1]) for h in history for k in h if k.startswith("mask_acc_")})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for j in offsets:
        ax1.plot(steps, [h.get(f"mask_acc_{j}") for h in history], label=f"offset {j}")
    ax1.set(xlabel="optimizer step", ylabel="top-1 accuracy", title="mask accuracy per offset j")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [h["mask_loss"] for h in history], color="#c44e52")
    ax2.set(xlabel="optimizer step", ylabel="cross-entropy", title="mask loss")
    fig.tight_layout()
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}: final accuracy " + ", ".join(f"j={j}: {history[-1].get(f'mask_acc_{j}', 0):.3f}" for j in offsets))


if __name__ == "__main__":
    main()
