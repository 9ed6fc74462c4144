"""Append-only JSONL files that survive interruption: a torn last line is dropped on reread.

Lines end at ``"\\n"`` only. ``json.dumps(..., ensure_ascii=False)`` writes U+2028, U+2029 and
U+0085 raw inside strings, and ``str.splitlines`` would split a record there, so nothing here uses it.
"""
from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def read_jsonl_resumable(path: Path, repair: bool = True) -> list[dict]:
    """Complete rows of ``path`` ([] when missing); rewrites the file without a torn last line.

    Only the last line may be torn (an interrupted append: no ``"\n"`` after it); it is dropped, and with ``repair`` the
    file rewritten without it, atomically (:func:`write_text_atomic`: a run stopped during the
    rewrite leaves every complete row), so the next append starts on a fresh line. ``repair=False``
    reads a file that another process may be appending to, and leaves it as it is.

    Raises:
        ValueError: a line other than a last one without its newline is not valid JSON or not
            UTF-8 (file and line named): the file was damaged some other way, or is not this
            program's, and dropping that line would lose a record.
    """
    if not path.is_file():
        return []
    raw = path.read_bytes()
    # split the bytes, not decoded text: an append cut inside a multi-byte character tears only
    # the last line, which must then be dropped, not make the whole file undecodable
    lines = raw.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows, good = [], []
    for i, line in enumerate(lines):
        if not line.strip():  # blank lines, and the b"" after the final newline
            continue
        try:
            rows.append(json.loads(line.decode("utf-8")))
            good.append(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            # an interrupted append is a prefix of rows that each end in "\n": its torn line is the last
            # and has none. Anything else (a user's file of other text named by mistake) is not ours to drop
            if i < last or i < len(lines) - 1:
                why = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
                raise ValueError(f"{path}: line {i + 1} is not valid JSON ({why}); fix or delete the file") from None
            # else: the torn last line of an interrupted write, dropped
    good = b"".join(line + b"\n" for line in good)
    if repair and good != raw:
        _replace(path, good)
    return rows


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append rows in one write and flush, so a unit of work lands whole or (torn) not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` as the whole file, atomically (a temporary file renamed over ``path``), so an
    interrupted run leaves the old file or the new one, never half of one. Creates the folder."""
    _replace(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """:func:`write_text_atomic` for bytes."""
    _replace(path, data)


def save_figure_atomic(fig, path: Path, dpi: int = 110) -> None:
    """A matplotlib figure saved as a PNG, atomically (:func:`write_text_atomic`'s way): a full
    disk left a 0-byte plot under the real name."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    _replace(path, buf.getvalue())


def publish_permissions(root: Path) -> None:
    """Give ``root`` (a folder from ``tempfile.mkdtemp``, made 0700 for its owner alone) and
    everything under it the permissions the process's umask gives new files, before it is renamed
    into place: a shared cache or artifact stays readable by the others who use it."""
    umask = os.umask(0)
    os.umask(umask)  # the only way to read it
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def publish_folder(tmp: Path, out: Path) -> None:
    """Put folder ``tmp`` (from ``tempfile.mkdtemp`` beside ``out``) in place as ``out``, with
    :func:`publish_permissions`. A folder already at ``out`` is renamed aside first and deleted
    after: a run stopped between the two renames leaves it whole as ``.old-<name>-*/`` beside
    ``out`` (a rename cannot replace a folder that holds files)."""
    publish_permissions(tmp)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
        os.replace(out, old)  # over the empty folder mkdtemp made
    os.replace(tmp, out)
    if old is not None:  # the new one is in place: an old file this user may not delete stays in .old-*/
        shutil.rmtree(old, ignore_errors=True)


def _replace(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``: written to a temporary file beside it, synced to the disk
    (or a power cut after the rename could leave an empty file under the new name), then renamed
    over ``path``; on failure the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:  # a full disk or a Ctrl-C: the old file stays, and no partial copy beside it
        tmp.unlink(missing_ok=True)
        raise


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as the whole file, atomically (:func:`write_text_atomic`); gzip-compressed
    when ``path`` ends in ``.gz`` (no timestamp in the header, so equal rows give equal bytes)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    data = text.encode("utf-8")
    _replace(path, gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file, plain or ``.gz`` ([] when missing), as :func:`write_jsonl` writes them.

    Raises:
        ValueError: a line is not valid JSON, the bytes are not UTF-8, or a ``.gz`` file is damaged
            (file and line named).
    """
    if not path.is_file():
        return []
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: damaged file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    return rows


@contextmanager
def held(path: Path, what: str, remedy: str) -> Iterator[None]:
    """Hold ``path`` for one process for the block: a second process that would write it is
    refused, so two runs never both write one set of files (space-eval's samples, space-distill's
    output, space-train's output_dir).

    The hold is an exclusive ``flock`` on ``.<path name>.lock`` beside ``path`` (inside it, for a
    folder), which holds this process's id; the kernel releases it when the process ends, a crash
    or ``kill -9`` included.

    Raises:
        ValueError: another process holds ``path``: "{what} is being written by another run (pid
            N); {remedy}".
    """
    lock_path = path / ".lock" if path.is_dir() else path.parent / f".{path.name}.lock"
    with open(lock_path, "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise ValueError(f"{what} is being written by another run (pid {lock.read().strip() or '?'}); "
                             f"{remedy}") from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield
