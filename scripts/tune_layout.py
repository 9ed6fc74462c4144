"""Pick mask_num and num_groups for this machine by measurement (DESIGN §3.5, cost-aware layout).

Decodes a few training prompts (MBPP by default: never the evaluation sets) with every
(k, num_groups, lookup_tokens) in the grid, and with the best token-tree layouts of a
``space-tree`` search (``--search``), interleaved with the AR loop, and ranks them by tokens/s.
Output is exact in every configuration, so only speed is compared.

    python scripts/tune_layout.py --adapter adapters/smollm2-135m-space --out results/tune_layout.json
    python scripts/tune_layout.py --adapter adapters/smollm2-135m-space --mask-nums 1 \
        --search runs/tree/tree_search.json --top 4 --lookup-tokens 0,10 --out results/tune_tree.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from space.choices import KERNEL_CHOICES
from space.cli import console, given_flags, output_file, positive_int, positive_ints
from space.cpu_kernels import apply_kernels
from space.data.prompts import chat_ids
from space.data.sft import load_examples
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.jsonl import write_text_atomic
from space.loader import load_space
from space.tokens import check_mask_num


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--dataset", default="mbpp", help="prompt source (a training set, not an evaluation set)")
    ap.add_argument("--prompts", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=96)
    ap.add_argument("--mask-nums", type=positive_ints, default="2,3,4,5", help="comma list of k")
    ap.add_argument("--lookup-tokens", default="0", help="comma list of SpaceDecoder lookup_tokens (0 = pure SPACE)")
    ap.add_argument("--search", type=Path, default=None, help="a space-tree tree_search.json: also time its best layouts")
    ap.add_argument("--top", type=positive_int, default=4, help="with --search: how many of its layouts")
    ap.add_argument("--kernels", choices=KERNEL_CHOICES, default="fast", help="as in space-eval")
    ap.add_argument("--out", type=output_file, default=Path("results/tune_layout.json"))
    a = ap.parse_args(argv)
    if a.search is None and "top" in given_flags(ap, argv):
        ap.error("--top counts the --search file's layouts: give --search with it")
    # counts are >= 1 (space.cli.positive_int): --prompts 0 took every example ([-0:]), and no AR time to divide by
    try:  # before the model loads
        lookups = [int(t) for t in a.lookup_tokens.split(",")]
    except ValueError:
        lookups = [-1]
    if min(lookups) < 0:
        ap.error(f"--lookup-tokens must be a comma list of integers >= 0, got {a.lookup_tokens!r}")
    try:
        for k in a.mask_nums:
            check_mask_num(k)
    except ValueError as e:
        ap.error(f"--mask-nums: {e}")
    # the prompts and the --search file read before the model loads: a bad one failed after it
    examples = load_examples(a.dataset)[-a.prompts:]
    searched = []
    if a.search is not None:
        try:
            found = json.loads(a.search.read_text())["layouts"][: a.top]
            searched = [DecodeConfig.from_dict(r["decode"]) for r in found]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            ap.error(f"--search {a.search}: not a space-tree tree_search.json ({type(e).__name__}: {e})")
        if not searched:
            ap.error(f"--search {a.search}: holds no layout")
    model, tok, spec = load_space(a.model, a.adapter)
    kernels = apply_kernels(model, a.kernels)
    prompts = [torch.tensor(chat_ids(tok, ex.context)) for ex in examples]
    grid = [DecodeConfig(k, g, lookup_tokens=lt) for k in a.mask_nums
            for g in sorted({1, 2, 3, k + 1}) if g <= k + 1 for lt in lookups]
    grid += [cfg.override(lookup_tokens=lt) for cfg in searched for lt in lookups]
    grid = list(dict.fromkeys(grid))
    stats = {cfg: [0, 0.0, 0] for cfg in grid}
    ar_tokens = ar_time = 0.0
    for ids in prompts:
        r = ar_generate(model, ids, a.max_new_tokens, stop_token_ids=[tok.eos_token_id])  # no masks: the base model
        ar_tokens, ar_time = ar_tokens + len(r.new_ids), ar_time + r.wall_time
        for cfg in grid:
            out = SpaceDecoder(model, spec, cfg).generate(ids, a.max_new_tokens, stop_token_ids=[tok.eos_token_id])
            s = stats[cfg]
            s[0], s[1], s[2] = s[0] + len(out.new_ids), s[1] + out.wall_time, s[2] + out.num_steps
        print(f"prompt done: AR {len(r.new_ids)} tokens", flush=True)
    ar_tps = ar_tokens / ar_time
    rows = sorted(({"decode": cfg.to_dict(), "tokens_per_s": round(n / t, 2), "tokens_per_step": round(n / st, 2),
                    "speedup_vs_ar": round(n / t / ar_tps, 3)} for cfg, (n, t, st) in stats.items()),
                  key=lambda r: -r["tokens_per_s"])
    for r in rows:
        print(json.dumps(r))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    # the prompts decoded: the set may hold fewer than --prompts
    write_text_atomic(a.out, json.dumps({"kernels": kernels, "prompts": len(prompts),
                                         "max_new_tokens": a.max_new_tokens, "ar_tokens_per_s": round(ar_tps, 2), "ranking": rows}, indent=2))
    best = rows[0]
    print(f"best: {json.dumps(best['decode'])} -> {a.out}")


if __name__ == "__main__":
    console("tune_layout", main)()
