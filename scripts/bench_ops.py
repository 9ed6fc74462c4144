"""Ops dispatched per greedy step on the real SmolLM2 with the shipped adapter (issue 58, item 1).

On a launch-bound GPU a step costs about its kernel launches; ``space.decoding.op_count.OpCounter``
counts the ops that would launch one, on the CPU, deterministically (no timing: the numbers do not
move with the machine's load). Methods: AR, the chain (k 3 x 4 groups), a static tree (k 3, 2
groups) and the shipped layout (the adapter's dynamic tree + prompt lookup 10), over
``--prompts`` HumanEval prompts x ``--max-new-tokens``, each after a warm-up generation, in each
``--dtype``. The model is what ``space.loader.load_space`` gives with the stock kernels (the
GPU's); ``--attention cuda`` counts the trunk CUDA loads: the grouped query heads folded into the
batch (``space.decoding.backends``: CUDA's memory-efficient SDPA has no GQA) and each norm one kernel
(``space.rms_norm``), where the default is the CPU's at load.
``--capture`` counts what a captured step launches besides its graph (``space.decoding.graphs``:
on a GPU the trunk is one replay; here it runs eagerly, its forward hooks pausing the counter), for
AR, prompt lookup (PLD, HF's settings, over the same captured steps as ``space-eval --capture``) and
the layouts. ``tests/decoding/test_op_budget.py`` holds the same budgets on a tiny model::

    python scripts/bench_ops.py --out results/op_budget/smollm2.json
    python scripts/bench_ops.py --capture --dtype float32 --out results/op_budget/smollm2_captured.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's space/, not an installed copy

import torch  # noqa: E402

from space.cli import output_file, positive_int  # noqa: E402
from space.data.prompts import chat_ids, code_prompt  # noqa: E402
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate  # noqa: E402
from space.decoding.graphs import StepGraphs  # noqa: E402
from space.decoding.op_count import OpCounter, cuda_attention  # noqa: E402
from space.eval.bench import PLD_NGRAM, PLD_TOKENS  # noqa: E402
from space.eval.tasks import load_tasks  # noqa: E402
from space.jsonl import write_text_atomic  # noqa: E402
from space.loader import load_space  # noqa: E402
from space.rms_norm import swap_rms_norms  # noqa: E402

ADAPTER = ROOT / "adapters" / "smollm2-135m-space"
WARM_TOKENS = 8  # each method's warm-up generation


def count(generate, prompts, trunk=None) -> tuple[float, int, dict]:
    """(ops per step, steps counted, ops per step by op) over ``prompts``, after a warm-up; with
    ``trunk``, none of the ops inside its forward (a captured step's graph).

    Raises:
        ValueError: every prompt took one step (nothing between two steps to count)."""
    generate(prompts[0], WARM_TOKENS, None)
    total = steps = 0
    by_op = {}
    for ids in prompts:
        with OpCounter() as ops:
            hooks = [] if trunk is None else [trunk.register_forward_pre_hook(lambda *_: ops.pause()),
                                              trunk.register_forward_hook(lambda *_: ops.resume())]
            try:
                generate(ids, None, ops.mark)
            finally:
                for hook in hooks:
                    hook.remove()
        n = len(ops.marks) - 1
        if n < 1:  # the prompt's step was its only one (an end of sequence at once): no whole step
            continue
        total, steps = total + ops.marks[-1] - ops.marks[0], steps + n
        for name, per in ops.per_step_by_op().items():
            by_op[name] = by_op.get(name, 0) + per * n
    if not steps:
        raise ValueError("every prompt took a single step: raise --max-new-tokens to count whole steps")
    return total / steps, steps, by_op


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=positive_int, default=2)
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--attention", choices=["load", "cuda"], default="load",
                   help="load: what load_space sets on this device; cuda: the trunk CUDA loads (the query heads "
                        "folded into the batch, masks in aligned rows, the one-call RMSNorm of space.rms_norm)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--capture", action="store_true",
                   help="count the ops of captured steps outside their graph (AR, PLD and the layouts)")
    p.add_argument("--out", type=output_file, help="JSON file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "torch": torch.__version__, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "attention": args.attention, "capture": args.capture, "ops_per_step": {}, "steps": {}, "by_op": {}}
    for dtype in args.dtype:
        model, tok, spec = load_space(adapter=ADAPTER, dtype=dtype)
        trunk = dict(getattr(model, "space_trunk", None) or {})
        if args.attention == "cuda":  # the trunk CUDA loads: the one-call RMSNorm (the attention's path below)
            trunk["rms_norms"] = swap_rms_norms(model, exact=False)
        record.setdefault("trunk", {})[dtype] = {**trunk, "attention": model.config._attn_implementation}
        prompts = [torch.tensor(chat_ids(tok, [{"role": "user", "content": code_prompt(t.problem["prompt"])}]))
                   for t in load_tasks("humaneval", limit=args.prompts)]
        n = args.max_new_tokens
        configs = {"chain": DecodeConfig(3, 4), "static tree": DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
                   "dynamic tree (shipped)": SpaceDecoder(model, spec).config}
        graphs = None
        if args.capture:  # PLD as space-eval --capture runs it: the SPACE decoder with no mask group
            configs = {"PLD": DecodeConfig(3, 0, lookup_tokens=PLD_TOKENS, lookup_ngram=PLD_NGRAM), **configs}
            decoders = [SpaceDecoder(model, spec, c, buckets=True) for c in configs.values()]
            sizes = {q for d in decoders for q in d.row_sizes}
            rows = max(d.max_rows for d in decoders)
            graphs = StepGraphs(model, max(p.numel() for p in prompts) + max(n, WARM_TOKENS) + rows, sizes)
            graphs.capture()  # on a GPU every graph now, none inside a count (nothing to do on the CPU)
        methods = {"AR": lambda ids, m, cb: ar_generate(model, ids, m or n, stop_token_ids=[tok.eos_token_id],
                                                        suppress_ids=spec.token_ids, on_tokens=cb, graphs=graphs)}
        for name, config in configs.items():
            dec = SpaceDecoder(model, spec, config, graphs=graphs)
            methods[name] = lambda ids, m, cb, dec=dec: dec.generate(ids, m or n, stop_token_ids=[tok.eos_token_id],
                                                                     on_tokens=cb)
        for name, generate in methods.items():
            with cuda_attention() if args.attention == "cuda" else nullcontext():
                per_step, steps, by_op = count(generate, prompts, graphs.trunk if graphs is not None else None)
            record["ops_per_step"].setdefault(name, {})[dtype] = round(per_step, 1)
            record["steps"].setdefault(name, {})[dtype] = steps
            record["by_op"].setdefault(name, {})[dtype] = {k: round(v / steps, 1) for k, v in
                                                           sorted(by_op.items(), key=lambda kv: -kv[1])}
            print(f"{dtype:9s} {name:24s} {per_step:7.1f} ops/step over {steps} steps", flush=True)
    ar = record["ops_per_step"]["AR"]
    record["over_ar"] = {name: {d: round(v / ar[d], 3) for d, v in by.items()}
                         for name, by in record["ops_per_step"].items()}
    if len(args.dtype) == 2:
        a, b = args.dtype
        record["bf16_over_fp32"] = {name: round(by[b] / by[a], 3) for name, by in record["ops_per_step"].items()}
    print(json.dumps({k: record[k] for k in ("ops_per_step", "over_ar", "bf16_over_fp32") if k in record}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
