"""``python -m space.train --config configs/train/smollm2_frozen_base_cpu.yaml [--key value ...]``"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..cli import console


def main(argv: list[str] | None = None) -> Path | None:
    """Parse and check the arguments, then train; returns the artifact directory (main process).

    A process of a multi-process run (torchrun, ``WORLD_SIZE`` > 1) that trained and saved leaves
    here: every rank waits for rank 0's save, leaves the process group, and exits 0 at once
    (:func:`_leave_group_and_exit`).

    Raises:
        ValueError, FileNotFoundError: a bad config, argument, dataset or checkpoint to resume.
    """
    from ..config import parse_train_args  # here, not at the top: --help loads no model code
    from .run import run_sft

    out = run_sft(*parse_train_args(argv))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _leave_group_and_exit()
    return out


def _leave_group_and_exit() -> None:
    """Wait for every rank, destroy the process group, flush, and ``os._exit(0)``.

    Why not a normal exit: the DeepSpeed engine and its optimizer sit in reference cycles that
    live until the interpreter finalizes. There gloo's worker threads can still drop tensors, which
    takes the GIL; a finalizing Python 3.11 ends such a thread inside a C++ destructor, and the rank
    aborts ("terminate called without an active exception", SIGABRT) after a run that saved
    everything, so torchrun reports a failed run (seen once in a CPU smoke of ZeRO-2 under CI;
    PyTorch pull request 179291 describes the same crash). Everything this process wrote is
    already on disk (checkpoints and final/ are written atomically) and Trainer's ``on_train_end``
    callbacks have run, so skipping finalization loses nothing. A single process keeps its group,
    so later in-process runs (tests, notebooks) can reuse it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


cli = console("space-train", main, resumes=True)

if __name__ == "__main__":
    cli()
