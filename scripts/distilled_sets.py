"""Pack complete self-distilled sets into a folder small enough to commit, or rebuild them from one
(``space.data.set_archive``; issue 60's sets travel from the GPU session that distils them to a later
one that trains on them through a commit).

    python scripts/distilled_sets.py pack runs/gpu60/distill_magpie.jsonl runs/gpu60/distill_lima_mbpp.jsonl \\
        --out data/distill/gpu60
    python scripts/distilled_sets.py unpack data/distill/gpu60 --out runs/gpu60
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from space.cli import console
from space.data import set_archive


def main(argv: list[str] | None = None) -> dict | list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a_pack = sub.add_parser("pack", help="complete sets (each with its manifest beside it) -> an archive folder")
    a_pack.add_argument("sets", nargs="+", type=Path, help="space-distill outputs (.jsonl or .jsonl.gz)")
    a_pack.add_argument("--out", type=Path, required=True, help="the archive folder")
    a_pack.add_argument("--max-mb", type=float, default=set_archive.MAX_BYTES / 1e6,
                        help="refuse an archive larger than this, in MB (default: %(default)s, issue 60's limit)")
    a_unpack = sub.add_parser("unpack", help="an archive folder -> the sets and their manifests, checked by sha256")
    a_unpack.add_argument("archive", type=Path, help="a folder `pack` wrote")
    a_unpack.add_argument("--out", type=Path, required=True, help="folder for the rebuilt sets")
    a = p.parse_args(argv)
    if a.command == "pack" and not (math.isfinite(a.max_mb) and a.max_mb > 0):
        p.error(f"--max-mb must be a finite number > 0, got {a.max_mb}")
    if a.command == "pack":
        index = set_archive.pack(a.sets, a.out, max_bytes=int(a.max_mb * 1e6))
        for name, entry in index["sets"].items():
            print(f"{name}: {entry['rows']} rows -> {entry['lean']} ({entry['lean_bytes'] / 1e6:.2f} MB)")
        print(f"{a.out}: {index['bytes'] / 1e6:.2f} MB in all")
        return index
    written = set_archive.unpack(a.archive, a.out)
    for path in written:
        print(f"rebuilt {path} (sha256 as packed)")
    return written


if __name__ == "__main__":
    console("distilled_sets", main)()
