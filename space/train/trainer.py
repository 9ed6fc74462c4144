"""SpaceTrainer: HF Trainer with the SAR-SFT loss; frozen-base runs real tokens without gradients."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache, Trainer, TrainerCallback

from .loss import space_loss


class SpaceTrainer(Trainer):
    """Overrides ``compute_loss`` (and ``log`` to report its metrics).

    Args:
        mask_loss_weight: lambda.
        mask_num: k (per-offset accuracy).
        two_pass: frozen-base: run the real tokens once under ``torch.no_grad()`` with the LoRA
            disabled into a KV cache, then only the mask rows with gradients. Exact, since real
            tokens never see masks and the frozen base's real-token states do not depend on the
            trainable weights; a step costs a no-grad forward plus a small forward/backward.
    """

    def __init__(self, *args, mask_loss_weight: float = 1.0, mask_num: int = 5, two_pass: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask_loss_weight, self.mask_num, self.two_pass = mask_loss_weight, mask_num, two_pass
        self.model_accepts_loss_kwargs = False  # our loss is a mean: let Trainer scale for accumulation
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out, labels, offsets = sar_forward(model, self.accelerator.unwrap_model(model), inputs, self.two_pass)
        loss, metrics = space_loss(out.logits, labels, offsets, self.mask_loss_weight, self.mask_num)
        metrics["short_samples"] = float(inputs["num_short"])
        for key, value in metrics.items():
            self._sums[key] += value
            self._counts[key] += 1
        return (loss, out) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # training log: add our averages since the last log
            logs.update({k: round(self._sums[k] / self._counts[k], 4) for k in sorted(self._sums)})
            self._sums.clear(), self._counts.clear()
        super().log(logs, *args, **kwargs)


def sar_forward(model, unwrapped, inputs: dict, two_pass: bool):
    """Forward a SpaceCollator batch; returns (model output, labels, mask_offset) of the rows scored.

    Args:
        model: what to call with gradients (the DeepSpeed/DDP wrapper when there is one).
        unwrapped: the peft model inside it (two_pass only).
        two_pass: run real columns ``:T`` under no_grad with the adapter disabled into a KV cache,
            then the mask rows ``T:`` with gradients (frozen-base).
    """
    labels, offsets, T = inputs["labels"], inputs["mask_offset"], inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    if not two_pass:
        return model(input_ids=ids, position_ids=pos, attention_mask=attn), labels, offsets
    cache = DynamicCache(config=unwrapped.config)
    with torch.no_grad(), unwrapped.disable_adapter():
        unwrapped.get_base_model().get_decoder()(
            input_ids=ids[:, :T], position_ids=pos[:, :T], attention_mask=attn[:, :, :T, :T],
            past_key_values=cache, use_cache=True)
    out = model(input_ids=ids[:, T:], position_ids=pos[:, T:], attention_mask=attn[:, :, T:, :],
                past_key_values=cache, use_cache=True)
    return out, labels[:, T:], offsets[:, T:]


class EpochSeedCallback(TrainerCallback):
    """Tells the collator the epoch, so spans are drawn afresh every epoch (DESIGN §3.2)."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)


class MaskRowsCheckpointCallback(TrainerCallback):
    """peft checkpoints hold only LoRA weights: also save the trainable mask rows, for resume."""

    def __init__(self, mask_embedding):
        self.emb = mask_embedding

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            save_file({"mask_rows": self.emb.mask_rows.detach().float().contiguous().cpu()},
                      ckpt / "mask_embedding.safetensors")
