"""Where a many-row step's time goes on this CPU (issue 58: a 16-row step <= 1.5x a 1-row step).

Times the shipped adapter's 1-row and ``--rows``-row forwards as ``space-tree`` prices them
(``space.eval.step_cost.time_steps``: ``--cache`` cached tokens, the LM head on every row, mask
rows from row 1), with the fast kernels ``space-eval`` runs (``--kernels fast``), in five setups:

* ``full``: as a decode step runs;
* ``one-call update``: as a decode step runs, but each fused group's LoRA update as one ``addmm_``
  over its block-diagonal B (``blockwise`` off: what a GPU step runs), not one per nonzero block
  (``space.cpu_kernels.blockwise_lora``);
* ``no LoRA update``: the same rows with no mask row (``mask_rows(None)``), so the
  frozen-base LoRA's ``addmm_`` of B on the mask rows is skipped; the packed GEMM still computes
  ``x A^T`` as long as ``--rows`` is above every linear's ``stock_rows`` (its few-row path reads W
  alone), which the script requires;
* ``no attention``: an attention function that returns zeros (registered through transformers'
  ``AttentionInterface``), so the step has no attention kernel; the KV cache is still written;
* ``neither``.

The last three compute wrong values: they exist only to price a part. The setups take turns,
``--rounds`` times (a step's cost drifts by 10-20 % over seconds on a shared CPU), each turn timing
every row count in alternating order (``time_steps``, 5 repeats after a warm-up); the medians of
the turns' medians are reported, with each setup's ratio of the many-row to the 1-row step. A
1-row step has no mask row, so ``full`` and ``no LoRA update`` share one 1-row time, as do the two
setups without attention (``one-call update`` times its own, in the same turn).
``results/step_parts_cpu`` holds a run on this machine (its README says what it shows)::

    python scripts/bench_step_parts.py --out results/step_parts_cpu/smollm2.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's space/, not an installed copy

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: E402

from space.cli import output_file, positive_int  # noqa: E402
from space.cpu_kernels import apply_kernels, cpu_model  # noqa: E402
from space.eval.step_cost import time_steps  # noqa: E402
from space.jsonl import write_text_atomic  # noqa: E402
from space.loader import load_space  # noqa: E402

ADAPTER = ROOT / "adapters" / "smollm2-135m-space"
NO_ATTENTION = "space_bench_no_attention"
SETUPS = ("full", "one-call update", "no LoRA update", "no attention", "neither")


def no_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """An attention function that attends to nothing: (batch, q, heads, head_dim) zeros."""
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int, default=16, help="the many-row step's rows (default 16)")
    p.add_argument("--cache", type=positive_int, default=300, help="cached tokens before the step (default 300)")
    p.add_argument("--rounds", type=positive_int, default=8, help="turns of the five setups (default 8)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=output_file, help="JSON file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, _ = load_space(adapter=ADAPTER)
    kernels = apply_kernels(model, "fast")
    stock = max((c["stock_rows"] for c in kernels.get("stock_rows", {}).values()), default=0)
    q = args.rows
    if q <= max(stock, 1):
        p.error(f"--rows {q}: must be above 1 and above every linear's stock_rows ({stock} here), or the "
                "'no LoRA update' setup would also skip x A^T")
    blockwise = [m for m in model.modules() if getattr(m, "blockwise", False)]
    if not blockwise:
        p.error("no fused LoRA update runs block by block here (space.cpu_kernels.blockwise_lora): "
                "the 'one-call update' setup would time the same step twice")
    attention = model.config._attn_implementation
    AttentionInterface.register(NO_ATTENTION, no_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NO_ATTENTION, sdpa_mask)
    turns = {s: {1: [], q: []} for s in SETUPS}

    def one_call() -> None:  # the fused updates as one addmm_ each, as a GPU step runs them
        for m in blockwise:
            m.blockwise = False
        try:
            timed = time_steps(model, [(1, False), (q, True)], args.cache, repeats=5)
        finally:
            for m in blockwise:
                m.blockwise = True
        turns["one-call update"][1].append(timed[1, False])
        turns["one-call update"][q].append(timed[q, True])

    def blockwise_setups(attend: bool) -> None:
        model.set_attn_implementation(attention if attend else NO_ATTENTION)
        timed = time_steps(model, [(1, False), (q, True), (q, False)], args.cache, repeats=5)
        full, bare = ("full", "no LoRA update") if attend else ("no attention", "neither")
        for setup in (full, bare):
            turns[setup][1].append(timed[1, False])
        turns[full][q].append(timed[q, True])
        turns[bare][q].append(timed[q, False])

    try:
        for round_ in range(args.rounds):  # time_steps shows its own progress bar
            runs = [lambda: blockwise_setups(True), one_call, lambda: blockwise_setups(False)]
            for run in runs if round_ % 2 == 0 else runs[::-1]:  # alternating order: no setup always first
                run()
    finally:  # the model attends again, whatever stopped the loop
        model.set_attn_implementation(attention)
    ms = {s: {n: round(statistics.median(t) * 1e3, 2) for n, t in by_rows.items()} for s, by_rows in turns.items()}
    record = {
        "command": "python scripts/bench_step_parts.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "torch": torch.__version__, "threads": args.threads, "rows": q, "cache": args.cache, "rounds": args.rounds,
        "cpu": cpu_model(),
        "kernels": {k: v for k, v in kernels.items() if k != "stock_rows"}, "max_stock_rows": stock,
        "step_ms": {s: {str(n): v for n, v in by_rows.items()} for s, by_rows in ms.items()},
        "ratio": {s: round(by_rows[q] / by_rows[1], 3) for s, by_rows in ms.items()},
    }
    for s in SETUPS:
        print(f"{s:16s} 1 row {ms[s][1]:7.2f} ms, {q} rows {ms[s][q]:7.2f} ms, ratio {record['ratio'][s]:.3f}")
    if args.out:  # made by the command, whole or not at all
        write_text_atomic(Path(args.out), json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
