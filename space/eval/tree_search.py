"""``space-tree``: choose the decode layout (k, groups, token tree) that is fastest on this machine.

Issue #14, DESIGN §3.5. Two measured inputs, no timed decoding:

1. the acceptance probe's teacher-forced ranks (``space-probe`` writes ``ranks.jsonl``): trees are
   grown greedily from the measured probability that a path of ranks is right
   (``space.decoding.tree.grow_tree``) on half the probe's samples, and every candidate layout is
   replayed exactly (``space.decoding.tree.replay``) on the other half, giving its tokens and the
   block rows of every step;
2. the step-cost curve of this model on this machine: the median time of one SPACE-like forward of
   q rows (4-D mask, adapter on the mask rows, LM head on every row) after a cache of typical
   length, q from 1 to ``--max-rows``. Host work per step is not in it, so the estimate is
   optimistic for large layouts; measure the winner with ``space-eval`` before shipping it.

A layout's estimated speedup over AR is ``tokens * cost(1) / sum over steps of cost(rows)``: it
maximizes tokens per second, not tokens per step. The best layout is printed, all of them go to
``--out/tree_search.json``, and ``--write-adapter`` stores the best in the adapter's
``space_config.json`` under ``"decode"`` (the default of space-eval, run_eval.sh and the API).

Example::

    space-tree --adapter adapters/smollm2-135m-space --ranks results/probe_stage2/ranks.jsonl \\
        --out runs/tree --write-adapter
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from ..adapters import SPACE_CONFIG, load_space
from ..cli import add_debug_flag, console
from ..cpu_kernels import KERNEL_CHOICES, apply_kernels
from ..decoding.cache import cache_input, crop_cache
from ..decoding.config import DecodeConfig
from ..decoding.tree import grow_tree, path_probs_from_ranks, replay
from ..masking import mask_rows, to_additive_4d

NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def load_ranks(path: Path, source: str | None = None) -> list[torch.Tensor]:
    """Per sample, the (anchors, k) ranks of ``space-probe``'s ranks.jsonl (only the samples of
    ``source``, e.g. "mbpp", when given).

    Raises:
        FileNotFoundError: no such file. ValueError: a row without ``ranks``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ranks file (space-probe --out DIR writes DIR/ranks.jsonl)")
    out = []
    for i, line in enumerate(path.read_text().split("\n")):
        if line.strip():
            row = json.loads(line)
            if "ranks" not in row:
                raise ValueError(f"{path}:{i + 1}: no 'ranks' field (is this space-probe's ranks.jsonl?)")
            if row["ranks"] and source in (None, row.get("source")):  # a too-short answer has no anchor
                out.append(torch.tensor(row["ranks"], dtype=torch.long))
    return out


@torch.inference_mode()
def step_cost_curve(model, rows: list[int], cache_len: int = 300, repeats: int = 15) -> dict[int, float]:
    """Median seconds of one SPACE-like forward of q rows after ``cache_len`` cached tokens: an
    additive 4-D mask, the frozen-base LoRA on rows 1.. (``mask_rows(1)``: every row but the first
    treated as a mask row, an upper bound on a step's adapter work) and the LM head on every row.
    q = 1 is timed as an AR step (no mask rows). Returns {q: seconds}.

    Which ids and which visibility the rows have does not change the cost, only their number.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    device = head.weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(base.config.vocab_size, 1000), (cache_len + max(rows),), generator=gen).to(device)
    cache = DynamicCache(config=base.config)
    decoder(input_ids=ids[None, :cache_len], **cache_input(cache), use_cache=True)
    out = {}
    for q in tqdm(rows, desc="step cost", unit="shape"):
        times = []
        causal = torch.ones(q, cache_len + q, dtype=torch.bool).tril(cache_len)
        attn = to_additive_4d(causal, head.weight.dtype).to(device) if q > 1 else None
        positions = torch.arange(cache_len, cache_len + q, device=device)[None]
        for _ in range(repeats + 1):  # the first call of a shape warms it up
            t0 = time.perf_counter()
            with mask_rows(1 if q > 1 else q):
                hidden = decoder(input_ids=ids[None, cache_len:cache_len + q], position_ids=positions,
                                 attention_mask=attn, **cache_input(cache), use_cache=True).last_hidden_state
            head(hidden)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            crop_cache(cache, cache_len)
        out[q] = statistics.median(times[1:])
    return out


def interpolate(curve: dict[int, float], q: int) -> float:
    """Cost of q rows from the measured curve (linear between points, linear beyond the last)."""
    xs = sorted(curve)
    if q <= xs[0]:
        return curve[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if q <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (q - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return curve[hi] + (curve[hi] - curve[lo]) * (q - hi) / (hi - lo)


def search(ranks: list[torch.Tensor], curve: dict[int, float], max_mask_num: int, max_rows: int) -> list[dict]:
    """Every layout up to ``max_mask_num`` and ``max_rows`` rows per step, replayed on the odd samples
    with trees grown on the even ones; sorted by estimated speedup over AR (best first)."""
    fit, held = ranks[0::2], ranks[1::2] or ranks
    results = []
    ks = range(1, min(max_mask_num, min(r.shape[1] for r in ranks)) + 1)
    for k in tqdm(ks, desc="layouts (k)", unit="k"):
        probs = path_probs_from_ranks([r[:, :k] for r in fit])
        chain = tuple((0,) * d for d in range(1, k + 1))
        trees = [None] + [t for t in dict.fromkeys(grow_tree(probs, n, k) for n in NODE_COUNTS) if t and t != chain]
        for groups in range(1, k + 2):
            for tree in trees:
                cfg = DecodeConfig(k, groups, tree=tree)
                if 1 + (len(tree) if tree else k) + groups * k > max_rows:
                    continue
                res = replay(held, k, groups, cfg.tree)
                cost = sum(interpolate(curve, q) for q in res.rows)
                results.append({"decode": cfg.to_dict(), "nodes": len(tree) if tree else k,
                                "tokens_per_step": round(res.tokens_per_step, 4),
                                "rows_per_step": round(sum(res.rows) / res.steps, 2),
                                "est_speedup": round(res.tokens * curve[1] / cost, 4)})
    return sorted(results, key=lambda r: -r["est_speedup"])


def write_decode(adapter: Path, decode: dict) -> None:
    """Store ``decode`` in the adapter's space_config.json, atomically, keeping the other keys."""
    path = adapter / SPACE_CONFIG
    cfg = json.loads(path.read_text())
    cfg["decode"] = decode
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    """Measure the step-cost curve, search the layouts, write ``tree_search.json``; returns it.

    Raises:
        FileNotFoundError: no ranks file or adapter. ValueError: bad sizes, or ranks of fewer
            offsets than --max-mask-num asks for (then the search stops at the ranks' k).
    """
    p = argparse.ArgumentParser(prog="space-tree", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--adapter", type=Path, default=None, help="the SPACE adapter whose drafts the ranks measure "
                   "(none: the model's own mask tokens, as space-probe --model)")
    p.add_argument("--model", default=None, help="base model (default: the adapter's)")
    p.add_argument("--ranks", type=Path, required=True, help="space-probe's ranks.jsonl for this adapter")
    p.add_argument("--max-mask-num", type=int, default=5, help="largest k tried")
    p.add_argument("--max-rows", type=int, default=64, help="largest block (rows per step) tried")
    p.add_argument("--cache-len", type=int, default=300, help="cached tokens behind the timed block")
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default="fast", help="as space-eval --kernels")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (as the evaluation will use)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("runs/tree"), help="folder for tree_search.json")
    p.add_argument("--write-adapter", action="store_true", help="store the best layout in the adapter's space_config.json")
    add_debug_flag(p)
    a = p.parse_args(argv)
    if a.max_mask_num < 1 or a.max_rows < 2 or a.cache_len < 1:
        raise ValueError("--max-mask-num must be >= 1, --max-rows >= 2 and --cache-len >= 1")
    if a.write_adapter and a.adapter is None:
        raise ValueError("--write-adapter needs --adapter")
    ranks = load_ranks(a.ranks)
    if not ranks:
        raise ValueError(f"{a.ranks} holds no samples")
    if a.threads:
        torch.set_num_threads(a.threads)
    model, _, spec = load_space(a.model, a.adapter, a.max_mask_num, device=a.device)
    if a.cache_len + a.max_rows > model.config.max_position_embeddings:
        raise ValueError(f"--cache-len + --max-rows = {a.cache_len + a.max_rows} exceeds the model's context "
                         f"of {model.config.max_position_embeddings}")
    apply_kernels(model, a.kernels)
    points = sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, a.max_rows} & set(range(1, a.max_rows + 1)))
    curve = step_cost_curve(model, points, a.cache_len)
    results = search(ranks, curve, min(a.max_mask_num, spec.mask_num), a.max_rows)
    chain = next(r for r in results if r["decode"]["tree"] is None and r["decode"]["mask_num"] == results[0]["decode"]["mask_num"]
                 and r["decode"]["num_groups"] == results[0]["decode"]["num_groups"])
    report = {"adapter": a.adapter and str(a.adapter), "model": a.model, "ranks": str(a.ranks), "samples": len(ranks), "threads": torch.get_num_threads(),
              "step_cost_ms": {q: round(s * 1e3, 3) for q, s in curve.items()}, "best": results[0],
              "chain_same_layout": chain, "layouts": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tree_search.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[space-tree] step cost (ms) by rows: {report['step_cost_ms']}")
    for r in results[:8]:
        print(f"  est. {r['est_speedup']:.3f}x  {r['tokens_per_step']:.3f} tokens/step  {r['rows_per_step']:5.1f} rows  "
              f"{json.dumps(r['decode'])}")
    print(f"[space-tree] best vs its chain: {results[0]['tokens_per_step'] / chain['tokens_per_step']:.2f}x tokens/step, "
          f"{results[0]['est_speedup'] / chain['est_speedup']:.2f}x est. speed; wrote {a.out / 'tree_search.json'}")
    if a.write_adapter:
        write_decode(a.adapter, results[0]["decode"])
        print(f"[space-tree] stored the best layout in {a.adapter / SPACE_CONFIG}")
    return report


cli = console("space-tree", main)

if __name__ == "__main__":
    cli()
