"""Replay prompt lookup alone over a run's greedy AR answers: the tokens/step that lookup with 1..N
continuations a step would reach (``space.decoding.lookup.PromptLookup.continuations``; a step
accepts the longest prefix that any continuation shares with the answer, plus one token). No model
and no timing: it bounds what more lookup branches can add, and the first branch alone is prompt
lookup decoding's (its replay equals PLD's measured tokens/step on the same answers).

    python scripts/replay_lookup.py results/humaneval40_lookup_branches results/mt_bench40_lookup_branches \\
        --branches 1,2,4,8 --out results/lookup_branches/replay.json

``--datastore SETS`` adds up to ``--datastore-branches`` continuations from a datastore of those
``space-distill`` sets' answers (``space.decoding.datastore``) after the text's own.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from space.data.prompts import chat_ids
from space.decoding.lookup import PromptLookup
from space.eval.tasks import load_tasks
from space.jsonl import write_text_atomic
from space.choices import SMOLLM2
from space.cli import console, given_flags, positive_ints
from space.models import smollm2_dir


def answers(run: Path, tokenizer, data_root: str | None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of every turn of the run's ``ar`` records, the prompt rebuilt as
    ``space-eval`` builds it (a later turn holds the earlier answers' text).

    Raises:
        ValueError: the run has no ``ar`` record, or was made on another model than SmolLM2.
    """
    meta = json.loads((run / "run_config.json").read_text())
    if meta.get("model") != SMOLLM2:
        raise ValueError(f"{run}: made on {meta.get('model')!r}; this replay tokenizes with {SMOLLM2}")
    tasks = {t.question_id: t for t in load_tasks(meta["dataset"], data_root, meta.get("limit"))}
    out = []
    for line in (run / "samples.jsonl").open():
        record = json.loads(line)
        # a skipped question has no answer; one past the run's --limit (an earlier run's, kept in the
        # file) is not in the run (space.eval.report.summarize counts neither)
        if record["model_id"] != "ar" or "skipped" in record or record["question_id"] not in tasks:
            continue
        messages, choice = [], record["choices"][0]
        for turn, ids, text in zip(tasks[record["question_id"]].turns, choice["token_ids"], choice["turns"]):
            messages.append({"role": "user", "content": turn})
            out.append((chat_ids(tokenizer, messages), ids))
            messages.append({"role": "assistant", "content": text})
    if not out:
        raise ValueError(f"{run}: no ar record to replay (run space-eval with --methods ar)")
    return out


def replay(pairs: list[tuple[list[int], list[int]]], branches: int, num_tokens: int, max_ngram: int,
           datastore=None, datastore_branches: int = 0) -> dict:
    """Steps and tokens/step of lookup alone with up to ``branches`` continuations a step (and up to
    ``datastore_branches`` from ``datastore``), and how often the text's own continuations and the
    datastore's are right: at their first token, and at each later token given the ones before it."""
    steps = tokens = 0
    counts = {source: {"first": [0, 0], "later": [0, 0]} for source in ("text", "datastore")}  # [right, tried]
    for prompt, answer in pairs:
        text = list(prompt)
        lookup = PromptLookup(text, num_tokens, max_ngram, 1 << 30, branches, datastore, datastore_branches)
        i = 0
        while i < len(answer):
            accepted = 0
            found_all = lookup.continuations()
            for place, found in enumerate(found_all):
                n = 0
                while n < len(found) and i + n < len(answer) and found[n] == answer[i + n]:
                    n += 1
                accepted = max(accepted, n)
                count = counts["datastore" if place >= len(found_all) - found_all.stored else "text"]
                count["first"][0] += n > 0
                count["first"][1] += 1
                # a later token is tried when every token before it was right, and right when it is too
                count["later"][0] += max(n - 1, 0)
                count["later"][1] += min(n, len(found) - 1, len(answer) - i - 1) if n else 0
            emitted = min(accepted + 1, len(answer) - i)
            text.extend(answer[i: i + emitted])
            i += emitted
            steps += 1
            tokens += emitted
    rates = {source: {part: round(right / tried, 4) if tried else None for part, (right, tried) in parts.items()}
             for source, parts in counts.items() if parts["first"][1]}
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps, 4), "right": rates}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="space-eval output folders with ar records")
    p.add_argument("--branches", default="1,2,4,8", help="comma list of continuations per step")
    p.add_argument("--lookup-tokens", type=int, default=10, help="tokens per continuation (the shipped 10)")
    p.add_argument("--lookup-ngram", type=int, default=2, help="longest n-gram matched (the shipped 2)")
    p.add_argument("--data-root", default=None, help="the datasets' folder (default ../shared/data)")
    p.add_argument("--datastore", default=None, help="comma list of space-distill sets whose answers are a datastore")
    p.add_argument("--datastore-branches", type=int, default=1, help="datastore continuations a step, with --datastore")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the table")
    a = p.parse_args(argv)
    if not a.datastore and "datastore_branches" in given_flags(p, argv):
        p.error("--datastore-branches counts a datastore's continuations: give --datastore with it")
    try:  # before the tokenizer loads: PromptLookup refused them with a traceback
        counts = positive_ints(a.branches)
    except argparse.ArgumentTypeError as e:
        p.error(f"argument --branches: {e}")
    for flag, value, least in (("--lookup-tokens", a.lookup_tokens, 1), ("--lookup-ngram", a.lookup_ngram, 1),
                               ("--datastore-branches", a.datastore_branches, 0)):
        if value < least:
            p.error(f"argument {flag}: must be >= {least}, got {value}")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    store = None
    if a.datastore:
        from space.decoding.datastore import Datastore

        store = Datastore.from_sets(a.datastore, tokenizer)
    table = {}
    for run in a.runs:
        pairs = answers(run, tokenizer, a.data_root)
        table[str(run)] = {b: replay(pairs, b, a.lookup_tokens, a.lookup_ngram, store, a.datastore_branches if store else 0)
                           for b in counts}
        print(run, " ".join(f"{b}: {r['tokens_per_step']:.3f}" for b, r in table[str(run)].items()))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.out, json.dumps({"lookup_tokens": a.lookup_tokens, "lookup_ngram": a.lookup_ngram,
                                             "datastore": a.datastore and {"sets": a.datastore, "tokens": len(store),
                                                                           "branches": a.datastore_branches},
                                             "tokens_per_step": table}, indent=2) + "\n")
    return table


if __name__ == "__main__":
    console("replay_lookup", main)()
