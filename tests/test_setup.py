"""scripts/setup.sh: which torch it keeps. Run against a fake venv whose python imports a stand-in
torch of a given version and logs its pip calls instead of installing."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def setup_pip_calls(tmp_path, torch_version: str) -> list[str]:
    """The pip commands setup.sh runs when the venv's torch is ``torch_version``."""
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
    subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "setup.sh")], check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "VENV": str(python.parents[1])})
    return log.read_text().splitlines()


@pytest.mark.parametrize("version, replaced", [("2.9.0", True), ("2.10.0+cpu", True), ("2.11.0", False),
                                                ("2.13.0+cpu", False)])
def test_setup_replaces_a_torch_older_than_2_11(tmp_path, version, replaced):
    """Catches comparing versions as strings ('2.9.0' < '2.11' is False): torch 2.9 was kept, and
    requirements.txt (torch >= 2.11) then made pip fetch its default multi-GB CUDA build."""
    calls = setup_pip_calls(tmp_path, version)
    assert any("torch==2.13.0" in c for c in calls) == replaced, calls
    assert any("-r requirements.txt" in c for c in calls) and calls[-1].endswith("-e .")
