"""The front door stays a front door (issue 46): the README and the model card within their size,
every ``results/...`` path the documents name exists, and every entry of ``results/`` is cited by a
document or by the code that writes or reads it (the rest is history: git keeps it)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/history.md names past runs that are no longer in results/ (it says at which commit to read them)
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("adapters/*/README.md")),
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "history.md")]
CODE = [*sorted((ROOT / "space").rglob("*.py")), *sorted(p for p in (ROOT / "scripts").glob("*") if p.is_file()),
        *sorted(p for p in (ROOT / "configs").rglob("*") if p.is_file()), ROOT / "run_eval.sh"]
RESULTS_PATH = re.compile(r"results/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-/]")


def named_paths(files: list[Path]) -> dict[str, Path]:
    """Each ``results/...`` path named in ``files`` -> the first file naming it."""
    found = {}
    for f in files:
        for path in RESULTS_PATH.findall(f.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(path.rstrip("/"), f)
    return found


@pytest.mark.parametrize("doc, limit", [("README.md", 12_000), ("adapters/smollm2-135m-space/README.md", 15_000)])
def test_front_door_sizes(doc, limit):
    assert (ROOT / doc).stat().st_size <= limit, f"{doc} is over {limit} bytes: history goes to docs/history.md"


def test_every_results_path_the_docs_name_exists():
    missing = {path: str(doc.relative_to(ROOT)) for path, doc in named_paths(DOCS).items()
               if not (ROOT / path).exists()}
    assert not missing, f"documents name results that do not exist: {missing}"


def test_every_results_entry_is_cited_and_has_its_command():
    """Every results/ entry is cited by a document or the code, or by the README of a results folder
    they cite (a run's baseline, the ranks its commands read): the history alone keeps none."""
    cited = {path.split("/")[1] for path in named_paths(DOCS + CODE)}
    while True:  # what the cited folders' own READMEs cite, until nothing new
        readmes = [ROOT / "results" / name / "README.md" for name in sorted(cited)]
        more = {path.split("/")[1] for path in named_paths([p for p in readmes if p.is_file()])} - cited
        if not more:
            break
        cited |= more
    entries = sorted(p for p in (ROOT / "results").iterdir())
    uncited = [p.name for p in entries if p.name not in cited]
    assert not uncited, f"results/ entries that no document or code cites (delete them: git keeps them): {uncited}"
    no_command = [p.name for p in entries if p.is_dir() and not (p / "README.md").is_file()]
    assert not no_command, f"results/ folders without a README giving their command: {no_command}"


def shell_commands(doc: Path) -> list[str]:
    """The commands in ``doc``'s fenced shell blocks, continuation lines joined, comments dropped."""
    lines, fence = [], None  # the open block's language, None outside a block
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = line.strip("` ") if fence is None else None
        elif fence in ("", "bash", "sh"):
            lines.append(line.split(" #")[0].rstrip())
    return [c.strip() for c in re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines() if c.strip()]


def test_the_commands_the_docs_run_are_installed_and_the_readme_says_how_to_reach_them():
    """A fresh user runs ``space-eval ...`` from the README after ``scripts/setup.sh``: each ``space-*``
    command a document's shell block starts with is a console script of this package, and the README
    says how to put ``.venv``'s on ``PATH`` (without it a bare ``space-eval`` is "command not found")."""
    from importlib.metadata import distribution
    scripts = {e.name for e in distribution("space-decoding").entry_points if e.group == "console_scripts"}
    run = {found[1] for doc in DOCS for command in shell_commands(doc)
           if (found := re.match(r"(space-[a-z]+)", command))}
    assert run, "no space-* command found in the documents' shell blocks"
    assert not run - scripts, f"documents run commands this package does not install: {sorted(run - scripts)}"
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text(encoding="utf-8")


PARSERS = {"space-eval": "space.eval.__main__", "-m space.eval": "space.eval.__main__",
           "space-probe": "space.eval.probe", "space-tree": "space.eval.tree_search", "space-chat": "space.chat"}


def test_the_commands_the_front_door_documents_give_parse():
    """Each ``space-eval``/``space-probe``/``space-tree``/``space-chat`` command in the README, the model
    cards and ``docs/`` parses with today's flags: a renamed or dropped flag fails here, not on a user's
    machine. ``...`` stands for flags left to the reader."""
    import importlib
    import shlex
    checked = []
    for doc in DOCS:
        for command in shell_commands(doc):
            found = re.search(r"(space-eval|-m space\.eval|space-probe|space-tree|space-chat)\b(.*)", command)
            if not found:
                continue
            argv = [a for a in shlex.split(found[2]) if a != "..."]
            parser = importlib.import_module(PARSERS[found[1]]).build_parser()
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{doc.relative_to(ROOT)}: {command!r} does not parse (see the error above)")
            checked.append(command)
    assert len(checked) >= 10, checked
