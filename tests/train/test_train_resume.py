"""space-train reruns: a resumed run says how far it got and equals the uninterrupted run bit for
bit, a finished one trains and rewrites nothing, and every run leaves its loss / mask-accuracy
curves as a PNG."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from space.train.__main__ import main as train_main


def test_rerun_of_a_finished_training_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(out), "--limit", "4", "--save_steps", "2"]
    final = train_main([*args, "--max_steps", "2"])
    assert (out / "training_curves.png").stat().st_size > 0
    log = (out / "log_history.json").read_text()
    weights = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}
    stamp = (final / "space_config.json").stat().st_mtime_ns
    capsys.readouterr()
    assert train_main([*args, "--max_steps", "2"]) == final
    said = capsys.readouterr().out
    assert "resuming: 2 of 2 steps done" in said and "training already finished: 2 of 2 steps done" in said
    assert (out / "log_history.json").read_text() == log  # no second train_loss entry (it was 0.0)
    assert "'train_loss': 0.0" not in said
    assert (final / "space_config.json").stat().st_mtime_ns == stamp  # final not saved again
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == weights
    train_main([*args, "--max_steps", "4"])  # more steps: it does train on
    assert "resuming: 2 of 4 steps done" in capsys.readouterr().out
    assert [h["step"] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h][-1] == 4


def test_rerun_of_a_run_finished_inside_an_epoch_trains_no_step(tmp_path, capsys):
    """max_steps 2 of a 3-step epoch. Catches HF's resume loop, which trains one batch before its
    first stop check: each rerun of the finished run trained a step past max_steps (checkpoint-3,
    then -4) and rewrote final/; a run killed after its last checkpoint but before final/ wrote a
    3-step artifact."""
    out = tmp_path / "run"
    args = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(out), "--limit", "6",
            "--per_device_train_batch_size", "2", "--max_steps", "2", "--save_steps", "1", "--lr_scheduler_type", "constant"]
    final = train_main(args)
    weights = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}
    capsys.readouterr()
    assert train_main(args) == final and "training already finished: 2 of 2 steps done" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == weights
    shutil.rmtree(final)  # killed after checkpoint-2, before final/ was written
    assert train_main(args) == final
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((final / "space_config.json").read_text())["global_step"] == 2
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file() and p.suffix == ".safetensors"} == \
        {n: b for n, b in weights.items() if n.endswith(".safetensors")}


@pytest.mark.parametrize("change, saved_now", [(("--lora_alpha", "64"), "'lora_alpha': (32, 64)"),
                                               (("--lora_r", "4"), "'lora_r': (16, 4)"),
                                               (("--lora_targets", "q_proj,v_proj"), "'lora_targets'")])
def test_a_resume_with_another_lora_is_refused(tmp_path, change, saved_now):
    """A checkpoint's LoRA weights belong to its rank, alpha and targets. Catches a resume that
    took another alpha silently (every trained update rescaled, the artifact recording the new
    alpha) or failed on another rank with a size-mismatch traceback after the model loaded."""
    args = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "run"), "--limit", "4",
            "--save_steps", "1"]
    train_main([*args, "--max_steps", "1"])
    with pytest.raises(ValueError, match=f"checkpoint-1 holds LoRA weights made with other settings.*{re.escape(saved_now)}"):
        train_main([*args, "--max_steps", "2", *change])


# --- resume == uninterrupted (issue 59, finding 3) ---------------------------------------------
# 6 samples at batch 2: 3 steps an epoch, so the resume at step 2 lands mid-epoch (the data loader
# skips what was trained) and step 4 starts epoch 2 (the collator's epoch seed after a resume)
RESUME_ARGS = ["--config", "configs/train/tiny_smoke.yaml", "--limit", "6", "--per_device_train_batch_size", "2",
               "--max_steps", "4", "--save_steps", "2"]
# what a log entry holds that is not a number of the training itself
CLOCK_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def final_tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``run``'s final artifact, keyed ``file:name`` (full: the whole model; lora /
    frozen-base: the LoRA weights and the mask rows)."""
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {run / 'final'}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


def step_logs(run: Path) -> list[dict]:
    """The per-step log entries (loss, grad norm, learning rate, SPACE metrics) of ``run``."""
    return [h for h in json.loads((run / "log_history.json").read_text()) if "loss" in h]


def interrupt_and_resume(whole: Path, resumed: Path, n: int) -> None:
    """``resumed`` holds what a run killed after step ``n`` leaves: ``whole``'s checkpoint-n alone."""
    resumed.mkdir()
    shutil.copytree(whole / f"checkpoint-{n}", resumed / f"checkpoint-{n}")


@pytest.mark.parametrize("mode, extra", [("full", ()), ("lora", ()), ("frozen-base", ()),
                                         ("frozen-base", ("--sampler_head", "true", "--sampler_width", "24"))],
                         ids=["full", "lora", "frozen-base", "sampler-head"])
def test_resume_after_n_steps_is_bit_exact(tmp_path, capsys, mode, extra):
    """Resume after 2 steps of a 4-step run == the same run uninterrupted, bit for bit: every tensor
    of the final artifact and every number logged per step. Without DeepSpeed nothing in between
    is allowed to differ (same seed, same process count, fp32 on CPU).

    For lora / frozen-base the mask rows are not in peft's checkpoint files: the resume reloads them
    from the checkpoint's mask_embedding.safetensors. With that reload stubbed out the run starts
    steps 3-4 from fresh mask rows and this test fails (checked when it was written: the mask rows
    then end about 0.04 away; issue 59, finding 3). It would also fail on a lost optimizer or
    scheduler state, the RNG state or the data loader's position. With a sampler head, the resume
    must also reload the head from the checkpoint's sampler_head.safetensors (else steps 3-4 train a
    fresh head). And the resume must not train steps 1-2 again: a run restarted from scratch (the
    checkpoint ignored) equals the whole one in full mode, so checkpoint-2 must stay as it was."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    args = [*RESUME_ARGS, "--mode", mode, *extra]
    train_main([*args, "--output_dir", str(whole)])
    interrupt_and_resume(whole, resumed, 2)
    saved_at_2 = {p.name: p.read_bytes() for p in (resumed / "checkpoint-2").iterdir() if p.is_file()}
    capsys.readouterr()
    train_main([*args, "--output_dir", str(resumed)])
    assert "resuming: 2 of 4 steps done" in capsys.readouterr().out
    assert not (resumed / "checkpoint-2" / "global_step2").exists()  # no DeepSpeed here
    assert {p.name: p.read_bytes() for p in (resumed / "checkpoint-2").iterdir() if p.is_file()} == saved_at_2

    expected, got = final_tensors(whole), final_tensors(resumed)
    assert expected.keys() == got.keys()
    unequal = {k: (expected[k] - got[k]).abs().max().item() for k in expected if not torch.equal(expected[k], got[k])}
    assert not unequal, f"{len(unequal)} of {len(expected)} tensors differ after the resume (max |diff|): {unequal}"
    # and steps 3-4 did train (else the resumed run could equal the whole one by doing nothing)
    at_2 = {f"{f.name}:{k}": v for f in sorted((whole / "checkpoint-2").glob("*.safetensors"))
            for k, v in load_file(f).items()}
    assert any(not torch.equal(at_2[k], got[k]) for k in at_2.keys() & got.keys())
    if mode != "full":
        assert not torch.equal(at_2["mask_embedding.safetensors:mask_rows"], got["mask_embedding.safetensors:mask_rows"])

    def numbers(logs):
        return [{k: v for k, v in h.items() if k not in CLOCK_KEYS} for h in logs]

    assert [h["step"] for h in step_logs(resumed)] == [1, 2, 3, 4]
    assert numbers(step_logs(resumed)) == numbers(step_logs(whole))


def test_resume_from_a_named_checkpoint_of_another_run(tmp_path, capsys):
    """``--resume_from_checkpoint`` names a checkpoint outside ``output_dir``: the run goes on from
    it and ends as the uninterrupted run does (frozen-base: the mask rows come back too). Catches
    the argument accepted and ignored (the run started from scratch, exit 0); a folder that is
    not a checkpoint is refused before the model loads."""
    whole, other = tmp_path / "whole", tmp_path / "other"
    args = [*RESUME_ARGS, "--mode", "frozen-base"]
    train_main([*args, "--output_dir", str(whole)])
    capsys.readouterr()
    train_main([*args, "--output_dir", str(other), "--resume_from_checkpoint", str(whole / "checkpoint-2")])
    assert "resuming: 2 of 4 steps done" in capsys.readouterr().out
    expected, got = final_tensors(whole), final_tensors(other)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        train_main([*args, "--output_dir", str(tmp_path / "third"), "--resume_from_checkpoint", str(whole)])
    # once the run has checkpoints of its own, a rerun with the same command goes on from them
    capsys.readouterr()
    train_main([*args, "--max_steps", "6", "--output_dir", str(other), "--resume_from_checkpoint",
                str(whole / "checkpoint-2")])
    assert "resuming: 4 of 6 steps done" in capsys.readouterr().out


def test_training_curves_plot_each_offset_in_order_on_the_token_axis(tmp_path, monkeypatch):
    """``space.train.curves`` read by hand off the figure it saves, not only "a PNG exists".
    Catches: entries without ``mask_loss`` (an eval or the train-end summary) plotted or crashing;
    offsets sorted as strings (``mask_acc_10`` before ``mask_acc_2``) or returned unsorted; the
    token axis losing the warm start's ``tokens_before`` or read off the step instead of the epoch;
    the Trainer's loss plotted from a log where an entry lacks it (a KeyError) or not plotted at all;
    the token axis chosen by ``tokens_before`` rather than ``tokens_per_epoch``; the legend of the
    offsets dropped; a history with nothing to plot written as an empty figure instead of refused."""
    from space.train import curves

    history = [
        {"loss": 2.0, "mask_loss": 3.0, "mask_acc_0": 0.5, "mask_acc_10": 0.1, "mask_acc_2": 0.3, "epoch": 0.5, "step": 4},
        {"eval_loss": 1.0, "epoch": 0.5, "step": 4},
        {"loss": 1.5, "mask_loss": 2.5, "mask_acc_0": 0.6, "mask_acc_10": 0.2, "mask_acc_2": 0.4, "epoch": 1.0, "step": 8},
        {"train_runtime": 3.0, "epoch": 1.0, "step": 8},
    ]
    figs = []
    monkeypatch.setattr(curves, "save_figure_atomic", lambda fig, png: figs.append(fig))
    png = tmp_path / "c.png"
    assert curves.plot_training_curves(history, png, tokens_per_epoch=100, tokens_before=1000) == [0, 2, 10]
    acc, losses = figs[-1].axes
    assert [line.get_label() for line in acc.get_lines()] == ["offset 0", "offset 2", "offset 10"]
    assert [list(line.get_ydata()) for line in acc.get_lines()] == [[0.5, 0.6], [0.3, 0.4], [0.1, 0.2]]
    assert all(list(line.get_xdata()) == [1050, 1100] for line in [*acc.get_lines(), *losses.get_lines()])
    assert acc.get_xlabel() == "training tokens" and acc.get_legend() is not None
    assert {line.get_label(): list(line.get_ydata()) for line in losses.get_lines()} == {
        "mask loss": [3.0, 2.5], "training loss": [2.0, 1.5]}

    curves.plot_training_curves(history, png, tokens_per_epoch=100)  # a fresh run: tokens from 0
    assert list(figs[-1].axes[0].get_lines()[0].get_xdata()) == [50, 100]

    del history[2]["loss"]  # frozen-base logs where the Trainer's loss is missing: mask loss alone
    assert curves.plot_training_curves(history, png) == [0, 2, 10]
    acc, losses = figs[-1].axes
    assert acc.get_xlabel() == "optimizer step" and list(acc.get_lines()[0].get_xdata()) == [4, 8]
    assert [line.get_label() for line in losses.get_lines()] == ["mask loss"]

    with pytest.raises(ValueError, match="no training log entry with mask_loss"):
        curves.plot_training_curves([{"eval_loss": 1.0, "step": 1}], png)
    assert len(figs) == 3 and not png.exists()
