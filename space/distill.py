"""Self-distillation (DESIGN §5): the target model's own greedy responses to training prompts.

Training the masks on what the model itself would say raises acceptance. Prompts come from MBPP
(code), LIMA (general) and the Python standard library's documented functions (code,
``space.data.stdlib_prompts``); never from HumanEval or MT-Bench, which are evaluation sets, and
never from the drafter dev set (``configs/data/dev_set.json``, see ``space.data.dev_set``), which
the acceptance probe measures on.

``python -m space.distill --out runs/distill/smollm2_mix.jsonl --sources mbpp,lima,stdlib --lima-limit 1000``

Each source has a limit (``--mbpp-limit``, ``--lima-limit``, ``--stdlib-limit``; prompts taken,
after the dev set and duplicates are skipped). Generation is batched HF ``generate`` (left padding,
attention mask, greedy; :func:`greedy_batches`, shared with the probe). The output JSONL is
appended batch by batch and resumable: a rerun skips prompts already answered (a torn last line
from an interrupted run is dropped). Prompts are deduplicated by their text.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from .cli import add_debug_flag, console
from .data.dev_set import dev_keys, prompt_key
from .data.prompts import chat_ids
from .data.sft import load_examples
from .data.stdlib_prompts import stdlib_prompts
from .jsonl import append_jsonl, read_jsonl_resumable
from .models import SMOLLM2, load_model

SOURCES = ("mbpp", "lima", "stdlib")


def source_prompts(name: str, data_root=None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of every prompt of a source: a registered dataset, ``stdlib`` or a file."""
    if name == "stdlib":
        return [(f"stdlib/{p.name}", [{"role": "user", "content": p.prompt}]) for p in stdlib_prompts(data_root)]
    return [(f"{name}/{i}", ex.context) for i, ex in enumerate(load_examples(name, data_root))]


def collect_prompts(sources: dict[str, int | None], data_root=None, exclude_dev: bool = True) -> list[dict]:
    """Deduplicated single-turn prompts: {"id", "source", "prompt" (messages), "key"}.

    Args:
        sources: source name -> how many prompts to take (None: all).
        exclude_dev: skip the drafter dev set's prompts (always, for training data).
    """
    seen = dev_keys(data_root) if exclude_dev else set()
    out = []
    for name, limit in sources.items():
        taken = 0
        for pid, context in source_prompts(name, data_root):
            if limit is not None and taken >= limit:
                break
            if len(context) != 1:  # multi-turn rows carry human answers: skip them
                continue
            key = prompt_key(context)
            if key not in seen:
                seen.add(key)
                out.append({"id": pid, "source": name, "prompt": context, "key": key})
                taken += 1
    return out


@torch.inference_mode()
def greedy_batches(model, tok, prompts: list[dict], batch_size: int = 16, max_new_tokens: int = 256,
                   suppress_ids: tuple[int, ...] = (), desc: str = "generate") -> Iterator[list[tuple[dict, list[int], bool]]]:
    """Greedy answers of ``model`` with batched HF ``generate`` (left padding, attention mask).

    Args:
        prompts: rows with ``ids`` (prompt token ids); batched shortest first (less padding).
        suppress_ids: token ids never generated (a SPACE model's mask tokens).

    Yields:
        per batch, (prompt row, new token ids cut before the first EOS, finished: EOS was reached).
    """
    side, tok.padding_side = tok.padding_side, "left"
    try:
        todo = sorted(prompts, key=lambda p: len(p["ids"]))
        for start in tqdm(range(0, len(todo), batch_size), desc=desc, unit="batch"):
            batch = todo[start:start + batch_size]
            enc = tok.pad({"input_ids": [p["ids"] for p in batch]}, return_tensors="pt").to(model.device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 suppress_tokens=list(suppress_ids) or None)
            rows = []
            for p, row in zip(batch, gen[:, enc["input_ids"].shape[1]:].tolist()):
                finished = tok.eos_token_id in row
                rows.append((p, row[: row.index(tok.eos_token_id)] if finished else row, finished))
            yield rows
    finally:
        tok.padding_side = side


def distill(out: Path, model_name: str = SMOLLM2, sources: dict[str, int | None] | None = None,
            batch_size: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 384, data_root=None) -> Path:
    """Write greedy responses for every prompt of ``sources`` (name -> limit) to ``out``."""
    sources = sources or {"mbpp": None, "lima": 400}
    prompts = collect_prompts(sources, data_root)  # before the model: a bad dataset fails at once
    model, tok = load_model(model_name)
    done = {row["key"] for row in read_jsonl_resumable(out)}
    todo = [p for p in prompts if p["key"] not in done]
    for p in todo:
        p["ids"] = chat_ids(tok, p["prompt"])
    todo = [p for p in todo if len(p["ids"]) <= max_prompt_tokens]
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[distill] {len(prompts)} prompts, {len(done)} done, {len(todo)} to go -> {out}", flush=True)
    for batch in greedy_batches(model, tok, todo, batch_size, max_new_tokens, desc="self-distillation"):
        rows = []
        for p, ids, finished in batch:
            text = tok.decode(ids, skip_special_tokens=True)
            if text.strip():
                rows.append({"id": p["id"], "key": p["key"], "source": p["source"], "prompt": p["prompt"],
                             "response": text, "new_tokens": len(ids), "finished": finished})
        append_jsonl(out, rows)
    return out


def main(argv: list[str] | None = None) -> Path:
    """Parse and check the arguments, then distill; returns the output file.

    Raises:
        ValueError: an unknown source, a count below its minimum, or ``--out`` that is a folder.
        FileNotFoundError: a missing dataset or model.
    """
    ap = argparse.ArgumentParser(prog="space-distill",
                                 description="Self-distillation: the model's own greedy answers to training prompts.")
    ap.add_argument("--model", default=SMOLLM2, help="alias or local HF directory")
    ap.add_argument("--out", type=Path, default=Path("runs/distill/smollm2_mbpp_lima.jsonl"), help="output JSONL")
    ap.add_argument("--sources", default="mbpp,lima", help=f"comma list of prompt sources: {', '.join(SOURCES)}")
    ap.add_argument("--mbpp-limit", type=int, default=None, help="MBPP prompts (default all outside the dev set)")
    ap.add_argument("--lima-limit", type=int, default=400, help="LIMA single-turn prompts (1000: all)")
    ap.add_argument("--stdlib-limit", type=int, default=None, help="stdlib function prompts (default all)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data)")
    add_debug_flag(ap)
    a = ap.parse_args(argv)
    for name, minimum in (("batch_size", 1), ("max_new_tokens", 1), ("max_prompt_tokens", 1),
                          ("mbpp_limit", 0), ("lima_limit", 0), ("stdlib_limit", 0)):
        value = getattr(a, name)
        if value is not None and value < minimum:  # None: no limit
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    if a.out.is_dir():
        raise ValueError(f"--out {a.out} is a folder; pass a .jsonl file")
    limits = {"mbpp": a.mbpp_limit, "lima": a.lima_limit, "stdlib": a.stdlib_limit}
    names = [n.strip() for n in a.sources.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown or not names:
        raise ValueError(f"--sources: unknown {unknown or 'empty list'}; choose from {', '.join(SOURCES)}")
    return distill(a.out, a.model, {n: limits[n] for n in names}, a.batch_size, a.max_new_tokens,
            a.max_prompt_tokens, a.data_root)


cli = console("space-distill", main)

if __name__ == "__main__":
    cli()
