"""Every entry point answers --help; the shell wrapper and the Table-1 script run on the tiny model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["space.eval", "space.train", "space.distill", "space.masking", "space.eval.probe"])
def test_module_help(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-500:]


def test_shell_wrappers_help():
    for script in ("run_eval.sh", "run_sft_multi_node.sh"):
        out = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "bash" in out.stdout


def test_run_eval_sh_on_another_model(tmp_path):
    """The shipped adapter is for SmolLM2: run_eval.sh leaves it out for another --model."""
    out = subprocess.run(["bash", "run_eval.sh", "--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "4",
                          "--methods", "ar,space", "--threads", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "run_config.json").read_text())["adapter"] is None


def test_reproduce_table1_tiny(tmp_path):
    # from another folder with a relative --out: training (run from the repo root) and evaluation
    # must both use tmp_path/table
    out = subprocess.run([sys.executable, str(ROOT / "scripts/reproduce_table1.py"), "--models", "tiny", "--limit", "1",
                          "--max-steps", "2", "--max-new-tokens", "8", "--out", "table"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "table" / "table1.md").read_text()
    assert "| tiny | frozen-base | python |" in table and "100.0 %" in table
