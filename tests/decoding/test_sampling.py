"""Exact speculative sampling preserves the target distribution (chi-square, fixed seeds)."""
import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, NoRepeatNGramLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor)

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.sampling import logits_to_probs
from space.decoding.verify import verify_rejection
from space.tokens import MaskSpec
from tests.conftest import CycleLanguage, train_drafter

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


def test_verify_rejection_three_candidates_vectorized():
    """10^5 steps of 3 candidates in one batched call. Target and draft are Markov chains over 6
    tokens (row i of p depends on c_i), and q is close enough to p that all accept lengths occur.
    Each emitted token must follow p given the tokens before it: t1 ~ p0, then t_{j+1} | t_j ~ P[t_j]
    over the steps that emitted it."""
    gen = torch.Generator().manual_seed(0)
    V, n, m = 6, 100_000, 3
    p0 = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    P = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, -1)  # P[c] = target after c
    Q = torch.softmax(torch.log(P) + 0.7 * torch.randn(V, V, generator=gen), -1)  # draft after c
    q0 = torch.softmax(torch.log(p0) + 0.7 * torch.randn(V, generator=gen), -1)
    c = [torch.multinomial(q0.expand(n, V), 1, generator=gen)[:, 0]]
    q = [q0.expand(n, V)]
    for _ in range(m - 1):
        q.append(Q[c[-1]])
        c.append(torch.multinomial(q[-1], 1, generator=gen)[:, 0])
    cands = torch.stack(c, 1)  # (n, m)
    p = torch.cat([p0.expand(n, 1, V), P[cands]], 1)  # (n, m+1, V): row i is the target after c_i
    a, bonus = verify_rejection(p, torch.stack(q, 1), cands, gen)
    assert a.shape == bonus.shape == (n,) and set(a.tolist()) == set(range(m + 1))
    emitted = torch.cat([cands, torch.zeros(n, 1, dtype=torch.long)], 1)
    emitted[torch.arange(n), a] = bonus  # c_1..c_a, bonus
    first = torch.bincount(emitted[:, 0], minlength=V).tolist()
    assert chi2_pvalue(dict(enumerate(first)), dict(enumerate(p0.tolist())), n) > ALPHA
    for j in range(1, m + 1):  # token j+1 given token j, on the steps that emitted j+1 tokens
        rows = a >= j
        prev, nxt = emitted[rows, j - 1], emitted[rows, j]
        counts = torch.bincount(prev * V + nxt, minlength=V * V).tolist()
        per_prev = torch.bincount(prev, minlength=V)
        expected = {i: float(per_prev[i // V] * P[i // V, i % V]) / int(rows.sum()) for i in range(V * V)}
        assert chi2_pvalue(dict(enumerate(counts)), expected, int(rows.sum())) > ALPHA, j


def test_verify_rejection_without_residual_mass_draws_from_p():
    """Catches the guard for a rejection that leaves no residual mass being dropped or drawing from
    anything but p: when p <= q everywhere (p == q up to rounding; here p = 0.6 q, so it shows at a
    fixed seed) a rejected candidate leaves max(0, p - q) = 0, and ``torch.multinomial`` raises on
    an all-zero row. The bonus must then come from p itself (exact, since the rows agree up to a
    factor): q and p are 0 on the last two tokens, so a uniform draw shows there, and the bonuses'
    counts fit p's."""
    gen = torch.Generator().manual_seed(0)
    n, V = 2000, 5
    logits = torch.randn(n, 1, V, generator=gen)
    logits[..., 3:] = float("-inf")  # outside the support of q and p
    q = torch.softmax(logits, -1)
    p = torch.cat([0.6 * q, q], 1)  # row 0 scores c_1; row 1 (after c_1) is not used on a rejection
    cands = torch.multinomial(q[:, 0], 1, generator=gen)
    a, bonus = verify_rejection(p, q, cands, gen)
    rejected = a == 0
    assert 0.3 < float(rejected.double().mean()) < 0.5  # accepted with probability 0.6
    assert bool((bonus[rejected] < 3).all())
    expected = q[rejected, 0].sum(0) / int(rejected.sum())  # p's row 0, normalized: q's
    counts = dict(enumerate(torch.bincount(bonus[rejected], minlength=V).tolist()))
    assert chi2_pvalue(counts, dict(enumerate(expected.tolist())), int(rejected.sum())) > ALPHA


@pytest.fixture(scope="module")
def small_vocab_model():
    """4 real tokens + a mask; trained a few seconds on a cycle language, so drafts are often
    accepted and a sampled step takes every path (accept, reject, all accepted)."""
    cfg = LlamaConfig(vocab_size=V_REAL + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = LlamaForCausalLM(cfg)
        spec = MaskSpec((MASK,), 3)
        train_drafter(model, spec, CycleLanguage([0, 1, 2, 3], seed=0), k=3, steps=60, seq_len=24)
    return model, spec


def sampled(dec, prompt, n, length=3, processor=None, planner=None, **sampling):
    """``n`` SPACE generations of ``length`` tokens after ``prompt``, seeds 0..n-1 of
    ``SamplingConfig(**sampling)``: (how often each emitted sequence came out, the results).
    ``planner``: a function giving each generation's planner (None: the decoder's own)."""
    outs = [dec.generate(torch.tensor(prompt), length, sampling=SamplingConfig(**sampling, seed=seed),
                         logits_processor=processor, planner=planner and planner()) for seed in range(n)]
    return Counter(tuple(out.new_ids) for out in outs), outs


def exact_distribution(model, prompt, cfg, length=3, processor=None):
    """P(t1..t_length | prompt) under AR sampling with ``cfg``, by enumeration (one batched forward
    of every continuation). ``processor`` (HF convention, (rows, seq) ids and (rows, vocab) scores)
    scores position i with the prompt and t1..t_{i-1}, after the mask is suppressed, as AR does."""
    seqs = torch.tensor(list(itertools.product(range(V_REAL), repeat=length)))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1: -1]  # (continuations, length, vocab)
    logits[..., MASK] = float("-inf")
    probs = torch.ones(len(seqs), dtype=torch.float64)
    for i in range(length):
        scores = logits[:, i] if processor is None else processor(ids[:, : len(prompt) + i], logits[:, i])
        probs *= logits_to_probs(scores, cfg)[torch.arange(len(seqs)), seqs[:, i]].double()
    return dict(zip(map(tuple, seqs.tolist()), probs.tolist()))


@pytest.mark.parametrize("temperature,top_p,k,groups,lookup,tree", [
    (1.0, 1.0, 3, None, 0, None), (1.0, 1.0, 3, 2, 0, None), (1.5, 0.9, 2, 1, 0, None), (1.0, 1.0, 2, None, 3, None),
    (1.0, 1.0, 3, 2, 0, [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]),  # sibling candidates
    (1.5, 0.9, 2, 1, 2, [[0], [1], [0, 0], [0, 1]])])  # this model is nearly deterministic at T=0.7
def test_space_sampling_matches_ar_distribution(small_vocab_model, temperature, top_p, k, groups, lookup, tree):
    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    exact = exact_distribution(model, prompt, SamplingConfig(temperature, top_p=top_p))
    n = 1500
    dec = SpaceDecoder(model, spec, DecodeConfig(k, groups, lookup_tokens=lookup, tree=tree))
    space_counts, ar_counts, accepts = {}, {}, []
    for seed in range(n):
        cfg = SamplingConfig(temperature, top_p=top_p, seed=seed)
        out = dec.generate(torch.tensor(prompt), 3, sampling=cfg)
        space_counts[tuple(out.new_ids)] = space_counts.get(tuple(out.new_ids), 0) + 1
        accepts += out.accept_lengths[1:]
        if seed < n // 3:
            ar = tuple(ar_generate(model, torch.tensor(prompt), 3, sampling=cfg, suppress_ids=[MASK]).new_ids)
            ar_counts[ar] = ar_counts.get(ar, 0) + 1
    # chain: rejections and multi-token accepts both ran; tree: a sibling was accepted (at top-p
    # 0.9 the two depth-1 siblings cover nearly all mass, so every step accepts one)
    assert max(accepts) >= 1 and (tree or (0 in accepts and max(accepts) >= 2))
    assert chi2_pvalue(space_counts, exact, n) > ALPHA
    assert chi2_pvalue(ar_counts, exact, n // 3) > ALPHA


def test_space_tree_sampling_with_rejected_siblings_matches_ar_distribution(small_vocab_model):
    """End to end, the two tree-walk bugs the cases above miss (their drafts are accepted at the
    first sibling too often): a sibling tried against the mass left by the last rejected sibling
    alone, and the mass left at a row carried down to an accepted sibling's children. At T = 3
    the target is spread over the 4 tokens, so the first sibling is often rejected and a later
    one accepted with its grandchildren; 4000 samples give p < 1e-7 on either bug (and
    ``tests/decoding/test_tree.py`` pins both on fixed distributions)."""
    model, spec = small_vocab_model
    prompt, n, temperature = [1, 3, 0, 2], 4000, 3.0
    exact = exact_distribution(model, prompt, SamplingConfig(temperature))
    dec = SpaceDecoder(model, spec, DecodeConfig(2, 1, tree=[[0], [1], [2], [1, 0], [1, 1], [0, 0]]))
    counts, outs = sampled(dec, prompt, n, temperature=temperature)
    accepts = [a for out in outs for a in out.accept_lengths[1:]]
    assert min(accepts.count(a) for a in (0, 1, 2)) > n / 5  # rejections, siblings and grandchildren all ran
    assert chi2_pvalue(counts, exact, n) > ALPHA


def context_processor():
    """A real HF processor whose effect depends on every token before the scored position:
    no-repeat bigrams ban what followed the last token before, the repetition penalty damps what
    was said. On this model and prompt it moves the 3-token distribution by TV ~0.9, and scoring
    every position with the prompt alone instead of its own prefix moves it by ~0.8."""
    return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8), NoRepeatNGramLogitsProcessor(2)])


@pytest.mark.parametrize("top_k,processor,tree", [
    (0, True, None), (0, True, [[0], [1], [0, 0]]), (0, True, "dynamic"),
    (2, False, None), (2, False, [[0], [1], [0, 0]])],
    ids=["processor-chain", "processor-tree", "processor-dynamic", "top_k-chain", "top_k-tree"])
def test_space_sampling_with_processor_or_top_k_matches_ar_distribution(small_vocab_model, top_k, processor, tree):
    """Sampling (T=1) with a logits processor, or with top_k=2, keeps AR's exact distribution in the
    chain (p/q rule), a static tree with siblings and the dynamic tree. Catches a processor skipped
    on the verification rows or fed the wrong prefix (e.g. x_0..x_{n-1} without the row's own path),
    and top-k left out of the target's p: each gives p ~ 0 here."""
    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    proc = context_processor() if processor else None
    exact = exact_distribution(model, prompt, SamplingConfig(1.0, top_k=top_k), processor=proc)
    plain = exact_distribution(model, prompt, SamplingConfig(1.0))
    assert sum(abs(exact[s] - plain[s]) for s in exact) / 2 > 0.1  # the setting matters here
    n = 1200
    dec = SpaceDecoder(model, spec, DecodeConfig(3, tree=tree))
    counts, outs = sampled(dec, prompt, n, processor=proc, temperature=1.0, top_k=top_k)
    accepts = [a for out in outs for a in out.accept_lengths[1:]]
    assert max(accepts) >= 1 and (tree or (0 in accepts and max(accepts) >= 2))
    assert chi2_pvalue(counts, exact, n) > ALPHA


@pytest.mark.parametrize("top_k,processor", [(0, True), (2, False)], ids=["processor", "top_k"])
def test_ar_sampling_with_processor_or_top_k_matches_exact(small_vocab_model, top_k, processor):
    """The baseline itself: ar_generate's sampling with a processor (fed every token so far) or
    top_k=2 follows the enumerated distribution, so SPACE is compared with a correct AR."""
    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    proc = context_processor() if processor else None
    exact = exact_distribution(model, prompt, SamplingConfig(1.0, top_k=top_k), processor=proc)
    n, counts = 600, {}
    for seed in range(n):
        out = ar_generate(model, torch.tensor(prompt), 3, sampling=SamplingConfig(1.0, top_k=top_k, seed=seed),
                          suppress_ids=[MASK], logits_processor=proc)
        counts[tuple(out.new_ids)] = counts.get(tuple(out.new_ids), 0) + 1
    assert chi2_pvalue(counts, exact, n) > ALPHA


def test_a_tiny_temperature_is_the_greedy_choice():
    """T = 1e-45 passes SamplingConfig's check (> 0). Catches ``logits / T`` overflowing to inf:
    the probabilities were NaN and the draw raised a traceback in space-chat and space-eval."""
    from space.decoding.sampling import SamplingConfig, logits_to_probs

    logits = torch.tensor([[30.0, 29.5, -4.0, 12.0], [-3.0, -2.0, -2.5, -9.0]])
    for t in (1e-45, 1e-38, 1e-6):
        probs = logits_to_probs(logits, SamplingConfig(temperature=t))
        assert torch.equal(probs, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])), t
