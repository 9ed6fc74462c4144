"""Resuming an evaluation folder (space/eval/resume.py): every setting that shapes the samples or
their timings blocks a resume when it changes; the adapter counts by content, not by path; one run
writes a samples file at a time, and a resume keeps no record twice."""
import hashlib
import json
import re
import os

import pytest

from space.eval.resume import RESUME_KEYS, adapter_sha256, check_resume, model_files
from space.eval.shard import Shard

# written out, not read from RESUME_KEYS: a key dropped from the tuple must fail here
CHANGES = {
    "model": "other-model", "model_files": "e" * 64, "adapter_sha256": "f" * 64, "dataset": "mbpp", "methods": ["ar"], "num_samples": 2,
    "mask_num": 4, "num_groups": 2, "lookup_tokens": 8, "lookup_ngram": 3, "baselines_suppress_masks": False, "tree": [[0], [1]], "row_budget": 16,
    "draft_ranks": 2, "lookup_branches": 4, "datastore_sha256": "d" * 16, "datastore_branches": 2, "step_cost": [[1, 1.0], [8, 2.0]], "adapter_cost": 3.0, "max_new_tokens": 99,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 1, "turn_seeds": True, "dtype": "bfloat16", "kernels": "stock",
    "threads": 7, "device": "cuda:0", "device_map": "auto", "machine": "aarch64 64 cores", "torch": "9.9.9",
    "transformers": "9.9.9", "compile": True, "buckets": True, "capture": 2048, "slot_buckets": [1024, 2048],
    "trunk": {"fused_groups": 60, "attention": "space_sdpa_gqa", "rms_norms": 61}, "sdpa": {"cudnn": False},
}


def meta() -> dict:
    return {"model": "tiny-random-llama", "model_files": None, "adapter": "adapters/a", "adapter_sha256": "0" * 64, "dataset": "humaneval",
            "methods": ["ar", "space"], "num_samples": 1, "mask_num": 3, "num_groups": 4, "lookup_tokens": 0,
            "lookup_ngram": 2, "baselines_suppress_masks": True, "tree": None, "row_budget": None, "draft_ranks": None, "lookup_branches": 1, "datastore_sha256": None, "datastore_branches": 0, "step_cost": None, "adapter_cost": None, "max_new_tokens": 12,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "turn_seeds": None,
            "dtype": "float32", "kernels": "fast", "threads": 1, "device": "cpu", "device_map": None,
            "machine": "x86_64 2 cores", "torch": "2.13.0", "transformers": "5.23.0", "compile": False, "buckets": False,
            "capture": None, "slot_buckets": None, "trunk": {"fused_groups": 60, "attention": "space_sdpa_gqa", "rms_norms": 0},
            "sdpa": None, "commits": ["abc"]}


def record(question: str, method: str) -> dict:
    """A sample record as a resume reads it (``space.eval.bench.read_samples``): a skipped one."""
    return {"question_id": question, "category": "c", "model_id": method, "skipped": "made by hand"}


def line(question: str, method: str) -> str:
    return json.dumps(record(question, method)) + "\n"


def test_every_key_is_checked():
    assert set(CHANGES) == set(RESUME_KEYS)


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_resume_refuses_a_change_of_any_key(tmp_path, key):
    check_resume(tmp_path, meta())
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    check_resume(tmp_path, meta())  # the same settings resume
    with pytest.raises(ValueError, match=rf"other settings.*'{key}': \("):
        check_resume(tmp_path, {**meta(), key: CHANGES[key]})
    assert json.loads((tmp_path / "run_config.json").read_text())[key] == meta()[key]  # the record is kept


def test_a_trunk_recorded_before_the_norm_swap_resumes_as_one_without_swapped_norms(tmp_path):
    """A run record written before the norm swap (5d4b329) holds the trunk without ``rms_norms``;
    nothing swapped norms then, so it resumes under a trunk with none swapped, not under one with
    norms swapped (a GPU's one-kernel norms)."""
    old = meta()
    old["trunk"] = {k: v for k, v in old["trunk"].items() if k != "rms_norms"}
    check_resume(tmp_path, old)
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    check_resume(tmp_path, meta())  # rms_norms 0
    (tmp_path / "run_config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="'trunk'"):
        check_resume(tmp_path, {**meta(), "trunk": {**meta()["trunk"], "rms_norms": 61}})


def test_adapter_hash_follows_content_not_path(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "space_config.json").write_text('{"mode": "frozen-base"}')
        (tmp_path / name / "sub" / "w.bin").write_bytes(b"\x00\x01")
    assert adapter_sha256(tmp_path / "a") == adapter_sha256(tmp_path / "b") and adapter_sha256(None) is None
    (tmp_path / "b" / "sub" / "w.bin").write_bytes(b"\x00\x02")  # retrained in place
    assert adapter_sha256(tmp_path / "a") != adapter_sha256(tmp_path / "b")
    before = adapter_sha256(tmp_path / "a")
    (tmp_path / "a" / "sub" / "w.bin").rename(tmp_path / "a" / "w.bin")  # same bytes, another file
    assert adapter_sha256(tmp_path / "a") != before


def test_a_model_folder_counts_by_its_files(tmp_path):
    """A full-mode final/ retrained in place and evaluated again with --model: its samples were
    resumed as the old model's (one space-eval folder, two models). Catches a fingerprint that
    misses a rewritten weight file or a changed config, or one that depends on the folder's path."""
    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"\0" * (17 << 20))  # past 16 MB: counted by size and time, not read
    first = model_files(str(model))
    assert model_files(str(model)) == first and model_files("tiny-random-llama") is None
    os.utime(weights, ns=(1, 2))  # rewritten: another modification time
    assert model_files(str(model)) != first
    second = model_files(str(model))
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert model_files(str(model)) != second
    before, moved = model_files(str(model)), tmp_path / "moved"
    model.rename(moved)
    assert model_files(str(moved)) == before


def test_a_model_file_counts_by_its_name_too(tmp_path):
    """A model folder's files count by name as well as bytes, as an adapter's do (above): the
    same bytes under another name are another model (transformers reads ``generation_config.json``,
    not a ``.bak`` of it). Catches a fingerprint of the bytes alone, in name order."""
    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "generation_config.json").write_text('{"temperature": 0.2}')
    before = model_files(str(model))
    (model / "generation_config.json").rename(model / "generation_config.json.bak")  # same bytes, another file
    assert model_files(str(model)) != before


def test_resume_drops_duplicate_records(tmp_path, capsys):
    """Two runs that wrote one folder at once left every record twice: the resume keeps the first
    of each (question, method), in order, and says how many went."""
    check_resume(tmp_path, meta())
    rows = [{**record(q, m), "n": i} for i, (q, m) in enumerate(
        [("q1", "ar"), ("q1", "space"), ("q1", "ar"), ("q2", "ar"), ("q1", "space"), ("q2", "ar")])]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_resume(tmp_path, meta())
    kept = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["n"] for r in kept] == [0, 1, 3]
    assert "dropped 3 duplicate (question, method) records" in capsys.readouterr().out
    shard, rank = Shard(1, 2), {**meta(), "shard": {"rank": 1, "world_size": 2, "questions": ["q1"]}}
    check_resume(tmp_path, rank, shard)  # a rank's own samples file too
    (tmp_path / shard.samples).write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    check_resume(tmp_path, rank, shard)
    assert len((tmp_path / shard.samples).read_text().splitlines()) == 2


def test_one_run_holds_a_samples_file(tmp_path):
    """A second holder of the same samples file is refused, naming the first one's process; another
    rank's file is free; the hold ends with its block."""
    from space.eval.resume import hold_samples

    with hold_samples(tmp_path / "samples.jsonl"):
        with pytest.raises(ValueError, match=rf"samples.jsonl is being written by another run \(pid {os.getpid()}\)"):
            with hold_samples(tmp_path / "samples.jsonl"):
                pass
        with hold_samples(tmp_path / "samples.rank1.jsonl"):
            pass
    with hold_samples(tmp_path / "samples.jsonl"):
        pass


def test_a_failed_record_write_keeps_the_old_record(tmp_path, monkeypatch, request):
    """run_config.json is written to a temporary file and renamed: a write that fails midway (a
    full disk) leaves the previous record whole, where writing in place left it torn and every
    later resume refused as "damaged"."""
    check_resume(tmp_path, meta())
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    before = (tmp_path / "run_config.json").read_text()
    request.getfixturevalue("torn_writes")
    with pytest.raises(OSError, match="No space left"):
        check_resume(tmp_path, meta())
    monkeypatch.undo()
    assert (tmp_path / "run_config.json").read_text() == before
    check_resume(tmp_path, meta())  # and the folder still resumes


def test_a_rank_is_checked_against_the_merged_samples_too(tmp_path):
    """A rank started in a folder whose merged samples.jsonl was made with other settings is refused
    (its records would be merged in beside them), though it has no samples of its own yet."""
    check_resume(tmp_path, meta())
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    rank = {**meta(), "max_new_tokens": 99, "shard": {"rank": 0, "world_size": 2, "questions": ["q"]}}
    with pytest.raises(ValueError, match=r"other settings \(run_config.json\).*'max_new_tokens': \(12, 99\)"):
        check_resume(tmp_path, rank, Shard(0, 2))


def test_merge_refuses_extra_records_made_with_other_settings(tmp_path):
    """samples.jsonl records that no rank wrote are kept by a merge only when run_config.json says
    they were made with the ranks' settings; otherwise the merge stops (they were mixed in)."""
    from space.eval.resume import MERGE_KEYS, merge

    rank = {**meta(), "num_questions": 1, "shard": {"rank": 0, "world_size": 1, "questions": ["q1"]}}
    (tmp_path / "run_config.rank0.json").write_text(json.dumps(rank))
    (tmp_path / "samples.rank0.jsonl").write_text(
        "".join(line("q1", m) for m in ("ar", "space")))
    (tmp_path / "samples.jsonl").write_text(line("q2", "ar"))
    (tmp_path / "run_config.json").write_text(json.dumps({**meta(), "num_questions": 2}))
    records, _ = merge(tmp_path, MERGE_KEYS)
    assert [(r["question_id"], r["model_id"]) for r in records] == [("q1", "ar"), ("q1", "space"), ("q2", "ar")]
    (tmp_path / "run_config.json").write_text(json.dumps({**meta(), "num_questions": 2, "max_new_tokens": 99}))
    with pytest.raises(ValueError, match=r"1 records the ranks did not write, made with other settings"):
        merge(tmp_path, MERGE_KEYS)


def test_merge_keeps_the_first_record_of_a_pair_and_holds_the_samples(tmp_path):
    """A rank file that holds a (question, method) twice is merged as a resume reads it: the first
    record kept (the merge kept the last). The merge holds samples.jsonl while it rewrites it: a
    plain run appending there meanwhile would lose its records, so a merge beside one is refused.
    A torn last line of a rank file (a rank still writing) is read past, not rewritten."""
    from space.eval.resume import MERGE_KEYS, hold_samples, merge, merge_run

    rank = {**meta(), "num_questions": 1, "shard": {"rank": 0, "world_size": 1, "questions": ["q1"]}}
    (tmp_path / "run_config.rank0.json").write_text(json.dumps(rank))
    rows = [{**record("q1", m), "n": i} for i, m in enumerate(("ar", "space", "ar"))]
    torn = "".join(json.dumps(r) + "\n" for r in rows) + '{"question_id": "q1", "mod'
    (tmp_path / "samples.rank0.jsonl").write_text(torn)
    with hold_samples(tmp_path / "samples.jsonl"):
        with pytest.raises(ValueError, match="samples.jsonl is being written by another run"):
            merge_run(tmp_path)
    assert not (tmp_path / "samples.jsonl").exists()
    merged, _ = merge(tmp_path, MERGE_KEYS)
    assert [(r["model_id"], r["n"]) for r in merged] == [("ar", 0), ("space", 1)]
    assert (tmp_path / "samples.rank0.jsonl").read_text() == torn


def sharded_folder(out) -> None:
    """A finished one-rank run in ``out`` (q1 by ar and space) beside a samples.jsonl with a q2
    record a plain run added after an earlier merge, and that run's run_config.json."""
    rank = {**meta(), "num_questions": 1, "shard": {"rank": 0, "world_size": 1, "questions": ["q1"]}}
    (out / "run_config.rank0.json").write_text(json.dumps(rank))
    (out / "samples.rank0.jsonl").write_text(
        "".join(line("q1", m) for m in ("ar", "space")))
    (out / "samples.jsonl").write_text(line("q2", "ar"))
    (out / "run_config.json").write_text(json.dumps({**meta(), "num_questions": 2}))


def test_merge_holds_the_samples_from_its_read_to_its_writes(tmp_path, monkeypatch):
    """Catches a merge that takes its hold on samples.jsonl only after reading it, or lets it go
    before writing the merged file and record: a plain run appending there in between lost its
    records. Every read and write of the merge finds samples.jsonl held."""
    import space.eval.resume as resume

    sharded_folder(tmp_path)
    samples, seen = tmp_path / "samples.jsonl", []

    def held() -> bool:
        try:
            with resume.hold_samples(samples):
                return False
        except ValueError:
            return True

    def spy(name, real):
        def call(path, *args, **kwargs):
            if path.name in ("samples.jsonl", "run_config.json"):
                seen.append((name, path.name, held()))
            return real(path, *args, **kwargs)
        monkeypatch.setattr(resume, name, call)

    for name in ("read_samples", "write_jsonl", "write_text_atomic"):
        spy(name, getattr(resume, name))
    monkeypatch.setattr(resume, "report", lambda records, meta, out: meta)  # no plots: the files are the point
    resume.merge_run(tmp_path)
    assert seen == [("read_samples", "samples.jsonl", True), ("write_jsonl", "samples.jsonl", True),
                    ("write_text_atomic", "run_config.json", True)]
    assert [json.loads(line)["question_id"] for line in samples.read_text().splitlines()] == ["q1", "q1", "q2"]


def test_a_merge_stopped_while_writing_its_record_keeps_the_old_one(tmp_path, monkeypatch):
    """Catches merge_run writing run_config.json in place: a merge stopped part way through it (a
    full disk, a kill) left the record torn, and every later resume or merge of the folder refused
    it as damaged. Here only writes to run_config.json* fail, after half a line."""
    import io
    from pathlib import Path

    import space.eval.resume as resume

    sharded_folder(tmp_path)
    before, real_open = (tmp_path / "run_config.json").read_text(), io.open

    def torn_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wa") and Path(file).name.startswith("run_config.json"):
            f.write(b'{"tor' if "b" in mode else '{"tor')
            f.close()
            raise OSError("No space left on device")
        return f

    monkeypatch.setattr(resume, "report", lambda records, meta, out: meta)
    monkeypatch.setattr(io, "open", torn_open)  # pathlib opens through io.open
    with pytest.raises(OSError, match="No space left"):
        resume.merge_run(tmp_path)
    monkeypatch.setattr(io, "open", real_open)
    assert (tmp_path / "run_config.json").read_text() == before
    assert resume.merge_run(tmp_path)["num_questions"] == 2  # and the folder merges again


def test_a_merged_run_resumes_on_any_device_of_its_ranks_type_and_on_their_machines_only(tmp_path):
    """A merged record names every rank's device and machine ("cuda:0; cuda:1"), which no single
    run repeats: a plain run resumes it on one of those machines on a device of their type, any
    index (its timings are comparable), and is refused on another device type or machine."""
    merged = {**meta(), "ranks": 2, "device": "cuda:0; cuda:1", "machine": "host a; host b"}
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    for device, machine in (("cuda:1", "host b"), ("cuda", "host a"), ("cuda:3", "host b")):
        (tmp_path / "run_config.json").write_text(json.dumps(merged))
        check_resume(tmp_path, {**meta(), "device": device, "machine": machine})
    for device, machine, key in (("cpu", "host a", "device"), ("cuda:0", "host c", "machine")):
        (tmp_path / "run_config.json").write_text(json.dumps(merged))
        with pytest.raises(ValueError, match=rf"other settings .*'{key}'"):
            check_resume(tmp_path, {**meta(), "device": device, "machine": machine})
    # resumed in turn, the record unchanged between them: a plain resume on host a rewrote it as one
    # device and machine, and host b was then refused samples it had made
    (tmp_path / "run_config.json").write_text(json.dumps(merged))
    for device, machine in (("cuda:0", "host a"), ("cuda:1", "host b"), ("cuda", "host a")):
        check_resume(tmp_path, {**meta(), "device": device, "machine": machine})
    kept = json.loads((tmp_path / "run_config.json").read_text())
    assert (kept["ranks"], kept["device"], kept["machine"]) == (2, "cuda:0; cuda:1; cuda", "host a; host b")


def test_a_full_checkpoints_fingerprint_for_a_resume_is_its_bytes_and_for_ranks_leaves_its_layout_out(tmp_path):
    """A full checkpoint's space_config.json counts by its bytes for a resume, as it did before a
    checkpoint could store a tuned layout (a re-serialised config made every full checkpoint
    another model to a run started before: resume refused on "model_files"); and without the
    layout for ranks (``layout=False``), so ``space-tree --write-adapter`` storing one leaves the
    checkpoint the model its ranks measured, while any other change still counts."""
    from space.eval.tree_search import write_decode

    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    saved = json.dumps({"mode": "full", "base_model": "x", "mask_num": 3, "mask_diff": True,
                        "mask_token_ids": [1, 2, 3]}, indent=2)  # as space.artifact.save_artifact writes it
    (model / "space_config.json").write_text(saved)
    digest = hashlib.sha256()
    for name in ("config.json", "space_config.json"):
        digest.update(name.encode() + b"\0" + (model / name).read_bytes())
    assert model_files(str(model)) == digest.hexdigest()
    drafts = model_files(str(model), layout=False)
    write_decode(model, {"mask_num": 2, "tree": "dynamic"}, {1: 0.001, 32: 0.002}, setup={
        "threads": 1, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "fused"})
    assert model_files(str(model)) != digest.hexdigest() and model_files(str(model), layout=False) == drafts
    cfg = json.loads((model / "space_config.json").read_text())
    (model / "space_config.json").write_text(json.dumps({**cfg, "mask_num": 4}))
    assert model_files(str(model), layout=False) != drafts


def test_damaged_records_name_their_file_instead_of_a_traceback(tmp_path):
    """A run record that is JSON but not an object, or a rank's record without its shard entry, gave
    an AttributeError or KeyError traceback (exit 1) where every other damaged record says which
    file and exits 2 (``space-eval: error``)."""
    from space.eval.resume import merge_run

    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    for damaged in ("null", "[]", "7"):
        (tmp_path / "run_config.json").write_text(damaged)
        with pytest.raises(ValueError, match="run_config.json: damaged run record"):
            check_resume(tmp_path, meta())
    for rank0 in ({}, {"shard": {"world_size": "2"}}, {"shard": {"world_size": 1}}):
        (tmp_path / "run_config.rank0.json").write_text(json.dumps(rank0))
        with pytest.raises(ValueError, match="run_config.rank0.json: not a rank's record"):
            merge_run(tmp_path)
    (tmp_path / "run_config.rank0.json").write_text(json.dumps({"shard": {"world_size": 2, "questions": []}}))
    (tmp_path / "run_config.rank1.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="run_config.rank1.json: not a rank's record"):
        merge_run(tmp_path)


def test_a_resume_tells_two_cpus_of_one_name_apart_by_their_vector_isa(tmp_path):
    """The machine record named the CPU by its model alone ("x86_64 2 cores, AMD EPYC"), which an
    AVX2 and a Zen 4 EPYC share although their steps cost 1.10x apart: a rerun on the other resumed
    and mixed their timings. It now names the ISA too; a record made before that resumes on the
    rest of the name."""
    from space.eval.__main__ import machine

    here = machine("cpu")
    assert re.search(r" cores, .+ \((AVX512|AVX2|DEFAULT|[A-Z0-9_]+)\)$", here), here
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    older = re.sub(r" \([A-Z0-9_]+\)$", "", here)
    for recorded, resumes in ((here, True), (older, True), (older + " (AVX2)" if "(AVX2)" not in here else older + " (AVX512)", False),
                              (older + ", NVIDIA H200", False)):
        (tmp_path / "run_config.json").write_text(json.dumps({**meta(), "machine": recorded}))
        if resumes:
            check_resume(tmp_path, {**meta(), "machine": here})
        else:
            with pytest.raises(ValueError, match=r"other settings .*'machine'"):
                check_resume(tmp_path, {**meta(), "machine": here})


def test_a_rank_record_of_no_ranks_is_a_damaged_record(tmp_path):
    """A rank 0 record naming a world of 0 ranks (hand-edited, torn) is no rank's record: accepted, the
    merge found no rank to read and failed with an IndexError traceback."""
    from space.eval.resume import merge_run

    (tmp_path / "run_config.rank0.json").write_text(json.dumps({"shard": {"world_size": 0, "questions": []}}))
    with pytest.raises(ValueError, match="run_config.rank0.json: not a rank's record"):
        merge_run(tmp_path)


@pytest.mark.parametrize("key", ["lookup_branches", "datastore_sha256", "datastore_branches", "turn_seeds"])
def test_a_record_made_before_a_setting_resumes_with_its_default(tmp_path, key):
    """A run record written before lookup branches, the datastore and per-turn seeds lacks their
    keys; it resumes under their defaults (one lookup branch, no datastore, one seed per sample), as
    OLD_DEFAULTS says those runs had them: a wrong default refused every older folder."""
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    (tmp_path / "run_config.json").write_text(json.dumps({k: v for k, v in meta().items() if k != key}))
    check_resume(tmp_path, meta())
    (tmp_path / "run_config.json").write_text(json.dumps({k: v for k, v in meta().items() if k != key}))
    with pytest.raises(ValueError, match=rf"'{key}'"):
        check_resume(tmp_path, {**meta(), key: CHANGES[key]})


def test_a_plain_resume_of_a_merged_run_keeps_the_timed_choices_it_shares(tmp_path):
    """A plain run resuming a merged record keeps the kernels' timed choices where it chose as the record
    holds them (a later resume on any of its machines pins them again) and drops them where it chose
    otherwise; dropping them always lost the pin after one resume."""
    timed = {"packed_min_rows": 4, "kernel_paths": {"576x576": {"stock_rows": 2}}}
    merged = {**meta(), "ranks": 2, "device": "cuda:0; cuda:1", "machine": "host a; host b", **timed}
    (tmp_path / "samples.jsonl").write_text(line("q", "ar"))
    (tmp_path / "run_config.json").write_text(json.dumps(merged))
    check_resume(tmp_path, {**meta(), "device": "cuda:0", "machine": "host a", **timed})
    kept = json.loads((tmp_path / "run_config.json").read_text())
    assert {k: kept.get(k) for k in timed} == timed
    check_resume(tmp_path, {**meta(), "device": "cuda:1", "machine": "host b", **timed, "packed_min_rows": 8})
    kept = json.loads((tmp_path / "run_config.json").read_text())
    assert "packed_min_rows" not in kept and kept["kernel_paths"] == timed["kernel_paths"]
