"""Timed generation of every method on the same prompts (DESIGN §6): records, never summaries.

Methods: ``ar`` (our cached loop), ``hf`` (HF ``generate``), ``pld`` (HF prompt lookup decoding),
``space``. The AR-like methods run on the original weights: a frozen-base adapter
(``space.adapters.GatedLoraLinear``) does nothing on inputs without mask tokens. Methods are
interleaved per prompt so that machine drift hits all of them alike, after one untimed warm-up each.
One JSONL line per (question, method), written when the question is done, so an interrupted run
resumes where it stopped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from ..data.prompts import chat_ids
from ..decoding import SamplingConfig, SpaceDecoder, ar_generate
from ..jsonl import append_jsonl, read_jsonl_resumable
from ..tokens import MaskSpec
from .execute import check
from .tasks import EvalTask

METHODS = ("ar", "hf", "pld", "space")


@dataclass
class Target:
    """The model under evaluation.

    Attributes:
        model: the SPACE model from ``space.adapters.load_space`` (a plain HF causal LM).
        tokenizer: its tokenizer.
        mask: its MaskSpec.
        decoder: the SpaceDecoder (mask_num, num_groups).
    """

    model: object
    tokenizer: object
    mask: MaskSpec
    decoder: SpaceDecoder

    @property
    def stop_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
        return sorted(i for i in ids if i is not None)


def generate(method: str, target: Target, ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> dict:
    """One generation; returns new token ids, wall time (s), forward passes and accept lengths."""
    prompt = torch.tensor(ids)
    if method == "space":
        r = target.decoder.generate(prompt, max_new_tokens, sampling, target.stop_ids)
        return {"ids": r.new_ids, "wall_time": r.wall_time, "steps": r.num_steps, "accept_lengths": r.accept_lengths}
    if method == "ar":
        r = ar_generate(target.model, prompt, max_new_tokens, sampling, target.stop_ids, target.mask.token_ids)
        return {"ids": r.new_ids, "wall_time": r.wall_time, "steps": r.num_steps, "accept_lengths": []}
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                           eos_token_id=target.stop_ids, pad_token_id=target.tokenizer.pad_token_id,
                           prompt_lookup_num_tokens=10 if method == "pld" else None,
                           **({} if sampling.greedy else {"temperature": sampling.temperature,
                                                           "top_p": sampling.top_p, "top_k": sampling.top_k}))
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                    generation_config=cfg)
    wall = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    return {"ids": new, "wall_time": wall, "steps": len(new) if method == "hf" else None, "accept_lengths": []}


def run_question(method: str, target: Target, task: EvalTask, max_new_tokens: int, sampling: SamplingConfig,
                 num_samples: int) -> dict:
    """All turns of one question, ``num_samples`` times, as a Spec-Bench style record."""
    choices = []
    for index in range(num_samples):
        cfg = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed + index)
        messages, choice = [], {"index": index, "turns": [], "new_tokens": [], "wall_time": [], "steps": [],
                                "accept_lengths": [], "token_ids": []}
        for turn in task.turns:
            messages.append({"role": "user", "content": turn})
            out = generate(method, target, chat_ids(target.tokenizer, messages), max_new_tokens, cfg)
            text = target.tokenizer.decode(out["ids"], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            choice["turns"].append(text)
            choice["new_tokens"].append(len(out["ids"]))
            for key in ("wall_time", "steps", "accept_lengths"):
                choice[key].append(out[key])
            choice["token_ids"].append(out["ids"])
        if task.language:
            choice["exec"] = check(task.problem, task.language, choice["turns"][0])
        choices.append(choice)
    return {"question_id": task.question_id, "category": task.category, "model_id": method, "choices": choices}


def run_bench(target: Target, tasks: list[EvalTask], methods: list[str], out_file: Path, max_new_tokens: int,
              sampling: SamplingConfig, num_samples: int = 1) -> list[dict]:
    """Run every method on every task (resuming ``out_file``); returns all records."""
    rows = read_jsonl_resumable(out_file)
    done = {(r["question_id"], r["model_id"]) for r in rows}
    todo = [t for t in tasks if any((t.question_id, m) not in done for m in methods)]
    if todo:
        warm = chat_ids(target.tokenizer, [{"role": "user", "content": todo[0].turns[0]}])
        for m in methods:  # untimed warm-up: allocator, kernels, caches
            generate(m, target, warm, min(8, max_new_tokens), sampling)
    for task in tqdm(todo, desc="evaluating", unit="question"):
        new = [run_question(m, target, task, max_new_tokens, sampling, num_samples)
               for m in methods if (task.question_id, m) not in done]
        append_jsonl(out_file, new)
        rows += new
    return rows
