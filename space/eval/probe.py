"""The acceptance probe (DESIGN §6 "drafter probe"): how often the masks' drafts are right.

Teacher-forced over the target's own greedy answers: for each prompt of the dev set
(``configs/data/dev_set.json``: 100 MBPP + 30 LIMA prompts kept out of training, see
``space.data.dev_set``; or, with ``--dataset``, the first turns of an evaluation set, to report
on it, never to choose a recipe), the target answers greedily (batched HF ``generate``, cached in a
resumable JSONL), then prompt + answer runs once through the model into a KV cache and a mask
group is anchored at every answer position e (layout core: ``space.masking.train_layout``; the
groups go in chunks over that cache, so memory stays bounded). Mask j anchored at e proposes
token e+j+1 (DESIGN §3.1); its rank among mask j's logits (mask tokens suppressed, as in
decoding) is what the report is made of:

* ``topk[t][j]``: share of anchors where the true token is in mask j's top t (t = 1, 3, 5, 10);
* ``chain_bound`` = 1 + sum_j P(offsets 0..j all top-1): tokens/step a chain of k drafts from
  the group anchored at the step's start would reach if every step drafted from that group;
* ``tree_bound`` of a token tree (Medusa format: paths of ranks, e.g. ``[[0], [1], [0, 0]]``) =
  1 + sum over nodes of P(for every depth d on the node's path, the true token at offset d has
  rank exactly path[d]).

P(.) at offset j is over the anchors that have a token at offset j. Hardware-independent and
minutes instead of hours of timed decoding: use it to choose training recipes. Its ranks replay
to the exact greedy tokens/step of any layout (``space.decoding.tree.replay``,
``scripts/compare_drafters.py``).

``space-probe --adapter adapters/smollm2-135m-space --out runs/probe/shipped --tree '[[0],[1],[0,0]]'``
writes ``probe.json``, ``probe.png`` and ``ranks.jsonl`` (per sample, (anchors, k) ranks, -1 past
the end) into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli import add_debug_flag, add_device_flag, add_threads_flag, console, device_flag, set_threads
from ..jsonl import append_jsonl, read_jsonl_resumable, save_figure_atomic, write_jsonl, write_text_atomic
from .resume import adapter_sha256, model_files

if TYPE_CHECKING:
    import torch

TOPS = (1, 3, 5, 10)


def anchor_ranks(model, ids: torch.Tensor, prompt_len: int, mask_ids: torch.Tensor, k: int,
                 suppress_ids=(), chunk_groups: int = 64) -> torch.Tensor:
    """Rank of the true token among each mask's logits, a group anchored at every answer position.

    Args:
        model: a causal LM with the mask token (a plain HF model or a peft one).
        ids: (n,) prompt + answer token ids.
        prompt_len: P; anchors are e = P..n-2 (mask 0 of the group at e predicts x_{e+1}).
        mask_ids: (1,) or (k,) mask ids (``MaskSpec.ids_for(k)``).
        suppress_ids: tokens never drafted (the mask tokens), excluded from the ranking.
        chunk_groups: groups per forward over the cache of the n real tokens.

    With a sampler head (``space.sampler_head``), mask j's logits are the head's given the true
    token x_{e+j} before its target, so chain and tree bounds stay exact: a path's nodes are right
    exactly when the drafted tokens they were conditioned on are the true ones.

    Returns:
        (anchors, k) long: 0 = top-1; -1 where offset j has no token (e+j+1 >= n).
    """
    import torch
    from ..decoding.cache import attention_dtype, attention_windows, cache_input, crop_cache, full_cache
    from ..masking import IGNORE_INDEX, mask_rows, previous_ids, targets, to_additive_4d, train_layout, windowed
    from ..sampler_head import sampler_head

    with torch.inference_mode():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder, head, sampler = base.get_decoder(), base.get_output_embeddings(), sampler_head(base)
        device, n = head.weight.device, ids.numel()
        ids = ids.to(device)
        anchors = list(range(max(prompt_len, 1), n - 1))
        if not anchors:
            return torch.empty(0, k, dtype=torch.long)
        windows = attention_windows(base.config)
        cache = full_cache()  # every layer keeps every token: a sliding layer's window is applied in the mask
        decoder(input_ids=ids[None], **cache_input(cache), use_cache=True)  # the real tokens, once
        out = []
        for start in range(0, len(anchors), chunk_groups):
            groups = anchors[start:start + chunk_groups]
            lay = train_layout(n, groups, k)  # rows :n are the cached real tokens, n: the groups
            pos = lay.position_ids[None].to(device)
            # the trunk's dtype, not the LM head's (an fp32 head on a bf16 trunk), as SpaceDecoder's mask;
            # a sliding layer's rows see only the keys within its window, as a decode step's do
            attn = windowed(to_additive_4d(lay.allowed[n:], attention_dtype(decoder)).to(device), pos[:, n:], pos,
                            windows)  # (1, 1, G*k, n + G*k), or one such per kind of layer
            with mask_rows(0):
                hidden = decoder(input_ids=lay.input_ids(ids, mask_ids.to(device))[None, n:],
                                 position_ids=pos[:, n:], attention_mask=attn,
                                 **cache_input(cache), use_cache=True).last_hidden_state[0]  # (G*k, hidden)
            crop_cache(cache, n)
            if sampler is not None:  # teacher-forced: given the true token before each target
                hidden = sampler(hidden, base.get_input_embeddings()(previous_ids(ids, lay.position_ids[n:].to(device))))
            logits = head(hidden.to(head.weight.dtype)).float()  # (G*k, vocab)
            logits[:, list(suppress_ids)] = float("-inf")
            tgt = targets(lay, ids)[n:].to(device)  # (G*k,) x_{e+j+1}, IGNORE_INDEX past the end
            true = logits.gather(1, tgt.clamp(min=0)[:, None])  # (G*k, 1)
            rank = (logits > true).sum(-1).masked_fill(tgt == IGNORE_INDEX, -1)
            out.append(rank.view(len(groups), k).cpu())
        return torch.cat(out)


def summarize(ranks: torch.Tensor, tree: list[list[int]] | None = None) -> dict:
    """Per-offset top-t accuracy, chain bound and tree bound of (anchors, k) ranks (a long tensor,
    -1 = none); every share and bound rounded to 4 decimals."""
    import torch

    k = ranks.shape[1]
    has = ranks >= 0  # (anchors, k)
    out = {"anchors": int(has[:, 0].sum()), "positions_per_offset": has.sum(0).tolist()}
    out["topk"] = {str(t): [_share((ranks[:, j] < t) & has[:, j], has[:, j]) for j in range(k)] for t in TOPS}
    run = torch.cumprod((ranks == 0).long(), dim=1).bool()  # offsets 0..j all top-1
    out["chain_all_top1"] = [_share(run[:, j], has[:, j]) for j in range(k)]
    out["chain_bound"] = round(1 + sum(out["chain_all_top1"]), 4)
    if tree is not None:
        nodes = [_share(torch.stack([ranks[:, d] == r for d, r in enumerate(p)], 1).all(1), has[:, len(p) - 1])
                 for p in tree]
        out["tree"], out["tree_nodes"], out["tree_bound"] = [list(p) for p in tree], nodes, round(1 + sum(nodes), 4)
    return out


def _share(hit: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return round(float((hit & valid).sum()) / n, 4) if n else 0.0


def cached_answers(model, tok, prompts: list[dict], path: Path, target: str, max_new_tokens: int,
                   batch_size: int, suppress_ids, dtype: str = "float32") -> dict[str, dict]:
    """Greedy answers by prompt key, generating only the missing ones (resumable JSONL at ``path``).

    Args:
        dtype: the name of the model's parameter dtype (float32, bfloat16, ...), recorded per
            answer: greedy answers in another dtype are other tokens (a row without one, from
            before it was recorded, is float32's).

    Raises:
        ValueError: ``path`` holds answers of another target, max_new_tokens or dtype, or rows
            that are not answers (another JSONL passed as ``--answers``).
    """
    from ..data.prompts import chat_ids
    from ..distill import greedy_batches

    rows = read_jsonl_resumable(path)
    fields = ("key", "target", "max_new_tokens", "prompt_ids", "answer_ids")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or any(f not in r for f in fields)), None)
    if bad is not None:
        raise ValueError(f"{path}: line {bad + 1} is not a space-probe answer (needs {', '.join(fields)}); "
                         "pass an answers.jsonl that space-probe wrote")
    mine = (target, max_new_tokens, dtype)
    other = {(r["target"], r["max_new_tokens"], r.get("dtype", "float32")) for r in rows} - {mine}
    if other:
        raise ValueError(f"{path} holds answers of {sorted(other)}, not of {mine} (target, max_new_tokens, "
                         "dtype): pass another --answers file")
    have = {r["key"]: r for r in rows}
    todo = [{**p, "ids": chat_ids(tok, p["prompt"])} for p in prompts if p["key"] not in have]
    for batch in greedy_batches(model, tok, todo, batch_size, max_new_tokens, suppress_ids, desc="target answers"):
        new = [{"id": p["id"], "key": p["key"], "source": p["source"], "target": target,
                "max_new_tokens": max_new_tokens, "dtype": dtype, "prompt_ids": p["ids"], "finished": stop is not None,
                "answer_ids": ids + ([] if stop is None else [stop])} for p, ids, stop in batch]
        append_jsonl(path, new)
        have.update((r["key"], r) for r in new)
    return have


def probe_prompts(dataset: str, root=None, limit: int | None = None) -> list[dict]:
    """Prompts as ``{"id", "source", "prompt" (messages), "key"}`` rows.

    ``dataset`` "dev" is the dev set (``limit`` prompts per source); any name of
    ``space.eval.tasks.DATASETS`` (or a question .jsonl) gives the first user turn of its first
    ``limit`` tasks, with ``source`` the dataset name: the prompt ``space-eval`` decodes first, so
    the replayed tokens/step are those of its greedy first turns.

    Raises:
        ValueError / FileNotFoundError: as ``space.eval.tasks.load_tasks``.
    """
    from ..data.dev_set import dev_prompts, prompt_key
    from .tasks import load_tasks

    if dataset == "dev":
        prompts = dev_prompts(root)
        if limit is None:
            return prompts
        sources = dict.fromkeys(q["source"] for q in prompts)  # mbpp, lima, general: each keeps its first `limit`
        return [p for s in sources for p in [q for q in prompts if q["source"] == s][:limit]]
    out = []
    for task in load_tasks(dataset, root, limit):
        context = [{"role": "user", "content": task.turns[0]}]
        out.append({"id": f"{dataset}/{task.question_id}", "source": dataset, "prompt": context,
                    "key": prompt_key(context)})
    return out


def plot(summary: dict, path: Path, title: str) -> None:
    """PNG: top-t accuracy per offset, and P(offsets 0..j all top-1) per offset, by source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for t, acc in summary["all"]["topk"].items():
        ax1.plot(range(len(acc)), acc, marker="o", label=f"top-{t}")
    for source, s in summary.items():
        ax2.plot(range(len(s["chain_all_top1"])), s["chain_all_top1"], marker="o",
                 label=f"{source} (chain bound {s['chain_bound']:.2f})")
    for ax, name in ((ax1, "P(true token in mask j's top t), all prompts"), (ax2, "P(offsets 0..j all top-1)")):
        ax.set(xlabel="offset j", ylim=(0, 1), title=name, xticks=range(len(summary["all"]["chain_all_top1"])))
        ax.grid(alpha=0.3), ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)


def base_model_name(model: str | None, adapter: str | Path | None) -> str:
    """The base model a run uses: ``model``, else the adapter's recorded base, else SmolLM2.

    Raises:
        FileNotFoundError / ValueError: ``adapter`` is not a SPACE adapter (``read_space_config``).
    """
    from ..artifact import read_space_config
    from ..models import SMOLLM2

    if model is not None:
        return model
    return SMOLLM2 if adapter is None else read_space_config(Path(adapter))["base_model"]


def target_name(model: str | None, adapter: str | None) -> str:
    """Which model's greedy answers are probed: the base for a frozen-base adapter (its real-token
    logits are the base's), else base + adapter (a merged lora adapter is a new model). A model
    folder and a lora adapter are named with their weights' fingerprints too
    (``resume.model_files``, ``resume.adapter_sha256``): retrained in place, they keep their paths,
    and the cached answers of the old weights were reused silently."""
    from ..artifact import read_space_config

    base = base_model_name(model, adapter)
    files = model_files(base, layout=False)  # None for a name (the embedded SmolLM2)
    name = base if files is None else f"{base}@{files[:16]}"
    if adapter is None or read_space_config(Path(adapter))["mode"] == "frozen-base":
        return name
    return f"{name}+{Path(adapter).resolve()}@{adapter_sha256(adapter)[:16]}"


def check_tree_vocab(tree, model: str | None, adapter: str | Path | None) -> None:
    """Refuse a token tree (paths of ranks, or None) with a rank at or above the base model's
    vocabulary size, read from its config without loading weights (the tiny test model is built).

    Raises:
        ValueError: such a rank (rank and size named). FileNotFoundError: an unknown model.
    """
    from ..models import SMOLLM2, TINY, smollm2_dir, tiny_random_llama

    if not tree:
        return
    name = base_model_name(model, adapter)
    if name == TINY:
        vocab = tiny_random_llama()[0].config.vocab_size
    else:
        path = (smollm2_dir() if name == SMOLLM2 else Path(name)) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"unknown model {name!r}: not an alias and no {path}")
        vocab = json.loads(path.read_text(encoding="utf-8")).get("vocab_size")
    top = max(max(p) for p in tree)
    if vocab is not None and top >= vocab:
        raise ValueError(f"--tree: rank {top} is not below the vocabulary size {vocab} of {name}")


def read_tree(spec: str | None, k: int, model: str | None, adapter: str | Path | None):
    """``--tree`` as ``space.decoding.tree.parse_tree`` reads it, its ranks checked against the
    vocabulary (:func:`check_tree_vocab`); None for the chain.

    Raises:
        ValueError: an invalid tree, a file that is not UTF-8 text, or a rank past the vocabulary.
    """
    from ..decoding.tree import parse_tree

    tree = parse_tree(spec, k)  # a non-UTF-8 tree file is a ValueError there
    check_tree_vocab(tree, model, adapter)
    return tree


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="space-probe", description="Drafter acceptance probe on the dev set (DESIGN §6).")
    ap.add_argument("--model", default=None, help="alias or local HF directory (default: the adapter's base, else SmolLM2)")
    ap.add_argument("--adapter", default=None, help="SPACE adapter directory (space.loader.load_space; default: none)")
    ap.add_argument("--mask-num", "-k", type=int, default=None, help="k masks per group (default: the trained k, else 5)")
    ap.add_argument("--tree", default=None, help="token tree: JSON paths of ranks, e.g. '[[0],[1],[0,0]]', or a file "
                    "(default: none, the chain)")
    ap.add_argument("--dataset", default="dev", help="dev (the default; for choosing recipes) or an evaluation set to "
                    "report on: humaneval, humaneval-x:LANG, mbpp, mt-bench (space.eval.tasks.DATASETS) or a "
                    "question .jsonl (first turns)")
    ap.add_argument("--limit", type=int, default=None, help="first N dev prompts per source (default all: 100 MBPP, "
                    "30 LIMA, 50 general), or first N tasks of --dataset")
    ap.add_argument("--out", type=Path, default=Path("runs/probe/latest"), help="output folder (default: %(default)s)")
    ap.add_argument("--answers", type=Path, default=None, help="greedy answers cache (default <out>/answers.jsonl)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="longest greedy answer (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default: %(default)s)")
    ap.add_argument("--chunk-groups", type=int, default=64, help="mask groups per forward (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", help="parameter dtype (default: %(default)s)")
    add_device_flag(ap)
    add_threads_flag(ap)
    ap.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data)")
    add_debug_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Run the probe on the dev set (or ``--dataset``); returns the summary written to ``<out>/probe.json``.

    ``<out>/ranks.jsonl`` opens with a ``{"meta": ...}`` line naming the base model (name, and a
    folder's files: ``space.eval.resume.model_files`` without a tuned layout) and the adapter (path
    and ``space.eval.resume.adapter_sha256``), which ``space-tree`` checks.

    Raises:
        ValueError: bad --tree (a rank past the vocabulary too), --mask-num, --limit, --threads,
            --device, or an answers file of another target.
        FileNotFoundError: missing adapter, model or data.
    """
    a = build_parser().parse_args(argv)
    for name in ("limit", "max_new_tokens", "batch_size", "chunk_groups", "mask_num"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    set_threads(a.threads)
    a.device = device_flag(a.device)
    import torch
    import transformers
    from tqdm import tqdm

    from ..decoding.cache import attention_dtype, attention_windows
    from ..decoding.config import DEFAULT_MASK_NUM
    from ..loader import load_space
    from ..tokens import MAX_MASK_NUM, check_mask_num

    if a.mask_num is not None:
        check_mask_num(a.mask_num)  # past MAX_MASK_NUM it was refused only after the weights loaded
    read_tree(a.tree, a.mask_num or MAX_MASK_NUM, a.model, a.adapter)  # before loading; rechecked against k below
    target = target_name(a.model, a.adapter)
    base = base_model_name(a.model, a.adapter)
    prompts = probe_prompts(a.dataset, a.data_root, a.limit)
    model, tok, spec = load_space(a.model, a.adapter, a.mask_num or DEFAULT_MASK_NUM, a.dtype, a.device,
                                  step_cost="stored")  # the probe ranks drafts: no tree is priced
    attention_windows(model.config)  # a layer type the masks cannot express, refused before hours of greedy answers
    k = a.mask_num or spec.mask_num or DEFAULT_MASK_NUM
    tree = read_tree(a.tree, k, a.model, a.adapter)
    mask_ids = spec.ids_for(k)
    a.out.mkdir(parents=True, exist_ok=True)
    # the name, however --dtype spelt it (fp32, bf16, ...); the trunk's, not model.dtype: an adapter's
    # fp32 mask rows come first in a bf16 model (a bf16 run's answers were recorded as float32)
    dtype = str(attention_dtype(model.get_decoder())).removeprefix("torch.")
    answers = cached_answers(model, tok, prompts, a.answers or a.out / "answers.jsonl", target,
                             a.max_new_tokens, a.batch_size, spec.token_ids, dtype)
    per_sample, ranks_by_source = [], {}
    for p in tqdm(prompts, desc="teacher-forced probe", unit="sample"):
        row = answers[p["key"]]
        ranks = anchor_ranks(model, torch.tensor(row["prompt_ids"] + row["answer_ids"]), len(row["prompt_ids"]),
                             mask_ids, k, spec.token_ids, a.chunk_groups)
        per_sample.append({"id": p["id"], "source": p["source"], "ranks": ranks.tolist()})
        ranks_by_source.setdefault(p["source"], []).append(ranks)
    # the model's files too: a full checkpoint retrained in place keeps its path (its layout left out,
    # which space-tree --write-adapter stores there)
    drafter = {"model": base, "model_files": model_files(base, layout=False), "adapter": a.adapter,
               "adapter_sha256": adapter_sha256(a.adapter), "mask_num": k}
    write_jsonl(a.out / "ranks.jsonl", [{"meta": drafter}, *per_sample])
    everything = torch.cat([r for rs in ranks_by_source.values() for r in rs])
    summary = {"all": summarize(everything, tree),
               **{s: summarize(torch.cat(rs), tree) for s, rs in ranks_by_source.items()}}
    dataset = "dev (configs/data/dev_set.json)" if a.dataset == "dev" else a.dataset
    meta = {**drafter, "target": target, "dtype": a.dtype, "device": a.device, "dataset": dataset, "limit": a.limit,
            "samples": len(prompts), "max_new_tokens": a.max_new_tokens, "seed": None, "decoding": "greedy",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    result = {"meta": meta, "summary": summary}
    one_line = lambda m: "[" + " ".join(m.group(1).split()) + "]"  # number lists on one line
    write_text_atomic(a.out / "probe.json", re.sub(r"\[\s+([-\d., \n]*?)\s+\]", one_line, json.dumps(result, indent=1)))
    name = Path(a.adapter).name if a.adapter else target
    plot(summary, a.out / "probe.png", f"{name}, k={k}, {len(prompts)} {a.dataset} prompts")
    s = summary["all"]
    print(f"[probe] {len(prompts)} prompts, {s['anchors']} anchors; top-1 per offset {s['topk']['1']}; "
          f"chain bound {s['chain_bound']:.3f}" + (f"; tree bound {s['tree_bound']:.3f}" if tree else "")
          + f" -> {a.out}", flush=True)
    return result


cli = console("space-probe", main)

if __name__ == "__main__":
    cli()
