"""Sharded evaluation: each rank runs a fixed slice of the questions, then the ranks are merged.

Ranks come from the launcher, torchrun or ``accelerate launch`` (``RANK``, ``WORLD_SIZE``: the
ranks join a gloo process group, wait for each other at a barrier, and rank 0 merges), or from
``space-eval --shard i/n`` for schedulers that start the processes themselves (no process group:
``space-eval --merge OUT`` merges once every rank has run). All ranks share one ``--out`` folder.

Rank i of n takes questions i, i+n, i+2n, ... of the dataset (a stride, not a block, so categories
stored together spread over the ranks), writes ``samples.rank{i}.jsonl`` and
``run_config.rank{i}.json`` and resumes from them. The merge orders the records as one process
writes them (question order, then method order), so the merged ``samples.jsonl``, exactness and
pass@k do not depend on n. All methods of a question run in one process, so a per-question
speedup never compares two GPUs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..jsonl import read_jsonl_resumable
from .resume import read_record

# ranks finish at different times; torchrun ends every rank when one fails, so a long wait at the
# barrier never waits on a dead rank
BARRIER_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class Shard:
    """One rank's part of a sharded evaluation.

    Attributes:
        rank: this process's rank, 0..world_size-1.
        world_size: number of ranks (n).
        launched: started by torchrun / accelerate launch (a process group joins the ranks),
            not by ``--shard``.
    """

    rank: int
    world_size: int
    launched: bool = False

    @property
    def samples(self) -> str:
        return f"samples.rank{self.rank}.jsonl"

    @property
    def config(self) -> str:
        return f"run_config.rank{self.rank}.json"

    def select(self, tasks: list) -> list:
        """This rank's questions: ``tasks[rank::world_size]``, in dataset order."""
        return tasks[self.rank::self.world_size]

    def device(self, device: str) -> str:
        """Under torchrun, a bare ``cuda`` means this node's GPU ``LOCAL_RANK``; else ``device``."""
        return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if self.launched and device == "cuda" else device


def parse_shard(spec: str) -> Shard:
    """``--shard i/n`` -> Shard(i, n).

    Raises:
        ValueError: not two integers ``i/n`` with 0 <= i < n.
    """
    try:
        rank, world = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected i/n (rank i of n processes, 0 <= i < n), e.g. 0/8") from None
    if not 0 <= rank < world:
        raise ValueError(f"--shard {spec}: rank {rank} is not in 0..{world - 1} (i/n needs 0 <= i < n)")
    return Shard(rank, world)


def current_shard(spec: str | None) -> Shard | None:
    """This process's shard: ``--shard``, else the launcher's ``RANK``/``WORLD_SIZE`` when it
    started more than one process, else None (a single process writes samples.jsonl itself).

    Raises:
        ValueError: a bad ``--shard``, or ``--shard`` under a launcher that already assigns ranks.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec is not None and world > 1:
        raise ValueError(f"--shard {spec} under torchrun/accelerate (WORLD_SIZE={world}): the launcher assigns "
                         "the ranks; drop --shard")
    if spec is not None:
        return parse_shard(spec)
    return Shard(int(os.environ["RANK"]), world, launched=True) if world > 1 else None


def join(shard: Shard) -> None:
    """Join the launcher's process group (gloo: a CPU barrier, whatever device the ranks use)."""
    import torch.distributed as dist

    if shard.launched and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)


def wait_for_all(shard: Shard) -> None:
    """Under a launcher, block until every rank has finished its slice, then leave the group."""
    import torch.distributed as dist

    if shard.launched:
        dist.barrier()
        dist.destroy_process_group()


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
    n = read_record(first)["shard"]["world_size"]
    metas = []
    for rank in range(n):
        path = out / Shard(rank, n).config
        if not path.is_file():
            raise ValueError(f"rank {rank} of {n} has not run in {out} (no {path.name}); "
                             f"run it with --shard {rank}/{n}")
        metas.append(read_record(path))
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
        rows = {(r["question_id"], r["model_id"]): r for r in read_jsonl_resumable(out / Shard(rank, n).samples)}
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
    return records + _beyond_ranks(out, records, meta, keys), meta


def _beyond_ranks(out: Path, records: list[dict], meta: dict, keys: tuple[str, ...]) -> list[dict]:
    """The records of ``out/samples.jsonl`` that no rank wrote, checked against ``run_config.json``
    (which says how they were made); widens ``meta``'s question count to cover them."""
    ours = {(r["question_id"], r["model_id"]) for r in records}
    extra = [r for r in read_jsonl_resumable(out / "samples.jsonl") if (r["question_id"], r["model_id"]) not in ours]
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
