"""The training curves as a PNG: per-offset mask accuracy (``mask_acc_j``) and the losses, from a
Trainer ``log_history``. ``space-train`` writes ``OUTPUT_DIR/training_curves.png`` with it."""
from __future__ import annotations

from pathlib import Path

from ..jsonl import save_figure_atomic


def plot_training_curves(history: list[dict], png: Path, tokens_per_epoch: int = 0, tokens_before: int = 0) -> list[int]:
    """Plot mask accuracy per offset j (left) and the training loss and mask loss (right).

    Args:
        history: ``trainer.state.log_history`` (entries without ``mask_loss`` are skipped).
        png: where to write the figure (folders created).
        tokens_per_epoch: real tokens of one pass over the training set: the x axis becomes
            training tokens (epoch x tokens_per_epoch + tokens_before); 0 = optimizer steps.
        tokens_before: tokens trained before this run (a warm start), added to the x axis.

    Returns:
        the offsets j plotted.

    Raises:
        ValueError: no training log entry with ``mask_loss`` in ``history``.
    """
    from matplotlib.figure import Figure  # no pyplot: a notebook's own backend stays as it is

    history = [h for h in history if "mask_loss" in h]
    if not history:
        raise ValueError(f"no training log entry with mask_loss to plot into {png}")
    if tokens_per_epoch:
        x, xlabel = [tokens_before + h["epoch"] * tokens_per_epoch for h in history], "training tokens"
    else:
        x, xlabel = [h["step"] for h in history], "optimizer step"
    offsets = sorted({int(k.rsplit("_", 1)[1]) for h in history for k in h if k.startswith("mask_acc_")})
    fig = Figure(figsize=(10, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    for j in offsets:
        ax1.plot(x, [h.get(f"mask_acc_{j}") for h in history], label=f"offset {j}")
    ax1.set(xlabel=xlabel, ylabel="top-1 accuracy", title="mask accuracy per offset j")
    if offsets:
        ax1.legend(fontsize=8)
    ax2.plot(x, [h["mask_loss"] for h in history], color="#c44e52", label="mask loss")
    if all("loss" in h for h in history):  # the Trainer's loss: AR + lambda x mask (mask only, frozen-base)
        ax2.plot(x, [h["loss"] for h in history], color="#4c72b0", label="training loss")
    ax2.set(xlabel=xlabel, ylabel="cross-entropy", title="losses")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, png)
    return offsets
