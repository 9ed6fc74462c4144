"""SpaceTrainer: HF's Trainer with the SAR-SFT step (``space.train.steps``), metrics reduced once
per log step (``space.train.metrics``) and a guard against non-finite steps."""
from __future__ import annotations

import torch
from transformers import Trainer
from transformers.trainer_utils import rotate_checkpoints

from ..config import SpaceSettings
from .callbacks import CheckpointInMaskRowsCallback
from .metrics import MetricSums
from .steps import sar_step, scored_rows


class TrainingDiverged(ValueError):
    """Training stopped: the loss or gradient norm stayed NaN or inf (``max_nonfinite_steps``).
    A ValueError, so ``space-train`` reports it in one line and exits non-zero."""


class SpaceTrainer(Trainer):
    """``compute_loss`` runs :func:`space.train.steps.sar_step`; ``log`` adds its metrics.

    Args:
        space: the SPACE settings (:class:`space.config.SpaceSettings`, validated when built).

    The guard: after ``space.max_nonfinite_steps`` consecutive optimizer steps whose loss or
    gradient norm is NaN or inf it raises :class:`TrainingDiverged` (0 = never). Such a step saves
    no checkpoint, so the last one saved before it stays; ``nonfinite_steps`` is the current run
    of them (``space.train.run`` writes no artifact when training ends inside one). Under fp16
    only the loss counts: an overflowing gradient there is the loss scaler's business.

    With ``activation_checkpointing``, every checkpointed layer is recomputed inside the forward's
    mask rows, and the frozen-base mask pass keeps its real tokens' cache
    (``space.train.prefix_cache``).

    Raises:
        ValueError: ``space.mask_chunk_rows`` > 0 under DeepSpeed (each backward also steps).
    """

    def __init__(self, *args, space: SpaceSettings | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.space = SpaceSettings() if space is None else space
        if self.space.mask_chunk_rows and self.is_deepspeed_enabled:
            raise ValueError("mask_chunk_rows > 0 does not work with DeepSpeed (each backward also steps): set it to 0")
        self.args.logging_nan_inf_filter = False  # HF's filter logs a NaN loss as the mean of the finite ones
        self.model_accepts_loss_kwargs = False  # HF's num_items_in_batch counts AR and mask rows as one
        self.loss_is_scaled_for_ga = True  # each micro-batch's loss is its share of the step's mean
        self.metrics = MetricSums()
        self.nonfinite_steps = 0  # consecutive optimizer steps with a non-finite loss or gradient norm, so far
        self._loss_finite = torch.ones((), dtype=torch.bool)  # this step's micro-batches so far
        self._checked_step = -1  # the global step the guard last counted
        self._checked_ok = True  # whether that step was finite
        self._rotate_after_save = False  # a checkpoint was saved this step: delete those past the limit after on_save
        if self.args.activation_checkpointing:  # after train() enables it: the callback runs then
            self.add_callback(CheckpointInMaskRowsCallback())

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """An optimizer step's micro-batches, and as ``num_items_in_batch`` their scored (AR, mask)
        rows summed over them and over every rank (one all-reduce per step)."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:  # the epoch ran out (every rank alike)
            return batches, None
        counts = torch.stack([scored_rows(b) for b in batches]).sum(0).to(device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        return batches, counts

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The step's loss. With ``num_items_in_batch`` (:meth:`get_batch_samples`' counts) it is
        this micro-batch's share of the optimizer step's mean over every rank, times the ranks
        (DDP and DeepSpeed average gradients over them); else this batch's mean."""
        scale = self.accelerator.num_processes if num_items_in_batch is not None else 1
        step = sar_step(model, inputs, self.space, self.accelerator.unwrap_model(model),
                        backward=lambda loss: self.accelerator.backward(loss * scale),
                        no_sync=self.accelerator.no_sync, totals=num_items_in_batch)
        if model.training:  # an evaluation's batches are no part of the training log, nor of the guard's step
            self._loss_finite = self._loss_finite.to(step.loss.device) & torch.isfinite(step.loss.detach())
            self.metrics.add(step.stats, short_samples=inputs["num_short"], batches=1)
        loss = step.loss * scale
        return (loss, {"logits": step.logits}) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log (every rank calls it): the interval's metrics over all ranks
            logs.update(self.metrics.reduce())
        super().log(logs, *args, **kwargs)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # the one place the Trainer hands over each optimizer step's gradient norm (before it logs
        # and saves): check the step here, so a bad step is never saved as a checkpoint
        self._check_finite(grad_norm)
        result = super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
        if self._rotate_after_save:  # see _save_checkpoint
            self._rotate_after_save = False
            rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, self.state.best_model_checkpoint,
                               use_mtime=True)
        return result

    def _save_checkpoint(self, model, trial):
        # HF deletes the checkpoints past save_total_limit at the end of this call, before the
        # on_save callbacks add SPACE's files (the mask rows, space_settings.json): a run stopped
        # between kept only a checkpoint that a resume refuses. _maybe_log_save_evaluate deletes
        # them after the callbacks instead.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self._rotate_after_save = bool(limit) and self.args.should_save

    def _check_finite(self, grad_norm) -> None:
        """Count consecutive non-finite steps (every rank agrees); raise past the limit.

        Once per optimizer step: at an epoch's end HF calls the hook again with the same step and
        gradient norm, which must neither count the step twice nor (its loss flag already reset)
        clear the count; a bad step's checkpoint stays unsaved then too (``save_strategy: epoch``
        asks for one between the two calls)."""
        if self.state.global_step == self._checked_step:
            if not self._checked_ok:
                self.control.should_save = False
            return
        self._checked_step = self.state.global_step
        ok = self._loss_finite.clone()
        self._loss_finite = torch.ones((), dtype=torch.bool, device=ok.device)
        if grad_norm is not None and not self.args.fp16:
            ok &= bool(torch.isfinite(torch.as_tensor(grad_norm, dtype=torch.float)).all())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            bad = (~ok).to(torch.float).reshape(1).to(self.args.device)
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # one bad rank stops all
            ok = bad.item() == 0
        self._checked_ok = bool(ok)
        if self._checked_ok:
            self.nonfinite_steps = 0
            return
        self.nonfinite_steps += 1
        self.control.should_save = False  # keep the last checkpoint saved before the trouble
        step, limit = self.state.global_step, self.space.max_nonfinite_steps
        if limit and self.nonfinite_steps >= limit:
            raise TrainingDiverged(
                f"training stopped at step {step}: the loss or gradient norm was NaN or inf on "
                f"{self.nonfinite_steps} consecutive steps (max_nonfinite_steps={limit}); "
                f"the last checkpoint in {self.args.output_dir} was saved before them. Lower the learning rate, "
                "check the data and the mask rows, or use bf16 instead of fp16")
        if self.is_world_process_zero():
            print(f"[space] step {step}: non-finite loss or gradient norm ({self.nonfinite_steps} in a row; "
                  f"stopping at {limit or 'never'}); no checkpoint saved for it", flush=True)
