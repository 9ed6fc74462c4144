"""Compare drafters by the exact greedy tokens/step their probe ranks replay to, per layout and
prompt source (``space.decoding.tree.replay``: masks only, lookup not modelled; no timing), with
the offset-0 acceptance over the steps that had a candidate. A layout deeper than a drafter's k,
or a source its file lacks, is recorded as skipped.

    python scripts/compare_drafters.py results/probe_stage1/ranks.jsonl results/probe_stage2/ranks.jsonl \\
        --out results/probe_stage2/replay_vs_stage1.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from space.cli import console
from space.decoding.tree import replay
from space.eval.tree_search import load_ranks
from space.jsonl import write_text_atomic

# name -> (mask_num, num_groups, tree); k + 1 groups is the paper's layout ("all groups")
LAYOUTS = {
    "chain k=5, 6 groups": (5, 6, None),
    "chain k=3, 4 groups": (3, 4, None),
    "k=1, 2 groups, tree [[0],[1],[2]] (shipped, lookup off)": (1, 2, ((0,), (1,), (2,))),
    "k=2, 1 group, tree [[0],[1],[0,0],[0,1]]": (2, 1, ((0,), (1,), (0, 0), (0, 1))),
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ranks", nargs="+", type=Path, help="space-probe ranks.jsonl files, one per drafter")
    p.add_argument("--sources", default="all,mbpp,lima", help="comma list of probe sources ('all': every sample)")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the table")
    a = p.parse_args(argv)
    table: dict = {}
    for path in a.ranks:
        for source in a.sources.split(","):
            ranks = load_ranks(path, None if source == "all" else source)
            for name, (k, groups, tree) in LAYOUTS.items():
                cell = table.setdefault(name, {}).setdefault(source, {})
                if not ranks:  # a file without this source: no figure, rather than 0 tokens/step
                    cell[str(path)] = {"skipped": f"no sample of source {source!r}"}
                elif ranks[0].shape[1] < k:  # a drafter with fewer masks cannot run this layout
                    cell[str(path)] = {"skipped": f"the ranks hold {ranks[0].shape[1]} offsets, the layout needs {k}"}
                else:
                    res = replay(ranks, k, groups, tree)
                    cell[str(path)] = {"tokens_per_step": round(res.tokens_per_step, 3),
                                       "offset0_accept": round(res.acceptance(0), 3),  # over steps with a candidate
                                       "steps": res.steps}
    text = json.dumps(table, indent=1)
    if a.out:
        write_text_atomic(a.out, text + "\n")
    print(text)
    return table


if __name__ == "__main__":
    console("compare_drafters", main)()
