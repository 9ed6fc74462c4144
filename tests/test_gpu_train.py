"""scripts/gpu_train.sh (issue 60's GPU self-distillation and training run) on this CPU: its ``local``
phase runs the GPU phases' stages at a tiny scale on the real SmolLM2, and what it packs must unpack into
distilled sets, their manifests, a training log and an adapter that decodes exactly. Also: the GPU phases'
caps fit a session's device time."""
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_train.sh"


def test_gpu_train_phase_caps_fit_a_call_and_the_device_time():
    """A call is cut at 600 s and a session has 900 s of device time, its start (about 35 s) and
    t60a's copying (about 20 s) included. A distilling session's t60b (the conversion, LIMA + MBPP,
    the Magpie stage) fits one call; a training session (t60a, t60b on complete sets: the conversion,
    each set's nothing-to-do check, then t60c) fits the device time, and the training stage must
    outlast the config's time budget plus what its clock leaves out (torchrun, loading, tokenizing
    about 40,000 rows at about 0.6 ms each, saving: about 60 s), or the cap kills it before final/
    is written."""
    import yaml

    text = SCRIPT.read_text()
    gpu = text.split('else\n  # 30,000 first turns', 1)[1].split("\nfi\n", 1)[0]
    answers, magpie, train = (int(n) for n in re.search(r"caps=\((\d+) (\d+) (\d+)\)", gpu).groups())
    assert "--max_train_minutes" not in gpu  # the config's epoch, in a session of its own
    config = yaml.safe_load((ROOT / "configs" / "train" / "smollm2_gpu_40k.yaml").read_text())
    convert = int(re.search(r"stage convert (\d+) ", (ROOT / "scripts" / "gpu_lib.sh").read_text())[1])
    assert convert + answers + magpie <= 540  # t60b, with its transfer, inside one call
    assert 35 + 20 + convert + 2 * 20 + train <= 840
    assert config["max_train_minutes"] * 60 + 80 <= train <= 540


def test_gpu_train_t60c_refuses_unfinished_sets(tmp_path):
    """A training call on sets a cut distillation left (a Magpie stage stopped at its cap) would train
    on fewer samples than the run is for: it stops in one line and says what to run."""
    runs = tmp_path / "stash" / "runs" / "gpu60"
    runs.mkdir(parents=True)
    (runs / "distill_magpie.jsonl").write_text('{"id": "magpie/0"}\n')
    (runs / "distill_lima_mbpp.manifest.json").write_text(json.dumps({"complete": True}, indent=1))
    (runs / "distill_magpie.manifest.json").write_text(json.dumps({"complete": False}, indent=1))
    env = {**os.environ, "SPACE_GPU_STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "SPACE_GPU_CARRIED": str(tmp_path / "nothing carried")}
    run = subprocess.run(["bash", str(SCRIPT), "t60c"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "unfinished: run t60b again" in run.stdout, run.stdout + run.stderr
    assert not (tmp_path / "out" / "status.txt").exists()  # no stage ran
    # the check itself, on manifests as space-distill writes them (json.dumps, indent=1)
    check = "complete() {" + SCRIPT.read_text().split("complete() {", 1)[1].split("\n}\n", 1)[0] + "\n}"
    for done, expected in ((True, 0), (False, 1)):
        (runs / "distill_magpie.manifest.json").write_text(json.dumps({"file": "x", "complete": done, "rows": 1}, indent=1))
        status = subprocess.run(["bash", "-c", f"runs={runs}; {check}\ncomplete distill_magpie"]).returncode
        assert status == expected, done


@pytest.mark.slow
def test_gpu_train_local_phase_packs_sets_and_an_exact_adapter(tmp_path):
    """Catches a stage that fails, a pack that leaves out what the next session needs (the sets,
    their manifests, final/), and a trained adapter that does not load or decode exactly."""
    from space.data.sft import data_root
    from space.models import cache_dir

    env = {**os.environ, "SPACE_GPU_STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "SPACE_DATA": str(data_root()), "SPACE_CACHE": str(cache_dir()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT), "local"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    status = (tmp_path / "out" / "status.txt").read_text()
    assert re.findall(r"^(\w+) rc=0", status, re.M) == ["distill_lima_mbpp", "distill_magpie", "train"], status

    parts = sorted((tmp_path / "out").glob("gpu60.tar.xz.part*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    back = tmp_path / "back"
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(b"".join(p.read_bytes() for p in parts)))) as tar:
        names = tar.getnames()
        tar.extractall(back, filter="data")
    assert not [n for n in names if "checkpoint-" in n]  # optimizer states stay behind
    runs = back / "runs" / "gpu60"
    for name, sources in (("distill_lima_mbpp", {"lima", "mbpp"}), ("distill_magpie", {"magpie"})):
        manifest = json.loads((runs / f"{name}.manifest.json").read_text())
        assert manifest["complete"] and manifest["settings"]["dtype"] == "float32" and manifest["devices"] == ["cpu"]
        rows = [json.loads(line) for line in (runs / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == manifest["rows"] > 0 and {r["source"] for r in rows} <= sources | {"magpie-turn2"}
        assert all(r["response_ids"] for r in rows)
    log = json.loads((runs / "train" / "log_history.json").read_text())
    assert [entry["step"] for entry in log if "loss" in entry] == [1, 2] and log[-1]["step"] == 2

    from space.decoding import SpaceDecoder, ar_generate
    from space.loader import load_space

    model, tok, spec = load_space(adapter=str(runs / "train" / "final"), kernels="stock")
    prompt = torch.tensor(tok("def add(a, b):", add_special_tokens=False)["input_ids"])
    ar = ar_generate(model, prompt, 24, suppress_ids=spec.token_ids).new_ids
    assert SpaceDecoder(model, spec).generate(prompt, 24).new_ids == ar

    # a later session: a fresh machine, the parts carried back; t60c restores the sets alone and trains
    later = {**env, "SPACE_GPU_STASH": str(tmp_path / "stash2"), "OUT": str(tmp_path / "out2"),
             "SPACE_GPU_CARRIED": str(tmp_path / "out"), "SPACE_GPU_SCALE": "tiny"}
    run = subprocess.run(["bash", str(SCRIPT), "t60c"], cwd=ROOT, env=later, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    restored = tmp_path / "stash2" / "runs" / "gpu60"
    assert (restored / "distill_magpie.jsonl").read_bytes() == (runs / "distill_magpie.jsonl").read_bytes()
    assert (restored / "train" / "final" / "adapter_model.safetensors").is_file()
    assert "train rc=0" in (tmp_path / "out2" / "status.txt").read_text()
    # the sets alone: an earlier train/ restored too would leave its final/ in place of this run's
    line = next(line for line in run.stdout.splitlines() if line.startswith("restored "))
    assert set(line.split(" from ")[0].split()[1:]) == {
        "distill_lima_mbpp.jsonl", "distill_lima_mbpp.manifest.json", "distill_magpie.jsonl",
        "distill_magpie.magpie.jsonl", "distill_magpie.manifest.json"}, line


def test_gpu_train_t60c_without_sets_says_what_to_run_first(tmp_path):
    """A training call on a fresh machine (the sets went back with the last one) stops in one line."""
    env = {**os.environ, "SPACE_GPU_STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "SPACE_GPU_CARRIED": str(tmp_path / "nothing carried")}
    run = subprocess.run(["bash", str(SCRIPT), "t60c"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no distilled set" in run.stdout and "run t60b first, or carry its parts" in run.stdout
