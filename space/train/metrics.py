"""Training metrics: sums and counts added up on the device, reduced across ranks once per log step.

A loss (``space.train.loss.space_loss``) returns sums and counts as device tensors; the trainer
adds each micro-batch's into :class:`MetricSums`, and its ``log`` calls :meth:`MetricSums.reduce`:
one all-reduce across ranks, one read back to the host (STYLE item 20). A ratio is then a ratio
of totals over every rank and micro-batch since the last log: accuracy = Σhits / Σrows, not rank
0's mean of per-batch ratios.
"""
from __future__ import annotations

import torch

# logged name: (sum, count) it is the ratio of
RATIOS = {"ar_loss": ("ar_loss_sum", "ar_rows"), "mask_loss": ("mask_loss_sum", "mask_rows"),
          "mask_token_ce": ("mask_token_ce_sum", "mask_rows"), "chain_weight_mean": ("chain_weight_sum", "mask_rows"),
          "consistency_loss": ("consistency_sum", "mask_rows"), "short_samples": ("short_samples", "batches")}


class MetricSums:
    """Running sums of a log interval: device tensors (the step's stats) and host numbers."""

    def __init__(self):
        self.device: dict[str, torch.Tensor] = {}
        self.host: dict[str, float] = {}

    def add(self, stats: dict[str, torch.Tensor], **host: float) -> None:
        """Add a micro-batch's ``stats`` (detached tensors, same keys and shapes on every call
        and rank) on their device, and host-side counts (``short_samples=2``) on the host."""
        for key, value in stats.items():
            self.device[key] = self.device[key] + value if key in self.device else value.clone()
        for key, value in host.items():
            self.host[key] = self.host.get(key, 0.0) + float(value)

    def reduce(self) -> dict[str, float]:
        """The interval's metrics over every rank, then start a new interval.

        Every rank must call it at the same log step (it is a collective under torch.distributed).

        Returns:
            ``{name: ratio}`` for each of :data:`RATIOS` whose sums were added and whose count is
            non-zero, and ``mask_acc_{j}`` = Σhits_j / Σrows_j for each offset j with rows;
            rounded to 4 digits. Empty when nothing was added.
        """
        if not self.device and not self.host:
            return {}
        keys = sorted(self.device)
        device = self.device[keys[0]].device if keys else torch.device("cpu")
        flat = torch.cat([self.device[k].reshape(-1) for k in keys]
                         + [torch.tensor([self.host[k] for k in sorted(self.host)], device=device)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat)  # one collective for every metric
        values, totals = flat.tolist(), {}  # the one read back
        for key in keys:
            n = self.device[key].numel()
            totals[key], values = (values[:n] if self.device[key].dim() else values[0]), values[n:]
        totals.update(zip(sorted(self.host), values))
        self.device, self.host = {}, {}
        return ratios(totals)


def ratios(totals: dict) -> dict[str, float]:
    """Metrics from totals: ``{sum or count name: float, or a list for per-offset ones}`` (the keys
    of ``space_loss``'s stats, plus ``consistency_sum``, ``short_samples`` and ``batches``)."""
    out = {name: round(totals[s] / totals[c], 4) for name, (s, c) in RATIOS.items()
           if s in totals and totals.get(c)}
    for j, (hits, rows) in enumerate(zip(totals.get("mask_hits", []), totals.get("mask_offset_rows", []))):
        if rows:
            out[f"mask_acc_{j}"] = round(hits / rows, 4)
    return out
