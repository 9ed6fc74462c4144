"""The incremental prompt lookup finds what transformers' PromptLookupCandidateGenerator finds
(the pld baseline's drafter), at every length of a growing text (issue 43)."""
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from space.decoding.lookup import SCAN, PromptLookup


@pytest.mark.parametrize("num_tokens,max_ngram,vocab", [(10, 2, 3), (10, 2, 20), (3, 1, 5), (7, 4, 4), (1, 3, 2)])
def test_lookup_equals_transformers_prompt_lookup(num_tokens, max_ngram, vocab):
    gen = torch.Generator().manual_seed(num_tokens * 100 + max_ngram * 10 + vocab)
    for trial in range(6):
        max_length = 40 + 20 * trial
        hf = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                            max_length=max_length)
        text: list[int] = []
        ours = PromptLookup(text, num_tokens, max_ngram, max_length)
        found = 0
        while len(text) < max_length - 1:
            # grow by 1-4 tokens at a time, as a step emits them; copy spans often, so matches recur
            if len(text) > 4 and torch.rand(1, generator=gen) < 0.5:
                i = int(torch.randint(len(text) - 3, (1,), generator=gen))
                text.extend(text[i: i + int(torch.randint(1, 5, (1,), generator=gen))])
            else:
                text.extend(torch.randint(vocab, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist())
            del text[max_length - 1:]
            expected = hf.get_candidates(torch.tensor([text]))[0][0, len(text):].tolist()
            assert ours.continuation() == expected, (trial, text)
            found += bool(expected)
        assert found >= 5  # matches occurred


def test_lookup_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookup([], 0, 2, 100)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup([], 10, 0, 100)


def reference_continuations(text, num_tokens, max_ngram, max_length, branches):
    """By brute force: the longest last n-gram with a non-empty first-occurrence continuation,
    that continuation, then the other occurrences' (the SCAN most recent, the most recent first),
    non-empty, none the start of one before it."""
    L = len(text)
    if L + 1 == max_length:
        return []
    for n in range(min(max_ngram, L - 1), 0, -1):
        starts = [i for i in range(L - n + 1) if text[i: i + n] == text[L - n:]]
        after = [text[i + n: min(i + n + num_tokens, L, max_length)] for i in starts]
        if not after[0]:
            continue
        out = [after[0]]
        for more in list(reversed(after[1:]))[:SCAN]:
            if len(out) < branches and more and all(have[: len(more)] != more for have in out):
                out.append(more)
        return out
    return []


@pytest.mark.parametrize("num_tokens,max_ngram,vocab,branches", [(10, 2, 3, 4), (10, 2, 20, 3), (3, 1, 5, 2),
                                                                  (7, 4, 4, 5), (1, 3, 2, 4)])
def test_continuations_are_the_first_then_the_most_recent_occurrences(num_tokens, max_ngram, vocab, branches):
    """PromptLookup.continuations, kept incrementally, equals a brute-force search at every length of a
    growing text; its first is prompt lookup decoding's (continuation()), and there were often others."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + max_ngram * 100 + vocab * 10 + branches)
    several = 0
    for trial in range(4):
        max_length = 50 + 20 * trial
        text: list[int] = []
        ours, first = PromptLookup(text, num_tokens, max_ngram, max_length, branches), []
        single = PromptLookup(first, num_tokens, max_ngram, max_length)
        while len(text) < max_length - 1:
            if len(text) > 4 and torch.rand(1, generator=gen) < 0.5:
                i = int(torch.randint(len(text) - 3, (1,), generator=gen))
                grow = text[i: i + int(torch.randint(1, 5, (1,), generator=gen))]
            else:
                grow = torch.randint(vocab, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
            text.extend(grow)
            del text[max_length - 1:]
            first[:] = text
            found = ours.continuations()
            assert found == reference_continuations(text, num_tokens, max_ngram, max_length, branches), (trial, text)
            assert (found[0] if found else []) == single.continuation() and len(found) <= branches
            assert ours.continuations(1) == found[:1]
            several += len(found) > 1
    assert several >= 5


def test_lookup_refuses_no_branch():
    with pytest.raises(ValueError, match="branches"):
        PromptLookup([], 10, 2, 100, 0)


def test_other_continuations_look_back_scan_occurrences_at_most():
    """A text that repeats its n-gram a hundred times is searched back SCAN occurrences (its own last
    one included), not to its start: a step's host time stays bounded."""
    text = [t for i in range(100) for t in (1, 2, 100 + i)] + [1, 2]
    found = PromptLookup(text, 3, 2, 10_000, branches=500).continuations()
    assert len(found) == SCAN and found[0] == [100, 1, 2] and found[1] == [199, 1, 2]
    assert found[-1] == [100 + 100 - (SCAN - 1), 1, 2]
