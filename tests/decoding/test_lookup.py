"""The incremental prompt lookup finds what transformers' PromptLookupCandidateGenerator finds
(the pld baseline's drafter), at every length of a growing text (issue 43)."""
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from space.decoding.lookup import PromptLookup


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
