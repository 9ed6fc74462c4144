"""``python -m space.train --config configs/train/smollm2_frozen_base_cpu.yaml [--key value ...]``"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..cli import console


def main(argv: list[str] | None = None) -> Path | None:
    """Parse and check the arguments, then train; returns the artifact directory (main process).

    A torchrun worker that returns from :func:`~space.train.run.run_sft` (trained and saved, or
    found the run already finished) exits 0 in :func:`_exit_if_torchrun_worker` instead.

    Raises:
        ValueError, FileNotFoundError: a bad config, argument, dataset or checkpoint to resume.
    """
    from ..config import parse_train_args  # here, not at the top: --help loads no model code
    from .run import run_sft

    out = run_sft(*parse_train_args(argv))
    _exit_if_torchrun_worker()
    return out


def _exit_if_torchrun_worker() -> None:
    """In a torchrun worker (``TORCHELASTIC_RUN_ID`` set and a process group initialized: the
    environment alone would also match a test run inside a job), wait for every rank (rank 0 saves
    final/ before it gets here), destroy the process group, flush, and ``os._exit(0)``; elsewhere
    return.

    Why not a normal exit: the DeepSpeed engine and its optimizer sit in reference cycles that
    live until the interpreter finalizes. There gloo's worker threads can still drop tensors, which
    takes the GIL; a finalizing Python 3.11 ends such a thread inside a C++ destructor, and the rank
    aborts ("terminate called without an active exception", SIGABRT) after a run that saved
    everything, so torchrun reports a failed run. Destroying the group first (accelerate's
    ``end_training``, before) did not prevent it: a fresh-clone CI saw it once in a ZeRO-2 CPU
    smoke. PyTorch pull request 179291 (closed unmerged) describes the same crash. Every file this
    process wrote is finished and closed by now, and Trainer's ``on_train_end`` callbacks (trackers,
    progress bars) have run, so skipping finalization loses nothing. A run in one process outside
    torchrun (tests, notebooks) keeps its group, so later in-process runs can reuse it. Error exits
    still finalize normally.
    """
    import torch.distributed as dist

    if not (os.environ.get("TORCHELASTIC_RUN_ID") and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


cli = console("space-train", main, resumes=True)

if __name__ == "__main__":
    cli()
