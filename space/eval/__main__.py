"""``python -m space.eval`` / ``space-eval``: speedup, tokens/step, exactness and pass@k in one run.

Example (the main job, what ``run_eval.sh`` runs)::

    python -m space.eval --model smollm2-135m-instruct --adapter adapters/smollm2-135m-space \\
        --dataset humaneval --limit 10 --methods ar,hf,pld,space --out runs/eval/humaneval
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import transformers

from ..adapters import git_commit, load_space
from ..cpu_kernels import KERNEL_CHOICES, apply_kernels
from ..decoding import SamplingConfig, SpaceDecoder
from ..models import SMOLLM2
from .bench import METHODS, Target, run_bench
from .report import write_reports
from .tasks import DATASETS, load_tasks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="space-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help=f"alias ({SMOLLM2}, tiny-random-llama) or local HF directory; "
                   "default: the adapter's base, else " + SMOLLM2)
    p.add_argument("--adapter", default=None, help="a lora / frozen-base SPACE adapter directory")
    p.add_argument("--dataset", default="humaneval", help=f"one of {', '.join(DATASETS)} or a .jsonl file")
    p.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data or $SPACE_DATA)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default all)")
    p.add_argument("--mask-num", type=int, default=None, help="k drafts per step (default: the adapter's k, else 5)")
    p.add_argument("--num-groups", type=int, default=None, help="mask groups per step, 1..k+1 (default k+1)")
    p.add_argument("--lookup-tokens", type=int, default=0,
                   help="space: also try up to N prompt-lookup candidates per step when an n-gram recurs (0 = pure SPACE)")
    p.add_argument("--methods", default="ar,hf,pld,space", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1, help="samples per question (pass@n needs temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (fp32 is fastest on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default="fast",
                   help="fast: oneDNN-packed linears + GQA attention for every method on an fp32 CPU "
                        "(space/cpu_kernels.py); stock: transformers' own kernels")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/eval/<dataset>); reruns resume")
    return p


# settings that shape every sample: a folder's samples are only resumed under the same values
RESUME_KEYS = ("model", "adapter", "dataset", "mask_num", "num_groups", "lookup_tokens", "max_new_tokens",
               "temperature", "top_p", "top_k", "seed", "dtype", "kernels")


def check_resume(out: Path, meta: dict) -> None:
    """Record the run's settings in ``out/run_config.json``; refuse to mix in samples made otherwise.

    Raises:
        ValueError: ``out`` holds samples whose recorded settings (run_config.json, or the meta of
            an older summary.json) differ from ``meta`` in a RESUME_KEYS entry.
    """
    recorded = next((out / name for name in ("run_config.json", "summary.json") if (out / name).is_file()), None)
    if recorded is not None and (out / "samples.jsonl").is_file():
        old = json.loads(recorded.read_text())
        old = {"lookup_tokens": 0, **old.get("meta", old)}  # runs from before the option were pure SPACE
        diff = {k: (old.get(k), meta[k]) for k in RESUME_KEYS if old.get(k) != meta[k]}
        if diff:
            raise ValueError(f"{out} holds samples made with other settings ({recorded.name}); "
                             f"(theirs, now): {diff}. Use another --out, or delete it to start over")
    tmp = out / "run_config.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out / "run_config.json")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise ValueError(f"unknown method(s) {bad}; choose from {METHODS}")
        if args.num_samples > 1 and args.temperature == 0:
            raise ValueError("--num-samples > 1 needs --temperature > 0 (greedy samples are identical)")
        tasks = load_tasks(args.dataset, args.data_root, args.limit)
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
        if args.threads:
            torch.set_num_threads(args.threads)
        model, tok, spec = load_space(args.model, args.adapter, args.mask_num or 5, args.dtype, args.device)
        kernels = apply_kernels(model, args.kernels)
        k = args.mask_num or spec.mask_num or 5
        decoder = SpaceDecoder(model, spec, k, args.num_groups, lookup_tokens=args.lookup_tokens)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        sys.exit(f"space-eval: error: {e}")
    out = args.out or Path("runs/eval") / args.dataset.replace(":", "-").replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    base = args.model or (json.loads((Path(args.adapter) / "space_config.json").read_text())["base_model"]
                          if args.adapter else SMOLLM2)
    meta = {"model": base, "adapter": args.adapter,
            "dataset": args.dataset, "limit": args.limit, "num_questions": len(tasks), "methods": methods,
            "mask_num": k, "num_groups": decoder.num_groups, "lookup_tokens": args.lookup_tokens, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "num_samples": args.num_samples,
            "seed": args.seed, "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
            "kernels": kernels,
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": git_commit()}
    try:
        check_resume(out, meta)
    except ValueError as e:
        sys.exit(f"space-eval: error: {e}")
    records = run_bench(Target(model, tok, spec, decoder), tasks, methods, out / "samples.jsonl",
                        args.max_new_tokens, sampling, args.num_samples)
    wanted = {t.question_id for t in tasks}
    records = [r for r in records if r["question_id"] in wanted and r["model_id"] in methods]
    summary = write_reports(records, meta, out)
    print((out / "summary.md").read_text())
    print(f"[space-eval] wrote {out}/samples.jsonl, summary.json, summary.md and plots")
    return summary


if __name__ == "__main__":
    main()
