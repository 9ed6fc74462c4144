"""AR tokens/s with ``--kernels fast`` against ``--kernels stock``, in one run (issue 43, item 7).

A benchmark that reports SPACE's speedup against AR is honest only if AR runs at its fastest
kernels. This loads the model with the shipped adapter twice, stock and fast (whose linears pick
MKL's stock or packed GEMM per row count on this machine, ``space.cpu_kernels.choose_stock_rows``), and
decodes the same HumanEval prompts greedily with AR, alternating the two per prompt so that a
busy spell of the machine hits both. It also times one SPACE step shape (``--rows``) with each.

Prints per-kernel medians and the ratio, and writes ``--out`` (JSON, with the fast kernels' timed
choice per weight shape). ``fast`` must not be slower than ``stock`` for AR.

    python scripts/bench_kernels.py --threads 2 --out results/kernels_ar/ar_fast_vs_stock.json
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

from space.cli import output_file, positive_int
from space.cpu_kernels import apply_kernels
from space.data.prompts import chat_ids, code_prompt
from space.decoding import SpaceDecoder, ar_generate
from space.eval.tasks import load_tasks
from space.jsonl import write_text_atomic
from space.loader import load_space

ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-space"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", default=str(ADAPTER))
    p.add_argument("--prompts", type=positive_int, default=6, help="HumanEval prompts (default 6)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=output_file, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    stock, tok, spec = load_space(adapter=args.adapter, kernels="stock")
    fast, _, _ = load_space(adapter=args.adapter)
    record = apply_kernels(fast, "fast")
    models = {"stock": stock, "fast": fast}
    prompts = [torch.tensor(chat_ids(tok, [{"role": "user", "content": code_prompt(t.problem["prompt"])}]))
               for t in load_tasks("humaneval", limit=args.prompts)]
    eos = [tok.eos_token_id]
    rates: dict[str, list[float]] = {"stock": [], "fast": []}
    space_rates: dict[str, list[float]] = {"stock": [], "fast": []}
    outputs: dict[str, list[list[int]]] = {"stock": [], "fast": []}
    with torch.inference_mode():
        for name, m in models.items():  # warm both
            ar_generate(m, prompts[0], 8, stop_token_ids=eos, suppress_ids=spec.token_ids)
        for i, prompt in enumerate(prompts):
            for name in (("stock", "fast") if i % 2 == 0 else ("fast", "stock")):
                t0 = time.perf_counter()
                out = ar_generate(models[name], prompt, args.max_new_tokens, stop_token_ids=eos,
                                  suppress_ids=spec.token_ids)
                rates[name].append(len(out.new_ids) / (time.perf_counter() - t0))
                outputs[name].append(out.new_ids)
                t0 = time.perf_counter()
                res = SpaceDecoder(models[name], spec).generate(prompt, args.max_new_tokens, stop_token_ids=eos)
                space_rates[name].append(len(res.new_ids) / (time.perf_counter() - t0))
            print(f"prompt {i}: AR stock {rates['stock'][-1]:.1f} tok/s, fast {rates['fast'][-1]:.1f}; "
                  f"SPACE stock {space_rates['stock'][-1]:.1f}, fast {space_rates['fast'][-1]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    space_med = {k: statistics.median(v) for k, v in space_rates.items()}
    result = {
        "command": "python scripts/bench_kernels.py " + " ".join(argv or __import__("sys").argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
        "ar_tokens_per_s": {k: round(v, 2) for k, v in med.items()},
        "ar_fast_over_stock": round(med["fast"] / med["stock"], 3),
        "space_tokens_per_s": {k: round(v, 2) for k, v in space_med.items()},
        "space_fast_over_stock": round(space_med["fast"] / space_med["stock"], 3),
        "ar_same_tokens": outputs["stock"] == outputs["fast"],
        "fast_kernels": record,
        "per_prompt": {"ar": rates, "space": space_rates},
    }
    print(f"AR median tokens/s: stock {med['stock']:.2f}, fast {med['fast']:.2f} "
          f"(fast/stock {result['ar_fast_over_stock']}); SPACE: stock {space_med['stock']:.2f}, fast "
          f"{space_med['fast']:.2f} (fast/stock {result['space_fast_over_stock']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(args.out), json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
