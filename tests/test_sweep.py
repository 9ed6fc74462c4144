"""scripts/sweep_recipes.py on tiny-random-llama: each arm trains for its time budget, is probed and
lands in one table; a second call reruns nothing, and the table rebuilds from <out> alone."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_trains_probes_and_tabulates_each_arm(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base_config: configs/train/tiny_smoke.yaml\nminutes: 1.0e-6\n"
                     "arms:\n  base: []\n  lora: [--mode, lora]\n  k4: [--mask_num, '4']\n  full: [--mode, full]\n")
    cmd = [sys.executable, "scripts/sweep_recipes.py", str(sweep), "--out", str(tmp_path / "out"),
           "--runs", str(tmp_path / "runs"), "--answers", "", "--probe-flags", "--limit 1 --max-new-tokens 8"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = json.loads((tmp_path / "out/sweep.json").read_text())["rows"]
    assert [(r["arm"], r["mode"], r["steps"]) for r in rows] == [("base", "frozen-base", 1), ("lora", "lora", 1),
                                                                 ("k4", "frozen-base", 1), ("full", "full", 1)]
    for r in rows:
        assert all(0 <= x <= 1 for x in r["top1"]) and 1 <= r["chain_bound_k3"] <= 4
        assert all(0 <= x <= 1 for x in r["general_top1"]) and 1 <= r["general_chain_bound_k3"] <= 4
        assert 1 <= r["chain k=3, 4 groups"] <= 4
    assert "| k4 | frozen-base | 1 |" in (tmp_path / "out/sweep.md").read_text()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "+ " not in again.stdout  # every arm was done: nothing reruns
    # a clone has results/ but no runs/: train.json carries the provenance the table needs
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "out/sweep.json").unlink()
    rebuilt = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rebuilt.returncode == 0 and "+ " not in rebuilt.stdout, rebuilt.stderr[-3000:]
    assert json.loads((tmp_path / "out/sweep.json").read_text())["rows"] == rows
