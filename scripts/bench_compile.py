"""A compiled trunk against the eager one, in one run on this machine (issue 43, item 4): the
step-cost curve, AR tokens/s, and SPACE against prompt lookup (PLD), plus the preallocated KV
cache alone (eager).

Loads the shipped adapter twice with the same kernels; compiles one copy's trunk
(``space.decoding.compiled.compile_trunk``: SPACE and AR then preallocate their caches). Every
method of the compiled copy first decodes every prompt once, untimed, so each shape is compiled
before the timed pass (the time that takes is reported as the compile cost). Then, per prompt,
every (setup, method) pair runs once, the order rotating per prompt so a busy spell hits all.
SPACE's output must equal AR's of the same copy (fp32, exact).

Setups: ``eager`` (growing DynamicCache, the default), ``eager-static`` (preallocated cache,
no compile), ``compiled``. Methods (``--methods``): ``ar``, ``pld`` (transformers' prompt lookup,
10 tokens, over its own growing cache: assisted generation takes no static cache), ``space``
with the adapter's layout or ``--layout chain`` (k = 3, 2 groups: few shapes, few graphs).

On a 2-core CPU a graph of SmolLM2's trunk takes minutes to compile; with the sizes symbolic and
the first mask row an argument of the graph (``space.decoding.compiled``), the three methods need
9 graphs, compiled in about 15 minutes from a cold cache. ``results/compile_cpu`` was made with

    python scripts/bench_compile.py --threads 2 --prompts 10 --max-new-tokens 128 --setups eager,compiled \
        --methods ar,pld,space --out results/compile_cpu

and ``results/static_cache_cpu`` (eager, both caches) with

    python scripts/bench_compile.py --threads 2 --prompts 10 --max-new-tokens 128 --setups eager,eager-static \
        --methods ar,pld,space --out results/static_cache_cpu
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from torch._dynamo.utils import counters

from space.choices import COMPILE_MODES
from space.cli import positive_int
from space.data.prompts import chat_ids, code_prompt
from space.decoding import DecodeConfig, SpaceDecoder
from space.eval.bench import Target, generate
from space.eval.tasks import load_tasks
from space.eval.step_cost import step_cost_curve
from space.jsonl import write_text_atomic
from space.loader import load_space

ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-space"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", default=str(ADAPTER))
    p.add_argument("--prompts", type=positive_int, default=10, help="HumanEval prompts (default 10)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (both copies)")
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                   help="the compiled copy's torch.compile mode (reduce-overhead: CUDA graphs, a GPU)")
    p.add_argument("--kernels", default="stock", help="both copies' kernels (stock: AR's fastest here, issue 43)")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="step-cost curve rows")
    p.add_argument("--methods", default="ar,pld,space", help="comma-separated: ar, pld, space")
    p.add_argument("--setups", default="eager,eager-static,compiled",
                   help="comma-separated: eager, eager-static, compiled (the compiled copy is loaded only if named)")
    p.add_argument("--layout", default="adapter", choices=["adapter", "chain"],
                   help="SPACE's layout: the adapter's tuned one, or the k=3 chain with 2 groups")
    p.add_argument("--out", type=Path, required=True, help="folder for compile.json and compile.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]  # none: no step-cost curve
    setups = tuple(s for s in args.setups.split(",") if s)
    if not setups or set(setups) - {"eager", "eager-static", "compiled"}:
        p.error(f"--setups: choose among eager, eager-static, compiled, got {args.setups!r}")
    methods = tuple(m for m in args.methods.split(",") if m)
    if not methods or set(methods) - {"ar", "pld", "space"}:
        p.error(f"--methods: choose among ar, pld, space, got {args.methods!r}")
    layout = DecodeConfig(3, 2) if args.layout == "chain" else None

    # stored: the eager and compiled setups decode one layout (a GPU's auto would price only the eager one)
    eager, tok, spec = load_space(adapter=args.adapter, kernels=args.kernels, device=args.device, step_cost="stored")
    targets = {"eager": Target(eager, tok, spec, SpaceDecoder(eager, spec, layout)),
               "eager-static": Target(eager, tok, spec, SpaceDecoder(eager, spec, layout, static_cache=True))}
    if "compiled" in setups:
        compiled, _, _ = load_space(adapter=args.adapter, kernels=args.kernels, device=args.device,
                                    compile=args.compile_mode, step_cost="stored")
        targets["compiled"] = Target(compiled, tok, spec, SpaceDecoder(compiled, spec, layout))
    targets = {s: targets[s] for s in setups}
    prompts = [chat_ids(tok, [{"role": "user", "content": code_prompt(t.problem["prompt"])}])
               for t in load_tasks("humaneval", limit=args.prompts)]
    n = args.max_new_tokens

    def run(setup: str, method: str, ids: list[int]) -> dict:
        if method == "ar" and setup == "eager-static":  # AR over a preallocated cache, not compiled
            from space.decoding import ar_generate
            r = ar_generate(eager, torch.tensor(ids), n, stop_token_ids=targets[setup].stop_ids,
                            suppress_ids=spec.token_ids, static_cache=True)
            return {"ids": r.new_ids, "wall_time": r.wall_time, "steps": r.num_steps}
        return generate(method, targets[setup], ids, n, _greedy())

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts if "compiled" in targets else []):  # every shape compiled before timing
        for method in methods:
            run("compiled", method, ids)
        print(f"warm-up (compiling) prompt {i}: {time.perf_counter() - t0:.0f} s so far", flush=True)
    compile_s = time.perf_counter() - t0
    graphs_warm = counters["stats"]["unique_graphs"]
    for setup in set(targets) - {"compiled"}:
        for method in methods:
            if not (setup == "eager-static" and method == "pld"):
                run(setup, method, prompts[0])
    pairs = [(s, m) for s in targets for m in methods if not (s == "eager-static" and m == "pld")]
    rates: dict[str, list[float]] = {f"{s}/{m}": [] for s, m in pairs}
    exact = {s: True if {"ar", "space"} <= set(methods) else None for s in targets}
    for i, ids in enumerate(prompts):
        out = {}
        for s, m in pairs[i % len(pairs):] + pairs[:i % len(pairs)]:
            r = run(s, m, ids)
            rates[f"{s}/{m}"].append(len(r["ids"]) / r["wall_time"])
            out[s, m] = r["ids"]
        for s in targets:
            if exact[s] is not None:
                exact[s] &= out[s, "space"] == out[s, "ar"]
        print(f"prompt {i}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    curves = {s: step_cost_curve(targets[s].model, rows, static=s != "eager") for s in targets} if rows else {}
    med = {k: round(statistics.median(v), 2) for k, v in rates.items()}
    result = {
        "command": "python scripts/bench_compile.py " + " ".join(argv or __import__("sys").argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "compile_mode": args.compile_mode,
        "kernels": args.kernels, "prompts": args.prompts, "max_new_tokens": n,
        "layout": targets[setups[0]].decoder.config.to_dict() if "space" in methods else None,
        "tokens_per_s_median": med,
        "space_vs_pld": {s: round(med[f"{s}/space"] / med[f"{s}/pld"], 3) for s in targets
                         if f"{s}/pld" in med and f"{s}/space" in med},
        "space_vs_ar": {s: round(med[f"{s}/space"] / med[f"{s}/ar"], 3) for s in targets
                        if f"{s}/ar" in med and f"{s}/space" in med},
        "compiled_over_eager": {m: round(med[f"compiled/{m}"] / med[f"eager/{m}"], 3) for m in methods
                                if f"compiled/{m}" in med and f"eager/{m}" in med},
        "static_over_dynamic_cache_eager": {m: round(med[f"eager-static/{m}"] / med[f"eager/{m}"], 3)
                                            for m in methods if f"eager-static/{m}" in med and f"eager/{m}" in med},
        "space_equals_ar": exact,
        "compile_warmup_s": round(compile_s, 1) if "compiled" in targets else None,
        # graphs compiled in the warm-up, and in the whole run (a timed pass that compiles is not timed fairly)
        "graphs": {"warm_up": graphs_warm, "total": counters["stats"]["unique_graphs"]},
        "step_cost_ms": {s: {q: round(v * 1e3, 3) for q, v in c.items()} for s, c in curves.items()},
        "per_prompt_tokens_per_s": rates,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "compile.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(args.out / "compile.md", markdown(result))
    print(markdown(result))
    return result


def _greedy():
    from space.decoding import SamplingConfig
    return SamplingConfig()


def markdown(r: dict) -> str:
    med, curve = r["tokens_per_s_median"], r["step_cost_ms"]
    where = r["machine"]["cpu"] if r["machine"]["device"] == "cpu" else r["machine"]["device"]
    lines = [f"# Compiled ({r['compile_mode']}) vs eager trunk ({where}, {r['machine']['threads']} threads, kernels "
             f"{r['kernels']}, HumanEval {r['prompts']} x {r['max_new_tokens']} tokens)", "",
             f"`{r['command']}`", "", *([f"SPACE layout: `{json.dumps(r['layout'])}`", ""] if r["layout"] else []),
             "| setup | AR tok/s | PLD tok/s | SPACE tok/s | SPACE / PLD | SPACE / AR | SPACE = AR |",
             "|---|---|---|---|---|---|---|"]
    for s in r["space_equals_ar"]:
        cells = [med.get(f"{s}/{m}", "-") for m in ("ar", "pld", "space")]
        lines.append(f"| {s} | " + " | ".join(map(str, cells)) + f" | {r['space_vs_pld'].get(s, '-')} | "
                     f"{r['space_vs_ar'].get(s, '-')} | {'-' if r['space_equals_ar'][s] is None else r['space_equals_ar'][s]} |")
    if r["compile_warmup_s"] is not None:
        lines += ["", f"Compile warm-up (every prompt once, every method): {r['compile_warmup_s']} s, "
                  f"{r['graphs']['warm_up']} graphs ({r['graphs']['total']} by the end of the run)."]
    if curve:
        rows = list(next(iter(curve.values())))
        lines += ["", "Step cost (ms) by rows, after 300 cached tokens:", "",
                  "| setup | " + " | ".join(str(q) for q in rows) + " |", "|---|" + "---|" * len(rows)]
        for s, c in curve.items():
            lines.append(f"| {s} | " + " | ".join(str(c[q]) for q in rows) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
