"""Append-only JSONL files that survive interruption: a torn last line is dropped on reread."""
from __future__ import annotations

import json
from pathlib import Path


def read_jsonl_resumable(path: Path) -> list[dict]:
    """Complete rows of ``path`` ([] when missing); rewrites the file without a torn last line."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows, good = [], []
    for line in lines:
        try:
            rows.append(json.loads(line))
            good.append(line if line.endswith("\n") else line + "\n")
        except json.JSONDecodeError:
            pass
    if len(good) != len(lines):
        path.write_text("".join(good), encoding="utf-8")
    return rows


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append rows in one write and flush, so a unit of work lands whole or (torn) not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
