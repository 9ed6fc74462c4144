"""Self-distillation (DESIGN §5): the target model's own greedy responses to training prompts.

Training the masks on what the model itself would say raises acceptance. Prompts come from MBPP
(code) and LIMA (general); never from HumanEval or MT-Bench, which are evaluation sets.

``python -m space.distill --out runs/distill/smollm2_mbpp_lima.jsonl --lima-limit 400``

Generation is batched HF ``generate`` (left padding, attention mask, greedy). The output JSONL is
appended batch by batch and resumable: a rerun skips prompts already answered (a torn last line
from an interrupted run is dropped). Prompts are deduplicated by their text.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from .data.prompts import chat_ids
from .data.sft import load_examples
from .jsonl import append_jsonl, read_jsonl_resumable
from .models import SMOLLM2, load_model


def prompt_key(context: list[dict]) -> str:
    return hashlib.sha1(json.dumps(context, sort_keys=True).encode()).hexdigest()[:16]


def collect_prompts(sources: dict[str, int | None], data_root=None) -> list[dict]:
    """Deduplicated single-turn prompts: {"id", "source", "prompt" (messages)}."""
    out, seen = [], set()
    for name, limit in sources.items():
        taken = 0
        for i, ex in enumerate(load_examples(name, data_root)):
            if limit is not None and taken >= limit:
                break
            if len(ex.context) != 1:  # multi-turn rows carry human answers: skip them
                continue
            key = prompt_key(ex.context)
            if key not in seen:
                seen.add(key)
                out.append({"id": f"{name}/{i}", "source": name, "prompt": ex.context, "key": key})
                taken += 1
    return out


@torch.inference_mode()
def distill(out: Path, model_name: str = SMOLLM2, sources: dict[str, int | None] | None = None,
            batch_size: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 384, data_root=None) -> Path:
    """Write greedy responses for every prompt of ``sources`` (name -> limit) to ``out``."""
    sources = sources or {"mbpp": None, "lima": 400}
    model, tok = load_model(model_name)
    tok.padding_side = "left"
    prompts = collect_prompts(sources, data_root)
    done = {row["key"] for row in read_jsonl_resumable(out)}
    todo = [p for p in prompts if p["key"] not in done]
    for p in todo:
        p["ids"] = chat_ids(tok, p["prompt"])
    todo = [p for p in todo if len(p["ids"]) <= max_prompt_tokens]
    todo.sort(key=lambda p: len(p["ids"]))  # similar lengths per batch: less padding
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[distill] {len(prompts)} prompts, {len(done)} done, {len(todo)} to go -> {out}", flush=True)
    for start in tqdm(range(0, len(todo), batch_size), desc="self-distillation", unit="batch"):
        batch = todo[start:start + batch_size]
        enc = tok.pad({"input_ids": [p["ids"] for p in batch]}, return_tensors="pt")
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        rows = []
        for p, row in zip(batch, gen[:, enc["input_ids"].shape[1]:]):
            ids = row.tolist()
            finished = tok.eos_token_id in ids
            ids = ids[: ids.index(tok.eos_token_id)] if finished else ids
            text = tok.decode(ids, skip_special_tokens=True)
            if text.strip():
                rows.append({"id": p["id"], "key": p["key"], "source": p["source"], "prompt": p["prompt"],
                             "response": text, "new_tokens": len(ids), "finished": finished})
        append_jsonl(out, rows)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Self-distillation: the model's own greedy answers to training prompts.")
    ap.add_argument("--model", default=SMOLLM2, help="alias or local HF directory")
    ap.add_argument("--out", type=Path, default=Path("runs/distill/smollm2_mbpp_lima.jsonl"), help="output JSONL")
    ap.add_argument("--mbpp-limit", type=int, default=None, help="MBPP prompts (default all 974)")
    ap.add_argument("--lima-limit", type=int, default=400, help="LIMA single-turn prompts")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data)")
    a = ap.parse_args(argv)
    distill(a.out, a.model, {"mbpp": a.mbpp_limit, "lima": a.lima_limit}, a.batch_size, a.max_new_tokens,
            a.max_prompt_tokens, a.data_root)


if __name__ == "__main__":
    main()
