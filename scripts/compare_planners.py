"""Compare the SPACE steps of space-eval runs folder by folder (issue 44): tokens/step, rows/step,
steps without a candidate, steps starved after an all-rejected step, and tokens per unit of the
step-cost curve that priced the run (the planner's own price of a step, relative to an AR step;
``--adapter``: that adapter's default curve for every run); with prompt lookup (pld) in a run, its
tokens/step and the provenance split.

    python scripts/compare_planners.py results/planner_issue44/old_humaneval20 results/planner_issue44/new_humaneval20
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from space.cli import console
from space.decoding.dynamic import StepCost
from space.jsonl import read_jsonl


def describe(folder: Path, cost: StepCost) -> str:
    summary = json.loads((folder / "summary.json").read_text())
    # the questions the summary counts (space.eval.report.summarize): samples.jsonl can hold more (an
    # earlier run with a larger --limit); a summary written before it listed them: those not skipped
    skipped = summary.get("skipped", {}).get("questions", {})
    counted = set(summary["questions"]) if "questions" in summary else None
    space = [r for r in read_jsonl(folder / "samples.jsonl")
             if r.get("model_id") == "space" and "skipped" not in r and r["question_id"] not in skipped
             and (counted is None or r["question_id"] in counted)]
    if not space:
        return f"{folder}: no SPACE samples"
    turns = [(A, M, R, T) for r in space for c in r["choices"]
             for A, M, R, T in zip(c["accept_lengths"], c["candidates"], c["rows"], c["step_tokens"])]
    rows = [q for _, _, R, _ in turns for q in R]
    tokens = sum(sum(T) for *_, T in turns)
    cands = [m for _, M, _, _ in turns for m in M]
    rejected = [(M[i], A[i - 1]) for A, M, _, _ in turns for i in range(1, len(A)) if M[i - 1] and A[i - 1] == 0]
    lines = [f"{folder}: tokens/step {tokens / len(rows):.3f}, rows/step {sum(rows) / len(rows):.2f}, "
             f"steps without a candidate {sum(m == 0 for m in cands) / len(cands):.3f}, "
             f"starved after an all-rejected step {sum(m == 0 for m, _ in rejected)} of {len(rejected)}, "
             f"tokens per AR-step of modelled cost {tokens / sum(cost(q) for q in rows):.3f}"]
    methods = summary["methods"]
    if "pld" in methods:
        lines.append(f"  pld tokens/step {methods['pld']['tokens_per_step']}, space/pld tokens/s {summary['speedup'].get('space_vs_pld')}")
    if methods["space"].get("accepted_from"):
        lines.append(f"  accepted from {methods['space']['accepted_from']}, acceptance per offset by source "
                     f"{methods['space']['acceptance_per_offset_by_source']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="space-eval output folders")
    p.add_argument("--adapter", type=Path, default=None,
                   help="price every run's rows by this adapter's default step-cost curve (default: each run "
                        "by the curve its run_config.json records, the one its planner priced its steps by)")
    a = p.parse_args(argv)
    source = a.adapter / "space_config.json" if a.adapter else None
    for run in a.runs:
        record = json.loads(source.read_text())["decode"] if source else json.loads((run / "run_config.json").read_text())
        if not record.get("step_cost"):
            p.error(f"{source or run} records no step-cost curve (a static layout's run, or an adapter without one: "
                    "give --adapter with a curve; space-tree --dynamic --write-adapter measures one)")
        print(describe(run, StepCost(tuple(map(tuple, record["step_cost"])), record.get("adapter_cost") or 0.0)))


if __name__ == "__main__":
    console("compare_planners", main)()
