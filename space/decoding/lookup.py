"""Prompt lookup for the SPACE step, incremental (issue 43: host time per step).

What it finds is what transformers' ``PromptLookupCandidateGenerator`` (the ``pld`` baseline's
drafter, "prompt lookup decoding") finds for the same text: the last n-gram of the text
(n = ``max_ngram`` down to 1, the longest first) is looked for from the start, and the first
occurrence whose continuation is not empty gives up to ``num_tokens`` tokens after it. That
generator rebuilds a tensor of the whole text and compares every window each call, ~0.25 ms a
step here; this index keeps each n-gram's positions in a dict and adds only the tokens that
arrived since the last call, so a step's lookup costs a few dict reads. Equality with the
generator is tested on random and repetitive texts (``tests/decoding/test_lookup.py``).

Our addition: :meth:`PromptLookup.continuations` also gives what followed the n-gram's other
earlier occurrences, the most recent first, as more branches of the dynamic tree, which prices
them (``space.decoding.dynamic``). Replayed over SmolLM2's greedy answers, prompt lookup alone with
the first occurrence and the three most recent gains 11 % (HumanEval 40) and 19 % (MT-Bench 40)
tokens per step over the first alone (``scripts/replay_lookup.py``, ``results/lookup_branches``).
"""
from __future__ import annotations

# most earlier occurrences looked at for the other continuations, the most recent first: a text that
# repeats one line over and over has hundreds, all with the same continuation, and a step's host time counts
SCAN = 64


class Continuations(list):
    """Prompt lookup's continuations of a text (lists of token ids), the text's own first, then
    the datastore's: ``stored`` is how many at the end are the datastore's (all of them when the
    text has none of its own), which the dynamic tree prices by their own rates
    (``space.decoding.dynamic.AcceptanceStats.store_rates``)."""

    def __init__(self, found=(), stored: int = 0):
        super().__init__(found)
        self.stored = stored


class PromptLookup:
    """Prompt lookup over one growing text (one generation).

    Args:
        text: the token ids so far (prompt, then output); the caller appends to this list and
            the index reads what was appended at the next :meth:`continuation`.
        num_tokens: most tokens a continuation holds (``DecodeConfig.lookup_tokens``), >= 1.
        max_ngram: longest n-gram matched (``DecodeConfig.lookup_ngram``), >= 1.
        max_length: the model's context: none is given when the text is one token short of it
            (as the generator does). The text's own continuations end at the text's end, as the
            generator's do, and may reach past the context (the planner cuts every path to the
            room left, ``dynamic.plan_step``); the datastore's are cut to the context.
        branches: most continuations :meth:`continuations` gives (>= 1): the first occurrence's,
            then the most recent other occurrences' of the same n-gram, none the start of another.
        datastore: a :class:`space.decoding.datastore.Datastore` whose continuations of the text
            :meth:`continuations` adds after the text's own, at most ``datastore_branches`` (>= 0).

    Raises:
        ValueError: ``num_tokens``, ``max_ngram`` or ``branches`` below 1, ``datastore_branches``
            below 0.
    """

    def __init__(self, text: list[int], num_tokens: int, max_ngram: int, max_length: int, branches: int = 1,
                 datastore=None, datastore_branches: int = 0):
        if num_tokens < 1 or max_ngram < 1 or branches < 1 or datastore_branches < 0:
            raise ValueError(f"prompt lookup needs num_tokens, max_ngram and branches >= 1 and datastore_branches "
                             f">= 0, got {num_tokens}, {max_ngram}, {branches}, {datastore_branches}")
        self.text, self.num_tokens, self.max_ngram, self.max_length = text, num_tokens, max_ngram, max_length
        self.branches = branches
        self.datastore, self.datastore_branches = datastore, datastore_branches if datastore is not None else 0
        self.where: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its occurrences, in order
        self.indexed = 0  # tokens of ``text`` whose n-grams ending there are in ``where``

    def continuation(self) -> list[int]:
        """The tokens that followed the first earlier occurrence of the text's last n-gram (the
        longest n that has one), at most ``num_tokens`` and never past the text's end; empty when
        no n-gram recurs: prompt lookup decoding's candidates."""
        found = self.continuations(1, 0)
        return found[0] if found else []

    def continuations(self, branches: int | None = None, datastore_branches: int | None = None) -> Continuations:
        """Up to ``branches`` (default: the constructor's) continuations of the text's last n-gram,
        for the longest n that has a non-empty one: first :meth:`continuation`'s, then those of
        the n-gram's other earlier occurrences, the most recent first (a text repeats what it
        said last more often than what it said first; the :data:`SCAN` most recent), each skipped
        when it is the start of one already given. Then up to ``datastore_branches`` (default: the
        constructor's) from the datastore, the best first, skipped alike, counted in the result's
        ``stored`` (all of them where the text has none of its own). Each holds at most
        ``num_tokens`` tokens, the text's own never past the text's end, the datastore's never past
        the context's last position but one (a node there never pays: prompt + new tokens fit the
        context); empty when nothing is found."""
        found = Continuations(self._own(branches))
        more = self.datastore_branches if datastore_branches is None else datastore_branches
        if more and self.datastore is not None and len(self.text) + 1 < self.max_length:
            # ends one position short of the context, where a node could never pay
            room = min(self.num_tokens, self.max_length - len(self.text) - 1)
            for c in self.datastore.continuations(self.text, more, room):
                if not any(have[: len(c)] == c for have in found):
                    found.append(c)
                    found.stored += 1
        return found

    def _own(self, branches: int | None) -> list[list[int]]:
        text, L = self.text, len(self.text)
        for end in range(self.indexed + 1, L + 1):  # n-grams ending at each new token
            for n in range(1, min(self.max_ngram, end) + 1):
                self.where.setdefault(tuple(text[end - n: end]), []).append(end - n)
        self.indexed = L
        if L + 1 == self.max_length:
            return []
        branches = self.branches if branches is None else branches
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            where = self.where[tuple(text[L - n:])]
            found = self._after(where[0] + n, L)
            if not found:  # the first occurrence is the last n-gram itself, with nothing after it
                continue
            out = [found]
            for i in range(len(where) - 1, max(len(where) - 1 - SCAN, 0), -1):  # the others, the most recent first
                if len(out) == branches:
                    break
                more = self._after(where[i] + n, L)
                # a continuation cut short by the text's end is often the start of one already
                # found: it would add no node, and takes no slot
                if more and not any(have[: len(more)] == more for have in out):
                    out.append(more)
            return out
        return []

    def _after(self, start: int, L: int) -> list[int]:
        return self.text[start: min(start + self.num_tokens, L, self.max_length)]
