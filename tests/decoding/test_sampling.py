"""Exact speculative sampling preserves the target distribution (chi-square, fixed seeds)."""
import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from space.decoding import SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.sampling import logits_to_probs
from space.decoding.verify import verify_rejection
from space.tokens import MaskSpec

ALPHA = 1e-3
V_REAL, MASK = 4, 4  # tokens 0..3 are real, 4 is the mask token


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Chi-square goodness of fit; categories with expected count < 5 are pooled."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for key, p in probs.items():
        if p * n < 5:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + p * n
        else:
            obs.append(counts.get(key, 0)), exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o), exp.append(pool_e)
    assert sum(obs) == n
    total = sum(exp)  # float probabilities sum to 1 only up to rounding
    return chisquare(obs, [e * n / total for e in exp]).pvalue


def test_verify_rejection_first_token_follows_p():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 5, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(1, 5, generator=gen) * 2, -1)
    counts, n, rejected = {}, 20000, 0
    for _ in range(n):
        c = torch.multinomial(q[0], 1, generator=gen)
        a, bonus = verify_rejection(p, q, c, gen)
        first = int(c) if a == 1 else bonus
        rejected += a == 0
        counts[first] = counts.get(first, 0) + 1
    assert 0 < rejected < n
    assert chi2_pvalue(counts, {i: float(p[0, i]) for i in range(5)}, n) > ALPHA


@pytest.fixture(scope="module")
def small_vocab_model():
    cfg = LlamaConfig(vocab_size=V_REAL + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = LlamaForCausalLM(cfg).eval()
    return model, MaskSpec((MASK,), 3)


def exact_distribution(model, prompt, cfg, length=3):
    """P(t1..t_length | prompt) under AR sampling with ``cfg``, by enumeration."""
    probs = {}
    for seq in itertools.product(range(V_REAL), repeat=length):
        ids = torch.tensor(prompt + list(seq))[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1]
        logits[:, MASK] = float("-inf")
        p = logits_to_probs(logits, cfg)
        probs[seq] = float(torch.prod(p[torch.arange(length), torch.tensor(seq)]))
    return probs


@pytest.mark.parametrize("temperature,top_p,k,lookup", [(1.0, 1.0, 3, 0), (0.7, 0.9, 2, 0), (1.0, 1.0, 2, 3)])
def test_space_sampling_matches_ar_distribution(small_vocab_model, temperature, top_p, k, lookup):
    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    exact = exact_distribution(model, prompt, SamplingConfig(temperature, top_p=top_p))
    n = 1500
    dec = SpaceDecoder(model, spec, k, lookup_tokens=lookup)  # lookup: one-hot q (4 real tokens: it hits often)
    space_counts, ar_counts, accepts = {}, {}, []
    for seed in range(n):
        cfg = SamplingConfig(temperature, top_p=top_p, seed=seed)
        out = dec.generate(torch.tensor(prompt), 3, sampling=cfg)
        space_counts[tuple(out.new_ids)] = space_counts.get(tuple(out.new_ids), 0) + 1
        accepts += out.accept_lengths[1:]
        if seed < n // 3:
            ar = tuple(ar_generate(model, torch.tensor(prompt), 3, sampling=cfg, suppress_ids=[MASK]).new_ids)
            ar_counts[ar] = ar_counts.get(ar, 0) + 1
    assert 0 in accepts and max(accepts) >= 1  # both rejection and acceptance paths ran
    assert chi2_pvalue(space_counts, exact, n) > ALPHA
    assert chi2_pvalue(ar_counts, exact, n // 3) > ALPHA
