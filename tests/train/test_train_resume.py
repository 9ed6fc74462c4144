"""space-train reruns: a resumed run says how far it got, a finished one trains and rewrites
nothing, and every run leaves its loss / mask-accuracy curves as a PNG."""
import json

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
