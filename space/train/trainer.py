"""SpaceTrainer: HF Trainer with the SAR-SFT loss; frozen-base runs real tokens without gradients."""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from transformers import DynamicCache, Trainer, TrainerCallback

from ..artifact import MASK_EMBEDDING, SAMPLER_HEAD, save_mask_rows, save_sampler_head
from ..decoding.cache import cache_input
from ..decoding.config import DEFAULT_MASK_NUM
from ..decoding.decoder import check_attention
from ..masking import IGNORE_INDEX, mask_rows, mask_rows_start, previous_ids, to_additive_4d
from ..sampler_head import sampler_head
from ..zero3 import gathered
from .loss import consistency_loss, offset_hits, space_loss, teacher_targets

SETTINGS_FILE = "space_settings.json"


class SpaceTrainer(Trainer):
    """Overrides ``compute_loss`` (and ``log`` to report its metrics).

    Args:
        mask_loss_weight: lambda.
        mask_num: k (per-offset accuracy).
        two_pass: frozen-base: run the real tokens once under ``torch.no_grad()`` with the LoRA
            disabled into a KV cache, then only the mask rows with gradients. Exact, since real
            tokens never see masks and the frozen base's real-token states do not depend on the
            trainable weights; a step costs a no-grad forward plus a small forward/backward.
        mask_target: "token" (CE on the next tokens) or "teacher" (soft CE on the frozen base's
            top-K at real row e+j, computed from the no-grad pass; two_pass only).
        teacher_topk: K of the teacher.
        mask_chunk_rows: two_pass only: mask rows per forward/backward (rounded down to whole
            groups, at least one group); 0 = all in one pass. Each chunk runs against the same
            no-grad cache and is back-propagated at once, so activation memory is bounded by one
            chunk; each chunk's loss is divided by the batch's mask-row count, so the chunks add
            up to the unchunked loss and gradients. Not with DeepSpeed (its backward also steps).
        suppress_ids: token ids the teacher never proposes (the mask tokens).
        chain_weight: alpha of the chain-weighted mask loss (``space.train.loss``; 0 = off).
        consistency_weight: weight of the hidden-state consistency loss (two_pass only; 0 = off).
        max_nonfinite_steps: stop with :class:`TrainingDiverged` after this many consecutive
            optimizer steps whose loss or gradient norm is NaN or inf (0 = never). Such a step
            saves no checkpoint, so the last one saved before it stays. Under fp16 only the loss
            counts: an overflowing gradient there is the loss scaler's business (it skips the step).

    With ``activation_checkpointing`` in frozen-base mode (two_pass), the mask pass reads the real
    tokens' keys and values from a :class:`PrefixCache` that it never writes, so each decoder
    layer can be recomputed in backward with the cache (transformers drops a cache it might write
    twice, and the mask rows would then attend to nothing but themselves).

    Raises:
        ValueError: unknown mask_target, teacher or consistency without two_pass, teacher_topk < 1,
            mask_chunk_rows < 0, chain_weight outside [0, 1], consistency_weight < 0.
    """

    def __init__(self, *args, mask_loss_weight: float = 1.0, mask_num: int = DEFAULT_MASK_NUM, two_pass: bool = False,
                 mask_target: str = "token", teacher_topk: int = 20, mask_chunk_rows: int = 0,
                 suppress_ids: tuple[int, ...] = (), chain_weight: float = 0.0, consistency_weight: float = 0.0,
                 max_nonfinite_steps: int = 3, **kwargs):
        if not 0 <= chain_weight <= 1 or not consistency_weight >= 0:  # False for NaN
            raise ValueError(f"need chain_weight in [0, 1] and consistency_weight >= 0, got {chain_weight}, "
                             f"{consistency_weight}")
        if consistency_weight and not two_pass:
            raise ValueError("consistency_weight needs the frozen-base mode (its no-grad pass holds the base's states)")
        if mask_target not in ("token", "teacher"):
            raise ValueError(f"mask_target must be 'token' or 'teacher', got {mask_target!r}")
        if mask_target == "teacher" and not two_pass:
            raise ValueError("mask_target 'teacher' needs the frozen-base mode (its no-grad pass is the teacher)")
        if teacher_topk < 1 or mask_chunk_rows < 0:
            raise ValueError(f"need teacher_topk >= 1 and mask_chunk_rows >= 0, got {teacher_topk}, {mask_chunk_rows}")
        super().__init__(*args, **kwargs)
        self.args.logging_nan_inf_filter = False  # HF's filter logs a NaN loss as the mean of the finite ones
        self.mask_loss_weight, self.mask_num, self.two_pass = mask_loss_weight, mask_num, two_pass
        self.mask_target, self.teacher_topk, self.mask_chunk_rows = mask_target, teacher_topk, mask_chunk_rows
        self.suppress_ids = tuple(suppress_ids)
        self.chain_weight, self.consistency_weight = chain_weight, consistency_weight
        self.model_accepts_loss_kwargs = False  # our loss is a mean: let Trainer scale for accumulation
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0  # consecutive optimizer steps with a non-finite loss or gradient norm, so far
        self._loss_finite = torch.ones((), dtype=torch.bool)  # this step's micro-batches so far
        self._checked_step = -1  # the global step the guard last counted
        if self.args.activation_checkpointing:  # after train() enables it: the callback runs then
            self.add_callback(CheckpointInMaskRowsCallback())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.two_pass:
            loss, metrics, out = self.two_pass_loss(model, inputs)
        else:
            out, labels, offsets = sar_forward(model, self.accelerator.unwrap_model(model), inputs, False)
            loss, metrics = space_loss(out.logits, labels, offsets, self.mask_loss_weight, self.mask_num,
                                       chain_weight=self.chain_weight)
        self._loss_finite = self._loss_finite.to(loss.device) & torch.isfinite(loss.detach()).all()
        metrics["short_samples"] = float(inputs["num_short"])
        for key, value in metrics.items():
            self._sums[key] += value
            self._counts[key] += 1
        return (loss, out) if return_outputs else loss

    def two_pass_loss(self, model, inputs):
        """Frozen-base step (DESIGN §3.6): a no-grad real pass, then the mask rows chunk by chunk.

        Every chunk but the last is back-propagated here (gradient-accumulation scaled, without a
        DDP sync); the last chunk's loss goes back to the Trainer, which back-propagates it. The
        returned loss adds the earlier chunks' detached losses, so it logs the whole batch's loss.

        Returns:
            (loss, metrics, output of the last chunk).
        """
        unwrapped = self.accelerator.unwrap_model(model)
        T = inputs["num_real"]
        labels, offsets = inputs["labels"][:, T:], inputs["mask_offset"][:, T:]
        cache, hidden = real_pass(unwrapped, inputs)
        teacher = None
        if self.mask_target == "teacher":
            head = unwrapped.get_base_model().get_output_embeddings()
            teacher = teacher_targets(head, hidden, inputs, self.teacher_topk, self.suppress_ids)
        chunks = mask_chunks(offsets, self.mask_chunk_rows)
        scored = (labels != IGNORE_INDEX) & (offsets >= 0)  # (batch, M)
        total = int(scored.sum())
        early = torch.is_grad_enabled() and model.training and len(chunks) > 1
        if early and self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError("mask_chunk_rows > 0 does not work with DeepSpeed (each backward also steps): set it to 0")
        done, sums = 0.0, defaultdict(float)
        hits, rows_n = torch.zeros(self.mask_num), torch.zeros(self.mask_num)
        for i, rows in enumerate(chunks):
            last = i == len(chunks) - 1
            # DDP: forward and backward of all but the last chunk inside no_sync (one all-reduce)
            with self.accelerator.no_sync(model) if early and not last else nullcontext():
                out = mask_pass(model, unwrapped, inputs, cache, rows, hidden_states=self.consistency_weight > 0)
                tch = None if teacher is None else (teacher[0][:, rows], teacher[1][:, rows])
                loss, m = space_loss(out.logits, labels[:, rows], offsets[:, rows], self.mask_loss_weight,
                                     self.mask_num, tch, total, self.chain_weight)
                if self.consistency_weight:
                    c = mask_consistency(out.hidden_states[-1], hidden, inputs, rows)
                    loss = loss + self.consistency_weight * c * int(scored[:, rows].sum()) / max(total, 1)
                    m["consistency_loss"] = c.item() * int(scored[:, rows].sum()) / max(total, 1)
                if early and not last:
                    self.accelerator.backward(loss / self._accumulation_steps())
            for key in ("mask_loss", "mask_token_ce", "consistency_loss"):
                sums[key] += m.get(key, 0.0)
            if "chain_weight_mean" in m:  # a mean over the chunk's rows: weighted by them
                sums["chain_weight_mean"] += m["chain_weight_mean"] * int(scored[:, rows].sum()) / total
            sel = scored[:, rows]
            h, r = offset_hits(out.logits[sel].detach(), labels[:, rows][sel], offsets[:, rows][sel], self.mask_num)
            hits, rows_n = hits + h.cpu(), rows_n + r.cpu()
            if not last:
                done = done + loss.detach()
        metrics = {k: v for k, v in sums.items() if total and (k != "mask_token_ce" or teacher is not None)
                   and (k != "consistency_loss" or self.consistency_weight) and (k != "chain_weight_mean" or self.chain_weight)}
        metrics.update({f"mask_acc_{j}": (hits[j] / rows_n[j]).item() for j in range(self.mask_num) if rows_n[j] > 0})
        return loss + done, metrics, out

    def _accumulation_steps(self) -> int:
        """What ``Trainer.training_step`` divides this micro-batch's loss by (set in the train loop)."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # the one place the Trainer hands over each optimizer step's gradient norm (before it logs
        # and saves): check the step here, so a bad step is never saved as a checkpoint
        self._check_finite(grad_norm)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _check_finite(self, grad_norm) -> None:
        """Count consecutive non-finite steps (every rank agrees); raise past the limit.

        Once per optimizer step: at an epoch's end HF calls the hook again with the same step and
        gradient norm, which must neither count the step twice nor (its loss flag already reset)
        clear the count."""
        if self.state.global_step == self._checked_step:
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
        if bool(ok):
            self.nonfinite_steps = 0
            return
        self.nonfinite_steps += 1
        self.control.should_save = False  # keep the last checkpoint saved before the trouble
        step = self.state.global_step
        if self.max_nonfinite_steps and self.nonfinite_steps >= self.max_nonfinite_steps:
            raise TrainingDiverged(
                f"training stopped at step {step}: the loss or gradient norm was NaN or inf on "
                f"{self.nonfinite_steps} consecutive steps (max_nonfinite_steps={self.max_nonfinite_steps}); "
                f"the last checkpoint in {self.args.output_dir} was saved before them. Lower the learning rate, "
                "check the data and the mask rows, or use bf16 instead of fp16")
        if self.is_world_process_zero():
            print(f"[space] step {step}: non-finite loss or gradient norm ({self.nonfinite_steps} in a row; "
                  f"stopping at {self.max_nonfinite_steps or 'never'}); no checkpoint saved for it", flush=True)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # training log: add our averages since the last log
            logs.update({k: round(self._sums[k] / self._counts[k], 4) for k in sorted(self._sums)})
            self._sums.clear(), self._counts.clear()
        super().log(logs, *args, **kwargs)


class TrainingDiverged(ValueError):
    """Training stopped: the loss or gradient norm stayed NaN or inf (``max_nonfinite_steps``).
    A ValueError, so ``space-train`` reports it in one line and exits non-zero."""


class PrefixCache(DynamicCache):
    """The real tokens' KV cache of a frozen-base step, read-only once ``frozen``.

    The no-grad real pass fills it; the mask pass then gets, per layer, the real keys and values
    followed by the mask rows' own, without storing the latter. The cache is the same before and
    after each mask forward, so a decoder layer recomputed in backward (activation checkpointing)
    sees exactly what it saw in forward, and every chunk of mask rows sees the real tokens alone.
    """

    frozen = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.frozen:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


def checkpoint_with_prefix_cache(model) -> None:
    """Make transformers' activation checkpointing of ``model`` recompute what the forward computed.

    Call it after checkpointing is enabled (``activation_checkpointing_enable``; the Trainer does
    that in ``train()``). Two things differ in a recompute unless told:

    * the mask rows: a layer recomputed in backward runs outside the forward's ``mask_rows``
      block (and on a GPU in autograd's own thread), so the frozen-base LoRA gate would see no
      mask row and zero the LoRA output; each checkpoint re-enters the forward's block
      (``context_fn``);
    * the cache: transformers drops the cache of a checkpointed layer, since a recomputed layer
      would write it twice; its ``_can_checkpoint_with_cache`` is for layers that only read it,
      which is what a frozen :class:`PrefixCache` makes every layer do (the frozen-base mask pass
      is the only one that runs layers with gradients and a cache).

    Raises:
        ValueError: a transformers version without that switch (it appeared in 5.24), or
            reentrant checkpointing (``use_reentrant: true``), which takes no ``context_fn``.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        raise ValueError("frozen-base training with activation_checkpointing needs transformers >= 5.24 (earlier "
                         "versions drop the real tokens' cache in checkpointed layers); upgrade, or turn it off")
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None and not getattr(func, "in_mask_rows", False):
                if getattr(func, "keywords", {}).get("use_reentrant", False):
                    raise ValueError("SPACE training needs activation_checkpointing_kwargs use_reentrant: false "
                                     "(a reentrant recompute cannot re-enter the mask rows' context)")
                module._gradient_checkpointing_func = _in_mask_rows(func)


def _in_mask_rows(func):
    """``func`` (a checkpoint function) with the recompute inside the forward's mask_rows block."""
    def checkpoint(function, *args, **kwargs):
        start = mask_rows_start()  # read at forward time; the recompute enters a block of its own
        return func(function, *args, context_fn=lambda: (nullcontext(), mask_rows(start)), **kwargs)

    checkpoint.in_mask_rows = True
    return checkpoint


def forward_mask(allowed: torch.Tensor, model) -> torch.Tensor:
    """The collator's boolean 4-D mask (True: may attend) in the form ``model``'s attention takes.

    SDPA takes it as it is (its memory-efficient kernel accepts a boolean mask in bf16 too); eager
    attention adds the mask to its scores, so it gets an additive mask in the compute dtype (the
    autocast dtype under mixed precision, else the weights'). Flash attention takes no 4-D mask.

    Raises:
        ValueError: a flash-attention model.
    """
    check_attention(model, "SAR-SFT training")
    impl = str(getattr(model.config, "_attn_implementation", "sdpa"))
    if impl == "sdpa" or allowed.dtype != torch.bool:
        return allowed
    kind = allowed.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else model.get_input_embeddings().weight.dtype
    return to_additive_4d(allowed, dtype)


def sar_forward(model, unwrapped, inputs: dict, two_pass: bool):
    """Forward a SpaceCollator batch; returns (model output, labels, mask_offset) of the rows scored.

    Args:
        model: what to call with gradients (the DeepSpeed/DDP wrapper when there is one).
        unwrapped: the peft model inside it (two_pass only).
        two_pass: run real columns ``:T`` under no_grad with the adapter disabled into a KV cache,
            then the mask rows ``T:`` with gradients (frozen-base); ``SpaceTrainer.two_pass_loss``
            does the same in chunks.
    """
    labels, offsets, T = inputs["labels"], inputs["mask_offset"], inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    if not two_pass:  # real rows :T, mask rows T: (the gate matters only to a frozen-base LoRA)
        with mask_rows(T):
            return model(input_ids=ids, position_ids=pos, attention_mask=forward_mask(attn, unwrapped)), labels, offsets
    cache, _ = real_pass(unwrapped, inputs)
    out = mask_pass(model, unwrapped, inputs, cache, slice(0, ids.shape[1] - T))
    return out, labels[:, T:], offsets[:, T:]


def real_pass(unwrapped, inputs: dict) -> tuple[DynamicCache, torch.Tensor]:
    """The real columns ``:T`` without gradients and without the adapter (the frozen base).

    Returns:
        (KV cache of the T real tokens, last hidden states (batch, T, hidden)).
    """
    T = inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    cache = PrefixCache(config=unwrapped.config)
    with torch.no_grad(), unwrapped.disable_adapter():
        hidden = unwrapped.get_base_model().get_decoder()(
            input_ids=ids[:, :T], position_ids=pos[:, :T], attention_mask=forward_mask(attn[:, :, :T, :T], unwrapped),
            **cache_input(cache), use_cache=True).last_hidden_state
    cache.frozen = True
    return cache, hidden


def mask_consistency(mask_hidden: torch.Tensor, hidden: torch.Tensor, inputs: dict, rows: slice) -> torch.Tensor:
    """Consistency loss of a chunk's scored mask rows: mask j anchored at e against the base's last
    hidden state at real row e+j, the row given by its position id (efficient layout, as for the
    teacher targets).

    Args:
        mask_hidden: (batch, rows, hidden) last hidden states of the chunk's mask rows.
        hidden: (batch, T, hidden) the no-grad real pass's last hidden states.
    """
    T = inputs["num_real"]
    cols = slice(T + rows.start, T + rows.stop)
    scored = (inputs["labels"][:, cols] != IGNORE_INDEX) & (inputs["mask_offset"][:, cols] >= 0)
    b, m = scored.nonzero(as_tuple=True)
    if not b.numel():
        return mask_hidden.sum() * 0.0
    return consistency_loss(mask_hidden[b, m], hidden[b, inputs["position_ids"][:, cols][b, m]])


def mask_pass(model, unwrapped, inputs: dict, cache: PrefixCache, rows: slice, hidden_states: bool = False):
    """Mask columns ``T + rows`` with gradients, after the real tokens' cache.

    ``rows`` must hold whole groups: a mask row sees the real tokens and its own group only, so
    the rows of other chunks are left out of the attention mask's columns. The cache is frozen
    (:class:`PrefixCache`): every chunk sees the real tokens alone, and no graph links two chunks.
    ``hidden_states``: also return every layer's hidden
    states (the consistency loss reads the last). With a sampler head (``space.sampler_head``), the
    logits are the LM head of the sampler head's output, given each mask's last hidden state and
    the true token before its target (efficient layout: ``space.masking.previous_ids``).
    """
    T = inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    q = slice(T + rows.start, T + rows.stop)
    mask = forward_mask(torch.cat([attn[:, :, q, :T], attn[:, :, q, q]], dim=-1), unwrapped)  # (batch, 1, rows, T + rows)
    head = sampler_head(unwrapped)
    # with a sampler head the model's own LM head is skipped (no logits kept): the head's output feeds it
    skip = {} if head is None else {"logits_to_keep": torch.empty(0, dtype=torch.long, device=ids.device)}
    with mask_rows(0):  # every row of this pass is a mask row (or padding nobody sees)
        out = model(input_ids=ids[:, q], position_ids=pos[:, q], attention_mask=mask, **cache_input(cache),
                    use_cache=True, output_hidden_states=hidden_states or head is not None, **skip)
    if head is not None:  # teacher-forced: the true token before each mask's target (issue 34)
        prev = unwrapped.get_input_embeddings()(previous_ids(ids[:, :T], pos[:, q]))
        out.logits = unwrapped.get_base_model().get_output_embeddings()(head(out.hidden_states[-1], prev))
    return out


def mask_chunks(mask_offset: torch.Tensor, chunk_rows: int) -> list[slice]:
    """Slices of the M mask columns, whole groups each (groups sit at multiples of the group size).

    Args:
        mask_offset: (batch, M) offsets of the mask columns (a group's rows have offsets 0..g-1).
        chunk_rows: rows per chunk, rounded down to whole groups (at least one); 0 = one chunk.
    """
    M = mask_offset.shape[1]
    if chunk_rows <= 0 or M <= chunk_rows:
        return [slice(0, M)]
    group = int(mask_offset.max()) + 1
    step = max(group, chunk_rows // group * group)
    return [slice(s, min(s + step, M)) for s in range(0, M, step)]


class CheckpointInMaskRowsCallback(TrainerCallback):
    """Runs :func:`checkpoint_with_prefix_cache` once ``Trainer.train`` has enabled activation
    checkpointing (it replaces each layer's checkpoint function then)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        checkpoint_with_prefix_cache(model)


class EpochSeedCallback(TrainerCallback):
    """Tells the collator the epoch, so spans are drawn afresh every epoch (DESIGN §3.2)."""

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

    * ``space_settings.json``: the SPACE settings (k, mode, layout, ...), so that a resume under
      other settings is refused (``space.train.run.check_checkpoint``).
    * ``mask_embedding.safetensors``: the trainable mask rows (lora / frozen-base), which peft
      checkpoints leave out since they hold only LoRA weights.
    * ``sampler_head.safetensors``: the sampler head's weights, when the run trains one.
    """

    def __init__(self, settings: dict, mask_embedding=None, sampler=None):
        self.settings, self.emb, self.sampler = settings, mask_embedding, sampler

    def on_save(self, args, state, control, **kwargs):
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
                # last, and whole or not at all: a save cut short leaves a checkpoint without it,
                # which a resume refuses (a checkpoint with it but without its mask rows would
                # resume from fresh rows)
                tmp = ckpt / f".{SETTINGS_FILE}.tmp"
                tmp.write_text(json.dumps(self.settings, indent=2))
                os.replace(tmp, ckpt / SETTINGS_FILE)
