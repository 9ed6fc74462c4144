"""Decoder benchmark (issue: auto-correct decoder): where a SPACE step's time goes on this machine.

1. step latency vs query tokens (1..64) after a cache of --cache tokens;
2. SPACE step latency vs k and num_groups;
3. the saving from running the LM head only on needed rows (k+1 verification + k drafts);
4. tokens/s of our AR loop vs HF ``generate`` (greedy, same prompt and weights).

Medians of --repeats runs; prints tables and writes JSON to --out.

    python scripts/bench_decode.py --out results/bench_decode.json
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
from transformers import DynamicCache, GenerationConfig

from space.choices import KERNEL_CHOICES
from space.cli import output_file, positive_int
from space.cpu_kernels import apply_kernels
from space.data.prompts import chat_ids, code_prompt
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.cache import cache_input, crop_cache
from space.eval.tasks import load_tasks
from space.jsonl import write_text_atomic
from space.masking import build_layout, decode_layout, to_additive_4d
from space.models import load_model
from space.tokens import add_mask_tokens


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def random_ids(model, n: int) -> torch.Tensor:
    """(n,) token ids below 1000 and below the model's vocabulary (tiny models have fewer ids)."""
    return torch.randint(0, min(1000, model.config.vocab_size), (n,))


def step_fn(model, prefix: torch.Tensor, lay, mask_id: int, head_rows: torch.Tensor | None):
    """One forward of ``lay`` after a cache holding ``prefix``; LM head on ``head_rows`` (None: all)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=prefix[None], **cache_input(cache), use_cache=True)
    L = cache.get_seq_length()
    ids = lay.input_ids(random_ids(model, lay.num_real), torch.tensor([mask_id]))[None]
    pos, mask = lay.position_ids[None], to_additive_4d(lay.allowed)

    def run():
        with torch.inference_mode():
            hidden = model.model(input_ids=ids, position_ids=pos, attention_mask=mask, **cache_input(cache),
                                 use_cache=True).last_hidden_state[0]
            model.lm_head(hidden if head_rows is None else hidden[head_rows])
            crop_cache(cache, L)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache", type=positive_int, default=200, help="tokens in the KV cache")
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--gen-tokens", type=positive_int, default=128, help="new tokens for the AR vs HF comparison")
    ap.add_argument("--kernels", choices=KERNEL_CHOICES, default="fast", help="as in space-eval")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids the steps are timed on")
    ap.add_argument("--out", type=output_file, default=Path("results/bench_decode.json"))
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model, tok = load_model(a.model)
    spec = add_mask_tokens(model, tok, 8)
    kernels = apply_kernels(model, a.kernels)
    mid = spec.token_ids[0]
    prefix = random_ids(model, a.cache)
    res = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
           "transformers": transformers.__version__, "model": a.model, "dtype": "float32", "device": "cpu",
           "cache": a.cache, "repeats": a.repeats, "seed": a.seed, "gen_tokens": a.gen_tokens,
           "gen_prompt": "humaneval HumanEval/0 (code prompt, chat template)", "kernels": kernels}

    # 1. latency vs query tokens: a causal block of q real tokens (attention shape is what matters)
    res["latency_vs_query_tokens_ms"] = {}
    for q in (1, 2, 4, 6, 8, 12, 16, 24, 36, 48, 64):
        lay = build_layout(a.cache, q, [], k=1)
        res["latency_vs_query_tokens_ms"][q] = median_ms(step_fn(model, prefix, lay, mid, torch.arange(1)), a.repeats)
        print(f"q={q:3d}  {res['latency_vs_query_tokens_ms'][q]:8.2f} ms", flush=True)

    # 2. + 3. full SPACE steps: head on needed rows vs on every row
    res["space_step_ms"] = []
    for k in (1, 2, 3, 4, 5, 6, 8):
        for g in sorted({1, 2, 3, (k + 1) // 2 + 1, k + 1} & set(range(1, k + 2))):
            lay = decode_layout(a.cache, k, g, k)
            needed = torch.cat([torch.arange(k + 1), lay.group_rows(min(g - 1, k))])
            row = {"k": k, "num_groups": g, "query_tokens": lay.num_rows,
                   "needed_rows_ms": median_ms(step_fn(model, prefix, lay, mid, needed), a.repeats)}
            if g == k + 1:
                row["all_rows_ms"] = median_ms(step_fn(model, prefix, lay, mid, None), a.repeats)
            res["space_step_ms"].append(row)
            print(json.dumps(row), flush=True)

    # 4. AR loop vs HF generate, same prompt, same weights (greedy), interleaved
    task = load_tasks("humaneval", limit=1)[0]
    ids = torch.tensor(chat_ids(tok, [{"role": "user", "content": code_prompt(task.problem["prompt"])}]))
    cfg = GenerationConfig(max_new_tokens=a.gen_tokens, min_new_tokens=a.gen_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id, suppress_tokens=list(spec.token_ids))
    ar_t, hf_t, sp_t = [], [], []
    dec = SpaceDecoder(model, spec, DecodeConfig())
    for _ in range(3):
        r = ar_generate(model, ids, a.gen_tokens, suppress_ids=spec.token_ids)  # as cfg's suppress_tokens
        ar_t.append(len(r.new_ids) / r.wall_time)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), generation_config=cfg)
        hf_t.append((out.shape[1] - len(ids)) / (time.perf_counter() - t0))
        s = dec.generate(ids, a.gen_tokens)
        sp_t.append(len(s.new_ids) / s.wall_time)
    res["tokens_per_s"] = {"ar_loop": round(statistics.median(ar_t), 2), "hf_generate": round(statistics.median(hf_t), 2),
                           "space_untrained_k5": round(statistics.median(sp_t), 2)}
    res["ar_loop_vs_hf_generate"] = round(res["tokens_per_s"]["ar_loop"] / res["tokens_per_s"]["hf_generate"], 3)
    print(json.dumps(res["tokens_per_s"]), "ratio AR/HF:", res["ar_loop_vs_hf_generate"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out, json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
