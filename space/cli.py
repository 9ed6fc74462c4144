"""The shared error path of every console entry point (``space-eval``, ``space-train``, ...).

``console(prog, main)`` wraps a ``main(argv) -> anything`` into what a console script needs:

* success exits 0, whatever ``main`` returns (a summary dict is for Python callers, not for
  ``sys.exit``, which would print it to stderr and exit 1);
* an expected error (bad input the user can fix) prints ``prog: error: <message>`` on one line and
  exits 2, the exit code argparse uses for bad arguments;
* any other exception keeps its traceback (a bug, to be reported);
* ``--debug`` anywhere on the command line shows the traceback of expected errors too.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

import yaml

# What "the user gave us something wrong" raises: argument and value checks, missing or
# unreadable files and folders, broken configs, a missing optional package.
EXPECTED_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                   FileExistsError, ModuleNotFoundError, yaml.YAMLError)


DEBUG_HELP = "on an error, show the full traceback instead of one line"


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """List ``--debug`` in ``parser``'s help; :func:`console` strips it before ``main`` parses."""
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch CPU threads, checked by :func:`set_threads` (one message everywhere)."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; use 1 when anything else runs)")


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: torch's choice). Raises ValueError below 1."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch  # lazy: --help stays fast

    torch.set_num_threads(threads)


def add_device_flag(parser: argparse.ArgumentParser, help: str = "torch device: cpu, cuda, cuda:N or mps") -> None:
    """``--device``, checked by :func:`check_device`."""
    parser.add_argument("--device", default="cpu", help=f"{help} (default: cpu)")


def check_device(device: str) -> None:
    """Raises ValueError for a device string torch does not know, or one this machine lacks."""
    import torch  # lazy: --help stays fast

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown --device {device!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is usable here (torch {torch.__version__}"
                         f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu")


def console(prog: str, main: Callable[[list[str] | None], object]) -> Callable[[list[str] | None], int]:
    """Wrap ``main`` for ``[project.scripts]``; the wrapper never returns, it exits 0, 2 or raises."""

    def entry(argv: list[str] | None = None) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in args
        args = [a for a in args if a != "--debug"]
        try:
            main(args)
        except EXPECTED_ERRORS as e:
            if debug:
                traceback.print_exc()
            print(f"{prog}: error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)

    return entry
