"""Instruction data for SAR-SFT: raw files -> (context messages, response) -> token ids.

Formats (DESIGN §5; detected per row):

* Alpaca / LIMA: ``instruction``, optional ``input``, ``output``, optional ``history`` ([[q, a], ...]).
* ShareGPT: ``conversations`` with ``from``/``value`` or ``role``/``content``; the last assistant
  turn is the response, earlier turns are context.
* MBPP: ``text`` + ``code``, turned into a prompt that states the task and the signature.
* Self-distilled JSONL: ``prompt`` (a string or a message list) + ``response``, optional
  ``finished`` and ``response_ids`` (``space-distill`` writes both: the model's own tokens, which
  training uses when they spell the response in the tokenizer at hand, see :func:`tokenize`).

A registry maps names to files under the data root (default ``../shared/data``, or
``$SPACE_DATA``); any other name is read as a path to a .json/.jsonl file. Malformed rows raise
ValueError naming the file and the row. No masks here: the collator adds them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..jsonl import read_jsonl
from .prompts import chat_ids, mbpp_prompt

REGISTRY = {
    "mbpp": "mbpp/mbpp.jsonl",
    "lima": "lima/lima.json",
    "mt-bench": "mt-bench/question.jsonl",
}
CHAT_ROLES = ("system", "user", "assistant")  # what a prompt message's role may be
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The shared data folder: ``root``, else ``$SPACE_DATA``, else ``../shared/data`` of the repo."""
    if root is not None:
        return Path(root)
    if "SPACE_DATA" in os.environ:
        return Path(os.environ["SPACE_DATA"])
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


@dataclass
class Example:
    """One training pair: ``context`` messages (role/content) and the assistant ``response``;
    ``finished`` False for a response cut at a length limit (``space-distill``'s rows record it):
    the model never ended its turn there, so :func:`tokenize` adds no end of turn.
    ``response_ids``: the token ids the model generated for ``response`` (cut before its end id), or
    None when the row has only text; ``stop_id``: that end id (None: not recorded, the tokenizer's
    EOS is taken)."""

    context: list[dict]
    response: str
    finished: bool = True
    response_ids: list[int] | None = None
    stop_id: int | None = None


def read_rows(path: Path) -> list[dict]:
    """Rows of a .json (list), .jsonl or .jsonl.gz file.

    JSONL lines end at ``"\n"`` only: U+2028, U+2029 and U+0085, which ``str.splitlines`` would
    also split at, are ordinary characters inside a JSON string.

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON or UTF-8 (file and line named), a .json that is not a list, or no rows
            at all.
    """
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".json":
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
    else:  # .jsonl, or .jsonl.gz: a committed self-distilled set (space-distill --out x.jsonl.gz)
        rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path}: the file is empty (no rows)")
    return rows


def to_example(row: dict) -> Example:
    """Normalize one row of any supported format. Raises ValueError saying what is missing."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    if "instruction" in row and "output" in row:
        context = []
        for turn in row.get("history") or []:
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
                raise ValueError("'history' must be a list of [question, answer] pairs of strings")
            context += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        if not isinstance(row.get("input") or "", str):
            raise ValueError(f"'input' must be a string, got {type(row['input']).__name__}")
        question = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        return _checked(context + [{"role": "user", "content": question}], row["output"])
    if "conversations" in row:
        if not isinstance(row["conversations"], list) or not all(isinstance(t, dict) for t in row["conversations"]):
            raise ValueError("'conversations' must be a list of turns (objects with from/value)")
        turns = [{"role": _sharegpt_role(t), "content": t.get("value", t.get("content"))} for t in row["conversations"]]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError("'conversations' has no assistant turn")
        return _checked(turns[:last], turns[last]["content"])
    if "text" in row and "code" in row:
        return _checked([{"role": "user", "content": mbpp_prompt(row["text"], row["code"], row.get("test_list"))}],
                        f"```python\n{row['code'].replace(chr(13), '').strip()}\n```")
    if "prompt" in row and "response" in row:
        prompt = row["prompt"]
        context = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        finished = row.get("finished", True)
        if not isinstance(finished, bool):  # "false" or 0 would read as finished
            raise ValueError(f"'finished' must be true or false, got {finished!r}")
        ids = row.get("response_ids")
        if ids is not None and not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
            raise ValueError("'response_ids' must be a non-empty list of token ids (integers)")
        stop = row.get("stop_id")
        if stop is not None and (type(stop) is not int or not finished):
            raise ValueError(f"'stop_id' must be the token id a finished answer ended with, got {stop!r}"
                             f"{'' if finished else ' on an unfinished one'}")
        return _checked(context, row["response"], finished, ids, stop)
    raise ValueError(f"unknown row format with keys {sorted(row)}; expected instruction/output, "
                     "conversations, text/code or prompt/response")


def _sharegpt_role(turn: dict) -> str:
    """A ShareGPT turn's role as a chat role; an unknown or missing one is refused (taken as the
    user's, a misspelt "gtp" answer became a question and a tool turn a user turn)."""
    role = turn.get("from", turn.get("role"))
    if str(role).lower() not in _ROLES:
        raise ValueError(f"conversation turn role {role!r} is not one of {', '.join(sorted(_ROLES))}")
    return _ROLES[str(role).lower()]


def _checked(context: list[dict], response, finished: bool = True, response_ids: list[int] | None = None,
             stop_id: int | None = None) -> Example:
    if not isinstance(response, str) or not response.strip():
        raise ValueError("empty or non-string response")
    if not context or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in context):
        raise ValueError("missing or non-string prompt")
    # checked here, not left to the chat template, which fails on a missing role with a jinja
    # traceback after the model has loaded and takes a misspelt one as text
    bad = [m.get("role") for m in context if m.get("role") not in CHAT_ROLES]
    if bad:
        raise ValueError(f"prompt message role {bad[0]!r} is not one of {', '.join(CHAT_ROLES)}")
    return Example(context, response, finished, response_ids, stop_id)


def data_lists(datasets: str | None, sources: str | None = None) -> tuple[list[str], list[str] | None]:
    """A training config's comma lists (``DataArgs.datasets`` and ``DataArgs.sources``) as training
    reads them: the dataset names, stripped, without empty entries, and the ``sources`` filter of
    :func:`load_examples` (None when not given: every row kept).

    Raises:
        ValueError: ``sources`` given but naming no source (e.g. ``", "``): an empty filter would keep
            no row, so say so at parse time rather than after the data is read.
    """
    names = [n.strip() for n in (datasets or "").split(",") if n.strip()]
    if not sources:
        return names, None
    kept = [s.strip() for s in sources.split(",") if s.strip()]
    if not kept:
        raise ValueError(f"sources={sources!r} names no source; leave it unset to keep every row")
    return names, kept


def load_examples(name: str, root: str | os.PathLike | None = None, limit: int | None = None,
                  sources: list[str] | None = None, seen: set[str] | None = None) -> list[Example]:
    """Examples of a registered dataset name or a .json/.jsonl path.

    ``sources`` keeps only the rows whose ``source`` field (written by ``space-distill``: mbpp, lima,
    stdlib) is in the list, before ``limit`` rows are taken; None keeps every row. ``seen``: the
    sources of the kept rows are added to it (a caller reading several files checks that every
    source it names matched a row somewhere: a misspelt one dropped its rows silently).

    Raises:
        FileNotFoundError: unknown name that is not a file either (lists the registered names).
        ValueError: a malformed row, naming file and row; with ``sources``, a row without a
            ``source`` field, or no row left.
    """
    path = data_root(root) / REGISTRY[name] if name in REGISTRY else Path(name)
    if name not in REGISTRY and not path.is_file():
        raise FileNotFoundError(f"unknown dataset {name!r}: not one of {sorted(REGISTRY)} and not a file")
    rows = list(enumerate(read_rows(path)))
    if sources is not None:
        for i, row in rows:
            if not isinstance(row, dict) or "source" not in row:
                raise ValueError(f"{path}: row {i} has no 'source' field to filter on (sources={sources})")
        rows = [(i, row) for i, row in rows if row["source"] in sources]
        if not rows:
            raise ValueError(f"{path}: no row has a source in {sources}")
        if seen is not None:
            seen.update(row["source"] for _, row in rows)
    out = []
    for i, row in rows[:limit]:
        try:
            out.append(to_example(row))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: row {i}: {e}") from None
    return out


def own_ids(ex: Example, tokenizer) -> list[int] | None:
    """``ex.response_ids`` when they are this tokenizer's spelling of ``ex.response`` (decoded
    without special tokens, an unfinished answer's cut character dropped, as ``space-distill``
    wrote the text), else None: ids from another model's tokenizer are not this model's tokens."""
    ids = ex.response_ids
    if ids is None or not all(0 <= i < len(tokenizer) for i in ids):
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return ids if (text if ex.finished else text.rstrip("\ufffd")) == ex.response else None


def tokenize(examples: list[Example], tokenizer, max_length: int):
    """Token ids (prompt + response + the template's end of turn, or EOS without a template;
    nothing after an unfinished response, whatever token the template ends a turn with) cut to
    ``max_length``, with ``prompt_len``, ``idx`` and ``own_ids``.

    A self-distilled answer whose ``response_ids`` spell it in this tokenizer (:func:`own_ids`) is
    trained on those ids, then EOS if it finished: the tokens the model generates, which the masks
    learn to draft (DESIGN §5). Its text tokenized again splits differently in 7-18 % of
    SmolLM2's answers (``ĊĊ`` generated, ``Ċ Ċ`` retokenized). Other responses are tokenized
    from their text (``own_ids`` False).

    Prompt tokens are excluded from the loss by the collator (targets before ``prompt_len``).
    Samples that leave their response fewer than 2 of ``max_length``'s tokens are dropped: a mask
    group starts after a response token and drafts the next (``SpaceCollator.draw_spans``).

    Returns:
        a ``datasets.Dataset`` (imported here: loading it costs about 1.5 s, which ``--help`` skips).

    Raises:
        ValueError: the tokenizer's chat template refuses an example's conversation (two user turns
            in a row under a template that enforces alternation), naming the example.
    """
    from datasets import Dataset
    from jinja2 import TemplateError  # what a chat template raises (raise_exception) on a conversation it refuses

    rows = []
    for i, ex in enumerate(examples):
        try:
            rows += _tokenized(i, ex, tokenizer, max_length)
        except TemplateError as e:  # e.g. two user turns in a row under a template that enforces alternation
            raise ValueError(f"training example {i}: the tokenizer's chat template refused its conversation "
                             f"({e}); fix or drop that row") from None
    return Dataset.from_list(rows)


def _tokenized(i: int, ex: Example, tokenizer, max_length: int) -> list[dict]:
    """:func:`tokenize`'s row of example ``i``, or none (a response left without 2 tokens)."""
    prompt = chat_ids(tokenizer, ex.context)
    ids = own_ids(ex, tokenizer)
    if ids is not None:
        # the model's own tokens, then the end id its generation stopped at (none after a cut): on a
        # model whose turns end otherwise than its tokenizer's EOS (Llama-3-Instruct's <|eot_id|>),
        # the EOS would teach an end the model never writes
        end = tokenizer.eos_token_id if ex.stop_id is None else ex.stop_id
        full = prompt + ids + ([end] if ex.finished else [])
    elif not ex.finished:
        # a response cut at max_new_tokens: the prompt and the tokens generated after it, as the
        # teacher produced them, with no end of turn (or template text) after the cut that would
        # teach the masks to close the turn there; whatever token the template ends a turn with.
        # An answer cut inside a multi-byte character ends in U+FFFD (its bytes, decoded alone),
        # which the model never wrote: dropped (15 committed rows)
        full = prompt + tokenizer(ex.response.rstrip("\ufffd"), add_special_tokens=False)["input_ids"]
    else:
        full = chat_ids(tokenizer, ex.context + [{"role": "assistant", "content": ex.response}], add_generation_prompt=False)
        # no template (chat_ids' "role: content" lines end a turn with a newline, not EOS: the model
        # would never learn to stop), or one that re-renders the prompt once an answer follows it
        if not tokenizer.chat_template or full[: len(prompt)] != prompt:
            full = prompt + tokenizer(ex.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(prompt) + 2 <= max_length:
        return [{"input_ids": full[:max_length], "prompt_len": len(prompt), "idx": i, "own_ids": ids is not None}]
    return []
