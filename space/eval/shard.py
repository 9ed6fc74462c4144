"""Sharded evaluation: each rank runs a fixed slice of the questions, then the ranks are merged.

Ranks come from the launcher, torchrun or ``accelerate launch`` (``RANK``, ``WORLD_SIZE``: the
ranks join a gloo process group, wait for each other at a barrier, and rank 0 merges), or from
``space-eval --shard i/n`` for schedulers that start the processes themselves (no process group:
``space-eval --merge OUT`` merges once every rank has run). All ranks share one ``--out`` folder.

Rank i of n takes questions i, i+n, i+2n, ... of the dataset (a stride, not a block, so categories
stored together spread over the ranks), writes ``samples.rank{i}.jsonl`` and
``run_config.rank{i}.json`` and resumes from them. The merge (``space.eval.resume.merge_run``)
orders the records as one process writes them (question order, then method order), so the merged
``samples.jsonl``, exactness and pass@k do not depend on n. All methods of a question run in one
process, so a per-question speedup never compares two GPUs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

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
    if world < 1:  # "rank 0 is not in 0..-1" named no fault
        raise ValueError(f"--shard {spec}: n must be a process count >= 1 (i/n: rank i of n processes)")
    if not 0 <= rank < world:
        raise ValueError(f"--shard {spec}: rank {rank} is not in 0..{world - 1} (i/n needs 0 <= i < n)")
    return Shard(rank, world)


def current_shard(spec: str | None) -> Shard | None:
    """This process's shard: ``--shard``, else the launcher's ``RANK``/``WORLD_SIZE`` when it
    started more than one process, else None (a single process writes samples.jsonl itself).

    Raises:
        ValueError: a bad ``--shard``, ``--shard`` under a launcher that already assigns ranks, or a
            launcher environment that is not one (WORLD_SIZE or RANK not an integer, RANK missing
            or outside 0..WORLD_SIZE-1).
    """
    env = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK")
    if not env[0].isdigit() or int(env[0]) < 1:
        raise ValueError(f"WORLD_SIZE={env[0]!r} in the environment: not a process count")
    world = int(env[0])
    if spec is not None and world > 1:
        raise ValueError(f"--shard {spec} under torchrun/accelerate (WORLD_SIZE={world}): the launcher assigns "
                         "the ranks; drop --shard")
    if spec is not None:
        return parse_shard(spec)
    if world == 1:
        return None
    if env[1] is None or not env[1].isdigit() or int(env[1]) >= world:  # a hand-set or half-set environment
        raise ValueError(f"WORLD_SIZE={world} with RANK={env[1]!r}: a launched process needs a RANK in "
                         f"0..{world - 1}; start the ranks with torchrun, or pass --shard I/N")
    return Shard(int(env[1]), world, launched=True)


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
