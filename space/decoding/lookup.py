"""Prompt lookup for the SPACE step, incremental (issue 43: host time per step).

What it finds is what transformers' ``PromptLookupCandidateGenerator`` (the ``pld`` baseline's
drafter, "prompt lookup decoding") finds for the same text: the last n-gram of the text
(n = ``max_ngram`` down to 1, the longest first) is looked for from the start, and the first
occurrence whose continuation is not empty gives up to ``num_tokens`` tokens after it. That
generator rebuilds a tensor of the whole text and compares every window each call, ~0.25 ms a
step here; this index keeps each n-gram's first position in a dict and adds only the tokens that
arrived since the last call, so a step's lookup costs a few dict reads. Equality with the
generator is tested on random and repetitive texts (``tests/decoding/test_lookup.py``).
"""
from __future__ import annotations


class PromptLookup:
    """Prompt lookup over one growing text (one generation).

    Args:
        text: the token ids so far (prompt, then output); the caller appends to this list and
            the index reads what was appended at the next :meth:`continuation`.
        num_tokens: most tokens a continuation holds (``DecodeConfig.lookup_tokens``), >= 1.
        max_ngram: longest n-gram matched (``DecodeConfig.lookup_ngram``), >= 1.
        max_length: the model's context: a continuation never reaches past it, and none is
            given when the text is one token short of it (as the generator does).

    Raises:
        ValueError: ``num_tokens`` or ``max_ngram`` below 1.
    """

    def __init__(self, text: list[int], num_tokens: int, max_ngram: int, max_length: int):
        if num_tokens < 1 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs num_tokens >= 1 and max_ngram >= 1, got {num_tokens}, {max_ngram}")
        self.text, self.num_tokens, self.max_ngram, self.max_length = text, num_tokens, max_ngram, max_length
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> position of its first occurrence
        self.indexed = 0  # tokens of ``text`` whose n-grams ending there are in ``first``

    def continuation(self) -> list[int]:
        """The tokens that followed the first earlier occurrence of the text's last n-gram (the
        longest n that has one), at most ``num_tokens`` and never past ``max_length``; empty when
        no n-gram recurs."""
        text, L = self.text, len(self.text)
        for end in range(self.indexed + 1, L + 1):  # n-grams ending at each new token
            for n in range(1, min(self.max_ngram, end) + 1):
                self.first.setdefault(tuple(text[end - n: end]), end - n)
        self.indexed = L
        if L + 1 == self.max_length:
            return []
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            start = self.first[tuple(text[L - n:])] + n
            end = min(start + self.num_tokens, L, self.max_length)
            if start < end:  # an earlier occurrence (the last n-gram itself has nothing after it)
                return text[start:end]
        return []
