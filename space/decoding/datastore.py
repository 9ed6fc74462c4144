"""Datastore lookup: continuations from the model's own earlier answers (our addition, REST-style).

Prompt lookup copies what followed the text's last n-gram in the text itself. A datastore holds
other texts, here the model's own greedy answers to its training prompts (a ``space-distill``
set, DESIGN §5): a greedy model answers alike prompts alike, so what followed the same n-gram
there is often what it says next here (He et al., "REST: Retrieval-Based Speculative Decoding",
2023, with a corpus for a datastore). Its continuations join prompt lookup's in the dynamic tree
as more branches, each priced like any node by the datastore's own running rates, which are
lower than the text's own (``space.decoding.lookup``, ``space.decoding.dynamic``). Verification
keeps the output AR's, whatever they hold.

Index: every position's n-gram (n = :data:`NGRAM`) packed into one int64 and sorted, so the
occurrences of the text's last n-gram are one ``searchsorted`` away. Among them (the last
:data:`SCAN` in store order), a continuation scores 1 plus :data:`CONTEXT_WEIGHT` for each
token of the unbroken run just before the n-gram that matches the text's (up to :data:`CONTEXT`),
summed over the occurrences it follows; the best ``k`` are given. Answers are kept apart by a separator that no
continuation crosses.

Replayed over SmolLM2's greedy answers with the two committed sets for a datastore (1.4 M tokens),
prompt lookup alone with its four continuations and one from the datastore reaches 3.47 / 3.06
tokens a step against 2.38 / 2.74 (HumanEval 40 / MT-Bench 40, ``scripts/replay_lookup.py
--datastore``); SPACE with it, eager on a 2-core CPU: 3.08 -> 3.40 tokens/step on HumanEval 40,
3.20 -> 3.36 on MT-Bench 20 (``results/datastore``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

NGRAM = 3  # tokens matched (a 2-gram recurs too often across answers to say much)
BITS = 21  # bits per token in a packed n-gram: NGRAM * BITS <= 63, vocabularies up to 2,097,152
SCAN = 512  # most occurrences scored a step (host time)
CONTEXT = 12  # most tokens before the n-gram compared with the text's
CONTEXT_WEIGHT = 4  # what each of them adds to an occurrence's weight
SEPARATOR = -1  # between answers


def set_paths(paths: str | list[str | Path]) -> list[Path]:
    """The sets of a datastore: a list, or a comma list as ``--datastore`` takes them."""
    if isinstance(paths, str):
        paths = [p.strip() for p in paths.split(",") if p.strip()]
    return [Path(p) for p in paths]


class Datastore:
    """An n-gram index over token sequences.

    Args:
        sequences: the texts' token ids (each a list of ints >= 0 and < 2**21); empty ones are
            skipped.

    Raises:
        ValueError: no sequence holds :data:`NGRAM` + 1 tokens (nothing to look up), or a token
            id out of range.
    """

    def __init__(self, sequences: list[list[int]]):
        parts = []
        for seq in sequences:
            if seq:
                parts += [seq, [SEPARATOR]]
        tokens = np.fromiter((t for part in parts for t in part), dtype=np.int64)
        real = np.fromiter((t for seq in sequences for t in seq), dtype=np.int64)  # a -1 among them is no separator
        if real.size and (real.min() < 0 or real.max() >= 1 << BITS):
            raise ValueError(f"datastore token ids must be in [0, {1 << BITS}), got {real.min()}..{real.max()}")
        starts = np.arange(max(tokens.size - NGRAM, 0))  # an n-gram with a token after it
        ok = np.ones(starts.size, dtype=bool)
        key = np.zeros(starts.size, dtype=np.int64)
        for j in range(NGRAM):
            ok &= tokens[starts + j] != SEPARATOR
            key = (key << BITS) | np.maximum(tokens[starts + j], 0)
        ok &= tokens[starts + NGRAM] != SEPARATOR
        if not ok.any():
            raise ValueError(f"the datastore holds no {NGRAM} tokens followed by another: nothing to look up")
        starts, key = starts[ok], key[ok]
        order = np.argsort(key, kind="stable")  # stable: each n-gram's occurrences stay in store order
        self.tokens, self.keys, self.starts = tokens, key[order], starts[order]
        self.identity = hashlib.sha256(tokens.tobytes()).hexdigest()

    def __len__(self) -> int:
        """Tokens held, separators excluded."""
        return int((self.tokens != SEPARATOR).sum())

    @classmethod
    def from_sets(cls, paths: str | list[str | Path], tokenizer) -> Datastore:
        """The answers of ``space-distill`` sets (``.jsonl`` or ``.jsonl.gz``; a list, or a comma
        list as ``--datastore`` takes them): each row's ``response_ids``, or its ``response``
        tokenized when it has none (sets made before them).

        Raises:
            FileNotFoundError: a set is missing.
            ValueError: a set holds no answer (rows without ``response``), or as the constructor.
        """
        from ..jsonl import read_jsonl

        sequences = []
        for path in set_paths(paths):
            if not path.is_file():
                raise FileNotFoundError(f"datastore set {path} not found")
            rows = read_jsonl(path)
            if not rows or not all(isinstance(r, dict) and ("response_ids" in r or "response" in r) for r in rows):
                raise ValueError(f"{path}: not a distilled set (every row needs a response or response_ids)")
            texts = [r["response"] for r in rows if "response_ids" not in r]
            spelled = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
            sequences += [r["response_ids"] if "response_ids" in r else next(spelled) for r in rows]
        return cls(sequences)

    def continuations(self, text: list[int], k: int, num_tokens: int) -> list[list[int]]:
        """Up to ``k`` distinct continuations (each at most ``num_tokens`` tokens, none crossing a
        separator) of the text's last :data:`NGRAM` tokens, the best scored first (module
        docstring); [] when the n-gram is not in the store or the text is shorter than it."""
        if len(text) < NGRAM or k < 1 or num_tokens < 1:
            return []
        key = 0
        for t in text[-NGRAM:]:
            if not 0 <= t < 1 << BITS:
                return []
            key = (key << BITS) | t
        lo, hi = np.searchsorted(self.keys, key, "left"), np.searchsorted(self.keys, key, "right")
        if lo == hi:
            return []
        at = self.starts[max(lo, hi - SCAN):hi]
        weight = np.ones(at.size)
        alive = np.ones(at.size, dtype=bool)
        for j in range(1, min(CONTEXT, len(text) - NGRAM) + 1):
            before = at - j
            alive &= (before >= 0) & (self.tokens[np.maximum(before, 0)] == text[-NGRAM - j])
            if not alive.any():
                break
            weight += CONTEXT_WEIGHT * alive
        span = np.minimum(at[:, None] + NGRAM + np.arange(num_tokens)[None, :], self.tokens.size - 1)
        follow = self.tokens[span]
        follow[np.cumsum(follow == SEPARATOR, axis=1) > 0] = SEPARATOR  # nothing after a separator
        # the distinct continuations in token order (ties keep it) and their summed weights: a
        # lexicographic sort and a run-length pass, 2x faster than np.unique(axis=0) here
        order = np.lexsort(follow.T[::-1])
        follow, weight = follow[order], weight[order]
        first = np.flatnonzero(np.r_[True, (follow[1:] != follow[:-1]).any(axis=1)])
        unique, score = follow[first], np.add.reduceat(weight, first)
        out = []
        for i in np.argsort(-score, kind="stable")[:k]:
            tokens = unique[i]
            out.append(tokens[tokens != SEPARATOR].tolist())
        return [c for c in out if c]
