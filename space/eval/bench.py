"""Timed generation of every method on the same prompts (DESIGN §6): records, never summaries.

Methods: ``ar`` (our cached loop), ``hf`` (HF ``generate``), ``pld`` (HF prompt lookup decoding),
``space``. The AR-like methods run on the original weights: a frozen-base adapter
(``space.adapter_layers.GatedLoraLinear``) does nothing on inputs without mask tokens. Methods are
interleaved per prompt so that machine drift hits all of them alike, after one untimed warm-up each.
One JSONL line per (question, method), written when the question is done, so an interrupted run
resumes where it stopped. A question whose prompt and answers cannot fit the model context is
skipped for every method alike, with a record that says why: ``{"question_id", "category",
"model_id", "skipped": reason}``. That check counts each earlier answer at max_new_tokens; a turn
whose real prompt still overflows (an answer's text tokenized again can be longer) is skipped for
that method alone, and ``space.eval.report.summarize`` then drops the question from every method's
numbers, so all methods are compared on the same questions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from ..data.prompts import chat_ids
from ..jsonl import append_jsonl, read_jsonl_resumable
from .execute import check
from .tasks import EvalTask, question_sha256

if TYPE_CHECKING:  # torch and the decoders load in the functions below: space-eval --help needs only METHODS
    from ..decoding import SamplingConfig, SpaceDecoder
    from ..tokens import MaskSpec

METHODS = ("ar", "hf", "pld", "space")
# transformers' sampling divides the float32 logits by the temperature unshifted: logits near 1e8 at most
# stay finite above this (SPACE and AR shift them first, space.decoding.sampling.logits_to_probs)
HF_MIN_TEMPERATURE = 1e-30
PLD_TOKENS, PLD_NGRAM = 10, 2  # prompt lookup's candidates per step and longest n-gram (transformers' default)


@dataclass
class Target:
    """The model under evaluation.

    Attributes:
        model: the SPACE model from ``space.loader.load_space`` (a plain HF causal LM).
        tokenizer: its tokenizer.
        mask: its MaskSpec.
        decoder: the SpaceDecoder (mask_num, num_groups).
        graphs: the captured steps SPACE and AR run through (``space.decoding.graphs``), or None.
        pld: with ``graphs``, prompt lookup (PLD) over them: a SpaceDecoder with no mask group and
            HF's PLD settings (``PLD_TOKENS``, ``PLD_NGRAM``), in place of transformers' eager assisted
            generation, so every method runs captured; else None.
    """

    model: object
    tokenizer: object
    mask: MaskSpec
    decoder: SpaceDecoder
    graphs: object = None
    pld: SpaceDecoder | None = None

    @property
    def stop_ids(self) -> list[int]:
        from ..models import stop_ids

        return stop_ids(self.model, self.tokenizer)


# per-step records of a SPACE generation (empty lists for the other methods): accepted drafts,
# tokens emitted, candidate depth, block rows, host and planner ms, and where the accepted tokens
# came from (a letter each: m mask, l lookup, b both) with the deepest candidate of each source
STEP_KEYS = ("accept_lengths", "step_tokens", "candidates", "rows", "padding", "host_ms", "plan_ms", "sources", "offered")


CHOICE_LISTS = ("turns", "new_tokens", "wall_time", "steps", "token_ids")  # one entry per turn in every choice


def read_samples(path: Path, repair: bool = True) -> list[dict]:
    """The records of a samples file (:func:`run_bench`'s), each checked for what the report and a
    resume read: a dict with ``question_id``, ``category`` and ``model_id``, and either
    ``skipped`` or ``choices``, a non-empty list of samples each holding the CHOICE_LISTS, one
    entry per turn. ``repair``: as ``space.jsonl.read_jsonl_resumable`` (a torn last line dropped).

    Raises:
        ValueError: a line that is not JSON (``read_jsonl_resumable``), or a record that is not a
            sample record (file, record number and the field named): an empty ``choices`` made the
            method's totals cover other questions than the others' (speedups off, exit 0), and a
            missing field failed as a KeyError after every question was decoded.
    """
    rows = read_jsonl_resumable(path, repair=repair)
    for i, row in enumerate(rows, 1):
        why = _not_a_record(row)
        if why:
            raise ValueError(f"{path}: record {i} is not a space-eval sample record ({why}): delete it (a rerun "
                             "decodes that question again) or pass another --out")
    return rows


def _not_a_record(row) -> str | None:
    """What makes ``row`` no sample record (:func:`read_samples`), or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for key in ("question_id", "category", "model_id"):
        if not isinstance(row.get(key), str):
            return f"{key} missing or not text"
    if "skipped" in row:
        return None
    choices = row.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        return "choices missing, empty or not a list of objects"
    for c in choices:
        lists = [c.get(key) for key in CHOICE_LISTS]
        if not all(isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1 or not lists[0]:
            return f"a choice without one entry per turn in each of {', '.join(CHOICE_LISTS)}"
    return None


def generate(method: str, target: Target, ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> dict:
    """One generation: new token ids, wall time (s), target forward passes ("steps", counted for
    every method), and for SPACE per step the accepted drafts, the tokens emitted and the
    candidates verified."""
    import torch
    from transformers import GenerationConfig

    from ..decoding import ar_generate
    from ..decoding.result import clock

    prompt = torch.tensor(ids)
    if method in ("space", "ar") or method == "pld" and target.pld is not None:
        decoder = target.pld if method == "pld" else target.decoder
        r = (decoder.generate(prompt, max_new_tokens, sampling, target.stop_ids) if method != "ar"
             else ar_generate(target.model, prompt, max_new_tokens, sampling, target.stop_ids, target.mask.token_ids,
                              graphs=target.graphs))
        return {"ids": r.new_ids, "wall_time": r.wall_time, "steps": r.num_steps, "accept_lengths": r.accept_lengths,
                "step_tokens": r.step_tokens if method != "ar" else [], "candidates": r.step_candidates,
                "rows": r.step_rows, "padding": r.step_padding, "host_ms": [round(x * 1e3, 3) for x in r.step_host],
                "plan_ms": [round(x * 1e3, 3) for x in r.step_plan], "sources": r.step_sources,
                "offered": [list(o) for o in r.step_offered]}
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                           eos_token_id=target.stop_ids, pad_token_id=target.tokenizer.pad_token_id,
                           prompt_lookup_num_tokens=PLD_TOKENS if method == "pld" else None,
                           # the mask tokens are never output, as in AR and SPACE (issue 44)
                           suppress_tokens=list(target.mask.token_ids) or None,
                           **({} if sampling.greedy else {"temperature": sampling.temperature,
                                                           "top_p": sampling.top_p, "top_k": sampling.top_k}))
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
    device = target.model.device
    prompt = prompt[None].to(device)
    forwards = []  # HF's target forward passes, counted, not assumed
    hook = target.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    # transformers fills every field a passed config leaves unset from the model's own generation
    # config (a Qwen2.5-Instruct's repetition_penalty 1.05, say), which AR and SPACE never read: for
    # the call, the model's config keeps its token ids only, so hf and pld decode what AR decodes
    saved = target.model.generation_config
    target.model.generation_config = GenerationConfig(
        **{key: getattr(saved, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    try:
        t0 = clock(device)
        with torch.inference_mode():
            out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=cfg)
        wall = clock(device) - t0
    finally:
        hook.remove()
        target.model.generation_config = saved
    new = out[0, len(ids):].tolist()
    return {"ids": new, "wall_time": wall, "steps": len(forwards), **{key: [] for key in STEP_KEYS}}


WARM_TRIES = 3  # runs of a question at most, while graphs are built during them (warm_question)


def warm_question(method: str, target: Target, task: EvalTask, max_new_tokens: int, sampling: SamplingConfig,
                  num_samples: int) -> dict:
    """:func:`run_question`, run again when torch.compile built a graph during it (``--compile``:
    a shape the warm-up did not meet, such as prompt lookup's 1-row step, takes a minute or more
    on a CPU), up to ``WARM_TRIES`` runs: the record then times warm graphs, as every other
    question's does."""
    from torch._dynamo.utils import counters

    for _ in range(WARM_TRIES):
        graphs = counters["stats"]["unique_graphs"]
        record = run_question(method, target, task, max_new_tokens, sampling, num_samples)
        if counters["stats"]["unique_graphs"] == graphs:
            break
    return record


class ContextOverflow(ValueError):
    """A turn's prompt (a later turn's holds the earlier answers' text) leaves no room for
    max_new_tokens: :func:`run_bench` records the (question, method) as skipped with this message."""


def _context(target: Target) -> tuple[int, str]:
    """(tokens a prompt and its answer may hold, the limit's name for a message): the model
    context, or over captured steps the captured cache's slots less a step's most rows
    (``StepGraphs.check_fits``)."""
    context = target.model.config.max_position_embeddings
    if target.graphs is None:
        return context, f"the model context {context}"
    return (min(context, target.graphs.slots - target.graphs.max_rows),
            f"the captured cache's {target.graphs.slots} slots less a step's {target.graphs.max_rows} rows "
            "(--capture-len)")


def run_question(method: str, target: Target, task: EvalTask, max_new_tokens: int, sampling: SamplingConfig,
                 num_samples: int) -> dict:
    """All turns of one question, ``num_samples`` times, as a Spec-Bench style record. Sample i's
    turn t samples with seed ``sampling.seed + i + (t - 1) * num_samples`` (mod 2**64): every
    (sample, turn) its own stream, the first turns' seeds those of a single-turn run.

    Raises:
        ContextOverflow: a turn's prompt (a later turn's holds the earlier answers' text, tokenized
            again) + max_new_tokens exceeds the context (:func:`_context`).
    """
    from ..decoding import SamplingConfig

    context, where = _context(target)
    choices = []
    for index in range(num_samples):
        messages, choice = [], {"index": index, "turns": [], "new_tokens": [], "wall_time": [], "steps": [],
                                **{key: [] for key in STEP_KEYS}, "token_ids": []}
        for number, turn in enumerate(task.turns, 1):
            messages.append({"role": "user", "content": turn})
            ids = chat_ids(target.tokenizer, messages)
            if len(ids) + max_new_tokens > context:
                raise ContextOverflow(f"turn {number}'s prompt ({len(ids)} tokens, the earlier answers tokenized "
                                      f"again) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                                      f"exceeds {where}")
            # a seed of its own per (sample, turn): one seed for every turn restarted the same random
            # stream each turn, so a later turn's draws followed the first's (first turns keep seed + index)
            cfg = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p,
                                 (sampling.seed + index + (number - 1) * num_samples) % 2**64)
            out = generate(method, target, ids, max_new_tokens, cfg)
            text = target.tokenizer.decode(out["ids"], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            choice["turns"].append(text)
            choice["new_tokens"].append(len(out["ids"]))
            for key in ("wall_time", "steps", *STEP_KEYS):
                choice[key].append(out[key])
            choice["token_ids"].append(out["ids"])
        if task.language:
            choice["exec"] = check(task.problem, task.language, choice["turns"][0])
        choices.append(choice)
    return {"question_id": task.question_id, "category": task.category, "model_id": method, "choices": choices}


def context_overflow(target: Target, task: EvalTask, max_new_tokens: int) -> str | None:
    """Why ``task`` cannot run within the model context (:func:`_context`), or None when it fits.

    The plain condition prompt + max_new_tokens > context, at the last turn, whose prompt holds
    every earlier turn and answer; each earlier answer is counted at max_new_tokens. That is an
    estimate: an answer's text tokenized again can take more tokens than were generated (80 of
    3,750 SmolLM2 answers stored under results/, up to 9 more), so :func:`run_question` checks
    each turn's real prompt too (:class:`ContextOverflow`).
    """
    context, where = _context(target)
    messages = []
    for turn in task.turns[:-1]:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    prompt = len(chat_ids(target.tokenizer, messages + [{"role": "user", "content": task.turns[-1]}]))
    n = len(task.turns)
    need = prompt + n * max_new_tokens
    if need <= context:
        return None
    answers = f"{n} x max_new_tokens ({max_new_tokens})" if n > 1 else f"max_new_tokens ({max_new_tokens})"
    return f"prompt ({prompt} tokens) + {answers} = {need} exceeds {where}"


def run_bench(target: Target, tasks: list[EvalTask], methods: list[str], out_file: Path, max_new_tokens: int,
              sampling: SamplingConfig, num_samples: int = 1) -> list[dict]:
    """Run every method on every task (resuming ``out_file``); returns all records, skipped ones included.
    Each new record holds its question's fingerprint (``tasks.question_sha256``).

    Raises:
        ValueError: ``out_file`` holds records of a question asked now whose fingerprint differs (its
            text or tests changed since), naming them; records written before fingerprints pass; a
            record that is not a sample record (:func:`read_samples`).
    """
    rows = read_samples(out_file)
    asked = {t.question_id: question_sha256(t) for t in tasks}
    changed = sorted({r["question_id"] for r in rows if r.get("question_sha256")
                      and r["question_sha256"] != asked.get(r["question_id"], r["question_sha256"])})
    if changed:
        raise ValueError(f"{out_file} holds answers to another text of {len(changed)} of this run's questions "
                         f"({', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''}): the dataset changed "
                         "since they were made; use another --out, or delete it to start over")
    done = {(r["question_id"], r["model_id"]) for r in rows}
    if done:
        mine = sum((t.question_id, m) in done for t in tasks for m in methods)
        print(f"[space-eval] resuming: {mine} of {len(tasks) * len(methods)} (question, method) records done "
              f"in {out_file}", flush=True)
    todo = [t for t in tasks if any((t.question_id, m) not in done for m in methods)]
    skip = {t.question_id: context_overflow(target, t, max_new_tokens) for t in todo}
    warm = next((t for t in todo if skip[t.question_id] is None), None)
    if warm is not None:
        ids = chat_ids(target.tokenizer, [{"role": "user", "content": warm.turns[0]}])
        for m in methods:  # untimed warm-up: allocator, kernels, caches
            generate(m, target, ids, min(8, max_new_tokens), sampling)
    for task in tqdm(todo, desc="evaluating", unit="question"):
        why = skip[task.question_id]
        new = []
        for m in methods:
            if (task.question_id, m) in done:
                continue
            head = {"question_id": task.question_id, "category": task.category, "model_id": m,
                    "question_sha256": asked[task.question_id]}
            if why:
                new.append({**head, "skipped": why})
                continue
            try:
                new.append({**head, **warm_question(m, target, task, max_new_tokens, sampling, num_samples)})
            except ContextOverflow as e:  # skipped, not a stop: a resume would stop at it again
                tqdm.write(f"[space-eval] {task.question_id}: {m} skipped, {e}")
                new.append({**head, "skipped": f"{m}: {e}"})
        append_jsonl(out_file, new)
        rows += new
    return rows
