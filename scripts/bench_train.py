"""Training throughput (issue: SAR-SFT): frozen-base two-pass step vs one full forward/backward.

Both sides run the same SmolLM2 batch (LIMA samples cut to --seq tokens, k masks in
--spans groups per sample) with an AdamW step, on this CPU; medians of --repeats steps.

    python scripts/bench_train.py --out results/bench_train.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from space.adapter_layers import prepare_model
from space.cli import output_file, positive_int
from space.data.collator import SpaceCollator
from space.data.sft import load_examples, tokenize
from space.jsonl import write_text_atomic
from space.models import load_model
from space.config import SpaceSettings
from space.train.steps import sar_step


def time_steps(model, batch, settings: SpaceSettings, repeats: int) -> float:
    """Median seconds of the training step (``space.train.steps.sar_step``) + backward + AdamW."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        sar_step(model, batch, settings).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seq", type=positive_int, default=512)
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--mask-num", type=positive_int, default=5)
    ap.add_argument("--spans", type=positive_int, default=8)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--out", type=output_file, default=Path("results/bench_train.json"))
    a = ap.parse_args()
    res = {"seq": a.seq, "batch": a.batch, "mask_num": a.mask_num, "spans_per_sample": a.spans,
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    for mode in ("frozen-base", "full"):
        model, tok = load_model(a.model)
        model.train()
        model, spec = prepare_model(model, tok, mode, a.mask_num)
        data = tokenize(load_examples("lima", limit=200), tok, a.seq)
        long = [row for row in data if len(row["input_ids"]) == a.seq][: a.batch]
        if len(long) < a.batch:  # tokenize drops a row whose prompt leaves no response token in --seq
            raise SystemExit(f"only {len(long)} of the first 200 LIMA rows fill --seq {a.seq} with a response "
                             f"token in it; --batch {a.batch} needs {a.batch}: raise --seq or lower --batch")
        col = SpaceCollator(spec.ids_for(a.mask_num), a.mask_num, tok.pad_token_id, spans_per_sample=a.spans)
        batch = col(long)
        secs = time_steps(model, batch, SpaceSettings(mode=mode, mask_num=a.mask_num), a.repeats)
        res[mode] = {"step_s": round(secs, 3), "tokens_per_s": round(a.batch * a.seq / secs, 1)}
        print(mode, res[mode], flush=True)
        del model
    res["frozen_base_vs_full"] = round(res["frozen-base"]["tokens_per_s"] / res["full"]["tokens_per_s"], 2)
    print("frozen-base two-pass / full forward-backward tokens/s:", res["frozen_base_vs_full"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out, json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
