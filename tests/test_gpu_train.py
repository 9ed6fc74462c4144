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


@pytest.mark.parametrize("unfinished", ["distill_magpie", "distill_lima_mbpp"])
def test_gpu_train_t60c_refuses_unfinished_sets(tmp_path, unfinished):
    """A training call on sets a cut distillation left (a Magpie stage stopped at its cap, or LIMA +
    MBPP cut at theirs) would train on fewer samples than the run is for: it stops in one line and
    says what to run."""
    runs = tmp_path / "stash" / "runs" / "gpu60"
    runs.mkdir(parents=True)
    (runs / "distill_magpie.jsonl").write_text('{"id": "magpie/0"}\n')
    for name in ("distill_lima_mbpp", "distill_magpie"):
        (runs / f"{name}.manifest.json").write_text(json.dumps({"complete": name != unfinished}, indent=1))
    env = {**os.environ, "SPACE_GPU_STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "SPACE_GPU_CARRIED": str(tmp_path / "nothing carried")}
    run = subprocess.run(["bash", str(SCRIPT), "t60c"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "unfinished: run t60b again" in run.stdout, run.stdout + run.stderr
    assert not (tmp_path / "out" / "status.txt").exists()  # no stage ran
    # the check itself, on manifests as space-distill writes them (json.dumps, indent=1)
    check = _function("set_complete")  # not "complete", a bash builtin: a test without the function passed
    for done, expected in ((True, 0), (False, 1)):
        (runs / "distill_magpie.manifest.json").write_text(json.dumps({"file": "x", "complete": done, "rows": 1}, indent=1))
        status = subprocess.run(["bash", "-c", f"runs={runs}; {check}\nset_complete distill_magpie"]).returncode
        assert status == expected, done


def _function(name: str) -> str:
    """A bash function of gpu_train.sh, as text to define it in a shell of a test's own."""
    return f"{name}() {{" + SCRIPT.read_text().split(f"{name}() {{", 1)[1].split("\n}\n", 1)[0] + "\n}"


def test_a_training_sessions_t60b_refuses_to_run_without_its_carried_sets(tmp_path):
    """A training session's .gpu2/ (gpu_pack.sh --sets) carried without .gpu3/ made t60b distil the
    sets again, about 450 s of a 900 s session, leaving too little for training. It now stops at
    once; with the parts carried, or with a distilling session's .gpu2/, it goes on."""
    (tmp_path / ".gpu2").mkdir()
    carried = tmp_path / "carried"
    carried.mkdir()
    runs = tmp_path / "runs"
    script = f"carried={carried}; runs={runs}\n{_function('expect_sets')}\n{_function('set_complete')}\nexpect_sets; echo went on"
    run = lambda: subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)  # noqa: E731
    assert run().stdout.strip() == "went on"  # a distilling session's .gpu2/
    (tmp_path / ".gpu2" / "sets_in_gpu3").write_text("the sets travel in .gpu3/\n")
    refused = run()
    assert refused.returncode == 1 and "carry .gpu3/ too" in refused.stdout
    (carried / "gpu60.tar.xz.part0").write_bytes(b"x")
    assert run().stdout.strip() == "went on"
    assert "sets_in_gpu3" in (ROOT / "scripts" / "gpu_pack.sh").read_text()  # where the marker is made
    # a second t60b on the warm machine, .gpu2/ alone carried: the first call restored the sets, so it goes on
    (carried / "gpu60.tar.xz.part0").unlink()
    runs.mkdir()
    for name in ("distill_lima_mbpp", "distill_magpie"):
        assert run().returncode == 1  # a set not restored yet (or unfinished): still refused
        (runs / f"{name}.manifest.json").write_text(json.dumps({"complete": True}, indent=1))
    assert run().stdout.strip() == "went on"


@pytest.mark.parametrize("budget, minutes", [("", "6.30"), ("530", "6.30"), ("400", "4.80"), ("100", "0.10")])
def test_t60c_trains_for_what_its_stage_has_left(budget, minutes):
    """The trainer's clock was the config's 6.3 minutes whatever the call's budget: a budget that cut the
    460 s stage shorter killed torchrun before final/ was written, and 6 minutes of training came back as
    logs alone. Its clock is now the stage's seconds (its cap, or what the budget leaves) less the 82 s
    that loading and saving take, at most the config's."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    script = (f"out=/tmp; stash=/tmp; budget={budget}; PACK_MARGIN=30\n"
              f"TRAIN_CONFIG=configs/train/smollm2_gpu_40k.yaml TRAIN_MARGIN=82\n{_function('train_minutes')}\n"
              "train_minutes 460")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.stdout.strip() == minutes, run.stdout + run.stderr
    assert "PACK_MARGIN=30" in lib.read_text() and "TRAIN_MARGIN=82" in SCRIPT.read_text()
    assert '--max_train_minutes "$(train_minutes "${caps[2]}")"' in SCRIPT.read_text()


@pytest.mark.parametrize("steps, said", [(378, "train steps=378 of 625 short_of_epoch"), (625, "train steps=625 of 625"),
                                         (None, "train steps=0 of 625 short_of_epoch")])
def test_t60c_says_when_its_clock_stopped_training_short_of_the_epoch(tmp_path, steps, said):
    """t60c exits 0 when max_train_minutes ends the run early (the last run saw 0.78 of an epoch,
    which discounted its verdict): status.txt says how far it got."""
    runs = tmp_path / "runs"
    (runs / "train").mkdir(parents=True)
    (tmp_path / "res").mkdir()
    if steps is not None:
        log = [{"loss": 1.0, "step": s} for s in range(10, steps + 1, 10)] + [{"train_runtime": 1.0, "step": steps}]
        (runs / "train" / "log_history.json").write_text(json.dumps(log))
    script = f"runs={runs}; stash={tmp_path}\n{_function('epoch_status')}\nepoch_status 625"
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert run.stdout.strip() == said and (tmp_path / "res" / "status.txt").read_text().strip() == said


def test_a_stage_is_cut_before_the_calls_budget_and_a_spent_one_skips(tmp_path):
    """A call the run tool cuts at its timeout loses what its running stage had not packed. With
    SPACE_GPU_BUDGET a stage is cut PACK_MARGIN (30) seconds before the budget ends, whatever its
    own cap, and a stage with no time left is skipped (rc 124, the call then fails); without one
    the caps alone hold."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    script = (f"source {lib}; pack() {{ :; }}\n"
              "stage slow 60 sleep 20; echo \"slow=$?\"; stage next 60 true; echo \"next=$? failed=$failed\"")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SPACE_GPU_STASH": str(tmp_path / "stash"),
           "SPACE_GPU_BUDGET": "32"}
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "slow=124" in run.stdout and "next=124 failed=1" in run.stdout, run.stdout + run.stderr
    status = (tmp_path / "stash" / "res" / "status.txt").read_text()
    assert re.search(r"^slow rc=124 seconds=[12]$", status, re.M) and "next rc=124 seconds=0 skipped" in status, status
    env.pop("SPACE_GPU_BUDGET")
    script = f"source {lib}; pack() {{ :; }}\nstage quick 60 sleep 1; echo \"quick=$? failed=$failed\""
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "quick=0 failed=0" in run.stdout, run.stdout + run.stderr


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
    assert "train steps=2 of 2" in (tmp_path / "out2" / "status.txt").read_text()
    parts = sorted((tmp_path / "out2").glob("gpu60.tar.xz.part*"))
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(b"".join(p.read_bytes() for p in parts)))) as tar:
        names = tar.getnames()  # t60c brings back its training, not the sets it restored (committed already)
    assert "runs/gpu60/train/final/adapter_model.safetensors" in names and not [n for n in names if "distill_" in n]
    assert not (tmp_path / "out2" / ".pack").exists()
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


@pytest.mark.parametrize("tar_rc, replaced", [(0, True), (1, True), (2, False)])
def test_a_pack_replaces_the_last_only_when_tar_made_a_whole_archive(tmp_path, tar_rc, replaced):
    """The pipe's status was split's alone: a failed tar replaced the last good parts with a torn
    archive. Now a tar failure keeps them, while tar's 1 ("a file changed as it was read", a cut
    stage's workers still writing their log) is a whole archive and replaces them."""
    out, stash = tmp_path / "out", tmp_path / "stash"
    (stash / "res").mkdir(parents=True)
    (stash / "res" / "status.txt").write_text("x rc=0\n")
    out.mkdir()
    (out / "gpu60.tar.xz.part0").write_text("the last pack")
    script = (f"out={out}; stash={stash}; phase=t60b\n"
              f"tar() {{ echo new archive; return {tar_rc}; }}\nxz() {{ cat; }}\n{_function('pack')}\npack")
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert (out / "gpu60.tar.xz.part0").read_text() == ("new archive\n" if replaced else "the last pack")
    assert not (out / ".pack").exists()


@pytest.mark.parametrize("tar_rc, replaced", [(0, True), (1, True), (2, False)])
def test_gpu_lib_pack_keeps_the_last_whole_archive(tmp_path, tar_rc, replaced):
    """gpu_check.sh's pack wrote gpu_results.tgz in place: a call cut while packing left a torn archive
    under the last good one's name. It writes beside and renames, taking tar's 1 (a file changed as it
    was read) as whole, and leaves no part behind on a failure."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SPACE_GPU_STASH": str(tmp_path / "stash")}
    script = (f"source {lib}\nprintf 'the last pack' > \"$out/gpu_results.tgz\"\n"
              f"tar() {{ printf 'new archive' > \"$2\"; return {tar_rc}; }}\npack")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert (out / "gpu_results.tgz").read_text() == ("new archive" if replaced else "the last pack")
    assert not (out / "gpu_results.tgz.part").exists()
