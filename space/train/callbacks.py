"""SpaceTrainer's callbacks: epoch seeds, a time budget, checkpoint contents, checkpointing hooks."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..artifact import MASK_EMBEDDING, SAMPLER_HEAD, save_mask_rows, save_sampler_head
from ..zero3 import gathered
from .prefix_cache import checkpoint_with_prefix_cache

SETTINGS_FILE = "space_settings.json"


class CheckpointInMaskRowsCallback(TrainerCallback):
    """Runs :func:`~space.train.prefix_cache.checkpoint_with_prefix_cache` once ``Trainer.train``
    has enabled activation checkpointing (it replaces each layer's checkpoint function then)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        checkpoint_with_prefix_cache(model)


class NothingToTrain(Exception):
    """Raised by :class:`StopAtMaxStepsCallback`: the resumed checkpoint is at ``max_steps``."""


class StopAtMaxStepsCallback(TrainerCallback):
    """Ends a run resumed from a checkpoint at ``max_steps`` before it draws a batch: HF's loop
    trains one batch before its first stop check, so a rerun of a finished run whose ``max_steps``
    ends inside an epoch trained a step past it (and each rerun one more)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise NothingToTrain


class EpochSeedCallback(TrainerCallback):
    """Tells the collator the epoch, so spans are drawn afresh every epoch (DESIGN §3.2). The
    collator must run in this process (``dataloader_persistent_workers`` is refused)."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)


class TimeBudgetCallback(TrainerCallback):
    """Ends training after the step that crosses ``minutes`` of wall-clock in this launch, and saves
    a checkpoint there, so runs whose steps cost differently can be compared at equal time (issue
    #13's recipe sweep) and a relaunch resumes with a fresh budget. The clock starts at the first
    step, so model loading and tokenization are not counted. Under torch.distributed the ranks
    agree (the first rank over budget stops them all): a rank that stopped alone would leave the
    others waiting in their next collective.
    """

    def __init__(self, minutes: float):
        self.seconds, self.start = minutes * 60, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        over = torch.tensor([float(time.monotonic() - self.start >= self.seconds)], device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
        if over.item():
            control.should_training_stop = control.should_save = True


class SpaceCheckpointCallback(TrainerCallback):
    """Adds to each checkpoint what a resume needs beyond HF's files.

    * ``mask_embedding.safetensors``: the trainable mask rows (lora / frozen-base), which peft
      checkpoints leave out since they hold only LoRA weights.
    * ``sampler_head.safetensors``: the sampler head's weights, when the run trains one.
    * ``space_settings.json``: the SPACE settings (k, mode, layout, ...), so that a resume under
      other settings is refused (``space.train.run.check_checkpoint``). Written last and
      atomically: a save cut short leaves a checkpoint without it, which a resume refuses.
    """

    def __init__(self, settings: dict, mask_embedding=None, sampler=None):
        self.settings, self.emb, self.sampler = settings, mask_embedding, sampler

    def on_save(self, args, state, control, **kwargs):
        # every rank's own checkpoint files (rng_state_{rank}.pth) are written before rank 0 marks the
        # checkpoint whole below: a kill in between left a checkpoint a resume took, without a rank's RNG
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        # every rank gathers (ZeRO-3 partitions the mask rows and the head too); rank 0 writes
        params = ([self.emb.mask_rows] if self.emb is not None else []) + \
            (list(self.sampler.parameters()) if self.sampler is not None else [])
        with gathered(params):
            if state.is_world_process_zero:
                ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if self.emb is not None:
                    save_mask_rows(self.emb, ckpt / MASK_EMBEDDING)
                if self.sampler is not None:
                    save_sampler_head(self.sampler, ckpt / SAMPLER_HEAD)
                tmp = ckpt / f".{SETTINGS_FILE}.tmp"
                tmp.write_text(json.dumps(self.settings, indent=2))
                os.replace(tmp, ckpt / SETTINGS_FILE)
