"""``run_sft``: model + mask tokens -> datasets -> SpaceTrainer.train() -> SPACE artifact."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import set_seed
from transformers.trainer_utils import get_last_checkpoint

from ..adapters import MASK_EMBEDDING, mask_embedding, prepare_model, save_artifact
from ..data.collator import SpaceCollator
from ..data.sft import load_examples, tokenize
from ..models import load_model
from .trainer import EpochSeedCallback, MaskRowsCheckpointCallback, SpaceTrainer


def run_sft(model_args, data_args, mask_args, train_args) -> Path | None:
    """Train with SAR-SFT and write ``<output_dir>/final`` (HF checkpoint or adapter).

    Resumes from the last ``checkpoint-*`` in ``output_dir`` when there is one.

    Returns:
        the artifact directory on the main process, None on the others.

    Raises:
        ValueError / FileNotFoundError: bad mode, mask_num, dataset name or rows.
    """
    set_seed(train_args.seed)
    train_args.remove_unused_columns = False  # the collator needs prompt_len and idx
    train_args.label_names = ["labels"]
    model, tok = load_model(model_args.model_name_or_path, model_args.dtype)
    model, spec = prepare_model(model, tok, model_args.mode, mask_args.mask_num, mask_args.mask_diff,
                                model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout,
                                model_args.lora_targets.split(","))
    names = [n.strip() for n in data_args.datasets.split(",") if n.strip()]
    examples = [ex for n in names for ex in load_examples(n, data_args.data_root, data_args.limit)]
    dataset = tokenize(examples, tok, data_args.max_length)
    if len(dataset) == 0:
        raise ValueError(f"no sample of {names} fits max_length={data_args.max_length} (prompts alone are longer)")
    collator = SpaceCollator(spec.ids_for(mask_args.mask_num), mask_args.mask_num, tok.pad_token_id,
                             mask_args.mask_prob, mask_args.spans_per_sample, mask_args.layout, train_args.seed)
    callbacks = [EpochSeedCallback(collator)]
    emb = mask_embedding(model)
    if emb is not None:
        callbacks.append(MaskRowsCheckpointCallback(emb))
    trainer = SpaceTrainer(model=model, args=train_args, train_dataset=dataset, data_collator=collator,
                           processing_class=tok, callbacks=callbacks, mask_loss_weight=mask_args.mask_loss_weight,
                           mask_num=mask_args.mask_num, two_pass=model_args.mode == "frozen-base")
    last = get_last_checkpoint(train_args.output_dir) if os.path.isdir(train_args.output_dir) else None
    if last and emb is not None and os.path.isfile(os.path.join(last, MASK_EMBEDDING)):
        with torch.no_grad():
            emb.mask_rows.copy_(load_file(os.path.join(last, MASK_EMBEDDING))["mask_rows"])
    if trainer.is_world_process_zero():
        print(f"[space] {len(dataset)} samples from {names}; mode {model_args.mode}; k={mask_args.mask_num}; "
              f"trainable params {sum(p.numel() for p in model.parameters() if p.requires_grad):,}"
              + (f"; resuming from {last}" if last else ""), flush=True)
    result = trainer.train(resume_from_checkpoint=last)
    if not trainer.is_world_process_zero():
        return None
    config = {cls_name: dataclasses.asdict(a) for cls_name, a in
              (("model", model_args), ("data", data_args), ("mask", mask_args))}
    meta = {"base_model": model_args.model_name_or_path, "training_data": names, "num_samples": len(dataset),
            "global_step": trainer.state.global_step, "train_runtime_s": result.metrics.get("train_runtime"),
            "train_config": config}
    out = save_artifact(Path(train_args.output_dir) / "final", trainer.accelerator.unwrap_model(trainer.model),
                        tok, spec, model_args.mode, meta)
    (Path(train_args.output_dir) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    print(f"[space] saved {model_args.mode} artifact to {out}", flush=True)
    return out
