"""What a checkpoint holds beyond HF's files, and what a resume refuses (issue 59, finding 4)."""
import json
from types import SimpleNamespace

import pytest

from space import artifact
from space.artifact import SAMPLER_HEAD
from space.adapter_layers import mask_embedding, prepare_model
from space.models import tiny_random_llama
from space.train import callbacks
from space.train.run import check_checkpoint
from space.train.callbacks import SETTINGS_FILE, SpaceCheckpointCallback

SETTINGS = {"model": "tiny-random-llama", "mode": "frozen-base", "mask_num": 3}


def save(tmp_path, monkeypatch=None, fail=False):
    model, tok = tiny_random_llama()
    model, _ = prepare_model(model, tok, "frozen-base", 3)
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    if fail:  # the job is killed while the mask rows are written
        def killed(*args):
            raise KeyboardInterrupt
        monkeypatch.setattr(callbacks, "save_mask_rows", killed)
    callback = SpaceCheckpointCallback(SETTINGS, mask_embedding(model))
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=2, is_world_process_zero=True)
    callback.on_save(args, state, None)
    return ckpt


def test_a_whole_save_resumes(tmp_path):
    ckpt = save(tmp_path)
    assert sorted(p.name for p in ckpt.iterdir()) == [artifact.MASK_EMBEDDING, SETTINGS_FILE]
    assert json.loads((ckpt / SETTINGS_FILE).read_text()) == SETTINGS
    check_checkpoint(str(ckpt), SETTINGS)


def test_a_save_cut_short_in_the_mask_rows_is_refused(tmp_path, monkeypatch):
    """The settings are written last: before, a save cut short in the mask rows left a checkpoint
    that passed the settings check and resumed from fresh mask rows."""
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, monkeypatch, fail=True)
    ckpt = tmp_path / "checkpoint-2"
    assert list(ckpt.iterdir()) == []
    with pytest.raises(ValueError, match=f"no {SETTINGS_FILE}"):
        check_checkpoint(str(ckpt), SETTINGS)


@pytest.mark.parametrize("mode", ["lora", "frozen-base"])
def test_a_checkpoint_without_its_mask_rows_is_refused(tmp_path, mode):
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**SETTINGS, "mode": mode}))
    with pytest.raises(ValueError, match=f"lacks {artifact.MASK_EMBEDDING}"):
        check_checkpoint(str(tmp_path), {**SETTINGS, "mode": mode})


def test_a_full_checkpoint_needs_no_mask_rows_file(tmp_path):
    """Full mode keeps its mask rows in the model weights HF saves."""
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**SETTINGS, "mode": "full"}))
    check_checkpoint(str(tmp_path), {**SETTINGS, "mode": "full"})


@pytest.mark.parametrize("key, value", [("model", "other-model"), ("mask_num", 5), ("mode", "lora")])
def test_a_checkpoint_of_other_settings_is_refused(tmp_path, key, value):
    """Resuming a checkpoint of another base model, k or mode would train on from weights that do
    not fit and save an artifact claiming the new settings. Catches a comparison that skips a key."""
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(SETTINGS))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    with pytest.raises(ValueError, match=f"other SPACE settings.*'{key}'"):
        check_checkpoint(str(tmp_path), {**SETTINGS, key: value})


def test_a_model_path_spelt_another_way_resumes(tmp_path, monkeypatch):
    """The same model folder with a trailing slash or as a relative path is one model: a job script
    that spelt it from $PWD was refused and told to delete the checkpoint. Another folder still is."""
    model = tmp_path / "base"
    model.mkdir()
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**SETTINGS, "model": str(model)}))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    for spelt in (f"{model}/", "base", "./base/"):
        check_checkpoint(str(tmp_path), {**SETTINGS, "model": spelt})
    with pytest.raises(ValueError, match=r"other SPACE settings.*'model': \('.*base', 'base2'\)"):
        check_checkpoint(str(tmp_path), {**SETTINGS, "model": "base2"})


def test_a_checkpoint_that_names_no_model_is_refused_as_another_models(tmp_path):
    """Settings with no model (or a null one: a hand-edited space_settings.json) are another model's:
    refused by name, not a TypeError from resolving None as a path. Catches the spelling check run
    on a recorded model that is not a string."""
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    for recorded in ({k: v for k, v in SETTINGS.items() if k != "model"}, {**SETTINGS, "model": None}):
        (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
        with pytest.raises(ValueError, match=r"other SPACE settings.*'model': \(None, 'tiny-random-llama'\)"):
            check_checkpoint(str(tmp_path), SETTINGS)


def test_a_checkpoint_from_before_the_run_keys_resumes_and_one_with_them_is_compared(tmp_path):
    """The data, loss and schedule keys (``RUN_KEYS``) are compared where the checkpoint recorded
    them; one saved before they were recorded resumes as it did."""
    from space.train.run import RUN_KEYS

    (tmp_path / SETTINGS_FILE).write_text(json.dumps(SETTINGS))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    now = {**SETTINGS, "data": {"samples": 4, "sha256": "ab"}, "learning_rate": 1e-3}
    assert {"data", "learning_rate"} <= set(RUN_KEYS)
    check_checkpoint(str(tmp_path), now)
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**now, "data": {"samples": 4, "sha256": "cd"}}))
    with pytest.raises(ValueError, match="other SPACE settings or data.*'data'"):
        check_checkpoint(str(tmp_path), now)


@pytest.mark.parametrize("key, value", [("data_seed", 7), ("max_grad_norm", 0.5), ("optim", "sgd"),
                                        ("adam_beta2", 0.95), ("adam_epsilon", 1e-6)])
def test_a_resume_with_another_shuffle_or_optimizer_is_refused(tmp_path, key, value):
    """The data seed (HF's skip over the seen batches replays the shuffle), gradient clipping and the
    optimizer's own settings resumed without a word: the run went on from a misaligned batch, or
    with another optimizer than the checkpoint's state was made by."""
    from space.train.run import RUN_KEYS

    now = {**SETTINGS, "data_seed": None, "max_grad_norm": 1.0, "optim": "adamw_torch", "adam_beta1": 0.9,
           "adam_beta2": 0.999, "adam_epsilon": 1e-8}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(now))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    assert key in RUN_KEYS
    check_checkpoint(str(tmp_path), now)
    with pytest.raises(ValueError, match=f"other SPACE settings or data.*'{key}'"):
        check_checkpoint(str(tmp_path), {**now, key: value})


def test_a_resume_that_extends_the_schedule_is_said_not_refused(tmp_path):
    """A resume with a larger max_steps is how a run is extended, but HF rebuilds the learning-rate
    schedule for the new total, so the rate jumps there: warned, not refused; the same length says
    nothing."""
    import warnings

    now = {**SETTINGS, "max_steps": 100, "num_train_epochs": 3.0}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(now))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_checkpoint(str(tmp_path), now)
    with pytest.warns(UserWarning, match=r"another schedule length .*'max_steps': \(100, 200\)"):
        check_checkpoint(str(tmp_path), {**now, "max_steps": 200})


@pytest.mark.parametrize("zero_stage, files", [(None, ("optimizer.pt", "scheduler.pt")), (2, ("latest",))])
def test_a_checkpoint_without_its_optimizer_state_is_refused(tmp_path, zero_stage, files):
    """HF's optimizer and scheduler files, or DeepSpeed's engine's ``latest``: without them a resume
    starts a fresh optimizer and the schedule's warm-up again."""
    from space.train.run import check_optimizer_state

    settings = {**SETTINGS, "zero_stage": zero_stage}
    for name in files:
        with pytest.raises(ValueError, match=f"lacks .*{name}"):
            check_optimizer_state(str(tmp_path), settings)
        (tmp_path / name).write_bytes(b"")
    check_optimizer_state(str(tmp_path), settings)


def test_a_checkpoint_without_its_sampler_head_is_refused(tmp_path):
    """A run with a sampler head must not resume from a checkpoint lacking the head's weights (it
    would train on from a fresh head under trained LoRA weights and mask rows)."""
    settings = {**SETTINGS, "sampler_head": True, "sampler_width": 24}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(settings))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    with pytest.raises(ValueError, match=f"lacks {SAMPLER_HEAD}"):
        check_checkpoint(str(tmp_path), settings)
    (tmp_path / SAMPLER_HEAD).write_bytes(b"")
    check_checkpoint(str(tmp_path), settings)


def test_settings_are_written_atomically(tmp_path, monkeypatch):
    """A save killed while space_settings.json is being written leaves no such file (a resume then
    says the save was cut short), never a partial one under its real name. Catches a direct,
    non-atomic write of the settings file."""
    from pathlib import Path

    real = Path.write_text

    def killed_half_way(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint-2" / SETTINGS_FILE).exists()
    with pytest.raises(ValueError, match=f"no {SETTINGS_FILE}"):
        check_checkpoint(str(tmp_path / "checkpoint-2"), SETTINGS)


def test_a_save_stopped_before_its_space_files_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    """save_total_limit 1: HF deleted the older checkpoints before the on_save callback wrote the
    mask rows and space_settings.json. Catches that order: a run killed in between kept only a
    checkpoint that a resume refuses, and the one its message says to resume from was gone. The
    older one now stays until the new one is whole, a completed save still rotates, and a rerun
    resumes from the whole one (it stopped with "checkpoint-2 has no space_settings.json", a
    Ctrl-C during a save needed the user to delete the checkpoint by hand)."""
    from space.config import parse_train_args
    from space.train.run import run_sft

    out = tmp_path / "run"
    argv = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(out), "--save_steps", "1",
            "--save_total_limit", "1", "--max_steps", "3", "--limit", "8"]
    real = SpaceCheckpointCallback.on_save

    def killed_at_step_2(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt
        return real(self, args, state, control, **kwargs)

    monkeypatch.setattr(SpaceCheckpointCallback, "on_save", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        run_sft(*parse_train_args(argv))
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (out / "checkpoint-1" / SETTINGS_FILE).is_file()
    # the same command goes on from checkpoint-1, as the interrupted run's message says (it stopped
    # with "checkpoint-2 has no space_settings.json"), and ends as the unbroken run
    with pytest.warns(UserWarning, match="checkpoint-2 was cut short while it was saved"):
        assert run_sft(*parse_train_args(argv)) == out / "final"
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]
    assert (out / "incomplete-checkpoint-2").is_dir()
    unbroken = tmp_path / "unbroken"
    run_sft(*parse_train_args([*argv, "--output_dir", str(unbroken)]))
    for name in ("mask_embedding.safetensors", "adapter_model.safetensors"):
        assert (out / "final" / name).read_bytes() == (unbroken / "final" / name).read_bytes()


def whole_or_cut_short(root, name, whole=True, holds=None):
    """A checkpoint folder ``root/name``: whole (its ``space_settings.json`` written, which a save
    writes last) or cut short; ``holds`` names one more file in it."""
    ckpt = root / name
    ckpt.mkdir()
    if whole:
        (ckpt / SETTINGS_FILE).write_text(json.dumps(SETTINGS))
    if holds:
        (ckpt / holds).write_text("x")
    return ckpt


def test_the_newest_whole_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    """Catches ordering checkpoints by name: "checkpoint-9" sorts after "checkpoint-10", so a run
    past step 9 resumed from step 9 and trained the steps after it again."""
    from space.train.run import last_whole_checkpoint

    for step in (9, 10):
        whole_or_cut_short(tmp_path, f"checkpoint-{step}")
    assert last_whole_checkpoint(str(tmp_path), True) == str(tmp_path / "checkpoint-10")


def test_a_step_s_second_save_cut_short_replaces_the_one_moved_aside_before(tmp_path):
    """A save of step 4 cut short, the rerun killed again in its own save of step 4: the first
    cut-short copy already lies in ``incomplete-checkpoint-4``. Catches moving the new one aside
    over it without removing it first: the rename onto a folder that holds files failed
    (ENOTEMPTY), and every rerun stopped there instead of resuming from checkpoint-2."""
    from space.train.run import last_whole_checkpoint

    whole_or_cut_short(tmp_path, "checkpoint-2")
    whole_or_cut_short(tmp_path, "incomplete-checkpoint-4", whole=False, holds="first-cut")
    whole_or_cut_short(tmp_path, "checkpoint-4", whole=False, holds="second-cut")
    with pytest.warns(UserWarning, match="checkpoint-4 was cut short while it was saved"):
        assert last_whole_checkpoint(str(tmp_path), True) == str(tmp_path / "checkpoint-2")
    assert [p.name for p in (tmp_path / "incomplete-checkpoint-4").iterdir()] == ["second-cut"]
    assert not (tmp_path / "checkpoint-4").exists()


@pytest.mark.parametrize("saved, deepspeed_files, now, refused", [
    (3, True, None, True),  # HF resumed it without DeepSpeed from a fresh optimizer and schedule, silently
    (2, True, 3, True),  # DeepSpeed failed on every rank with a bare AssertionError
    (None, False, 2, True),  # "Can't find a valid checkpoint", which blamed the checkpoint
    (3, True, 3, False),
    (None, False, None, False),
    ("absent", True, 3, False),  # saved before the stage was recorded: DeepSpeed's "latest" file tells it was one
    ("absent", True, None, True),
    ("absent", False, 2, True),
    ("absent", False, None, False),
])
def test_a_checkpoint_resumes_under_its_own_zero_stage_only(tmp_path, saved, deepspeed_files, now, refused):
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / SETTINGS_FILE).write_text(json.dumps({**SETTINGS, "mode": "full", **({} if saved == "absent" else {"zero_stage": saved})}))
    if deepspeed_files:
        (ckpt / "latest").write_text("global_step2")
    settings = {**SETTINGS, "mode": "full", "zero_stage": now}
    if refused:
        with pytest.raises(ValueError, match="'zero_stage'.*resumes only under the DeepSpeed config"):
            check_checkpoint(str(ckpt), settings)
    else:
        check_checkpoint(str(ckpt), settings)


@pytest.mark.parametrize("deepspeed, stage", [("zero2", 2), ("zero3", 3), (None, None)])
def test_a_checkpoint_records_the_zero_stage_of_its_deepspeed_config(tmp_path, deepspeed, stage):
    """The stage a resume compares (above) is read from the run's DeepSpeed config. Catches a
    stage not read from it (every DeepSpeed run recorded as stage 0): a ZeRO-2 checkpoint then
    resumed under ZeRO-3, where DeepSpeed failed on every rank with a bare AssertionError."""
    from space.config import parse_train_args
    from space.train.run import space_settings

    argv = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "run")]
    model_args, _, mask_args, train_args = parse_train_args(
        argv + (["--deepspeed", f"configs/deepspeed/{deepspeed}.json"] if deepspeed else []))
    assert space_settings(model_args, mask_args, train_args)["zero_stage"] == stage


def test_a_second_run_into_the_same_output_dir_is_refused(tmp_path):
    """Two runs into one output_dir wrote each other's checkpoints and final/ (both exit 0, one's
    work gone), or one failed half-way in a save. Catches a run that does not hold its output_dir."""
    from space.config import parse_train_args
    from space.jsonl import held
    from space.train.run import run_sft

    out = tmp_path / "run"
    out.mkdir()
    with held(out, "-", "-"):
        with pytest.raises(ValueError, match=rf"output_dir {out} is being written by another run \(pid \d+\)"):
            run_sft(*parse_train_args(["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(out),
                                       "--max_steps", "1", "--limit", "4"]))
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_resume_with_another_effective_batch_or_other_token_ids_is_refused(tmp_path):
    """What a checkpoint records of its run (``run_settings``) and a resume compares. Catches a
    batch recorded without its gradient accumulation (a rerun with ``gradient_accumulation_steps``
    2 restored the optimizer and skipped the batches of 1, going on from a misaligned point) and a
    data hash of the text alone (a set distilled again with other token ids, or its answers now
    marked cut at the length limit, trains on other targets: a resume took it as the same data)."""
    from space.config import parse_train_args
    from space.data.sft import Example
    from space.train.run import run_settings, space_settings

    examples = [Example([{"role": "user", "content": "q"}], "a b", True, [5, 6])]

    def settings(*flags, examples=examples):
        model_args, data_args, mask_args, train_args = parse_train_args(
            ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "run"), *flags])
        return {**space_settings(model_args, mask_args, train_args),
                **run_settings(model_args, data_args, mask_args, train_args, examples)}

    (tmp_path / SETTINGS_FILE).write_text(json.dumps(settings()))
    (tmp_path / artifact.MASK_EMBEDDING).write_bytes(b"")
    check_checkpoint(str(tmp_path), settings())  # the same run resumes
    # a longer schedule, as run_settings records it: said, not refused (catches its length left out of the record)
    with pytest.warns(UserWarning, match=r"another schedule length .*'max_steps': \(4, 8\)"):
        check_checkpoint(str(tmp_path), settings("--max_steps", "8"))
    with pytest.raises(ValueError, match=r"other SPACE settings or data.*'batch': \(4, 8\)"):
        check_checkpoint(str(tmp_path), settings("--gradient_accumulation_steps", "2"))
    # ... or the same ids re-distilled with the end id the model wrote (stop_id), which its last trained token is
    for changed in (Example(examples[0].context, "a b", True, [5, 7]), Example(examples[0].context, "a b", False, [5, 6]),
                    Example(examples[0].context, "a b", True, [5, 6], stop_id=9)):
        with pytest.raises(ValueError, match="other SPACE settings or data.*'data'"):
            check_checkpoint(str(tmp_path), settings(examples=[changed]))
    # rows naming no end keep the fingerprint they had before rows could name one
    import hashlib

    before = hashlib.sha256(json.dumps([examples[0].context, "a b", True, [5, 6]]).encode()).hexdigest()[:16]
    assert settings()["data"]["sha256"] == before


def _agree(rank, world, init, lasts, out):
    """One rank of test_ranks_that_see_different_checkpoints_all_stop (module level: spawned)."""
    import torch.distributed as dist

    from space.train.run import agree_on_checkpoint

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out[rank] = ("resumes", agree_on_checkpoint(lasts[rank]))
    except ValueError as e:
        out[rank] = ("refused", str(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lasts", [["out/checkpoint-4", "out/checkpoint-4"], ["out/checkpoint-4", None]])
def test_ranks_that_see_different_checkpoints_all_stop(tmp_path, lasts):
    """Each rank looked for the last checkpoint in its own filesystem: with an output_dir local to each
    node, node 0 resumed while the others, holding only their ZeRO shards, started afresh, and the
    job hung or trained on a mix. The ranks now agree on rank 0's, and all stop, naming both, when
    any rank sees another (two gloo processes on this CPU)."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_agree, args=(2, f"file://{tmp_path / 'rendezvous'}", lasts, out), nprocs=2, join=True)
    if lasts[0] == lasts[1]:
        assert dict(out) == {0: ("resumes", lasts[0]), 1: ("resumes", lasts[1])}
    else:
        assert [out[r][0] for r in (0, 1)] == ["refused", "refused"]
        assert f"rank 0: {lasts[0]}, rank 1: {lasts[1]}" in out[1][1] and "shared" in out[0][1]


def _any_rank(rank, world, init, flags, out):
    """One rank of test_a_refusal_one_rank_sees_stops_every_rank (module level: spawned)."""
    import torch.distributed as dist

    from space.train.run import any_rank

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out[rank] = any_rank(flags[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flags", [[True, False], [False, True], [False, False]])
def test_a_refusal_one_rank_sees_stops_every_rank(tmp_path, flags):
    """An earlier run's final/ is looked for on each rank's filesystem; only rank 0 refused it and the
    others went on into the model load's collectives (waiting up to ddp_timeout on other nodes).
    Every rank gets any rank's answer (two gloo processes on this CPU)."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_any_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", flags, out), nprocs=2, join=True)
    assert dict(out) == {0: any(flags), 1: any(flags)}


def test_distilled_rows_that_name_no_end_are_warned_of_where_the_model_ends_otherwise():
    """Sets distilled before rows carried ``stop_id`` train the tokenizer's EOS as every answer's
    end: on a model whose turns also end with another id (Llama-3-Instruct's <|eot_id|>) that teaches
    an end it may never write. Training now says so; rows naming their end, or a model ending with
    its EOS alone (SmolLM2), pass without a word."""
    import warnings

    from space.data.sft import Example
    from space.models import tiny_random_llama
    from space.train.run import warn_unnamed_ends

    model, tok = tiny_random_llama()
    old = [Example([{"role": "user", "content": "q"}], "a b", True, [5, 6])]
    named = [Example([{"role": "user", "content": "q"}], "a b", True, [5, 6], stop_id=tok.eos_token_id)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unnamed_ends(old, model, tok)  # the EOS is the model's only end
        model.generation_config.eos_token_id = [tok.eos_token_id, 300]
        warn_unnamed_ends(named, model, tok)
        # an answer cut at the length limit has no end to name (counting it warned of every unfinished row)
        warn_unnamed_ends([Example([{"role": "user", "content": "q"}], "a b", False, [5, 6])], model, tok)
    with pytest.warns(UserWarning, match=r"1 distilled rows name no end id .* also ends turns with \[300\]"):
        warn_unnamed_ends(old, model, tok)
