"""The shared error path of every console entry point (``space-eval``, ``space-train``, ...).

``console(prog, main)`` wraps a ``main(argv) -> anything`` into what a console script needs:

* success exits 0, whatever ``main`` returns (a summary dict is for Python callers, not for
  ``sys.exit``, which would print it to stderr and exit 1);
* an expected error (bad input the user can fix) prints ``prog: error: <message>`` on one line and
  exits 2, the exit code argparse uses for bad arguments;
* Ctrl-C prints one line (with how to resume, for a command that resumes) and exits 130;
* SIGTERM unwinds like an exception (``finally`` blocks and context managers run, so child
  processes such as the code executor's are ended) and exits 143;
* ``on_exit(code)``, if given, runs just before the exits 0, 2 and 130 and may end the process itself
  (``space-train``'s torchrun workers leave without the interpreter's finalization);
* any other exception keeps its traceback (a bug, to be reported);
* ``--debug`` anywhere on the command line shows the traceback of expected errors too.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml

# What "the user gave us something wrong" raises: argument and value checks, missing or
# unreadable files and folders, broken configs, a missing optional package.
EXPECTED_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                   FileExistsError, ModuleNotFoundError, yaml.YAMLError)
# and the OSErrors of a place the user chose to write: a read-only file system, a full disk or quota,
# a file-size limit (``ulimit -f``)
EXPECTED_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


DEBUG_HELP = "on an error, show the full traceback instead of one line"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not for None, a flag (store_true), or a help text that already
    says its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or isinstance(action, argparse._StoreTrueAction) or "default" in text:
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (a repeat, prompt, token or row count); argparse exits 2
    naming the flag otherwise (0 and negatives failed deep inside the benchmark scripts)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse ``type``: a comma list of integers >= 1 (``"2,4,8"``), each as :func:`positive_int`."""
    try:
        values = [positive_int(t) for t in text.split(",") if t.strip()]
    except ValueError:  # not an integer (positive_int's refusal names the value)
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= 1, got {text!r}")
    return values


def output_file(text: str) -> Path:
    """argparse ``type``: a file to write results to, checked while parsing (made nothing): a
    folder given for the file, or a path whose nearest existing folder is a file or not writable,
    failed only when the results were written, after minutes of timing. The caller makes the
    folder when it writes."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; name a file")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{path} lies under the file {existing}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{existing} is not writable, so {path} cannot be written")
    return path


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The ``dest`` names of the options ``argv`` gives (abbreviated or not), default or not: a
    second parse into a namespace whose every field is already set, where argparse fills no
    default. For refusing a flag that the other flags leave unread."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed = parser.parse_args(argv, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not unset}


def check_number(flag: str, value: float | None, minimum: float | None = None, maximum: float | None = None) -> None:
    """Raises ValueError when ``value`` is NaN, infinite or outside [minimum, maximum] (None: the
    default, not checked), naming ``flag``: NaN slips through every ``<`` check on its own."""
    if value is None:
        return
    if not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{flag} must be <= {maximum}, got {value}")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """List ``--debug`` in ``parser``'s help; :func:`console` strips it before ``main`` parses."""
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch CPU threads, checked by :func:`set_threads` (one message everywhere)."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; use 1 when anything else runs)")


def check_threads(threads: int | None) -> None:
    """Raises ValueError for ``--threads`` below 1 (None: torch's choice), before any model loads."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: torch's choice). Raises ValueError below 1."""
    if threads is None:
        return
    check_threads(threads)
    import torch  # lazy: --help stays fast

    torch.set_num_threads(threads)


def add_device_flag(parser: argparse.ArgumentParser, help: str = "torch device: cpu, cuda, cuda:N, mps or auto "
                                                                  "(CUDA when there is a GPU, else the CPU)") -> None:
    """``--device``, resolved and checked by :func:`device_flag`."""
    parser.add_argument("--device", default="cpu", help=f"{help} (default: cpu)")


def check_device(device: str) -> None:
    """Raises ValueError for a device string torch does not know, a device type other than cpu, cuda
    and mps (torch's xpu, meta, hpu: they failed inside torch after the weights moved), or one this
    machine lacks."""
    import torch  # lazy: --help stays fast

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown --device {device!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type not in ("cpu", "cuda", "mps"):  # xpu, meta, hpu, ...: torch knows them, no decoder here ran on them
        raise ValueError(f"--device {device}: not supported (the decoders run on cpu, cuda, cuda:N or mps)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is usable here (torch {torch.__version__}"
                         f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu")


def device_flag(device: str) -> str:
    """``--device`` as a run uses it: ``"auto"`` resolved (``models.resolve_device``: the GPU when
    there is one), then checked (:func:`check_device`, which raises)."""
    from .models import resolve_device  # lazy: --help stays fast

    device = resolve_device(device)
    check_device(device)
    return device


def _terminate(signum, frame) -> None:
    # an exception, not the default instant death: context managers and finally blocks run
    raise SystemExit(128 + signum)


def console(prog: str, main: Callable[[list[str] | None], object], resumes: bool = False,
            on_exit: Callable[[int], None] | None = None) -> Callable[[list[str] | None], int]:
    """Wrap ``main`` for ``[project.scripts]``; the wrapper never returns, it exits 0, 2, 130
    (Ctrl-C), 143 (SIGTERM) or raises. ``resumes``: the command picks up where it stopped, and
    Ctrl-C says so. ``on_exit(code)`` runs with the exit code 0, 2 or 130, after the message and
    with the SIGTERM handler restored, just before ``sys.exit``; it may end the process itself."""

    def entry(argv: list[str] | None = None) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in args
        args = [a for a in args if a != "--debug"]
        previous = signal.signal(signal.SIGTERM, _terminate)
        code = 0
        try:
            main(args)
        except (*EXPECTED_ERRORS, OSError) as e:
            if not isinstance(e, EXPECTED_ERRORS) and e.errno not in EXPECTED_ERRNOS:
                raise  # any other OSError is a bug to see whole
            if debug:
                traceback.print_exc()
            print(f"{prog}: error: {e}", file=sys.stderr)
            code = 2
        except KeyboardInterrupt:
            if debug:
                traceback.print_exc()
            hint = "; run the same command again to resume" if resumes else ""
            print(f"{prog}: interrupted{hint}", file=sys.stderr)
            code = 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        if on_exit is not None:
            on_exit(code)
        sys.exit(code)

    return entry
