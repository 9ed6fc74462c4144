"""SAR-SFT collator benchmark: milliseconds per micro-batch of ``SpaceCollator`` on this CPU.

Synthetic rows of the 7B recipes' shape (random ids, prompt a quarter of the length, every
sample --length tokens): the full-zero2 config collates 2 x 2048 with k = 5 and one span, the
LoRA config 4 x 2048 with two spans. Median of --repeats calls after a warm-up, single-threaded
by default (a dataloader worker). With --baseline, another collator module (for example the
committed one) is timed in the same run, calls interleaved, and its batch is checked against
this one's (a float additive mask is read as ``mask == 0``); --baseline-masking gives it its own
copy of ``space/masking.py`` too (else it uses this checkout's):

    git show HEAD:space/data/collator.py > /tmp/old_collator.py
    git show HEAD:space/masking.py > /tmp/old_masking.py
    python scripts/bench_collator.py --baseline /tmp/old_collator.py --baseline-masking /tmp/old_masking.py \
        --out results/bench_collator.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from space.cli import output_file, positive_int
from space.data.collator import SpaceCollator
from space.jsonl import write_text_atomic

VOCAB, MASK_ID, PAD_ID = 32000, 32000, 0


def load_module(name: str, path: Path):
    """Import the file at ``path`` as module ``name`` (inside the ``space`` package, so its relative
    imports resolve to this checkout's modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_collator(path: Path, masking: Path | None = None):
    """``SpaceCollator`` from a copy of ``space/data/collator.py``; with ``masking``, the layout
    functions it imported are replaced by those of that copy of ``space/masking.py``."""
    module = load_module("space.data._bench_baseline_collator", path)
    if masking is not None:
        layout = load_module("space._bench_baseline_masking", masking)
        for name in ("IGNORE_INDEX", "targets", "to_additive_4d", "train_layout", "truncate_layout"):
            if hasattr(module, name):
                setattr(module, name, getattr(layout, name))
    return module.SpaceCollator


def features(batch: int, length: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (length,), generator=gen).tolist(), "prompt_len": length // 4,
             "idx": i} for i in range(batch)]


def same_batch(got: dict, want: dict) -> bool:
    """Equal batches; a float additive mask (the old collator's) is compared as ``mask == 0``."""
    def as_bool(m):
        return m if m.dtype == torch.bool else m == 0
    return got.keys() == want.keys() and all(
        torch.equal(as_bool(got[k]), as_bool(want[k])) if k == "attention_mask"
        else torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor) else got[k] == want[k]
        for k in got)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=positive_int, default=2, help="samples per micro-batch")
    ap.add_argument("--length", type=positive_int, default=2048, help="tokens per sample")
    ap.add_argument("--mask-num", type=positive_int, default=5, help="k, masks per group")
    ap.add_argument("--spans-per-sample", type=positive_int, default=1, help="mask groups per sample")
    ap.add_argument("--span-density", type=float, default=0.0,
                    help="dense groups: share of answer positions that anchor one (overrides --spans-per-sample; 0 = off)")
    ap.add_argument("--layout", choices=["efficient", "truncate"], default="efficient")
    ap.add_argument("--repeats", type=positive_int, default=20, help="timed calls (median reported)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (1: a dataloader worker)")
    ap.add_argument("--baseline", type=Path, default=None, help="another collator.py to time against")
    ap.add_argument("--baseline-masking", type=Path, default=None,
                    help="the baseline's own masking.py (default: this checkout's)")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    feats = features(a.batch, a.length, seed=0)
    kwargs = dict(mask_ids=torch.tensor([MASK_ID]), mask_num=a.mask_num, pad_id=PAD_ID,
                  spans_per_sample=a.spans_per_sample, layout=a.layout, span_density=a.span_density)
    collators = {"current": SpaceCollator(**kwargs)}
    if a.baseline is not None:
        collators["baseline"] = load_collator(a.baseline, a.baseline_masking)(**kwargs)
    batches = {name: col(feats) for name, col in collators.items()}  # warm-up
    times = {name: [] for name in collators}
    for _ in range(a.repeats):  # interleaved: both see the same machine load
        for name, col in collators.items():
            t0 = time.perf_counter()
            col(feats)
            times[name].append(time.perf_counter() - t0)
    q = batches["current"]["input_ids"].shape[1]
    res = {"batch": a.batch, "length": a.length, "mask_num": a.mask_num, "spans_per_sample": a.spans_per_sample,
           "span_density": a.span_density,
           "layout": a.layout, "repeats": a.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "rows": q, "mask_bytes": batches["current"]["attention_mask"].nbytes}
    for name in collators:
        res[f"{name}_ms"] = round(statistics.median(times[name]) * 1e3, 2)
        print(f"{name:8s} median {res[f'{name}_ms']:8.2f} ms per micro-batch "
              f"({a.batch} x {a.length}, k={a.mask_num}, {a.spans_per_sample} span(s), Q={q}, {a.threads} thread(s))")
    if a.baseline is not None:
        res["baseline_mask_bytes"] = batches["baseline"]["attention_mask"].nbytes
        res["same_batch"] = same_batch(batches["current"], batches["baseline"])
        res["speedup"] = round(res["baseline_ms"] / res["current_ms"], 2)
        print(f"speedup {res['speedup']}x, same batch as the baseline: {res['same_batch']}, "
              f"mask {res['baseline_mask_bytes'] / 1e6:.1f} MB -> {res['mask_bytes'] / 1e6:.1f} MB")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.out, json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
