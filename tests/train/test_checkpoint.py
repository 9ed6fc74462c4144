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
