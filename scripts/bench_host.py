"""Host time per SPACE step on the tiny trained drafter (issue 43, item 6).

The host's part of a step is everything outside the model's forward and LM head: the planner,
the block's layout, verification, the cache's compaction, drafting, prompt lookup, the records
(``DecodeResult.step_host``; ``step_plan`` is the planner + layout part). A tiny model makes the
model's part small, so the host's is what is left to see. The drafter is the test suite's
(``tests/conftest.py``: a tiny Llama trained for ~10 s on a cyclic language, k = 4, drafts
usually right), decoded with the shipped layout's kind: the dynamic tree + prompt lookup 10.

Prints and writes ``--out`` (JSON): median and mean host ms per step, plan ms, step ms, steps.
To compare two checkouts, run the script from each in turns on a quiet machine (the numbers move
with the machine's load; compare runs made side by side only)::

    python scripts/bench_host.py --out host.json  # results/host_time: 7 rounds against 2f8b19a, then 82ab8ce
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's space/ and tests/, not an installed copy

import torch  # noqa: E402

from space.cli import output_file, positive_int  # noqa: E402
from space.decoding import DecodeConfig, SpaceDecoder  # noqa: E402
from space.jsonl import write_text_atomic  # noqa: E402
from space.models import tiny_random_llama  # noqa: E402
from space.tokens import add_mask_tokens  # noqa: E402
from tests.conftest import TRAINED_K, CycleLanguage, train_drafter  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=positive_int, default=24, help="timed prompts, after --warmup more (default 24)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=output_file, help="JSON file to write")
    args = p.parse_args(argv)

    with torch.random.fork_rng():  # the `trained` fixture's recipe
        torch.manual_seed(0)
        model, tok = tiny_random_llama(seed=3)
        spec = add_mask_tokens(model, tok, mask_num=TRAINED_K)
        cycle = (11 + torch.randperm(200, generator=torch.Generator().manual_seed(0))[:40]).tolist()
        train_drafter(model, spec, CycleLanguage(cycle, seed=0), TRAINED_K, steps=200)
    torch.set_num_threads(args.threads)
    lang = CycleLanguage(cycle, seed=1)
    prompts = [torch.tensor(lang.sample(10 + i % 16)) for i in range(args.warmup + args.prompts)]
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10))
    host, plan, step, tokens = [], [], [], 0
    for i, prompt in enumerate(prompts):
        out = dec.generate(prompt, args.max_new_tokens)
        if i >= args.warmup:
            host += out.step_host
            plan += out.step_plan
            step += out.step_times
            tokens += len(out.new_ids)
    ms = lambda xs, f: round(f(xs) * 1e3, 4)  # noqa: E731
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "threads": args.threads, "prompts": args.prompts, "steps": len(host),
              "tokens_per_step": round(tokens / len(host), 3),
              "host_ms_median": ms(host, statistics.median), "host_ms_mean": ms(host, statistics.mean),
              "plan_ms_median": ms(plan, statistics.median), "step_ms_median": ms(step, statistics.median),
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
