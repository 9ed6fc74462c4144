"""space.jsonl: appends keep what was written before, whole-file writes are atomic and
reproducible, and a damaged file is a ValueError naming it (the resume machinery's ground)."""
import gzip
import os

import pytest

from space.jsonl import append_jsonl, read_jsonl, read_jsonl_resumable, write_jsonl, write_text_atomic


def test_appends_keep_the_rows_already_written(tmp_path):
    """Catches an append that truncates the file (opened "w"): a resumed run would lose every
    record of the runs before it."""
    path = tmp_path / "sub" / "rows.jsonl"
    append_jsonl(path, [{"a": 1}, {"a": 2}])
    append_jsonl(path, [{"a": 3}])
    assert read_jsonl_resumable(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path):
    """The resume sequence: reread drops the torn last line, the next append lands whole."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2')
    assert read_jsonl_resumable(path) == [{"a": 1}]
    append_jsonl(path, [{"a": 2}])
    assert read_jsonl_resumable(path) == [{"a": 1}, {"a": 2}]


def test_an_append_torn_inside_a_multibyte_character_is_dropped(tmp_path):
    """Catches decoding the whole file before splitting it: an append cut inside a character of
    two or more bytes (a kill, a full disk) made every resume fail on a UnicodeDecodeError."""
    path = tmp_path / "rows.jsonl"
    whole = '{"a": "é"}\n{"a": "日本"}\n'.encode()
    path.write_bytes(whole[:-4])  # the second row cut inside 本's three bytes
    assert read_jsonl_resumable(path) == [{"a": "é"}]
    assert path.read_bytes() == '{"a": "é"}\n'.encode()
    path.write_bytes(b'{"a": "\xe6"}\n' + whole)  # a line before the last that is not UTF-8: damage
    with pytest.raises(ValueError, match="line 1 is not valid JSON .not UTF-8"):
        read_jsonl_resumable(path)


def test_a_repair_stopped_part_way_keeps_every_complete_row(tmp_path, torn_writes):
    """Catches rewriting the file in place to drop a torn last line: a resume stopped during that
    rewrite (a kill, a full disk) left the samples file half written, every record after the
    half lost."""
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:  # builtins.open: not torn
        f.write('{"a": 1}\n{"a": 2}\n{"a": 3')
    with pytest.raises(OSError, match="No space left"):
        read_jsonl_resumable(path)
    with open(path) as f:
        assert f.read() == '{"a": 1}\n{"a": 2}\n{"a": 3'
    assert read_jsonl_resumable(path, repair=False) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("name", ["out.json", "rows.jsonl"])
def test_a_failed_write_leaves_the_old_file(tmp_path, name):
    """Catches writing ``path`` in place instead of a temporary file renamed over it: a write
    that fails part way (here: text that cannot be encoded) must leave the old file whole."""
    path = tmp_path / name
    write_text_atomic(path, '{"old": 1}\n')
    with pytest.raises(UnicodeEncodeError):
        if name.endswith(".jsonl"):
            write_jsonl(path, [{"new": "\ud800"}])
        else:
            write_text_atomic(path, '{"new": "\ud800"}\n')
    assert path.read_text() == '{"old": 1}\n'


def test_gz_output_is_byte_for_byte_reproducible(tmp_path):
    """Catches a gzip header with the write time in it: a committed .jsonl.gz would change on
    every rewrite of the same rows."""
    path = tmp_path / "rows.jsonl.gz"
    write_jsonl(path, [{"a": "é"}])
    raw = path.read_bytes()
    assert raw[4:8] == b"\0\0\0\0"  # MTIME field of the gzip header (RFC 1952)
    assert read_jsonl(path) == [{"a": "é"}]
    assert not path.with_name(path.name + ".tmp").exists()


@pytest.mark.parametrize("data", [b"not gzip at all\n", gzip.compress(b'{"a": 1}\n')[:-6]],
                         ids=["not-gzip", "truncated"])
def test_a_damaged_gz_file_is_a_value_error(tmp_path, data):
    """Catches letting gzip's own OSError/EOFError through: a damaged .gz is bad input, named."""
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="rows.jsonl.gz: damaged file"):
        read_jsonl(path)


def test_a_whole_file_is_read_without_a_write(tmp_path, torn_writes):
    """Catches rewriting the file on every read, not only to drop a torn last line: a resume or a
    merge would rewrite every samples file it reads (here any write fails, as on a full disk)."""
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:  # builtins.open: not torn
        f.write('{"a": 1}\n{"a": 2}\n')
    assert read_jsonl_resumable(path) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("name", ["out.json", "rows.jsonl.gz"])
def test_a_whole_file_write_is_on_disk_before_its_rename(tmp_path, monkeypatch, name):
    """Catches a write renamed over ``path`` before its bytes are synced (no ``os.fsync``, an fsync
    before the buffer is flushed, or one after the rename): a power cut could leave an empty file
    under the new name. At the sync the temporary file holds every byte and ``path`` the old text."""
    import space.jsonl

    path, real_fsync, synced = tmp_path / name, space.jsonl.os.fsync, []

    def fsync(fd):
        synced.append((os.fstat(fd).st_size, read_jsonl(path)))
        real_fsync(fd)

    write_jsonl(path, [{"old": 1}])
    monkeypatch.setattr(space.jsonl.os, "fsync", fsync)
    if name.endswith(".gz"):
        write_jsonl(path, [{"new": 2}])
        size = len(gzip.compress(b'{"new": 2}\n', mtime=0))
    else:
        write_text_atomic(path, '{"new": 2}\n')
        size = len(b'{"new": 2}\n')
    assert synced[:1] == [(size, [{"old": 1}])]  # the file's own sync (a folder's sync may follow)
    assert read_jsonl(path) == [{"new": 2}]


def test_whole_file_writes_create_the_folder(tmp_path):
    """Catches dropping the ``mkdir`` of :func:`write_text_atomic` / :func:`write_jsonl`: a first
    write into a new output folder failed with FileNotFoundError."""
    write_text_atomic(tmp_path / "a" / "b" / "out.json", "{}")
    write_jsonl(tmp_path / "c" / "rows.jsonl.gz", [{"a": 1}])
    assert (tmp_path / "a" / "b" / "out.json").read_text() == "{}"
    assert read_jsonl(tmp_path / "c" / "rows.jsonl.gz") == [{"a": 1}]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_partial_copy(tmp_path, monkeypatch):
    """A full disk (or ``ulimit -f``) while writing: the old file stays whole. Catches the
    partial ``.tmp`` beside it left behind."""
    import errno
    import os as os_module

    from space.jsonl import write_text_atomic

    path = tmp_path / "a.json"
    write_text_atomic(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os_module, "fsync", full)
    with pytest.raises(OSError):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_figure_save_that_fails_keeps_the_old_png(tmp_path, torn_writes):
    """A full disk while a plot is saved (space-eval's and space-train's curves): the old PNG
    stays whole and no partial copy is left beside it. Catches writing the PNG in place, which
    left a torn (or 0-byte) plot under the real name."""
    from matplotlib.figure import Figure

    from space.jsonl import save_figure_atomic

    path = tmp_path / "curve.png"
    with open(path, "wb") as f:  # builtins.open: not torn
        f.write(b"the old plot")
    fig = Figure()
    fig.add_subplot().plot(range(10))
    with pytest.raises(OSError, match="No space left"):
        save_figure_atomic(fig, path)
    with open(path, "rb") as f:
        assert f.read() == b"the old plot"
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]


def test_a_refused_run_is_told_the_holder_s_pid_not_a_stale_one(tmp_path):
    """The lock file outlives its run (the kernel releases only the lock): the next holder writes
    its pid over the old one. Catches appending it (the file is opened "a+"): a second run was
    told "pid 4242424242<pid>", a process that does not exist, and could not find whom to wait for."""
    from space.jsonl import held

    samples = tmp_path / "samples.jsonl"
    (tmp_path / ".samples.jsonl.lock").write_text("4242424242")  # left by an earlier run, long gone
    with held(samples, "samples.jsonl", "wait"):
        refusal = rf"samples.jsonl is being written by another run \(pid {os.getpid()}\); wait$"
        with pytest.raises(ValueError, match=refusal):
            with held(samples, "samples.jsonl", "wait"):
                pass
