"""Resuming an evaluation folder: which settings a folder's samples were made with, and the
refusal to mix in samples made otherwise (other settings, or another timing setup).

Every run records its settings in ``run_config.json`` (a rank of a sharded run in
``run_config.rank{i}.json``); a rerun in the same ``--out`` resumes only when the RESUME_KEYS
entries are equal, so one samples file never mixes two setups' outputs or timings. The ranks
of a sharded run (``space.eval.shard``) are merged into one folder by :func:`merge_run`
(``space-eval --merge``, or rank 0 under a launcher).

One run writes a samples file at a time (:func:`hold_samples`), and a resume drops records that
an earlier run wrote twice (:func:`check_resume`).
"""
from __future__ import annotations

import hashlib
import json
import re
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ..jsonl import held, write_jsonl, write_text_atomic
from .bench import read_samples
from .shard import Shard

# settings that shape every sample's tokens: a folder's samples are only resumed under the same
# values. The adapter by the hash of its files, not its path: a retrained adapter in the same
# folder makes other tokens, and a moved one the same; a model folder by its files' fingerprint.
SAMPLE_KEYS = ("model", "model_files", "adapter_sha256", "dataset", "methods", "num_samples", "mask_num", "num_groups",
               "lookup_tokens", "lookup_ngram", "baselines_suppress_masks", "tree", "row_budget", "draft_ranks", "lookup_branches", "datastore_sha256", "datastore_branches", "step_cost", "adapter_cost", "max_new_tokens", "temperature",
               "top_p", "top_k", "seed", "turn_seeds", "dtype", "kernels")
# what shapes the timings: a speedup over samples timed on two setups compares nothing. The ranks of
# one sharded run differ in device (each its GPU) and may differ in machine; the merge allows that,
# since every question's methods run in one process. The trunk (fused groups, attention, one-kernel
# norms: space.decoding.fused) and the attention backend (space.decoding.backends) change a GPU
# step's launches, and its norms' rounding, with the code rather than with a flag.
SETUP_KEYS = ("threads", "device", "device_map", "machine", "torch", "transformers", "compile", "buckets", "capture",
              "slot_buckets", "trunk", "sdpa")
RESUME_KEYS = SAMPLE_KEYS + SETUP_KEYS
# the resume keys the command line gives as they are recorded (check_flags_resume: checked before the model loads)
FLAG_KEYS = ("dataset", "methods", "num_samples", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "dtype")
MERGE_KEYS = tuple(k for k in RESUME_KEYS if k not in ("device", "machine"))
# the fast kernels' timed choices a record holds (``__main__.recorded_paths`` pins them on a resume): a record
# naming several machines keeps them only where those machines chose alike
TIMED_CHOICES = ("packed_min_rows", "kernel_paths")
# what older run_config.json files lack, as those runs had it: chain, no lookup (an adapter's hash
# is not known: such a folder resumes only without an adapter)
OLD_DEFAULTS = {"model_files": None, "lookup_tokens": 0, "lookup_ngram": 2, "baselines_suppress_masks": False, "tree": None, "adapter_sha256": None, "row_budget": None, "draft_ranks": None,
                "lookup_branches": 1, "datastore_sha256": None, "datastore_branches": 0,
                "step_cost": None, "adapter_cost": None, "compile": False, "buckets": False, "capture": None,
                "slot_buckets": None, "trunk": None, "sdpa": None, "turn_seeds": None}


def model_files(model: str, layout: bool = True) -> str | None:
    """A fingerprint (SHA-256 hex) of a model folder's files, so samples of a model retrained or
    overwritten in place (a full-mode ``final/`` evaluated with ``--model``) are not resumed as
    the old one's; None for a name that is not a folder (the embedded SmolLM2, the tiny model).

    Files up to 16 MB (configs, tokenizer) count by their bytes; larger ones (weights) by name,
    size and modification time, which a rewrite changes and which costs no read of gigabytes.
    ``layout=False`` leaves a full SAR-SFT checkpoint's tuned layout out of its space_config.json
    (:func:`_drafts_only`, as :func:`adapter_sha256` does): which model a ranks file measured
    (``space-probe``), the same after ``space-tree --write-adapter`` stored a layout in it. A
    resume counts the file as it is (the fingerprint of runs before the layout could be stored).
    """
    root = Path(model).expanduser()
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        small = stat.st_size <= 16 << 20
        digest.update(f"{stat.st_size} {stat.st_mtime_ns}".encode() if not small
                      else path.read_bytes() if layout else _drafts_only(path, root))
    return digest.hexdigest()


def adapter_sha256(adapter: str | Path | None) -> str | None:
    """SHA-256 (hex) of an adapter folder's files, which drafter a record or a ranks file speaks of;
    None for no adapter.

    Every file counts by its relative name and bytes, in name order, except the README and the
    tuned layout in space_config.json (:func:`_drafts_only`).

    Raises:
        FileNotFoundError: ``adapter`` is not a folder.
    """
    if adapter is None:
        return None
    root = Path(adapter)
    if not root.is_dir():
        raise FileNotFoundError(f"--adapter {adapter}: no such folder")
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "README.md"):
        data = _drafts_only(path, root)
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _drafts_only(path: Path, root: Path) -> bytes:
    """The bytes of artifact file ``path`` under ``root`` that fingerprint it: a space_config.json
    without its tuned ``"decode"`` entry and step-cost curves (``"step_cost_setup"``,
    ``"step_costs"``), which ``space-tree --write-adapter`` rewrites without changing the model or
    its drafts (an evaluation records its layout and curve separately); any other file whole."""
    data = path.read_bytes()
    if path.relative_to(root).as_posix() != "space_config.json":
        return data
    try:
        config = json.loads(data)
        config.pop("decode", None)
        config.pop("step_cost_setup", None)  # how the tuned layout's curve was measured
        config.pop("step_costs", None)  # the curves measured per threads and kernels
        return json.dumps(config, sort_keys=True).encode()
    except (ValueError, AttributeError):  # not a JSON object: its bytes count as they are
        return data


def read_record(path: Path) -> dict:
    """A run_config / summary JSON file. Raises ValueError (file named) when it is not UTF-8 JSON or
    not a JSON object."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged run record ({e}); fix or delete it") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: damaged run record (a JSON {type(record).__name__}, not an object); fix or delete it")
    return record


def _shard_of(meta: dict, path: Path) -> dict:
    """A rank's ``shard`` entry (rank, world_size, questions) from its record ``path``; ValueError
    naming the file when it has none of that shape."""
    shard = meta.get("shard")
    if not (isinstance(shard, dict) and isinstance(shard.get("world_size"), int) and shard["world_size"] >= 1
            and isinstance(shard.get("questions"), list)):
        raise ValueError(f"{path}: not a rank's record (no shard entry with world_size and questions); fix or delete it")
    return shard


def hold_samples(samples: Path) -> AbstractContextManager[None]:
    """Hold ``samples`` (a run's samples file) while a run writes it (``space.jsonl.held``): a
    second run into the same ``--out`` is refused, so two runs never both append every record. The
    ranks of a sharded run write files of their own and run side by side.

    Raises:
        ValueError: another process holds ``samples`` (its process id named).
    """
    return held(samples, str(samples), "wait for it to end, or use another --out")


def check_resume(out: Path, meta: dict, shard: Shard | None = None) -> None:
    """Record the run's settings in ``out/run_config.json``; refuse to mix in samples made otherwise;
    drop the records its samples file holds twice (the first of each (question, method) is kept).

    A rank of a sharded run records them in its own ``run_config.rank{i}.json`` (``meta`` then
    holds its ``shard`` entry) and is checked against its own samples and the merged ones.
    ``meta["commits"]`` becomes the list of every code commit that wrote samples in the file
    resumed (the recorded list, plus the current commit when it is new). A plain run resuming a
    merged one keeps its ``ranks`` and adds its device and machine to theirs, so the record still
    names every device and machine its samples came from and resumes on each of them.

    Raises:
        ValueError: ``out`` holds samples but no record of their settings (run_config.json, or the
            meta of an older summary.json), or settings that differ from ``meta`` in a RESUME_KEYS
            entry (each named, with both values).
    """
    commits, old = _recorded_commits(out, meta, "samples.jsonl", ("run_config.json", "summary.json"))
    if shard is not None:
        commits = _recorded_commits(out, meta, shard.samples, (shard.config,))[0]
    elif old and old.get("ranks", 1) > 1:  # resuming a merged run: its samples came from every rank
        meta["ranks"] = old["ranks"]
        for key in ("device", "machine"):
            meta[key] = "; ".join(dict.fromkeys([*str(old[key]).split("; "), str(meta[key])]))
        for key in TIMED_CHOICES:  # one machine's, pinned by a later resume on any of the record's machines
            if meta.get(key) != old.get(key):
                meta.pop(key, None)
    meta["commits"] = commits + [c for c in meta["commits"] if c not in commits]
    name = shard.config if shard is not None else "run_config.json"
    write_text_atomic(out / name, json.dumps(meta, indent=2))
    _drop_duplicates(out / (shard.samples if shard is not None else "samples.jsonl"))


def _drop_duplicates(samples: Path) -> None:
    """Rewrite ``samples`` with the first record of each (question, method) only, saying how many
    went (two runs that wrote one folder at once, before runs held their samples file)."""
    if not samples.is_file():
        return
    rows, first = read_samples(samples), {}
    for row in rows:
        first.setdefault((row["question_id"], row["model_id"]), row)
    kept = list(first.values())
    if len(kept) < len(rows):
        write_jsonl(samples, kept)
        print(f"[space-eval] {samples}: dropped {len(rows) - len(kept)} duplicate (question, method) records, "
              "kept the first of each", flush=True)


def _recorded_commits(out: Path, meta: dict, samples: str, records: tuple[str, ...]) -> tuple[list[str], dict | None]:
    """The commits that wrote ``out/samples`` ([] when there is none) and the record read (None
    then), once its recorded settings (the first of ``records`` present) are found equal to
    ``meta``'s. Raises as check_resume."""
    found = _record_of(out, samples, records)
    if found is None:
        return [], None
    recorded, old = found
    # a merged record names every rank's device and machine ("cuda:0; cuda:1"), which no single run
    # repeats: a run resuming it must be on one of those machines, on a device of their type
    merged = old.get("ranks", 1) > 1
    keys = MERGE_KEYS if merged else RESUME_KEYS
    diff = _differing(old, meta, [k for k in keys if k != "machine"])
    machines = str(old.get("machine")).split("; ") if merged else [old.get("machine")]
    if not any(same_machine(m, meta["machine"]) for m in machines):
        diff["machine"] = (old.get("machine"), meta["machine"])
    if merged:
        devices = str(old.get("device")).split("; ")
        if str(meta["device"]).split(":")[0] not in {d.split(":")[0] for d in devices}:
            diff["device"] = (old.get("device"), meta["device"])
    _refuse(out, recorded, diff)
    return old.get("commits") or ([old["commit"]] if old.get("commit") else []), old  # older runs kept one


def check_flags_resume(out: Path, flags: dict, shard: Shard | None = None) -> None:
    """The resume check of the settings the command line alone gives (``flags``, FLAG_KEYS),
    made before the model loads: :func:`check_resume` made it only after loading, capturing and
    timing (minutes for a 7B model). A damaged record is refused here too. The other keys are
    :func:`check_resume`'s, which repeats these.

    Raises:
        ValueError: as :func:`check_resume`, for these keys.
    """
    for samples, records in (("samples.jsonl", ("run_config.json", "summary.json")),
                             *([(shard.samples, (shard.config,))] if shard is not None else [])):
        found = _record_of(out, samples, records)
        if found is not None:
            _refuse(out, found[0], _differing(found[1], flags, list(flags)))


def _record_of(out: Path, samples: str, records: tuple[str, ...]) -> tuple[Path, dict] | None:
    """(the record's path, its settings with OLD_DEFAULTS filled in) of ``out/samples``; None when
    there are no samples. Raises ValueError for samples without a record, or a damaged record."""
    if not (out / samples).is_file():
        return None
    recorded = next((out / name for name in records if (out / name).is_file()), None)
    if recorded is None:
        raise ValueError(f"{out} holds {samples} but no {records[0]} saying how they were made; "
                         "use another --out, or delete the folder to start over")
    old = read_record(recorded)
    old = {**OLD_DEFAULTS, **old.get("meta", old)}
    if isinstance(old["trunk"], dict):  # recorded before the norm swap (5d4b329), which swapped none
        old["trunk"] = {"rms_norms": 0, **old["trunk"]}
    return recorded, old


def _differing(old: dict, meta: dict, keys: list[str]) -> dict:
    """{key: (recorded, now)} for each of ``keys`` whose value differs. A --dataset file counts by
    the file it names: ``q.jsonl`` and ``../w/q.jsonl`` are one dataset (its questions' fingerprints
    catch a changed file, ``bench.run_bench``)."""
    def same(key, a, b):
        if key == "dataset" and isinstance(a, str) and isinstance(b, str) and Path(a).is_file() and Path(b).is_file():
            return Path(a).resolve() == Path(b).resolve()
        return a == b

    return {k: (old.get(k), meta[k]) for k in keys if not same(k, old.get(k), meta[k])}


def _refuse(out: Path, recorded: Path, diff: dict) -> None:
    if diff:
        raise ValueError(f"{out} holds samples made with other settings ({recorded.name}); "
                         f"(theirs, now): {diff}. Use another --out, or delete it to start over")


def same_machine(recorded, now: str) -> bool:
    """Whether a run's recorded machine (``space.eval.__main__.machine``) is this one. A record made
    before it named the CPU's vector ISA ("x86_64 2 cores, AMD EPYC", which an AVX2 and a Zen 4 EPYC
    share) matches on the rest of the name."""
    if recorded == now:
        return True
    return isinstance(recorded, str) and not _ISA.search(recorded) and recorded == _ISA.sub("", now)


_ISA = re.compile(r" \((?:DEFAULT|[A-Z]+[0-9]*(?:_[A-Z0-9]+)*)\)(?=,|$)")  # "(AVX512)": get_cpu_capability()'s names


def merge_run(out: Path) -> dict:
    """Merge the finished ranks of a sharded run in ``out`` (space/eval/shard.py): writes
    samples.jsonl (ordered as one process writes it), run_config.json, summary.* and plots.

    Returns:
        the summary; its ``meta["ranks"]`` says how many ranks ran.

    Records that ``samples.jsonl`` already holds beyond the ranks' (a plain run resumed in ``out``
    after an earlier merge added questions) are kept, after the ranks' ones.

    Raises:
        FileNotFoundError: no sharded run in ``out``.
        ValueError: a rank that has not run or not finished, ranks with different settings,
            records in samples.jsonl made with settings other than the ranks', or another run
            writing samples.jsonl (:func:`hold_samples`); after writing, every question skipped
            (:func:`report`).
    """
    # held: a plain run appending to samples.jsonl between the merge's read and its rewrite would
    # lose its records (no folder: merge raises that there is no run to merge)
    with hold_samples(out / "samples.jsonl") if out.is_dir() else nullcontext():
        records, meta = merge(out, MERGE_KEYS)
        write_jsonl(out / "samples.jsonl", records)
        write_text_atomic(out / "run_config.json", json.dumps(meta, indent=2))
    return report(records, meta, out)


def merge(out: Path, keys: tuple[str, ...]) -> tuple[list[dict], dict]:
    """Every rank's records in ``out``, ordered as one process writes them, and the run's meta.

    Args:
        out: the folder the ranks wrote (``run_config.rank{i}.json``, ``samples.rank{i}.jsonl``).
        keys: the settings every rank must share (the resume keys, plus dataset size and n).

    Returns:
        (records, meta): records of the current questions and methods only, sorted by question
        (dataset order) then method (``--methods`` order), then the records an earlier
        ``samples.jsonl`` holds beyond them (a plain run resumed in ``out`` after a merge added
        questions: kept, in their order); meta is rank 0's without its shard entry, plus ``ranks``
        (n), every rank's commits, each distinct device and machine, and the larger question count.

    Raises:
        FileNotFoundError: ``out`` holds no rank 0 record (``run_config.rank0.json``).
        ValueError: a rank of the run has not started or not finished, ranks differ in a setting
            of ``keys`` (named, with each rank's value), or ``samples.jsonl`` holds other records
            made with settings other than the ranks' (``run_config.json``).
    """
    first = out / "run_config.rank0.json"
    if not first.is_file():
        raise FileNotFoundError(f"{out} holds no run_config.rank0.json: no sharded run to merge there")
    n = _shard_of(read_record(first), first)["world_size"]
    metas = []
    for rank in range(n):
        path = out / Shard(rank, n).config
        if not path.is_file():
            raise ValueError(f"rank {rank} of {n} has not run in {out} (no {path.name}); "
                             f"run it with --shard {rank}/{n}")
        metas.append(read_record(path))
        _shard_of(metas[-1], path)
    for key in (*keys, "num_questions", "shard.world_size"):
        values = [m["shard"]["world_size"] if key == "shard.world_size" else m.get(key) for m in metas]
        if any(v != values[0] for v in values):
            raise ValueError(f"the ranks in {out} ran with different settings, cannot merge: {key} = "
                             + ", ".join(f"{v!r} (rank {r})" for r, v in enumerate(values)))
    methods = metas[0]["methods"]
    position, records = {}, []
    for rank, meta in enumerate(metas):
        questions = meta["shard"]["questions"]
        position.update({q: j * n + rank for j, q in enumerate(questions)})
        # read only: the rank may still be appending to its file (a torn last line is its to repair).
        # The first record of a (question, method), as a resume keeps (_drop_duplicates)
        rows = {}
        for r in read_samples(out / Shard(rank, n).samples, repair=False):
            rows.setdefault((r["question_id"], r["model_id"]), r)
        missing = [(q, m) for q in questions for m in methods if (q, m) not in rows]
        if missing:
            raise ValueError(f"rank {rank} of {n} has not finished: {len(missing)} of {len(questions) * len(methods)} "
                             f"(question, method) records missing in {Shard(rank, n).samples}; rerun it (it resumes)")
        records += [rows[q, m] for q in questions for m in methods]
    records.sort(key=lambda r: (position[r["question_id"]], methods.index(r["model_id"])))
    meta = {k: v for k, v in metas[0].items() if k != "shard"}
    meta["ranks"] = n
    meta["commits"] = list(dict.fromkeys(c for m in metas for c in m.get("commits", [])))
    for key in ("device", "machine"):
        meta[key] = "; ".join(dict.fromkeys(str(m.get(key)) for m in metas))
    # each rank's packed CPU kernel, timed on its machine (None: none packed on any)
    meta["packed_kernel"] = "; ".join(dict.fromkeys(m["packed_kernel"] for m in metas if m.get("packed_kernel"))) or None
    # rank 0's alone would pin another machine's on a resume there
    for key in TIMED_CHOICES:
        if any(m.get(key) != metas[0].get(key) for m in metas):
            meta.pop(key, None)
    return records + _beyond_ranks(out, records, meta, keys), meta


def _beyond_ranks(out: Path, records: list[dict], meta: dict, keys: tuple[str, ...]) -> list[dict]:
    """The records of ``out/samples.jsonl`` that no rank wrote, checked against ``run_config.json``
    (which says how they were made); widens ``meta``'s question count to cover them."""
    ours = {(r["question_id"], r["model_id"]) for r in records}
    extra = [r for r in read_samples(out / "samples.jsonl") if (r["question_id"], r["model_id"]) not in ours]
    if not extra:
        return []
    recorded = read_record(out / "run_config.json") if (out / "run_config.json").is_file() else {}
    diff = {k: (recorded.get(k), meta.get(k)) for k in keys if recorded.get(k) != meta.get(k)}
    if diff:
        raise ValueError(f"{out}/samples.jsonl holds {len(extra)} records the ranks did not write, made with other "
                         f"settings (run_config.json, ranks): {diff}; move them away to merge")
    if recorded.get("num_questions", 0) > meta.get("num_questions", 0):
        meta["num_questions"], meta["limit"] = recorded["num_questions"], recorded.get("limit")
    return extra


def report(records: list[dict], meta: dict, out: Path) -> dict:
    """Write and print the summary of ``records``; returns it.

    Raises:
        ValueError: after writing, when every question was skipped (its prompt + ``max_new_tokens``
            past the context, ``bench.context_overflow``): the report measured nothing, and a run
            that exits 0 on it reads as a result.
    """
    from .report import write_reports

    summary = write_reports(records, meta, out)
    print((out / "summary.md").read_text())
    print(f"[space-eval] wrote {out}/samples.jsonl, summary.json, summary.md and plots")
    questions = {r["question_id"] for r in records}
    if questions and questions == {r["question_id"] for r in records if "skipped" in r}:
        raise ValueError(f"all {len(questions)} question(s) were skipped, so no method was measured: each prompt + "
                         f"--max-new-tokens {meta.get('max_new_tokens')} outgrew the context or the captured cache "
                         f"({out}/summary.md says which for each); lower --max-new-tokens")
    return summary
