"""``python -m space.train --config configs/train/smollm2_frozen_base_cpu.yaml [--key value ...]``"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..cli import console


def main(argv: list[str] | None = None) -> Path | None:
    """Parse and check the arguments, then train; returns the artifact directory (main process).

    Raises:
        ValueError, FileNotFoundError: a bad config, argument, dataset or checkpoint to resume.
    """
    from ..config import parse_train_args  # here, not at the top: --help loads no model code
    from .run import run_sft

    return run_sft(*parse_train_args(argv))


def leave_torchrun_worker(code: int) -> None:
    """``space-train``'s exit (``console``'s ``on_exit``, after a return, an expected error or
    Ctrl-C): in a torchrun worker (``TORCHELASTIC_RUN_ID`` set and a process group initialized:
    the environment alone would also match a test run inside a job), flush and ``os._exit(code)``;
    elsewhere return (the caller exits normally). After a run that returned (code 0: trained and
    saved, or found the run already finished), first wait for every rank (rank 0 saves final/
    before it gets here) and destroy the process group; a Ctrl-C or SIGTERM while waiting ends the
    process without ``console``'s message. After an error (2) or Ctrl-C (130), no barrier and no
    teardown: the other ranks may be anywhere, and a collective could wait for one that never comes.
    What ``console`` does not catch still finalizes normally, and can still abort as below: a bug's
    exception (e.g. a RuntimeError from a collective or out of memory), SIGTERM (143), argparse's
    exits.

    Why not a normal exit: the DeepSpeed engine and its optimizer sit in reference cycles that
    live until the interpreter finalizes. There gloo's worker threads can still drop tensors, which
    takes the GIL; a finalizing Python 3.11 ends such a thread inside a C++ destructor, and the rank
    aborts ("terminate called without an active exception", SIGABRT) after a run that saved
    everything, so torchrun reports a failed run. Destroying the group first (accelerate's
    ``end_training``, before) did not prevent it: a fresh-clone CI saw it once in a ZeRO-2 CPU
    smoke. PyTorch pull request 179291 (closed unmerged) describes the same crash. After a return,
    every file this process wrote is finished and closed, and Trainer's ``on_train_end`` callbacks
    (trackers, progress bars) have run, so skipping finalization loses nothing. After an error the
    one-line message is printed; a checkpoint whose save was cut short lacks its
    ``space_settings.json`` (written last, atomically), so a resume refuses it. A run in one
    process outside torchrun (tests, notebooks) keeps its group, so later in-process runs can reuse
    it; a command called in-process under torchrun after such a run (with its group still up)
    would end the caller's process here.
    """
    if not os.environ.get("TORCHELASTIC_RUN_ID") or "torch" not in sys.modules:  # no group without torch
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


cli = console("space-train", main, resumes=True, on_exit=leave_torchrun_worker)

if __name__ == "__main__":
    cli()
