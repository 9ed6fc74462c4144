"""Step cost with each packed CPU kernel, and the one the fast kernels choose on this machine.

``--kernels fast`` packs the linears for MKL's or oneDNN's GEMM, whichever it times faster here
(``space.cpu_kernels.choose_packed_kernel``): which one is faster depends on the CPU (MKL on an
AVX-512 Intel CPU, oneDNN on an AVX2 AMD EPYC). This prices that choice: the shipped adapter on
SmolLM2 loaded once per kernel (``optimize_for_cpu(model, kernel=...)``, every other fast kernel
alike), the step shapes ``space-tree`` prices (``space.eval.step_cost.time_steps``: ``--cache``
cached tokens, the LM head on every row, mask rows from row 1; 1 row is an AR step), the kernels
taking turns ``--rounds`` times in alternating order (a step's cost drifts over seconds on a
shared CPU), 3 timed repeats a turn. Reports the median ms per kernel and row count, the ratio of
each to the first kernel's, and the kernel the timed choice took; writes ``--out`` atomically.

    python scripts/bench_packed_kernels.py --out results/packed_kernels_cpu/<machine>.json
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

from space.cli import output_file, positive_int, positive_ints  # noqa: E402
from space.cpu_kernels import PACKED_KERNELS, cpu_model, has_kernel, optimize_for_cpu  # noqa: E402
from space.eval.step_cost import time_steps  # noqa: E402
from space.jsonl import write_text_atomic  # noqa: E402
from space.loader import load_space  # noqa: E402

ADAPTER = ROOT / "adapters" / "smollm2-135m-space"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_ints, default="1,4,16,32", help="step row counts, comma-separated (default 1,4,16,32)")
    p.add_argument("--cache", type=positive_int, default=300, help="cached tokens before the step (default 300)")
    p.add_argument("--rounds", type=positive_int, default=6, help="turns of the kernels (default 6)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=output_file, help="JSON file to write")
    args = p.parse_args(argv)
    rows = sorted(set(args.rows))
    if rows[0] != 1:
        p.error(f"--rows {','.join(map(str, rows))}: must hold 1 (the AR step the ratios divide by)")
    kernels = [k for k in PACKED_KERNELS if has_kernel(k)]
    if len(kernels) < 2:
        p.error(f"this torch build has {kernels or 'no'} packed kernel(s): nothing to compare")
    torch.set_num_threads(args.threads)
    models = {}
    for kernel in kernels:
        models[kernel], _, _ = load_space(adapter=ADAPTER)
        optimize_for_cpu(models[kernel], kernel=kernel)
    chooser, _, _ = load_space(adapter=ADAPTER)
    chosen = optimize_for_cpu(chooser)  # the timed choice, as space-eval --kernels fast makes it
    del chooser
    shapes = [(q, q > 1) for q in rows]
    turns = {k: {q: [] for q in rows} for k in kernels}
    for round_ in range(args.rounds):  # time_steps shows its own progress bar
        for kernel in kernels if round_ % 2 == 0 else kernels[::-1]:
            timed = time_steps(models[kernel], shapes, args.cache, repeats=3)
            for q in rows:
                turns[kernel][q].append(timed[q, q > 1])
    ms = {k: {q: round(statistics.median(t) * 1e3, 2) for q, t in by_rows.items()} for k, by_rows in turns.items()}
    first = kernels[0]
    record = {
        "command": "python scripts/bench_packed_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "cpu": cpu_model(), "torch": torch.__version__, "threads": args.threads, "cache": args.cache,
        "rounds": args.rounds, "chosen": chosen["packed_kernel"],
        "chosen_by": {shape: e.get("kernel_us") for shape, e in chosen["stock_rows"].items()},
        "step_ms": {k: {str(q): v for q, v in by_rows.items()} for k, by_rows in ms.items()},
        "vs_" + first: {k: {str(q): round(ms[k][q] / ms[first][q], 3) for q in rows} for k in kernels},
        "many_vs_one_row": {k: {str(q): round(ms[k][q] / ms[k][1], 3) for q in rows} for k in kernels},
    }
    for k in kernels:
        print(f"{k:7s} " + "  ".join(f"{q} rows {ms[k][q]:7.2f} ms" for q in rows))
    print(f"the fast kernels chose {chosen['packed_kernel']} here ({record['cpu']})")
    if args.out:  # made by the command, whole or not at all
        write_text_atomic(Path(args.out), json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
