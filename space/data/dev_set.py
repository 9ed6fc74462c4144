"""The drafter dev set (DESIGN §5, §6): 100 MBPP, 30 LIMA and 50 self-generated general prompts
kept out of training.

The acceptance probe (``space.eval.probe``) measures drafts on these prompts, and
self-distillation (``space.distill.collect_prompts``) skips them, so recipes are chosen on prompts
the drafter never saw. HumanEval and MT-Bench are evaluation sets and are never used here.

The list is recorded in ``configs/data/dev_set.json`` (MBPP ``task_id`` values, LIMA row indices)
and was drawn by :func:`build_dev_set`: ``random.Random(seed)`` samples 100 of MBPP's sorted task
ids and 30 of LIMA's single-turn rows (no ``history``), seed 13; both lists are stored sorted.
``python -m space.data.dev_set`` redraws it and checks that it equals the recorded file
(``--write`` rewrites it). The test suite checks the same.

Held out means the prompt itself (:func:`held_out_key`), not its near-variants: MBPP holds many of
its own tasks twice over in other words (404 and 970 both ask for the minimum of two numbers, 130
and 658 for the most frequent item of a list), and 72 of the 874 training tasks share at least 80 %
of their words with a dev task (word sets, "python" left out). So the MBPP dev score measures drafts
on MBPP-style tasks whose variants the drafter saw; the LIMA and general prompts are the stricter
held-out signal. No word-overlap rule separates the copies from the variants ("minimum" against
"maximum") that a drafter is meant to generalise to, so none is applied.

The general prompts (``general_prompts``, source ``general``) were written by SmolLM2 itself
(``space.data.magpie``, seed :data:`GENERAL_SEED`, which self-distillation never uses) and are
stored verbatim, since redrawing them needs the model: ``python -m space.data.dev_set --general 50
--write`` draws them again. Self-generated training prompts are leak-checked against them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from ..jsonl import write_text_atomic
from .sft import REGISTRY, data_root, read_rows, to_example

DEV_SET_FILE = Path(__file__).resolve().parents[2] / "configs" / "data" / "dev_set.json"
SEED, NUM_MBPP, NUM_LIMA = 13, 100, 30
GENERAL_SEED = 1013


def prompt_key(context: list[dict]) -> str:
    """Identity of a prompt (its messages), used to dedupe and to exclude the dev set."""
    return hashlib.sha1(json.dumps(context, sort_keys=True).encode()).hexdigest()[:16]


def held_out_key(context: list[dict]) -> str:
    """What the dev set is held out by: a prompt's user and assistant messages with their
    whitespace collapsed, system messages left out, so a copy of a dev prompt with a trailing
    newline, other spacing or a system turn is held out too (``prompt_key`` tells those apart)."""
    turns = [(m.get("role"), " ".join(str(m.get("content")).split())) for m in context if m.get("role") != "system"]
    return hashlib.sha1(json.dumps(turns).encode()).hexdigest()[:16]


def build_dev_set(root=None, seed: int = SEED, num_mbpp: int = NUM_MBPP, num_lima: int = NUM_LIMA) -> dict:
    """Draw the dev set deterministically (see the module docstring)."""
    root = data_root(root)
    mbpp_ids = sorted(int(r["task_id"]) for r in read_rows(root / REGISTRY["mbpp"]))
    lima_single = [i for i, r in enumerate(read_rows(root / REGISTRY["lima"])) if not r.get("history")]
    rng = random.Random(seed)
    return {"seed": seed,
            "how": f"random.Random({seed}).sample(sorted MBPP task_ids, {num_mbpp}), then "
                   f".sample(LIMA single-turn row indices, {num_lima}); lists stored sorted",
            "mbpp_task_ids": sorted(rng.sample(mbpp_ids, num_mbpp)),
            "lima_rows": sorted(rng.sample(lima_single, num_lima))}


def load_dev_set(path: Path = DEV_SET_FILE) -> dict:
    """The recorded dev set. Raises FileNotFoundError when the file is missing."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"dev set file not found: {path}")
    return json.loads(Path(path).read_text())


def dev_prompts(root=None, path: Path = DEV_SET_FILE) -> list[dict]:
    """Dev prompts as ``{"id", "source", "prompt" (messages), "key"}`` rows, MBPP first.

    Ids are ``mbpp/<row>`` and ``lima/<row>``, the same ids ``space.distill`` gives these rows, and
    ``general/<i>`` for the self-generated prompts.
    """
    dev, root = load_dev_set(path), data_root(root)
    out = []
    mbpp = read_rows(root / REGISTRY["mbpp"])
    wanted = set(dev["mbpp_task_ids"])
    for i, row in enumerate(mbpp):
        if int(row["task_id"]) in wanted:
            out.append(_row("mbpp", i, row))
    lima = read_rows(root / REGISTRY["lima"])
    out += [_row("lima", i, lima[i]) for i in dev["lima_rows"]]
    for i, text in enumerate(dev.get("general_prompts", [])):
        context = [{"role": "user", "content": text}]
        out.append({"id": f"general/{i}", "source": "general", "prompt": context, "key": prompt_key(context)})
    return out


def dev_keys(root=None, path: Path = DEV_SET_FILE) -> set[str]:
    """:func:`held_out_key` of every dev prompt: what training and its prompt collection skip."""
    return {held_out_key(p["prompt"]) for p in dev_prompts(root, path)}


def _row(source: str, i: int, raw: dict) -> dict:
    context = to_example(raw).context
    return {"id": f"{source}/{i}", "source": source, "prompt": context, "key": prompt_key(context)}


def build_general(num: int, root=None, seed: int = GENERAL_SEED) -> list[str]:
    """Draw ``num`` self-generated general prompts with SmolLM2 (filtered and leak-checked against
    HumanEval, MT-Bench and the MBPP/LIMA dev prompts, ``space.data.magpie``)."""
    from ..cpu_kernels import optimize_for_cpu
    from ..models import load_model
    from .magpie import PromptFilter, eval_texts, generate_prompts

    model, tok = load_model()
    optimize_for_cpu(model)
    texts = eval_texts(root) + [m["content"] for p in dev_prompts(root) if p["source"] != "general" for m in p["prompt"]]
    return generate_prompts(model, tok, num, PromptFilter(texts, tok.all_special_tokens), seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Redraw the drafter dev set and compare it with the recorded one.")
    ap.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data)")
    ap.add_argument("--write", action="store_true", help=f"rewrite {DEV_SET_FILE}")
    ap.add_argument("--general", type=int, default=None,
                    help="also draw this many self-generated general prompts with SmolLM2 (default: keep the recorded ones)")
    a = ap.parse_args(argv)
    drawn = build_dev_set(a.data_root)
    recorded = load_dev_set() if DEV_SET_FILE.is_file() else {}
    if a.general is not None:
        drawn["general_seed"], drawn["general_prompts"] = GENERAL_SEED, build_general(a.general, a.data_root)
    else:
        drawn.update({k: recorded[k] for k in ("general_seed", "general_prompts") if k in recorded})
    if a.write:
        lines = [f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}" for key, value in drawn.items()]  # one key a line
        write_text_atomic(DEV_SET_FILE, "{\n" + ",\n".join(lines) + "\n}\n")
        print(f"wrote {DEV_SET_FILE}")
    elif drawn != recorded:
        raise ValueError(f"{DEV_SET_FILE} differs from the deterministic draw (run with --write to rewrite)")
    else:
        print(f"{DEV_SET_FILE}: matches the draw ({len(drawn['mbpp_task_ids'])} MBPP, {len(drawn['lima_rows'])} LIMA, "
              f"{len(drawn.get('general_prompts', []))} general recorded)")


if __name__ == "__main__":
    main()
