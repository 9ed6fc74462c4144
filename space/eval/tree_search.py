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
``--out/tree_search.json``, and ``--write-adapter`` stores the best in the adapter's (or a full
SAR-SFT checkpoint's, given as ``--model``) ``space_config.json`` under ``"decode"`` (the default
of space-eval, run_eval.sh and the API), with the measured curve as its ``"step_cost"``
``[[rows, ms], ...]``, so that a dynamic tree (``tree: "dynamic"``, issue 31, now or after a later
switch) prices rows with this machine's costs.

The replay cannot play a dynamic tree (its tree is chosen each step from the drafts'
probabilities, which the ranks do not hold): a current layout that is dynamic is not estimated,
and ``--dynamic --write-adapter`` stores the dynamic tree (the artifact's trained k, capped by
``--max-mask-num``, k+1 groups, row budget ``--max-rows``, the curve) instead of the best static
layout, unestimated: compare it with ``space-eval --tree dynamic``.

Example::

    space-tree --adapter adapters/smollm2-135m-space --ranks results/probe_stage2/ranks.jsonl \\
        --out runs/tree --write-adapter
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..choices import COMPILE_MODES
from ..cli import (add_debug_flag, add_device_flag, add_threads_flag, console, device_flag, output_file,
                   set_threads)
from ..jsonl import write_text_atomic
from .probe import base_model_name
from .resume import adapter_sha256, model_files
from .step_cost import adapter_cost, curve_points, curve_setup, step_cost_curve, step_cost_points

if TYPE_CHECKING:
    import torch

    from ..decoding.config import DecodeConfig

NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def read_ranks_file(path: Path) -> tuple[dict | None, list[dict]]:
    """``space-probe``'s ranks.jsonl: (its meta line or None for a file written before it had one,
    the per-sample rows ``{"id", "source", "ranks"}``), every row checked.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8, a line that is not JSON, a row without ``ranks``, or ranks that are
            not an (anchors, k) list of integers >= -1 with one k in the whole file (file and line named).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ranks file (space-probe --out DIR writes DIR/ranks.jsonl)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file (byte {e.start}); is this space-probe's ranks.jsonl?") from None
    meta, rows, width = None, [], None
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}); is this space-probe's ranks.jsonl?") from None
        if isinstance(row, dict) and "meta" in row and not rows and meta is None:
            meta = row["meta"] if isinstance(row["meta"], dict) else {}
            continue
        if not isinstance(row, dict) or "ranks" not in row:
            raise ValueError(f"{where}: no 'ranks' field (is this space-probe's ranks.jsonl?)")
        ranks = row["ranks"]
        if not isinstance(ranks, list) or not all(isinstance(r, list) for r in ranks):
            raise ValueError(f"{where}: 'ranks' must be a list of per-anchor lists of ranks")
        for r in ranks:
            if width is None:
                width = len(r)
            if len(r) != width or not width or not all(type(x) is int and x >= -1 for x in r):
                raise ValueError(f"{where}: ranks must be integers >= -1 (-1: no token), {width or 'k >= 1'} per "
                                 f"anchor in the whole file, got {r!r}")
        rows.append(row)
    return meta, rows


def load_ranks(path: Path, source: str | None = None) -> list[torch.Tensor]:
    """Per sample, the (anchors, k) long tensor of ``space-probe``'s ranks.jsonl (only the samples
    of ``source``, e.g. "mbpp", when given).

    Raises:
        FileNotFoundError / ValueError: as :func:`read_ranks_file`.
    """
    import torch

    _, rows = read_ranks_file(path)
    # a too-short answer has no anchor
    return [torch.tensor(row["ranks"], dtype=torch.long) for row in rows
            if row["ranks"] and source in (None, row.get("source"))]


def check_ranks_source(meta: dict | None, path: Path, model: str | None, adapter: Path | None) -> None:
    """Refuse ranks another adapter or model produced: their drafts are not this one's.

    ``meta`` is the ranks file's meta line (:func:`read_ranks_file`); a file without one (an
    older space-probe) cannot be checked, which is said on stderr. A model folder (a full SAR-SFT
    checkpoint) is compared by its files too (``resume.model_files`` without the tuned layout)
    where the ranks record them: one retrained in place keeps its path.

    Raises:
        ValueError: the ranks' adapter (by a hash of its files) or model (by name, and by its
            files) differs (both named).
    """
    if meta is None:
        print(f"[space-tree] warning: {path} does not record which adapter produced it (an older space-probe); "
              "make sure it is this adapter's", file=sys.stderr, flush=True)
        return
    digest, base = adapter_sha256(adapter), base_model_name(model, adapter)
    if meta.get("adapter_sha256") != digest:
        ranks_by = f"adapter {meta.get('adapter')} (sha256 {str(meta.get('adapter_sha256'))[:12]})" \
            if meta.get("adapter_sha256") else "no adapter"
        this = f"adapter {adapter} (sha256 {digest[:12]})" if digest else "no adapter"
        raise ValueError(f"{path} holds the ranks of {ranks_by}, not of {this}: run space-probe on this adapter")
    from ..models import model_identity

    if model_identity(str(meta.get("model"))) != model_identity(base):  # an alias and its folder are one model
        raise ValueError(f"{path} holds the ranks of base model {meta.get('model')!r}, not of {base!r}: "
                         "run space-probe with this model")
    if meta.get("model_files") is not None and meta["model_files"] != model_files(base, layout=False):
        raise ValueError(f"{path} holds the ranks of {base!r} as its files were then: the model has changed since "
                         "(retrained or overwritten in place); run space-probe on it again")


def _key(decode: dict) -> tuple:
    """What makes two decode dicts the same layout (num_groups None is k+1; the dynamic tree's
    own settings and the step-cost curve are not part of a static layout)."""
    groups = decode["num_groups"] if decode["num_groups"] is not None else decode["mask_num"] + 1
    tree = decode["tree"] if decode["tree"] in (None, "dynamic") else tuple(map(tuple, decode["tree"]))
    return decode["mask_num"], groups, tree, decode["lookup_tokens"], decode["lookup_ngram"]


def estimate(held: list[torch.Tensor], cfg: DecodeConfig, curve: dict[int, float], buckets: bool = False) -> dict:
    """Replay ``cfg`` (a DecodeConfig) over the ranks ``held``: tokens/step, rows/step and the
    estimated speedup over AR, tokens * cost(1) / sum of the steps' costs. ``buckets``: each step
    is priced at its row bucket, as a compiled decoder pads a static layout's steps
    (``dynamic.bucket`` up to the layout's bucketed ``max_rows``); rows/step stays unpadded.

    Raises:
        ValueError: ``cfg`` is the dynamic tree, which the replay cannot play.
    """
    from ..decoding.dynamic import BUCKETS, StepCost, bucket
    from ..decoding.tree import replay

    if cfg.tree == "dynamic":
        raise ValueError("the replay cannot estimate the dynamic tree (its tree is chosen each step from the drafts' "
                         "probabilities); time it with space-eval --tree dynamic")
    res = replay(held, cfg.mask_num, cfg.groups, cfg.tree)
    cost = StepCost(tuple(sorted(curve.items())))  # the one interpolation of the curve, relative to 1 row
    top = bucket(cfg.max_rows(), BUCKETS[-1])  # the largest bucket a step of this layout pads to
    priced = [bucket(q, top) for q in res.rows] if buckets else res.rows
    return {"decode": cfg.to_dict(), "nodes": len(cfg.tree) if cfg.tree else cfg.mask_num,
            "tokens_per_step": round(res.tokens_per_step, 4), "rows_per_step": round(sum(res.rows) / res.steps, 2),
            "est_speedup": round(res.tokens / sum(cost(q) for q in priced), 4)}


def search(ranks: list[torch.Tensor], curve: dict[int, float], max_mask_num: int, max_rows: int,
           current: DecodeConfig | None = None, buckets: bool = False) -> list[dict]:
    """Every layout up to ``max_mask_num`` and ``max_rows`` rows per step, replayed on the odd samples
    with trees grown on the even ones; sorted by estimated speedup over AR (best first).

    ``current`` (the adapter's DecodeConfig, or None) is estimated too and flagged ``"current":
    True``, so the best is never estimated slower than it; that needs its k within the ranks' k
    and a static layout with a mask group (the dynamic tree and prompt lookup alone cannot be replayed:
    they are left out). Every layout keeps
    ``current``'s prompt-lookup settings: the replay does not model lookup, so the search cannot
    choose it (``scripts/tune_layout.py --search`` times it); and its row budget, draft ranks and
    step-cost prices (curve and adapter cost, a pair), which a later switch to the dynamic tree would use.
    """
    from ..decoding.config import DecodeConfig
    from ..decoding.tree import grow_tree, path_probs_from_ranks

    fit, held = ranks[0::2], ranks[1::2] or ranks
    lookup = {} if current is None else {"lookup_tokens": current.lookup_tokens, "lookup_ngram": current.lookup_ngram,
                                         "lookup_branches": current.lookup_branches,
                                         "row_budget": current.row_budget, "draft_ranks": current.draft_ranks,
                                         "step_cost": current.step_cost, "adapter_cost": current.adapter_cost}
    width = min(r.shape[1] for r in ranks)
    results = []
    for k in range(1, min(max_mask_num, width) + 1):
        probs = path_probs_from_ranks([r[:, :k] for r in fit])
        chain = tuple((0,) * d for d in range(1, k + 1))
        trees = [None] + [t for t in dict.fromkeys(grow_tree(probs, n, k) for n in NODE_COUNTS) if t and t != chain]
        for groups in range(1, k + 2):
            for tree in trees:
                cfg = DecodeConfig(k, groups, tree=tree, **lookup)
                if cfg.max_rows() - cfg.lookup_tokens <= max_rows:  # the replay plays no lookup branch
                    results.append(estimate(held, cfg, curve, buckets))
    # prompt lookup alone (no mask group) is not replayed either: the replay plays mask drafts only
    if current is not None and current.tree != "dynamic" and current.groups > 0 and current.mask_num <= width:
        mine = next((r for r in results if _key(r["decode"]) == _key(current.to_dict())), None)
        if mine is None:
            mine = estimate(held, current, curve, buckets)
            results.append(mine)
        mine["current"] = True
    return sorted(results, key=lambda r: -r["est_speedup"])


def write_decode(adapter: Path, decode: dict, curve: dict[int, float] | None = None,
                 setup: dict | None = None) -> None:
    """Store ``decode`` in the adapter's space_config.json, atomically, keeping the other keys; with
    ``curve`` (measured {rows: seconds}), as its ``"step_cost"`` (:func:`step_cost_points`).

    ``setup`` (threads and kernels the curve was measured with) goes beside it as
    ``"step_cost_setup"`` whenever the stored layout holds a curve (the dynamic tree's prices; a
    static layout's, for a ``tree="dynamic"`` override), so ``space-eval`` can warn when a run's
    setup differs (issue 44); else any old one is dropped.

    The curve and adapter cost are also kept in ``"step_costs"``, one entry per
    setup (threads, kernels, device type, captured steps, compile mode, packed kernel, CPU or GPU, dtype:
    ``artifact.setup_key``), replacing only the entry of the same setup: a curve written at 2
    threads leaves the 1-thread one, one measured on oneDNN leaves MKL's, a compiled trunk's the
    eager one's, and ``load_space`` / ``space-eval`` price rows by the
    entry of their own setup (``artifact.priced_for_setup``).

    Raises:
        ValueError: the file's ``step_costs`` is malformed (``artifact.stored_step_costs``).
    """
    from ..artifact import SPACE_CONFIG, setup_key, stored_step_costs

    path = adapter / SPACE_CONFIG
    cfg = json.loads(path.read_text())
    cfg["decode"] = decode if curve is None else {**decode, "step_cost": step_cost_points(curve)}
    if setup is not None and cfg["decode"].get("step_cost"):
        cfg["step_cost_setup"] = setup
        keys = ("threads", "kernels", "device", "capture", "compile", "trunk", "packed_kernel", "cpu", "gpu", "dtype")
        entry = {**{k: setup[k] for k in keys if k in setup},
                 "step_cost": cfg["decode"]["step_cost"], "adapter_cost": cfg["decode"].get("adapter_cost", 0.0)}
        others = [e for e in stored_step_costs(cfg, path) if setup_key(e) != setup_key(entry)]
        # compile is a bool or a mode's name: compared as text
        cfg["step_costs"] = sorted(others + [entry],
                                   key=lambda e: (*map(str, setup_key(e)[2:]), e["kernels"], e["threads"]))
    else:
        cfg.pop("step_cost_setup", None)
    write_text_atomic(path, json.dumps(cfg, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="space-tree", description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", type=Path, default=None, help="the SPACE adapter whose drafts the ranks measure "
                   "(default: none, the model's own mask tokens, as space-probe --model)")
    p.add_argument("--model", default=None, help="base model (default: the adapter's), or a full SAR-SFT checkpoint "
                   "without --adapter")
    p.add_argument("--ranks", type=Path, required=True, help="space-probe's ranks.jsonl for this adapter and model")
    p.add_argument("--max-mask-num", type=int, default=5, help="largest k tried (default: %(default)s)")
    p.add_argument("--max-rows", type=int, default=64, help="largest block (rows per step) tried (default: %(default)s)")
    p.add_argument("--cache-len", type=int, default=300,
                   help="cached tokens behind the timed block (default: %(default)s)")
    p.add_argument("--kernels", default=None, help="CPU kernels, fast or stock, as space-eval --kernels "
                   "(default: fast, stock with --compile)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="measure the curve on the compiled trunk over a static cache, as space-eval --compile runs "
                        "(space/decoding/compiled.py; its graphs build first, minutes), price steps at their row "
                        "bucket, and store the curve for that setup (frozen: on a CPU, with --kernels stock)")
    p.add_argument("--buckets", action="store_true", help="price each step at its row bucket, as a --compile run "
                   "pads static layouts (space/decoding/compiled.py), with an eager curve")
    p.add_argument("--capture", action="store_true", help="measure the curve through captured steps (one CUDA graph "
                   "per row count, space/decoding/graphs.py), as space-eval --capture runs them, and store it for that "
                   "setup")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16: the trunk's dtype, as the "
                   "space-eval runs this curve prices (a bf16 trunk's steps cost otherwise; stored per dtype); "
                   "default: %(default)s")
    add_threads_flag(p)
    add_device_flag(p)
    p.add_argument("--out", type=Path, default=Path("runs/tree"), help="folder for tree_search.json (default: %(default)s)")
    p.add_argument("--write-adapter", action="store_true", help="store the best layout in the adapter's "
                   "space_config.json (a full SAR-SFT checkpoint's, given as --model), with the measured step-cost "
                   "curve (its current layout stays when it is already the best estimate; the curve is updated)")
    p.add_argument("--dynamic", action="store_true", help="store the dynamic tree (tree 'dynamic': the artifact's "
                   "trained k capped by --max-mask-num, k+1 groups, the current lookup setting, row budget "
                   "--max-rows, 4 draft ranks, the measured step-cost curve) instead of the best static layout, "
                   "with --write-adapter; without it, only report it. The search cannot replay a dynamic tree, "
                   "so it is not estimated: compare it with space-eval --tree dynamic")
    add_debug_flag(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    """Measure the step-cost curve, search the layouts, write ``tree_search.json``; returns it.

    Raises:
        FileNotFoundError: no ranks file or adapter.
        ValueError: bad sizes, --threads or --device, a malformed ranks file, ranks another adapter
            or base model produced, --write-adapter without an artifact (--adapter or a full
            checkpoint), --compile with --capture or --kernels fast, or a mode the device cannot
            run (``loader.check_compile``), or no static layout within --max-rows. Ranks of fewer
            offsets than --max-mask-num asks for are no error (the search stops at the ranks' k).
    """
    a = build_parser().parse_args(argv)
    for flag, value, least in (("--max-mask-num", a.max_mask_num, 1), ("--max-rows", a.max_rows, 2),
                               ("--cache-len", a.cache_len, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if a.max_rows < 3:  # found after the curve was timed: the smallest static layout, x + 1 candidate + 1 mask
        raise ValueError(f"no static layout fits in --max-rows {a.max_rows} rows (the smallest needs 3)")
    try:  # a file given for the folder, or one under a file: found when the results were written, after the timing
        output_file(str(a.out / "tree_search.json"))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--out {a.out}: {e}") from None
    from ..artifact import artifact_folder

    folder = artifact_folder(a.model, a.adapter)  # the adapter, or a full SAR-SFT checkpoint as --model
    if a.write_adapter and folder is None:
        raise ValueError("--write-adapter needs --adapter, or a full SAR-SFT checkpoint as --model")
    set_threads(a.threads)
    a.device = device_flag(a.device)
    from ..choices import KERNEL_CHOICES
    from ..loader import check_compile

    if a.kernels is None:
        a.kernels = "stock" if a.compile else "fast"
    if a.kernels not in KERNEL_CHOICES:
        raise ValueError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {a.kernels!r}")
    if a.compile and (a.capture or a.kernels != "stock"):  # as space-eval refuses them
        raise ValueError("--compile measures the compiled trunk with the stock kernels: drop --capture and "
                         "--kernels fast")
    check_compile(a.compile or False, a.device)
    meta, _ = read_ranks_file(a.ranks)
    check_ranks_source(meta, a.ranks, a.model, a.adapter)
    ranks = load_ranks(a.ranks)
    if not ranks:
        raise ValueError(f"{a.ranks} holds no samples")
    import torch

    from ..artifact import SPACE_CONFIG, compile_setup
    from ..cpu_kernels import apply_kernels
    from ..decoding.config import DecodeConfig
    from ..loader import load_space

    model, _, spec = load_space(a.model, a.adapter, a.max_mask_num, a.dtype, device=a.device, compile=a.compile or False,
                                step_cost="stored")  # this tool measures the curves itself
    if a.cache_len + a.max_rows > model.config.max_position_embeddings:
        raise ValueError(f"--cache-len + --max-rows = {a.cache_len + a.max_rows} exceeds the model's context "
                         f"of {model.config.max_position_embeddings}")
    applied = apply_kernels(model, a.kernels)
    current = DecodeConfig.of_model(model, spec.mask_num) if folder else None
    owner = "adapter" if a.adapter else "checkpoint"  # whose layout and curves (folder)
    points = curve_points(a.max_rows)
    graphs = None
    if a.capture:
        from ..decoding.graphs import StepGraphs

        # one slot bucket: every timed step reaches past half the slots, so a smaller one is never replayed
        slots = a.cache_len + a.max_rows
        graphs = StepGraphs(model, slots, points, min_slots=slots)
        seconds = graphs.capture()  # before the count is read: a GPU's graphs exist after it
        print(f"[space-tree] captured {graphs.num_graphs} step graphs in {seconds:.1f} s")
    # a compiled trunk steps over a static cache (space.decoding.compiled): its graphs build in the
    # curve's warm-up round
    static, mode = bool(a.compile), compile_setup(a.compile)
    curve = step_cost_curve(model, points, a.cache_len, static=static, graphs=graphs)
    # what the curve was measured with (artifact.setup_key)
    setup = {**curve_setup(model, a.kernels, a.capture), **({"compile": mode} if mode else {}),
             **({"packed_kernel": applied["packed_kernel"]} if applied.get("packed_linears") else {})}
    # captured steps pad every block to a bucket, as space-eval --capture runs them
    buckets = a.buckets or a.capture or static
    results = search(ranks, curve, min(a.max_mask_num, spec.mask_num), a.max_rows, current, buckets)
    if not results:  # the smallest static layout, x + 1 candidate + a group of 1 mask, is 3 rows
        raise ValueError(f"no static layout fits in --max-rows {a.max_rows} rows (the smallest needs 3)")
    dynamic = None
    if a.dynamic:  # the replay cannot play it: stored unestimated
        k = min(a.max_mask_num, spec.mask_num)
        lookup = DecodeConfig() if current is None else current
        dynamic = DecodeConfig(k, k + 1, lookup.lookup_tokens, lookup.lookup_ngram, tree="dynamic",
                               row_budget=a.max_rows, lookup_branches=lookup.lookup_branches,
                               datastore_branches=lookup.datastore_branches, draft_ranks=4,
                               step_cost=tuple(map(tuple, step_cost_points(curve))),
                               adapter_cost=adapter_cost(model, a.cache_len, graphs=graphs, static=static)).to_dict()
    best, mine = results[0], next((r for r in results if r.get("current")), None)
    chain = next((r for r in results if r["decode"]["tree"] is None
                  and _key(r["decode"])[:2] == _key(best["decode"])[:2]), None)
    report = {"adapter": a.adapter and str(a.adapter), "model": a.model, "ranks": str(a.ranks), "ranks_meta": meta,
              "samples": len(ranks), "threads": torch.get_num_threads(), "dtype": setup["dtype"], "buckets": buckets, "capture": a.capture,
              "compile": mode, "step_cost_setup": setup,
              "step_cost_ms": {q: round(s * 1e3, 3) for q, s in curve.items()}, "best": best, "current": mine,
              "chain_same_layout": chain, "lookup_modelled": False, "dynamic": dynamic, "layouts": results}
    write_text_atomic(a.out / "tree_search.json", json.dumps(report, indent=1) + "\n")
    print(f"[space-tree] step cost (ms) by rows: {report['step_cost_ms']}")
    for r in results[:8]:
        print(f"  est. {r['est_speedup']:.3f}x  {r['tokens_per_step']:.3f} tokens/step  {r['rows_per_step']:5.1f} rows  "
              f"{json.dumps(r['decode'])}{'  (current)' if r.get('current') else ''}")
    if chain is not None:
        print(f"[space-tree] best vs its chain: {best['tokens_per_step'] / chain['tokens_per_step']:.2f}x tokens/step, "
              f"{best['est_speedup'] / chain['est_speedup']:.2f}x est. speed")
    if current is not None and current.tree == "dynamic":
        print(f"[space-tree] the {owner}'s current layout is the dynamic tree, which the replay cannot estimate: "
              "it is not among the layouts (compare them with space-eval --tree dynamic)")
    if current is not None and current.lookup_tokens:
        print(f"[space-tree] prompt lookup (lookup_tokens {current.lookup_tokens}) is not modelled by the replay: every "
              f"layout keeps the {owner}'s setting; time it with scripts/tune_layout.py --search")
    if best["est_speedup"] < 1:
        print(f"[space-tree] warning: every layout is estimated slower than AR here (best {best['est_speedup']:.3f}x); "
              "check with space-eval before shipping one", file=sys.stderr, flush=True)
    if dynamic is not None:
        print(f"[space-tree] dynamic tree (not estimated: the replay cannot play it): {json.dumps(dynamic)}")
    print(f"[space-tree] wrote {a.out / 'tree_search.json'}")
    if a.write_adapter:
        where = folder / SPACE_CONFIG
        # a static layout stores the curve for a tree="dynamic" override: the adapter cost is measured
        # with it, not the one the adapter was priced with at load (another setup's)
        fixed = adapter_cost(model, a.cache_len, graphs=graphs, static=static) if dynamic is None else None
        if dynamic is not None:
            write_decode(folder, dynamic, setup=setup)
            print(f"[space-tree] stored the dynamic tree (k = {dynamic['mask_num']}, row budget {a.max_rows}) with "
                  f"this machine's step-cost curve in {where}; time it with space-eval --tree dynamic")
        elif best is mine:
            if current.to_dict()["step_cost"] == step_cost_points(curve):
                print(f"[space-tree] the {owner}'s current layout is already the best estimate: {where} left unchanged")
            else:
                write_decode(folder, {**current.to_dict(), "adapter_cost": fixed}, curve, setup=setup)
                print(f"[space-tree] the {owner}'s current layout is already the best estimate: kept it, with this "
                      f"machine's step-cost curve, in {where}")
        else:
            if mine:
                was = f"current layout est. {mine['est_speedup']:.3f}x"
            elif current is not None and current.tree == "dynamic":
                was = "replaces the current dynamic tree, not estimated"
            elif current is not None and current.groups == 0:
                was = "replaces the current layout of prompt lookup alone, not estimated"
            else:
                was = (f"current layout (k = {current.mask_num}) not estimated: the ranks have k = "
                       f"{min(r.shape[1] for r in ranks)}")
            write_decode(folder, {**best["decode"], "adapter_cost": fixed}, curve, setup=setup)
            print(f"[space-tree] stored the best layout (est. {best['est_speedup']:.3f}x; {was}) with this machine's "
                  f"step-cost curve in {where}")
    return report


cli = console("space-tree", main)

if __name__ == "__main__":
    cli()
