"""``run_sft``: model + mask tokens -> datasets -> SpaceTrainer.train() -> SPACE artifact."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import set_seed
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..adapter_layers import mask_embedding, prepare_model
from ..artifact import (MASK_EMBEDDING, SAMPLER_HEAD, check_lora_shape, load_mask_rows, load_sampler_head,
                        read_space_config, save_artifact)
from ..config import SpaceSettings, check_train_args
from ..data.collator import SpaceCollator
from ..data.dev_set import dev_keys, held_out_key
from ..data.sft import data_lists, load_examples, tokenize
from ..decoding.cache import attention_windows
from ..jsonl import held, write_text_atomic
from ..loader import warm_start
from ..models import load_model, model_identity, stop_ids
from ..sampler_head import add_sampler_head
from .curves import plot_training_curves
from .callbacks import (SETTINGS_FILE, EpochSeedCallback, NothingToTrain, SpaceCheckpointCallback,
                        StopAtMaxStepsCallback, TimeBudgetCallback)
from .trainer import SpaceTrainer, TrainingDiverged

_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
# what a checkpoint must share with the run that resumes it: mixing them would train k=3 masks
# for a while and then save an artifact that claims k=5 (keys MaskArgs lacks are left out)
SETTING_KEYS = ("mask_num", "mask_diff", "layout", "spans_per_sample", "span_density", "mask_target",
                "chain_weight", "consistency_weight", "sampler_head", "sampler_width")
# what checkpoints saved before a key existed trained with (they resume when the run keeps it)
SETTINGS_BEFORE = {"chain_weight": 0.0, "consistency_weight": 0.0, "sampler_head": False, "sampler_width": 0}
# what a resumed run must also share with its checkpoint (:func:`run_settings`): its data, loss and
# optimizer schedule. HF restores the optimizer and schedule and skips the batches already seen, so
# another learning rate was ignored and other data was trained from a misaligned point, while the
# artifact named the new data. A checkpoint saved before these were recorded is not compared on them
RUN_KEYS = ("data", "max_length", "mask_prob", "mask_loss_weight", "teacher_topk", "seed", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "batch", "lora_dropout",
            # the shuffle HF's skip over seen batches relies on, and the optimizer's own settings
            "data_seed", "max_grad_norm", "optim", "adam_beta1", "adam_beta2", "adam_epsilon")
# the schedule's length: a resume that extends a run is allowed, but HF rebuilds the schedule for the
# new total (scheduler.pt holds the step count only), so the learning rate jumps there: said, not refused
SCHEDULE_KEYS = ("max_steps", "num_train_epochs")
# the files a checkpoint holds its optimizer and learning-rate schedule in: HF's, or DeepSpeed's engine's
OPTIMIZER_FILES = {False: ("optimizer.pt", "scheduler.pt"), True: ("latest",)}


def space_settings(model_args, mask_args, train_args) -> dict:
    """The SPACE settings a checkpoint records (``space_settings.json``) and a resume must match,
    with the DeepSpeed ZeRO stage (None: no DeepSpeed): its optimizer state resumes under that stage
    only (another one failed with a bare AssertionError on every rank), and HF resumes a run
    without DeepSpeed from it with a fresh optimizer and schedule, silently."""
    stage = None
    if train_args.deepspeed:
        stage = int(train_args.hf_deepspeed_config.config.get("zero_optimization", {}).get("stage", 0))
    return {"model": model_args.model_name_or_path, "mode": model_args.mode,
            **{k: getattr(mask_args, k) for k in SETTING_KEYS if hasattr(mask_args, k)}, "zero_stage": stage}


def run_settings(model_args, data_args, mask_args, train_args, examples: list) -> dict:
    """The rest of what a resume must match (:data:`RUN_KEYS`): the training examples (count and a
    hash of their text and ids, in order), ``max_length``, the loss settings, the seed, the optimizer's
    learning rate, schedule and weight decay, the batch (per device x accumulation x processes) and
    the LoRA dropout, the data seed, gradient clipping and the optimizer's settings; and the
    schedule's length (:data:`SCHEDULE_KEYS`, warned of, not refused). (transformers 5 folds
    ``warmup_ratio`` into a fractional ``warmup_steps``.)"""
    import hashlib

    digest = hashlib.sha256()
    for ex in examples:
        # the end id the answer's last trained token is (``stop_id``), when a row names one: rows without
        # keep the fingerprint they had before rows named it
        end = [] if ex.stop_id is None else [ex.stop_id]
        digest.update(json.dumps([ex.context, ex.response, ex.finished, ex.response_ids, *end]).encode())
    return {"data": {"samples": len(examples), "sha256": digest.hexdigest()[:16]},
            "max_length": data_args.max_length, "mask_prob": mask_args.mask_prob,
            "mask_loss_weight": mask_args.mask_loss_weight, "teacher_topk": mask_args.teacher_topk,
            "seed": train_args.seed, "learning_rate": train_args.learning_rate,
            "lr_scheduler_type": str(getattr(train_args.lr_scheduler_type, "value", train_args.lr_scheduler_type)),
            "warmup_steps": train_args.warmup_steps, "warmup_ratio": getattr(train_args, "warmup_ratio", None),
            "weight_decay": train_args.weight_decay,
            "batch": train_args.per_device_train_batch_size * train_args.gradient_accumulation_steps
            * train_args.world_size, "lora_dropout": model_args.lora_dropout,
            "data_seed": train_args.data_seed, "max_grad_norm": train_args.max_grad_norm,
            "optim": str(getattr(train_args.optim, "value", train_args.optim)),
            **{k: getattr(train_args, k) for k in ("adam_beta1", "adam_beta2", "adam_epsilon", *SCHEDULE_KEYS)}}


def check_optimizer_state(last: str, settings: dict) -> None:
    """Refuse to resume from checkpoint ``last`` without its optimizer and schedule state
    (:data:`OPTIMIZER_FILES`; a run with ``save_only_model``, or a checkpoint copied without them):
    HF would go on with a fresh Adam and the schedule's warm-up again, silently, and the weights
    would differ from an unbroken run's.

    Raises:
        ValueError: a file missing, named.
    """
    missing = [n for n in OPTIMIZER_FILES[settings.get("zero_stage") is not None] if not (Path(last) / n).exists()]
    if missing:
        raise ValueError(f"{last} lacks {', '.join(missing)}, so its optimizer and learning-rate schedule would "
                         "start afresh (saved with save_only_model, or copied without them); delete it to resume "
                         "from the checkpoint before, or start a new output_dir with init_adapter")


def last_whole_checkpoint(output_dir: str, main_process: bool) -> str | None:
    """The newest checkpoint in ``output_dir`` whose save finished: ``space_settings.json`` is
    written last (:class:`~space.train.callbacks.SpaceCheckpointCallback`). Newer ones, cut short
    by a kill or Ctrl-C while they were written, are moved aside to ``incomplete-checkpoint-N``
    by the main process (HF's resume and rotation skip that name), with a warning: the run goes
    on from the whole one, as the interrupted run's message promised. None: no whole checkpoint.
    """
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)), m.group(0)) for m in map(_CHECKPOINT.fullmatch, os.listdir(output_dir))
                   if m and os.path.isdir(os.path.join(output_dir, m.group(0))))
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, SETTINGS_FILE)):
            return path
        if main_process:
            aside = os.path.join(output_dir, f"incomplete-{name}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            warnings.warn(f"{path} was cut short while it was saved (no {SETTINGS_FILE}); moved it to {aside} "
                          "and resuming from the checkpoint before it", stacklevel=2)
    return None


def agree_on_checkpoint(last: str | None) -> str | None:
    """``last`` (this rank's newest whole checkpoint) when every rank of the process group found the
    same one. Each rank looks in its own filesystem: with an output_dir local to each node, node 0
    resumed while the others, holding only their ZeRO shards, started afresh, and the job hung or
    trained on a mix. Without a process group (one process), ``last`` as it is.

    Raises:
        ValueError: on every rank, when any rank found another checkpoint (or none), naming rank 0's
            and this rank's.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return last
    chosen = [last]
    dist.broadcast_object_list(chosen, src=0)
    if any_rank(chosen[0] != last):  # every rank stops, or none: one alone would leave the rest waiting
        raise ValueError(f"the ranks see different checkpoints in output_dir (rank 0: {chosen[0]}, rank "
                         f"{dist.get_rank()}: {last}): every node must see the same output_dir (a shared "
                         "filesystem) to resume")
    return last


def any_rank(flag: bool) -> bool:
    """``flag`` of any rank of the process group (each may look at its own filesystem), on every
    rank: a refusal on one rank alone left the others waiting in a collective. Without a process
    group, ``flag``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    found = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def check_checkpoint(last: str, settings: dict) -> None:
    """Refuse to resume from checkpoint ``last`` unless it was trained with ``settings``.

    Raises:
        ValueError: the checkpoint has no space_settings.json, or one that differs from ``settings``,
            or lacks the mask rows (lora / frozen-base) or the sampler head its settings need.
    """
    path = Path(last) / SETTINGS_FILE
    if not path.is_file():
        raise ValueError(f"{last} has no {SETTINGS_FILE}, so its SPACE settings are unknown (a save cut "
                         "short?); use another output_dir, or delete the checkpoint to resume from the one before")
    recorded = json.loads(path.read_text(encoding="utf-8"))
    saved = {**SETTINGS_BEFORE, **recorded}
    if isinstance(saved.get("model"), str) and model_identity(saved["model"]) == model_identity(settings["model"]):
        saved["model"] = settings["model"]  # one model however it is spelt (a trailing slash, a relative path)
    if "zero_stage" in settings and "zero_stage" not in saved:
        # saved before the stage was recorded: DeepSpeed's engine writes a "latest" file, which
        # says DeepSpeed, not which stage
        deepspeed = (Path(last) / "latest").is_file()
        saved["zero_stage"] = (settings["zero_stage"] if settings["zero_stage"] is not None else "DeepSpeed") \
            if deepspeed else None
    diff = {k: (saved.get(k), v) for k, v in settings.items()
            if saved.get(k) != v and (k in recorded or k not in RUN_KEYS) and k not in SCHEDULE_KEYS}
    schedule = {k: (saved[k], settings[k]) for k in SCHEDULE_KEYS if k in recorded and k in settings
                and saved[k] != settings[k]}
    if schedule and not diff:
        warnings.warn(f"resuming {last} with another schedule length (checkpoint, now): {schedule}; HF rebuilds the "
                      "learning-rate schedule for the new total, so the rate jumps at this step", stacklevel=2)
    if diff:
        raise ValueError(f"{last} was trained with other SPACE settings or data; (checkpoint, now): {diff}. "
                         + ("zero_stage None is a run without DeepSpeed: the optimizer state resumes only under "
                            "the DeepSpeed config (ZeRO stage) it was saved with. " if "zero_stage" in diff else "")
                         + "Use another output_dir, or delete it to start over")
    needed = ([MASK_EMBEDDING] if settings.get("mode") != "full" else []) + \
        ([SAMPLER_HEAD] if settings.get("sampler_head") else [])
    missing = [name for name in needed if not (Path(last) / name).is_file()]
    if missing:  # resuming would train from fresh mask rows (or a fresh head) under trained LoRA weights
        raise ValueError(f"{last} lacks {', '.join(missing)}; delete the checkpoint to resume from the one before, "
                         "or use another output_dir")


def warn_unnamed_ends(examples: list, model, tok) -> None:
    """Warn when finished distilled rows name no end id (sets made before rows carried ``stop_id``):
    they train the tokenizer's EOS, which a model whose turns end with other ids too
    (``models.stop_ids``: Llama-3-Instruct's ``<|eot_id|>``) may never write. SmolLM2's end is its EOS."""
    unnamed = sum(ex.response_ids is not None and ex.stop_id is None and ex.finished for ex in examples)
    others = sorted(set(stop_ids(model, tok)) - {tok.eos_token_id})
    if unnamed and others:
        warnings.warn(f"{unnamed} distilled rows name no end id (made before sets recorded one): they train the "
                      f"tokenizer's EOS {tok.eos_token_id}, while this model also ends turns with {others}; "
                      "distil them again to train the end the model writes", stacklevel=2)


def drop_dev_set(examples: list, root) -> tuple[list, int]:
    """Keep the probe's dev prompts (configs/data/dev_set.json) out of training, whatever file they
    come from (MBPP, LIMA or a self-distilled JSONL). Returns (kept examples, how many were dropped);
    without the shared MBPP/LIMA files there is no dev set to hold out, which a warning says (a JSONL
    of their prompts would then train on the probe's)."""
    try:
        keys = dev_keys(root)
    except FileNotFoundError as e:
        warnings.warn(f"the drafter dev set cannot be held out of training ({e}): the acceptance probe's "
                      "dev prompts may be trained on; give --data_root the shared data", stacklevel=2)
        return examples, 0
    kept = [ex for ex in examples if held_out_key(ex.context) not in keys]
    return kept, len(examples) - len(kept)


def run_sft(model_args, data_args, mask_args, train_args) -> Path | None:
    """Train with SAR-SFT and write ``<output_dir>/final`` (HF checkpoint or adapter).

    Resumes from the last ``checkpoint-*`` in ``output_dir`` when there is one, else from
    ``resume_from_checkpoint`` when given (a checkpoint folder, perhaps of another run). A run that
    already finished (its last checkpoint is at the final step) trains nothing and keeps its
    artifact and log as they are, or writes ``final`` from that checkpoint when it is missing (a
    run stopped between the two). A checkpoint cut short while it was saved is moved aside
    (:func:`last_whole_checkpoint`). One run at a time writes an ``output_dir``.

    Returns:
        the artifact directory on the main process, None on the others.

    Raises:
        ValueError / FileNotFoundError: a setting out of range (``space.config.check_train_args``),
            an init_adapter that is not a SPACE artifact, bad dataset name or rows (an empty file
            included), or a checkpoint in ``output_dir`` made with other SPACE or LoRA settings
            or missing its mask rows, or an output_dir another run is writing, or one holding an
            earlier run's ``final`` and no checkpoint (this run would replace it); all raised before
            the model loads; after it, a teacher_topk above the model's vocabulary, a max_length
            that lets samples past the model's positions, or dataloader_drop_last with fewer
            samples than one batch (nothing would train).
        TrainingDiverged: too many NaN or inf steps in a row, or training ended inside such a run
            (:func:`refuse_a_bad_end`); no artifact is written.
    """
    set_seed(train_args.seed)
    train_args.remove_unused_columns = False  # the collator needs prompt_len and idx
    train_args.label_names = ["labels"]
    check_train_args(model_args, data_args, mask_args, train_args)  # also for callers that skip the parser
    # one run per output_dir: two wrote each other's checkpoints and final/ (or one's save failed
    # half-way); the main process holds it, so a run's own ranks do not refuse each other
    out = Path(train_args.output_dir)
    main, created = train_args.process_index == 0, not out.exists()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    try:
        with held(out, f"output_dir {out}", "wait for it to end, or use another output_dir") if main else nullcontext():
            return _train(model_args, data_args, mask_args, train_args)
    except BaseException:
        if main and created and [p.name for p in out.iterdir()] == [".lock"]:  # refused before writing anything
            shutil.rmtree(out)
        raise


def _train(model_args, data_args, mask_args, train_args) -> Path | None:
    """:func:`run_sft` once its arguments are checked and ``output_dir`` is held."""
    if mask_args.sampler_head:
        # the head runs on the forward's hidden states, outside the DDP-wrapped forward: DDP's
        # unused-parameter search walks only the forward's outputs, would mark the head's weights ready
        # there, and their gradients in backward would mark them ready twice (an error under torchrun)
        train_args.ddp_find_unused_parameters = False
    names, sources = data_lists(data_args.datasets, data_args.sources)
    seen: set[str] = set()
    examples = [ex for n in names for ex in load_examples(n, data_args.data_root, data_args.limit, sources, seen)]
    if sources is not None and set(sources) - seen:
        raise ValueError(f"sources {sorted(set(sources) - seen)} match no row of {names} (their sources: {sorted(seen)})")
    examples, held_out = drop_dev_set(examples, data_args.data_root)
    settings = {**space_settings(model_args, mask_args, train_args),
                **run_settings(model_args, data_args, mask_args, train_args, examples)}
    # the process group (TrainingArguments creates it lazily, on first use of its device): the ranks agree
    # on the checkpoint through it; the load below needs it too (under ZeRO-3, from_pretrained partitions
    # the weights as they load, deepspeed.zero.Init, which needs the world size)
    train_args.device  # noqa: B018
    last = agree_on_checkpoint(last_whole_checkpoint(train_args.output_dir, train_args.process_index == 0))
    final = Path(train_args.output_dir) / "final"
    if any_rank(not last and final.is_dir()):  # every rank stops (last is agreed): none is left waiting
        # an earlier run's artifact with no checkpoint of it to go on from (save_strategy no, or its
        # checkpoints deleted): this run would replace it, settings unchecked
        raise ValueError(f"output_dir {train_args.output_dir} holds the artifact of an earlier run ({final}) and no "
                         "checkpoint to resume it from; use another output_dir, or delete that final/ to train again")
    if train_args.resume_from_checkpoint and not last:
        # a checkpoint the user names, perhaps of another run, starts this one; once this run has
        # checkpoints of its own, a rerun (preempted, the key still in its config) goes on from them
        last = train_args.resume_from_checkpoint
    done = total = 0
    if last:
        check_checkpoint(last, settings)
        check_optimizer_state(last, settings)
        if model_args.mode != "full":
            check_lora_shape(Path(last), model_args.lora_r, model_args.lora_alpha, model_args.lora_targets.split(","),
                             False, last)
        state = json.loads((Path(last) / "trainer_state.json").read_text())
        # the total: max_steps when given, else as the checkpoint's run counted the epochs
        done, total = state["global_step"], train_args.max_steps if train_args.max_steps > 0 else state["max_steps"]
    if model_args.init_adapter:  # like the data, it may come from an earlier stage: check it before loading
        try:
            read_space_config(Path(model_args.init_adapter))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"init_adapter: {e}") from None
    if train_args.deepspeed and torch.distributed.is_initialized():
        # on GPUs accelerate does this; on CPU (use_cpu) DeepSpeed's own communicator must be told
        # of the group, else zero.Init counts a world of 1 and rejects the batch size
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    model, tok = load_model(model_args.model_name_or_path, model_args.dtype)
    # a layer type SPACE's masks cannot express (chunked attention, ...) is refused before training;
    # sliding windows are applied in each batch's masks (space.train.steps.forward_mask)
    attention_windows(model.config)
    if mask_args.mask_target == "teacher" and mask_args.teacher_topk > model.config.vocab_size:
        raise ValueError(f"teacher_topk {mask_args.teacher_topk} exceeds the vocabulary of "
                         f"{model_args.model_name_or_path} ({model.config.vocab_size} tokens)")
    model, spec = prepare_model(model, tok, model_args.mode, mask_args.mask_num, mask_args.mask_diff,
                                model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout,
                                model_args.lora_targets.split(","))
    sampler = add_sampler_head(model, mask_args.sampler_width) if mask_args.sampler_head else None
    if model_args.init_adapter:
        warm_start(model, model_args.init_adapter, model_args.mode, spec)
    warn_unnamed_ends(examples, model, tok)
    dataset = tokenize(examples, tok, data_args.max_length)
    if len(dataset) == 0:
        raise ValueError(f"no sample of {names} fits max_length={data_args.max_length} (each prompt leaves its response fewer than 2 tokens)")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(map(len, dataset["input_ids"]))
    if context and longest > context:  # trained on positions the model never had, which decoding then refuses
        raise ValueError(f"max_length {data_args.max_length} lets samples reach {longest} tokens, past the "
                         f"{context} positions of {model_args.model_name_or_path} (max_position_embeddings); "
                         f"set max_length <= {context}")
    batch = train_args.train_batch_size * train_args.world_size  # train_batch_size counts DataParallel's GPUs
    if train_args.dataloader_drop_last and len(dataset) < batch:  # no whole batch: 0 steps, an untrained final/
        raise ValueError(f"dataloader_drop_last with {len(dataset)} samples and a batch of {batch} "
                         f"(per_device_train_batch_size x GPUs x processes): every batch would be dropped and nothing "
                         "trained; lower the batch or drop dataloader_drop_last")
    collator = SpaceCollator(spec.ids_for(mask_args.mask_num), mask_args.mask_num, tok.pad_token_id,
                             mask_args.mask_prob, mask_args.spans_per_sample, mask_args.layout, train_args.seed,
                             span_density=mask_args.span_density)
    emb = mask_embedding(model)
    callbacks = [EpochSeedCallback(collator), SpaceCheckpointCallback(settings, emb, sampler), StopAtMaxStepsCallback()]
    if getattr(train_args, "max_train_minutes", 0) > 0:
        callbacks.append(TimeBudgetCallback(train_args.max_train_minutes))
    space = SpaceSettings.from_args(model_args, mask_args, train_args, suppress_ids=spec.token_ids)
    trainer = SpaceTrainer(model=model, args=train_args, train_dataset=dataset, data_collator=collator,
                           processing_class=tok, callbacks=callbacks, space=space)
    if last and emb is not None:  # check_checkpoint found the file
        load_mask_rows(emb, os.path.join(last, MASK_EMBEDDING))
    if last and sampler is not None:  # settings matched, so a checkpoint of this run holds the head
        load_sampler_head(sampler, os.path.join(last, SAMPLER_HEAD))
    if trainer.is_world_process_zero():
        with_ids = sum(ex.response_ids is not None for ex in examples)
        own = (f"; {sum(dataset['own_ids'])} samples on their generated token ids ({with_ids} rows carry ids; "
               "ids that do not spell the text in this tokenizer are not used)" if with_ids else "")
        cut = len(examples) - len(dataset)
        cut = f", {cut} whose prompt leaves its response < 2 of max_length's tokens dropped" if cut else ""
        print(f"[space] {len(dataset)} samples from {names} ({held_out} dev-set prompts held out{cut}){own}; "
              f"mode {model_args.mode}; k={mask_args.mask_num}; "
              f"trainable params {sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters() if p.requires_grad):,}"
              + (f"; resuming: {done} of {total} steps done ({last})" if last else ""), flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=last)
    except NothingToTrain:  # resumed at max_steps: the checkpoint's weights are loaded, none trained
        result = None
    if last and trainer.state.global_step == done and final.is_dir():
        # nothing trained: saving again would append a train_loss of 0.0 and rewrite the artifact
        if trainer.is_world_process_zero():
            print(f"[space] training already finished: {done} of {trainer.state.max_steps} steps done in {last}; "
                  f"kept {final}", flush=True)
        return final if trainer.is_world_process_zero() else None
    refuse_a_bad_end(trainer)
    # (a run stopped between its last checkpoint and final/ gets final/ written from that checkpoint)
    # ZeRO-3: every rank takes part in gathering the 16-bit weights; rank 0 writes them
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped) if is_deepspeed_zero3_enabled() else None
    out = _save_final(trainer, result, tok, spec, model_args, data_args, mask_args, names, len(dataset), state) \
        if trainer.is_world_process_zero() else None
    return out


def refuse_a_bad_end(trainer) -> None:
    """Raise when training ended inside a run of NaN or inf steps (fewer than max_nonfinite_steps):
    the weights are those of a bad step, so no artifact is written. Keeps the log to look at.

    Raises:
        TrainingDiverged: ``trainer.nonfinite_steps`` > 0 (on every rank: they agree on it).
    """
    n = trainer.nonfinite_steps
    if not n:
        return
    if trainer.is_world_process_zero():
        write_text_atomic(Path(trainer.args.output_dir) / "log_history.json", json.dumps(trainer.state.log_history, indent=1))
    raise TrainingDiverged(
        f"training ended at step {trainer.state.global_step} with {n} NaN or inf step{'s' if n > 1 else ''} in a "
        f"row, so no final/ was written (its weights would be those of a bad step); the last checkpoint in "
        f"{trainer.args.output_dir} was saved before them. Lower the learning rate, or check the data")


def _save_final(trainer, result, tok, spec, model_args, data_args, mask_args, names, num_samples,
                state_dict=None) -> Path:
    """Write ``OUTPUT_DIR/final`` (the artifact of DESIGN §3.6's training modes), ``log_history.json`` and
    ``training_curves.png`` (loss and mask accuracy); main process only. ``state_dict``: the
    gathered weights of a ZeRO-3 run (``space.artifact.save_artifact`` refuses partitions)."""
    config = {cls_name: dataclasses.asdict(a) for cls_name, a in
              (("model", model_args), ("data", data_args), ("mask", mask_args))}
    meta = {"base_model": model_args.model_name_or_path, "training_data": names, "num_samples": num_samples,
            "global_step": trainer.state.global_step,
            "train_runtime_s": result.metrics.get("train_runtime") if result is not None else None,
            "train_config": config}
    out = save_artifact(Path(trainer.args.output_dir) / "final", trainer.accelerator.unwrap_model(trainer.model),
                        tok, spec, model_args.mode, meta, state_dict)
    run_dir = Path(trainer.args.output_dir)
    write_text_atomic(run_dir / "log_history.json", json.dumps(trainer.state.log_history, indent=1))
    if any("mask_loss" in h for h in trainer.state.log_history):  # a run shorter than logging_steps logs none
        plot_training_curves(trainer.state.log_history, run_dir / "training_curves.png")
    print(f"[space] saved {model_args.mode} artifact to {out}", flush=True)
    return out
