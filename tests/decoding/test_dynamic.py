"""Per-step dynamic token trees (issue 31): greedy exactness, the row budget, KV compaction through
siblings, exact sampling, the one model call site, the planner, its config and the layout core."""
import inspect
import json
import math
from collections import Counter

import pytest
import torch

import space.decoding.decoder as decoder_mod
from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.dynamic import LOOKUP, MASK, STORE, BUCKETS, AcceptanceStats, StepCost, bucket, calibrated, plan_step
from space.masking import build_layout, tree_ancestors
from tests.conftest import TRAINED_K, assert_cache_matches_fresh
from tests.decoding.test_sampling import ALPHA, chi2_pvalue, exact_distribution, sampled, small_vocab_model  # noqa: F401
from tests.oracle import oracle_generate

# ---------------------------------------------------------------------------------------------
# decoding with the trained tiny drafter


def step_rows_seen(model):
    """Forward pre-hook on the base decoder recording each step's block rows (the prefill, fed
    without position ids, is skipped). Returns (rows list, hook handle)."""
    rows = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(int(kwargs["input_ids"].shape[1]))
        if kwargs.get("position_ids") is not None else None, with_kwargs=True)
    return rows, hook


def test_dynamic_greedy_exact(trained):
    """Random k, groups, ranks, row budgets (small ones included), lookup on and off, stop tokens,
    prompts and lengths on a drafter that is usually right: dynamic SPACE == AR token for token,
    no step exceeds its budget, and drafts were accepted deep into the trees."""
    model, _, spec, language = trained
    gen = torch.Generator().manual_seed(0)
    accepted = []
    for case in range(24):
        k = int(torch.randint(1, TRAINED_K + 1, (1,), generator=gen))
        budget = [4, 8, 32, int(torch.randint(2, 41, (1,), generator=gen))][case % 4]
        cfg = DecodeConfig(k, int(torch.randint(1, k + 2, (1,), generator=gen)), tree="dynamic",
                           lookup_tokens=[0, 4][(case // 4) % 2], row_budget=budget,
                           draft_ranks=int(torch.randint(1, 5, (1,), generator=gen)), lookup_branches=1 + case % 3 * 2)
        prompt = torch.tensor(language.sample(int(torch.randint(1, 30, (1,), generator=gen))))
        max_new = int(torch.randint(1, 60, (1,), generator=gen))
        stop = []
        if case % 3 == 2:  # a stop token from the answer, so EOS lands inside a step
            full = ar_generate(model, prompt, max_new, suppress_ids=spec.token_ids).new_ids
            stop = [full[int(torch.randint(len(full), (1,), generator=gen))]]
        ar = ar_generate(model, prompt, max_new, stop_token_ids=stop, suppress_ids=spec.token_ids)
        out = SpaceDecoder(model, spec, cfg).generate(prompt, max_new, stop_token_ids=stop)
        assert out.new_ids == ar.new_ids, (cfg, prompt.tolist(), max_new, stop)
        assert max(out.step_rows) <= budget and sum(out.step_tokens) == len(out.new_ids)
        accepted += out.accept_lengths
    assert max(accepted) >= 3 and sum(a >= 2 for a in accepted) >= 10  # deep paths were verified


def test_the_last_steps_plan_no_node_past_what_they_can_emit(trained):
    """The dynamic tree planned full blocks up to the model's context even when a generation had one
    or two tokens left: rows (and the next step's masks) that could never pay. A step now plans no
    node deeper than the tokens it may still emit less its bonus, and never less than 1 deep (a
    1-row block is a graph of its own for a compiled trunk); the output stays AR's, and the same
    generation capped by the context alone (a planner of its own) plans deeper."""
    model, _, spec, language = trained
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 4, tree="dynamic", lookup_tokens=4))
    gen = torch.Generator().manual_seed(3)
    for max_new in (1, 2, 3, 5, 9, 17):
        prompt = torch.tensor(language.sample(int(torch.randint(4, 20, (1,), generator=gen))))
        out = dec.generate(prompt, max_new)
        assert out.new_ids == ar_generate(model, prompt, max_new, suppress_ids=spec.token_ids).new_ids
        emitted = 0
        for depth, tokens in zip(out.step_candidates, out.step_tokens):
            assert depth <= max(max_new - emitted - 1, 1), (max_new, out.step_candidates, out.step_tokens)
            emitted += tokens
    prompt = torch.tensor(language.sample(10) * 2)  # repeated: prompt lookup offers its 4 tokens at once
    capped = dec.generate(prompt, 1)
    unbounded = dec.generate(prompt, 1, planner=dec.planner())  # the context's end alone: a full block
    assert unbounded.new_ids == capped.new_ids and capped.step_candidates == [1] and unbounded.step_candidates[0] > 1


@pytest.mark.parametrize("lookup", [0, 4])
def test_row_budget(trained, lookup):
    """Every step's block has at most ``row_budget`` rows, padding included, and its rows are a
    bucket size or the budget; the recorded rows are the rows the model was fed. Budget 1 is AR:
    one row per step, no candidate, the AR output."""
    model, _, spec, language = trained
    prompt = torch.tensor(language.sample(16))
    ar = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids).new_ids
    for budget in (1, 2, 3, 5, 8, 16):
        rows, hook = step_rows_seen(model)
        try:
            out = SpaceDecoder(model, spec, DecodeConfig(TRAINED_K, tree="dynamic", row_budget=budget,
                                                         lookup_tokens=lookup)).generate(prompt, 40)
        finally:
            hook.remove()
        assert out.new_ids == ar, budget
        assert out.step_rows == rows and len(rows) == out.num_steps
        assert all(1 <= r <= budget and (r in BUCKETS or r == budget) for r in rows), (budget, rows)
        if budget == 1:
            assert set(rows) == {1} and set(out.accept_lengths) == {0} and set(out.step_candidates) == {0}
            assert out.num_steps == 40
        if budget >= 8:
            assert max(out.accept_lengths) >= 2  # not AR in disguise


def test_other_lookup_continuation_is_verified_and_accepted(tiny_varied):
    """A step's other lookup continuations are verified as branches of its tree: with the first
    continuation always wrong and the true next tokens only in the second, steps accept through the
    second (lookup tokens, deep paths) and the output is AR's token for token; the cache stays right."""
    model, _, spec = tiny_varied
    dec = SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", lookup_tokens=5, lookup_branches=2))
    prompt = torch.tensor([12, 40, 77, 5, 19, 63, 8])
    truth = ar_generate(model, prompt, 50, suppress_ids=spec.token_ids).new_ids
    wrong = [t for t in range(11, 256) if t not in truth][:5]

    class Second:  # the decoder's own planner, given a wrong first continuation and the truth second
        def __init__(self):
            self.inner, self.generated = dec.planner(), 0

        def propose(self, drafts, found, cache_len):
            return self.inner.propose(drafts, [wrong, truth[self.generated: self.generated + 5]], cache_len)

        def observe(self, outcome):
            self.generated += len(outcome.emitted)
            self.inner.observe(outcome)

    planner = Second()
    out = dec.generate(prompt, 50, planner=planner)
    assert out.new_ids == truth
    assert planner.inner.stats.other[0][0] > fresh_stats(lookup=5).other[0][0] + 5  # the planner learned its rate
    through = sum(src.count("l") for src in out.step_sources)
    assert through >= 25 and max(out.accept_lengths) >= 4, (out.step_sources, out.accept_lengths)


@pytest.mark.parametrize("branches,tree", [(3, "dynamic"), (1, "dynamic"), (3, None)])
def test_decoder_looks_up_as_many_continuations_as_its_layout_says(tiny_varied, branches, tree):
    """The decoder hands its planner up to ``lookup_branches`` continuations in the dynamic tree (a
    prompt whose last 2-gram recurred with three continuations), the first alone in a static
    layout; the output is AR's either way."""
    model, _, spec = tiny_varied
    dec = SpaceDecoder(model, spec, DecodeConfig(2, tree=tree, lookup_tokens=4, lookup_branches=branches))
    prompt = torch.tensor([30, 31, 50, 51, 52, 30, 31, 60, 61, 30, 31, 70, 71, 9, 30, 31])
    seen = []

    class Recorded:
        def __init__(self):
            self.inner = dec.planner()

        def propose(self, drafts, found, cache_len):
            seen.append(found)
            return self.inner.propose(drafts, found, cache_len)

        def observe(self, outcome):
            self.inner.observe(outcome)

    out = dec.generate(prompt, 20, planner=Recorded())
    assert out.new_ids == ar_generate(model, prompt, 20, suppress_ids=spec.token_ids).new_ids
    want = branches if tree == "dynamic" else 1
    assert seen[0] == [[50, 51, 52, 30], [70, 71, 9, 30], [60, 61, 30, 31]][:want]
    assert all(len(found) <= want for found in seen)


def test_oracle_accepts_siblings_and_cache_matches_fresh_forward(trained):
    """An oracle puts the true token at chosen ranks of each mask's drafts, with probabilities that
    make the planner spend rows on runner-ups, so the accepted path runs through non-first
    siblings at depth >= 2; after every step the compacted KV cache (padding and rejected rows
    dropped, the path moved next to x_{n-1}) equals a fresh forward of prompt + emitted tokens."""
    model, _, spec, language = trained
    R = 3
    dec = SpaceDecoder(model, spec, DecodeConfig(TRAINED_K, tree="dynamic", draft_ranks=R, row_budget=48))
    prompt = torch.tensor(language.sample(12))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    wrong = [t for t in range(11, 256) if t not in truth and t not in prompt.tolist()]
    ranks = [[1, 1, 0], [2, 1, 2, 1], [0, 2, 1], [1, 2, 0], [0, 0, 0, 0], [2, 2], [0, 1, 1, 2]]
    state = {"calls": 0, "want": None}

    def override(generated, drafts):
        want = ranks[state["calls"] % len(ranks)]
        state["calls"] += 1
        state["want"] = want
        out = torch.tensor(wrong[: TRAINED_K * R]).view(TRAINED_K, R)  # wrong tokens, never the truth
        for j in range(min(len(want), len(truth) - len(generated))):
            out[j, want[j]] = truth[len(generated) + j]
        return out, torch.tensor([[0.4, 0.3, 0.3]] * TRAINED_K)

    original, sibling_accepts, accepts = dec._step, 0, []

    def checked(cache, last, *args):
        nonlocal sibling_accepts
        want = state["want"]
        out = original(cache, last, *args)
        a = len(out[3])
        accepts.append(a)
        if want is not None and a >= 2 and any(r > 0 for r in want[1:a]):
            sibling_accepts += 1  # the path went through a runner-up at depth >= 2
        assert_cache_matches_fresh(model, cache, torch.cat([prompt, torch.tensor(truth)])[:cache.get_seq_length()])
        return out

    dec._step = checked
    out = oracle_generate(dec, prompt, 60, override=override)
    assert out.new_ids == truth
    assert max(accepts) >= 3 and sibling_accepts >= 4, (accepts, sibling_accepts)


@pytest.mark.parametrize("tail,lookup", [(6, 0), (6, 3), (9, 0)])
def test_dynamic_context_end(tiny, tail, lookup):
    """Near the context end the planner gets less room: no row (padding included) reaches position
    >= context, the last step runs right at the end, and output stays exact."""
    model, _, spec = tiny
    context = model.config.max_position_embeddings
    prompt = torch.randint(11, 250, (context - tail,), generator=torch.Generator().manual_seed(3))
    truth = ar_generate(model, prompt, tail, suppress_ids=spec.token_ids).new_ids
    dec = SpaceDecoder(model, spec, DecodeConfig(4, tree="dynamic", draft_ranks=2, lookup_tokens=lookup))
    wrong = [t for t in range(11, 250) if t not in truth][:8]

    def override(generated, drafts):  # the truth at rank 1, confidently (the planner sorts by value)
        out = torch.tensor(wrong).view(4, 2)
        for j in range(min(4, len(truth) - len(generated))):
            out[j, 1] = truth[len(generated) + j]
        return out, torch.tensor([[0.05, 0.9]] * 4)

    positions = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: positions.append(int(kwargs["position_ids"].max()))
        if kwargs.get("position_ids") is not None else None, with_kwargs=True)
    try:
        out = oracle_generate(dec, prompt, tail, override=override)
    finally:
        hook.remove()
    assert out.new_ids == truth and max(positions) == context - 1 and max(out.accept_lengths) >= 3


@pytest.mark.parametrize("temperature,top_p,lookup", [(1.0, 1.0, 0), (1.0, 1.0, 2), (1.5, 0.9, 2)])
def test_dynamic_sampling_matches_ar_distribution(small_vocab_model, temperature, top_p, lookup):
    """Sampling with the dynamic tree (siblings chosen from the drafts' processed distributions,
    lookup tokens merged in) emits t1..t3 with AR sampling's exact joint distribution. Top-p runs
    at T = 1.5: this model is nearly deterministic at T = 1 with top-p 0.9 (test_sampling). Both
    with full blocks to the context's end (a planner without the generation's end: deep trees after
    the first step, accepted past the 3 tokens and cut) and with the decoder's own, which plans no
    node past what the generation can still emit."""
    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    exact = exact_distribution(model, prompt, SamplingConfig(temperature, top_p=top_p))
    n = 1000
    # three lookup continuations where lookup is on: the other occurrences' are siblings too
    dec = SpaceDecoder(model, spec, DecodeConfig(3, lookup_tokens=lookup, tree="dynamic", lookup_branches=3))
    counts, outs = sampled(dec, prompt, n, planner=dec.planner, temperature=temperature, top_p=top_p)
    accepts = [a for out in outs for a in out.accept_lengths[1:]]
    rows = [r for out in outs for r in out.step_rows]
    assert max(accepts) >= 2 and max(rows) > 4  # trees with several nodes were verified and accepted
    assert chi2_pvalue(counts, exact, n) > ALPHA
    counts, outs = sampled(dec, prompt, n, temperature=temperature, top_p=top_p)
    assert max(a for out in outs for a in out.accept_lengths) >= 1  # drafts accepted on this path too
    assert chi2_pvalue(counts, exact, n) > ALPHA


@pytest.mark.parametrize("cfg", [DecodeConfig(3), DecodeConfig(3, 2, lookup_tokens=4, tree=[[0], [1], [0, 0]]),
                                 DecodeConfig(4, tree="dynamic"), DecodeConfig(4, 2, tree="dynamic", lookup_tokens=4)],
                         ids=["chain", "tree+lookup", "dynamic", "dynamic+lookup"])
def test_one_model_call_site(trained, cfg):
    """Every forward of the model during generate (prefill and steps) goes through
    ``SpaceDecoder._forward``, the one place that sets mask rows for the frozen-base LoRA: a
    second call site would run the model without them."""
    model, _, spec, language = trained
    dec = SpaceDecoder(model, spec, cfg)
    calls = {"forward": 0, "model": 0}
    original = dec._forward

    def counted(*args, **kwargs):
        calls["forward"] += 1
        return original(*args, **kwargs)

    dec._forward = counted
    hook = dec.decoder.register_forward_pre_hook(lambda *a: calls.__setitem__("model", calls["model"] + 1))
    try:
        for n in (1, 14):  # a one-token prompt has no prefill
            dec.generate(torch.tensor(language.sample(n)), 30)
    finally:
        hook.remove()
    assert calls["model"] == calls["forward"] > 0
    source = inspect.getsource(decoder_mod)
    assert source.count("self.decoder(") == 1 and "self.model(" not in source


# ---------------------------------------------------------------------------------------------
# the planner


def node_paths(plan):
    """Token path of each node of a StepPlan (row r's path is its parent's plus its token)."""
    paths = [()]
    for r, tok in enumerate(plan.tokens, 1):
        assert 0 <= plan.parents[r] < r  # parents precede children
        paths.append(paths[plan.parents[r]] + (tok,))
    return paths[1:]


def check_plan(plan, budget, mask_num, max_groups, room):
    """Invariants every plan must satisfy."""
    paths = node_paths(plan)
    assert len(plan.parents) == 1 + len(plan.tokens) == 1 + len(plan.values) and plan.parents[0] == -1
    assert len(set(paths)) == len(paths)  # no duplicate token path: one node per verified token
    assert all(len(p) <= room for p in paths)
    assert all(a >= b for a, b in zip(plan.values, plan.values[1:]))  # decreasing value
    assert plan.used_rows <= plan.rows <= max(budget, 1)
    assert plan.rows in BUCKETS or plan.rows == budget
    assert len(plan.group_rows) == len(plan.group_len) <= max_groups
    assert all(1 <= n <= mask_num for n in plan.group_len)
    for g, (row, n) in enumerate(zip(plan.group_rows, plan.group_len)):  # groups on a chain from x_{n-1}
        depth = 0 if row == 0 else len(paths[row - 1])
        assert depth == g and (g == 0 or plan.parents[row] == plan.group_rows[g - 1])
        assert depth + n <= room  # mask j of a group at depth g sits at depth g + 1 + j


def drafts(probs, k=4):
    """(k, R) distinct draft tokens 100 + 10 * depth + rank, and ``probs`` for every mask."""
    return [[100 + 10 * d + r for r in range(len(probs))] for d in range(k)], [list(probs)] * k


def fresh_stats(k=4, lookup=0):
    return AcceptanceStats(k, lookup, StepCost())


def test_step_cost_validation_and_interpolation():
    """Bad curves are refused at construction; c(q) interpolates linearly, extrapolates past the
    last point, is relative to one row, and marginal costs are differences (never negative)."""
    for bad in ([], [(2, 1.0)], [(0, 1.0), (1, 2.0)], [(1, 1.0), (4, 2.0), (3, 3.0)], [(1, 1.0), (1, 2.0)],
                [(1, 0.0)], [(1, 1.0), (2, -1.0)], [(1, float("nan"))], [(1, 1.0), (8, math.inf)],
                [(1.5, 1.0)], [("a", 1.0)], [(1,)]):
        with pytest.raises(ValueError, match="step_cost"):
            StepCost(bad)
    c = StepCost([[1, 2.0], [5, 4.0], [9, 12.0]])
    assert c.points == ((1, 2.0), (5, 4.0), (9, 12.0))
    assert [c(q) for q in (1, 3, 5, 7, 9, 13)] == pytest.approx([1.0, 1.5, 2.0, 4.0, 6.0, 10.0])
    assert c.marginal(3) == pytest.approx(0.25) and c.marginal(8) == pytest.approx(1.0)
    assert StepCost([(1, 2.0), (4, 1.0)]).marginal(2) == 0.0  # a falling curve: rows cost nothing, not less
    assert StepCost([(1, 3.0)])(50) == 1.0
    default = StepCost()
    assert default(1) == 1.0 and default(8) == pytest.approx(1.35) and default(24) == pytest.approx(1.75)


def test_bucket():
    """Rows round up to the next bucket, never past the budget, never below the rows."""
    assert [bucket(r, 32) for r in (1, 2, 3, 5, 7, 9, 13, 25, 33)] == [1, 2, 4, 6, 8, 12, 16, 32, 33]
    assert bucket(3, 3) == 3 and bucket(17, 18) == 18 and bucket(300, 512) == 300 and bucket(5, 1) == 5
    for budget in range(1, 70):
        for rows in range(1, budget + 1):
            b = bucket(rows, budget)
            assert rows <= b <= budget and (b in BUCKETS or b == budget)


def test_acceptance_stats():
    """observe() counts a draft chain until its first miss, from the group's offset on, and the
    lookup chain likewise; alphas() pools an easier later offset into the earlier one (never
    increasing), lookup_rates() a harder deeper depth into the shallower one (never decreasing);
    calibration and λ follow what was observed."""
    stats = fresh_stats(k=3, lookup=3)
    assert stats.alphas() == pytest.approx([0.5] * 3) and stats.lookup_rates() == pytest.approx([0.3, 0.6, 0.6])
    lam0 = stats.rate
    for i in range(8):  # offset 0: right 2 of 8 times
        stats.observe([7, 8], [[7 if i < 2 else 9]], [0.5], 0, [], 4)
    for _ in range(8):  # offset 1 (a shifted group): always right
        stats.observe([5, 6], [[5]], [0.5], 1, [], 4)
    hits = [c[0] for c in stats.mask]
    trials = [c[1] for c in stats.mask]
    assert hits == pytest.approx([1 + 2, 1 + 8, 1]) and trials == pytest.approx([10, 10, 2])
    assert stats.alphas() == pytest.approx([0.6, 0.6, 0.5])  # 0.3 then 0.9 pool to 12 / 20
    assert stats.calibration(1) == pytest.approx((2 + 8) / (2 + 4))  # right more often than 0.5 said
    stats.observe([1, 2, 3, 4], [[1, 8], [9, 2], [3, 0]], [0.9, 0.9, 0.9], 0, [1, 2, 5], 8)  # right, wrong, (right)
    assert stats.mask[0] == pytest.approx([4, 11]) and stats.mask[1] == pytest.approx([9, 11])
    assert stats.mask[2] == pytest.approx([1, 2])  # after a miss the chain is not counted
    # top-R: offset 1's true token was its second draft, so the ranked chain goes on to offset 2
    assert [c[1] for c in stats.ranked] == pytest.approx([2 + 8 + 1, 2 + 8 + 1, 2 + 1])
    assert stats.ranked[1][0] == pytest.approx(1 + 8 + 1) and stats.ranked[2][0] == pytest.approx(1 + 1)
    assert stats.ranked_alphas()[1] >= stats.alphas()[1]
    assert stats.lookup[0] == pytest.approx([1.6, 3]) and stats.lookup[2] == pytest.approx([1.2, 3])
    assert stats.lookup_rates() == pytest.approx([1.6 / 3, 3.4 / 6, 3.4 / 6])  # 2.2/3 then 1.2/3 pool
    assert stats.rate > lam0  # 2 tokens per 4-row step beat the prior
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):  # any rates: alphas never increase and keep the pooled mean
        s = fresh_stats(k=5)
        s.mask = [[float(h), float(h + m + 1)] for h, m in torch.randint(0, 20, (5, 2), generator=gen).tolist()]
        a = s.alphas()
        assert all(x >= y - 1e-12 for x, y in zip(a, a[1:]))
        assert sum(x * t for x, (_, t) in zip(a, s.mask)) == pytest.approx(sum(h for h, _ in s.mask))


def test_plan_step_by_case():
    """Confident drafts buy a deep chain, unconfident ones a small block; no drafts with lookup
    tokens is prompt lookup's chain; budget 1 is an AR step; a lookup token equal to the mask
    draft at the same place is one node."""
    args = dict(budget=32, mask_num=4, max_groups=5, room=100, mask_rows_before=4)
    sure = plan_step(*drafts([0.97, 0.01, 0.01, 0.01]), 0, [], fresh_stats(), **args)
    unsure = plan_step(*drafts([0.05] * 4), 0, [], fresh_stats(), **args)
    for plan in (sure, unsure):
        check_plan(plan, 32, 4, 5, 100)
    assert max(map(len, node_paths(sure))) == 4 > max(map(len, node_paths(unsure)), default=0)
    assert sure.rows > unsure.rows and sure.used_rows > unsure.used_rows
    assert node_paths(sure)[:4] == [(100,), (100, 110), (100, 110, 120), (100, 110, 120, 130)]

    only_lookup = plan_step([], [], 0, [50, 51, 52, 53], fresh_stats(lookup=4), **args)
    check_plan(only_lookup, 32, 4, 5, 100)
    n = len(only_lookup.tokens)
    assert n >= 1 and only_lookup.tokens == (50, 51, 52, 53)[:n] and only_lookup.parents == tuple(range(-1, n))

    for found in ([], [100, 110]):
        ar = plan_step(*drafts([0.97, 0.01, 0.01, 0.01]), 0, found, fresh_stats(lookup=2), **{**args, "budget": 1})
        assert ar.rows == 1 and ar.tokens == () and ar.group_len == () and ar.parents == (-1,)

    merged = plan_step(*drafts([0.6, 0.3, 0.05, 0.05]), 0, [100, 110, 99], fresh_stats(lookup=3), **args)
    check_plan(merged, 32, 4, 5, 100)
    paths = node_paths(merged)
    assert paths.count((100,)) == 1 and paths.count((100, 110)) == 1
    assert merged.values[paths.index((100,))] == pytest.approx(0.6)  # the larger (mask) value


def test_calibration_scales_the_top_draft_and_shrinks_the_rest():
    """Calibration scales only the top draft (its rate was counted on top drafts) and shrinks the
    others only as far as a mask's row must to sum to at most 1."""
    assert calibrated([0.5, 0.3, 0.1], 1.6) == pytest.approx([0.8, 0.15, 0.05])
    assert calibrated([0.5, 0.1, 0.1], 1.2) == pytest.approx([0.6, 0.1, 0.1])  # room left: unchanged
    assert calibrated([0.7, 0.2], 2.0) == pytest.approx([1.0, 0.0])
    assert calibrated([0.5, 0.4], 0.5) == pytest.approx([0.25, 0.4])  # never raised
    assert calibrated([], 3.0) == [] and calibrated([0.2], 3.0) == pytest.approx([0.6])
    stats = fresh_stats(k=2)
    stats.said = [[8.0, 4.0], [8.0, 4.0]]  # top drafts right twice as often as they said
    plan = plan_step(*drafts([0.4, 0.35, 0.05], k=2), 0, [], stats, budget=64, mask_num=2, max_groups=0,
                     room=100, mask_rows_before=2)
    by_path = dict(zip(node_paths(plan), plan.values))
    assert by_path[(100,)] == pytest.approx(0.8)
    assert by_path[(101,)] == pytest.approx(0.2 * 0.35 / 0.4)  # not 0.7: the row sums to 1
    assert by_path[(100, 110)] == pytest.approx(0.8 * 0.8)
    over = fresh_stats(k=2)
    over.said = [[2.0, 8.0], [2.0, 8.0]]  # an over-confident top draft falls below the next
    plan = plan_step(*drafts([0.4, 0.35], k=2), 0, [], over, budget=64, mask_num=2, max_groups=0, room=100,
                     mask_rows_before=2)
    check_plan(plan, 64, 2, 0, 100)
    assert node_paths(plan)[0] == (101,) and plan.values[0] == pytest.approx(0.35)


def test_merged_node_prices_its_children_from_the_merged_value():
    """A lookup token that is also the mask draft at its place is one node worth the larger of
    the two probabilities, and both its mask children and its lookup child build on that value.
    The lookup child comes first: its mask siblings share what it leaves (v·(1-r)·p), so siblings
    never sum above their parent (issue 44)."""
    stats = fresh_stats(k=3, lookup=3)  # lookup rates 0.3, 0.6, 0.6
    stats.tokens = 1e-6  # λ ~ 0: every node pays, so every value can be read
    ids, probs = drafts([0.2, 0.1], k=3)
    plan = plan_step(ids, probs, 0, [101, 999, 5], stats, budget=64, mask_num=3, max_groups=0, room=100,
                     mask_rows_before=3)
    check_plan(plan, 64, 3, 0, 100)
    by_path = dict(zip(node_paths(plan), plan.values))
    assert by_path[(101,)] == pytest.approx(0.3)  # merged: the lookup rate beats the draft's 0.1
    assert by_path[(101, 999)] == pytest.approx(0.3 * 0.6)  # lookup child of the merged node
    assert by_path[(101, 110)] == pytest.approx(0.3 * (1 - 0.6) * 0.2)  # its mask child shares the rest
    assert by_path[(100,)] == pytest.approx(0.2 * (1 - 0.3) / (1 - 0.1))  # beside the merged 0.3, not 0.1
    assert by_path[(100, 110)] == pytest.approx(by_path[(100,)] * 0.2)
    assert list(by_path).count((101,)) == 1
    for parent in [()] + list(by_path):  # siblings never sum above their parent
        kids = [v for p, v in by_path.items() if p[:-1] == parent]
        assert sum(kids) <= by_path.get(parent, 1.0) + 1e-9
    source = dict(zip(node_paths(plan), plan.sources))
    assert source[(101,)] == MASK | LOOKUP and source[(101, 999)] == LOOKUP and source[(100,)] == MASK


def test_other_lookup_continuations_are_priced_branches():
    """The lookup's other continuations (PromptLookup.continuations after the first) hang where they
    leave the first continuation and each other, each token worth the running rate of other
    continuations past that point times its parent; they are kept only when they pay (never forced)."""
    stats = fresh_stats(k=3, lookup=4)  # lookup rates 0.3, 0.6, ...; other rates 0.2, 0.6, ...
    stats.tokens = 1e-6  # λ ~ 0: every node pays
    found, others = [50, 51, 52, 53], [[60, 61, 62], [50, 51, 70, 71], [60, 61, 80], [50, 51, 52, 53]]
    plan = plan_step([], [], 0, found, stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=0,
                     others=others)
    check_plan(plan, 64, 3, 0, 100)
    by_path = dict(zip(node_paths(plan), plan.values))
    source = dict(zip(node_paths(plan), plan.sources))
    assert set(by_path) == {(50,), (50, 51), (50, 51, 52), (50, 51, 52, 53), (60,), (60, 61), (60, 61, 62),
                            (50, 51, 70), (50, 51, 70, 71), (60, 61, 80)}  # the repeat of `found` adds nothing
    assert by_path[(60,)] == pytest.approx(0.2) and by_path[(60, 61)] == pytest.approx(0.2 * 0.6)
    assert by_path[(50, 51, 70)] == pytest.approx(by_path[(50, 51)] * 0.2)  # leaves `found` after 50 51
    assert by_path[(60, 61, 80)] == pytest.approx(by_path[(60, 61)] * 0.2)  # leaves the first other after 60 61
    assert all(source[p] == LOOKUP for p in by_path)
    stats.tokens = 1e6  # λ huge: no node pays for its row; the first continuation is kept all the same
    costly = plan_step([], [], 0, found, stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=0,
                       others=others)
    kept = node_paths(costly)  # the forced chain, then only what fills the block's bucket (6 rows)
    assert kept[0] == (50,) and {(50, 51), (50, 51, 52), (50, 51, 52, 53)} <= set(kept)
    assert costly.rows == bucket(5, 64) == 6 and len(kept) == 5
    # an other continuation equal to a mask draft's path goes on past it, under that node, priced from
    # the node's larger value: the draft's 0.3 (popped first) over the continuation's own 0.2; the node
    # is both sources, and its mask drafts go on too
    stats.tokens = 1e-6
    ids, probs = drafts([0.6, 0.3], k=3)
    both = plan_step(ids, probs, 0, [], stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=3,
                     others=[[101, 7, 8]])
    check_plan(both, 64, 3, 0, 100)
    paths = node_paths(both)
    assert paths.count((101,)) == 1 and (101, 7) in paths and (101, 7, 8) in paths
    by_path = dict(zip(paths, both.values))
    assert by_path[(101,)] == pytest.approx(0.3) and by_path[(101, 7)] == pytest.approx(0.3 * 0.6)
    source = dict(zip(paths, both.sources))
    assert source[(101,)] == MASK | LOOKUP and source[(101, 7)] == LOOKUP and (101, 110) in paths
    # the continuation's value (0.2) above the draft's (0.1): its path comes first, and the mask tree
    # under that node goes on all the same
    ids, probs = drafts([0.5, 0.1], k=3)
    first = plan_step(ids, probs, 0, [], stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=3,
                      others=[[101, 7]])
    check_plan(first, 64, 3, 0, 100)
    paths = node_paths(first)
    assert paths.count((101,)) == 1 and (101, 7) in paths and (101, 110) in paths and (101, 111) in paths
    by_path, source = dict(zip(paths, first.values)), dict(zip(paths, first.sources))
    assert by_path[(101,)] == pytest.approx(0.2) and source[(101,)] == MASK | LOOKUP
    assert by_path[(101, 110)] == pytest.approx(0.2 * 0.5)  # the mask tree goes on from the node's value
    # with a sampler head only the top-1 path has mask children: a continuation through another rank's
    # draft is lookup's alone past it, and nothing of the mask tree hangs under it
    ids, probs = drafts([0.6, 0.3], k=3)
    head = plan_step(ids, probs, 0, [], stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=3,
                     chained=True, others=[[101, 111, 5]])
    check_plan(head, 64, 3, 0, 100)
    source = dict(zip(node_paths(head), head.sources))
    assert source[(101,)] == MASK | LOOKUP and source[(101, 111)] == LOOKUP and source[(101, 111, 5)] == LOOKUP
    assert not any(p[:2] == (101, 111) and len(p) > 2 and p[2] != 5 for p in source) and (100, 110) in source
    # one through the top-1 path, its copy popping first below the root (0.5 x 0.6 above 0.5 x 0.5): it
    # is a mask draft there too, and the mask tree goes on under it
    ids, probs = drafts([0.5, 0.3], k=3)
    deep = plan_step(ids, probs, 0, [], stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=3,
                     chained=True, others=[[100, 110, 5]])
    source = dict(zip(node_paths(deep), deep.sources))
    assert source[(100, 110)] == MASK | LOOKUP and (100, 110, 120) in source


def test_other_lookup_rates_learn_from_where_a_continuation_leaves():
    """A step teaches the other continuations' rates only past where each leaves those before it,
    and only when the text matched it up to there."""
    stats = fresh_stats(k=3, lookup=4)
    before = [list(c) for c in stats.other]
    # the first continuation 5 6 7 is wrong at 7; the other, 5 6 9 9, leaves it after 5 6 and is right twice
    stats.observe([5, 6, 9, 9, 1], [], [], 0, [5, 6, 7], 4, others=[[5, 6, 9, 9, 2], [8, 8]])
    assert stats.other[0] == pytest.approx([before[0][0] + 1, before[0][1] + 2])  # [5,6,9..]: a hit; [8,8]: a miss
    assert stats.other[1] == pytest.approx([before[1][0] + 1, before[1][1] + 1])
    assert stats.other[2] == pytest.approx([before[2][0], before[2][1] + 1])  # 2 != 1
    wrong = fresh_stats(k=3, lookup=4)
    wrong.observe([4, 4, 4], [], [], 0, [5, 6], 4, others=[[5, 7]])  # its shared 5 was wrong: not tried
    assert wrong.other == fresh_stats(k=3, lookup=4).other
    assert wrong.other_first == []


def test_each_other_continuation_rank_learns_its_first_token_rate():
    """The most recent other occurrence's continuation can be right far more often than the next
    one's: a continuation's first token is counted and priced by its rank's own rate, its deeper
    tokens by the rate all ranks share."""
    stats = fresh_stats(k=3, lookup=4)
    found, others = [5, 6, 7], [[8, 1], [9, 1]]  # both leave the first continuation at the root
    for _ in range(10):  # the text goes 8 1 2: the first other continuation is right, the second wrong
        stats.observe([8, 1, 2], [], [], 0, found, 4, others=others)
    assert [c for cell in stats.other_first for c in cell] == pytest.approx([0.4 + 10, 12, 0.4, 12])
    pooled = stats.other_rates()
    first, second = stats.other_rates(0), stats.other_rates(1)
    assert pooled[0] == pytest.approx(10.4 / 22) and first[1:] == second[1:] == pooled[1:]
    # never above the shared rate one token further (non-decreasing in depth): here it caps the first
    assert pooled[1] == pytest.approx(13.6 / 16) and pooled[1] < 10.4 / 12 and first[0] == pytest.approx(pooled[1])
    assert second[0] == pytest.approx(0.4 / 12)
    assert stats.other_rates(2) == pooled  # a rank never seen: the shared rate
    stats.tokens = 1e-6  # λ ~ 0: every node pays
    plan = plan_step([], [], 0, found, stats, budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=0,
                     others=others)
    by_path = dict(zip(node_paths(plan), plan.values))
    assert by_path[(8,)] == pytest.approx(first[0]) and by_path[(9,)] == pytest.approx(second[0])
    assert by_path[(8, 1)] == pytest.approx(first[0] * pooled[1])


def test_reserve_for_the_first_group_returns_to_nodes_without_groups():
    """Rows held back for G_0 verify nodes when no group is chosen (drafts that never hit)."""
    stats = fresh_stats(k=4, lookup=8)
    stats.mask = [[0.0, 1000.0] for _ in range(4)]  # the masks' drafts were never right: no group pays
    stats.ranked = [[0.0, 1000.0] for _ in range(4)]
    stats.lookup = [[1000.0, 1000.0] for _ in range(8)]  # lookup always right
    plan = plan_step([], [], 0, list(range(50, 58)), stats, budget=8, mask_num=4, max_groups=2, room=100,
                     mask_rows_before=0)
    check_plan(plan, 8, 4, 2, 100)
    assert plan.group_len == () and plan.tokens == tuple(range(50, 57)) and plan.rows == 8


def test_plan_step_random_invariants():
    """Random drafts (ties and zeros included), lookup tokens overlapping them, budgets, room
    near the context end, offsets and statistics: every plan is a valid block."""
    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        k = int(torch.randint(1, 6, (1,), generator=gen))
        r, R = int(torch.randint(0, k + 1, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        ids = torch.randint(20, 24, (r, R), generator=gen).tolist()  # a small vocabulary: repeats
        probs = torch.rand(r, R, generator=gen)
        probs[probs < 0.1] = 0
        probs = probs.sort(-1, descending=True).values.tolist()  # top-R probabilities come sorted
        found = torch.randint(20, 24, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
        stats = fresh_stats(k, lookup=4)
        for _ in range(int(torch.randint(0, 6, (1,), generator=gen))):
            stats.observe(torch.randint(20, 24, (3,), generator=gen).tolist(), [[20], [21]], [0.7, 0.4], 0,
                          [20, 22], int(torch.randint(1, 30, (1,), generator=gen)))
        budget = [1, 2, 3, 5, 8, 13, 32, 64][case % 8]
        groups = int(torch.randint(0, k + 2, (1,), generator=gen))
        room = [1, 2, 3, 100][case % 4]
        offset = int(torch.randint(0, k, (1,), generator=gen))
        others = [torch.randint(20, 24, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(int(torch.randint(0, 4, (1,), generator=gen)))]  # other continuations, repeats too
        # the last `stored` of found and others are a datastore's (all of them: the text has none of its own)
        stored = int(torch.randint(0, len(others) + 2, (1,), generator=gen)) if found else 0
        stats.observe(torch.randint(20, 24, (3,), generator=gen).tolist(), [], [], 0, found, 8, others, stored)
        plan = plan_step(ids, probs, offset, found, stats, budget, k, groups, room, k, others=others, stored=stored)
        check_plan(plan, budget, k, groups, room)
        if budget == 1:
            assert plan.rows == 1
        # sources: a node marked the datastore's lies on one of its continuations, one marked the
        # text's own lookup on one of those; prompt lookup's own chain is verified as deep as it fits
        lookups = [found, *others]
        own = len(lookups) - stored
        for path, source in zip(node_paths(plan), plan.sources):
            if source & STORE:
                assert any(tuple(c[: len(path)]) == path for c in lookups[own:]), (case, path)
            if source & LOOKUP:
                assert any(tuple(c[: len(path)]) == path for c in lookups[:own]), (case, path)
        if own > 0:
            depth = min(len(found), room, 4, budget - 1)  # 4: the stats' lookup tokens
            assert {tuple(found[:d]) for d in range(1, depth + 1)} <= set(node_paths(plan)), case


# ---------------------------------------------------------------------------------------------
# config


def test_decode_config_dynamic():
    """tree="dynamic" survives JSON, a k override, and validation; its cap is k + 1."""
    cfg = DecodeConfig(4, 3, tree="dynamic", row_budget=24, draft_ranks=3, step_cost=[[1, 2.0], [8, 3.5]],
                       lookup_branches=3)
    assert cfg.step_cost == ((1, 2.0), (8, 3.5))
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["tree"] == "dynamic" and d["step_cost"] == [[1, 2.0], [8, 3.5]] and d["lookup_branches"] == 3
    assert DecodeConfig.from_dict(d) == cfg
    assert DecodeConfig.from_dict(DecodeConfig(2, tree="dynamic").to_dict()) == DecodeConfig(2, tree="dynamic")
    small = cfg.override(mask_num=2)
    assert small.tree == "dynamic" and small.mask_num == 2 and small.num_groups == 3 and small.row_budget == 24
    assert small.lookup_branches == 3 and cfg.override(lookup_branches=None).lookup_branches == 3
    assert cfg.override(tree="chain").tree is None
    for bad in (dict(tree="foo"), dict(row_budget=0), dict(draft_ranks=0), dict(step_cost=[[2, 1.0]]),
                dict(row_budget=2.0), dict(step_cost=[[1, float("nan")]]), dict(lookup_branches=0)):
        with pytest.raises(ValueError):
            DecodeConfig(3, **{"tree": "dynamic", **bad})
    for k in (1, 3, 5):
        assert DecodeConfig(k, tree="dynamic").max_tokens_per_step() == k + 1


def test_dynamic_ranks_beyond_vocabulary(tiny):
    """draft_ranks above the vocabulary is refused where the vocabulary is known."""
    model, _, spec = tiny
    with pytest.raises(ValueError, match="vocabulary"):
        SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", draft_ranks=model.config.vocab_size + 1))


# ---------------------------------------------------------------------------------------------
# the layout core


def naive_tree(parents):
    """Depth and ancestor-or-self sets by walking up from each row."""
    depth, anc = [], []
    for r in range(len(parents)):
        chain, x = {r}, r
        while parents[x] >= 0:
            x = parents[x]
            chain.add(x)
        depth.append(len(chain) - 1)
        anc.append(chain)
    return depth, anc


def naive_layout(cache_len, parents, ctx, lens, pad_to):
    """Position ids of the used rows and the block's visibility, row by row (module docstring of
    space.masking)."""
    depth, anc = naive_tree(parents)
    n, pos, sees = len(parents), [], []
    for r in range(n):
        pos.append(cache_len + depth[r])
        sees.append(set(anc[r]))
    start = n
    for e, length in zip(ctx, lens):
        for j in range(length):
            pos.append(cache_len + depth[e - 1] + 1 + j)
            sees.append(set(anc[e - 1]) | {start + i for i in range(j + 1)})
        start += length
    for p in range(start, pad_to):
        sees.append({p})
    return pos, sees


def random_parents(gen, n, chainy=False):
    return [-1] + [r - 1 if chainy else int(torch.randint(r, (1,), generator=gen)) for r in range(1, n)]


def test_tree_ancestors_matches_naive():
    """Pointer doubling gives every row's depth and ancestors for random, deep and tiny trees."""
    gen = torch.Generator().manual_seed(0)
    trees = [[-1], [-1, 0], random_parents(gen, 70, chainy=True), [-1, 0, 1, 2, 0, 4, 5, 6, 7]]
    trees += [random_parents(gen, int(torch.randint(1, 50, (1,), generator=gen)), chainy=i % 5 == 0) for i in range(60)]
    for parents in trees:
        depth, anc = tree_ancestors(torch.tensor(parents))
        want_depth, want_anc = naive_tree(parents)
        assert depth.tolist() == want_depth, parents
        assert anc.tolist() == [[j in a for j in range(len(parents))] for a in want_anc], parents


def test_layout_group_lengths_and_padding_by_hand():
    """x; c1, c2 siblings; c3 under c1; groups of 3, 1 and 2 masks on x, c1 and c3; 3 padding rows."""
    lay = build_layout(5, 4, [1, 2, 4], [3, 1, 2], parents=[-1, 0, 0, 1], pad_to=13)
    assert lay.position_ids.tolist() == [5, 6, 6, 7, 6, 7, 8, 7, 8, 9, 5, 5, 5]
    assert lay.group_len.tolist() == [3, 1, 2] and lay.k == 3
    assert lay.mask_offset.tolist() == [-1] * 4 + [0, 1, 2, 0, 0, 1] + [-1] * 3
    assert lay.mask_group.tolist() == [-1] * 4 + [0, 0, 0, 1, 2, 2] + [-1] * 3
    assert lay.is_mask.tolist() == [False] * 4 + [True] * 6 + [False] * 3
    block = ["".join("o" if v else "." for v in row[5:]) for row in lay.allowed.tolist()]
    assert block == ["o............",   # x
                     "oo...........",   # c1
                     "o.o..........",   # c2
                     "oo.o.........",   # c3
                     "o...o........",   # G0m0
                     "o...oo.......",   # G0m1
                     "o...ooo......",   # G0m2
                     "oo.....o.....",   # G1m0
                     "oo.o....o....",   # G2m0
                     "oo.o....oo...",   # G2m1
                     "..........o..",   # padding sees only itself
                     "...........o.",
                     "............o"]
    assert lay.allowed[:, :5].all()
    for bad in (dict(k=[3, 1]), dict(k=[3, 0, 2]), dict(k=[3, 1, 2], pad_to=9)):
        with pytest.raises(ValueError):
            build_layout(5, 4, [1, 2, 4], parents=[-1, 0, 0, 1], **{"k": [3, 1, 2], **bad})


def test_layout_matches_naive_random():
    """Random trees, anchors, group lengths and padding: positions and visibility row by row; no
    row sees padding and padding never sits past the used rows' positions."""
    gen = torch.Generator().manual_seed(1)
    for case in range(80):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        parents = random_parents(gen, n, chainy=case % 4 == 0)
        G = int(torch.randint(0, 4, (1,), generator=gen))
        ctx = torch.randint(1, n + 1, (G,), generator=gen).tolist()
        lens = torch.randint(1, 5, (G,), generator=gen).tolist()
        used = n + sum(lens)
        pad_to = used + int(torch.randint(0, 4, (1,), generator=gen))
        cache_len = int(torch.randint(0, 6, (1,), generator=gen))
        lay = build_layout(cache_len, n, ctx, lens, parents=torch.tensor(parents), pad_to=pad_to)
        pos, sees = naive_layout(cache_len, parents, ctx, lens, pad_to)
        assert lay.position_ids[:used].tolist() == pos, (parents, ctx, lens)
        assert int(lay.position_ids.max()) == max(pos)
        assert lay.allowed[:, cache_len:].tolist() == [[j in s for j in range(pad_to)] for s in sees]
        assert lay.allowed[:, :cache_len].all()
        listed = build_layout(cache_len, n, ctx, lens, parents=parents, pad_to=pad_to)
        assert torch.equal(listed.allowed, lay.allowed) and torch.equal(listed.position_ids, lay.position_ids)


def test_host_block_equals_build_layout():
    """The decoder's host-side block (issue 43) has build_layout's positions, mask offsets and
    visibility, through the packed upload, for random trees, groups and padding, blocks of more
    than one and two 32-bit words per row included."""
    from space.masking import host_block, pack_rows, unpack_rows

    gen = torch.Generator().manual_seed(2)
    for case in range(120):
        n = int(torch.randint(1, 70 if case % 6 == 0 else 14, (1,), generator=gen))
        parents = random_parents(gen, n, chainy=case % 4 == 0)
        G = int(torch.randint(0, 5, (1,), generator=gen))
        ctx = torch.randint(1, n + 1, (G,), generator=gen).tolist()
        lens = torch.randint(1, 6, (G,), generator=gen).tolist()
        q = n + sum(lens) + int(torch.randint(0, 40, (1,), generator=gen))
        lay = build_layout(0, n, ctx, lens, parents=parents, pad_to=q)
        positions, offsets, sees = host_block(parents, ctx, lens, q)
        assert positions == lay.position_ids.tolist() and offsets == lay.mask_offset.tolist(), (parents, ctx, lens)
        assert torch.equal(unpack_rows(torch.tensor(pack_rows(sees, q)), q), lay.allowed), (parents, ctx, lens, q)


def test_step_records_host_time_and_reuses_layouts(trained):
    """Issue 43: each step records its time outside the model (planner + layout included), and a
    tree shape seen before reuses its block layout, still exact against AR."""
    from space.decoding import DecodeConfig, SpaceDecoder, ar_generate

    model, _, spec, lang = trained
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10))
    built, steps = [], []
    for i in range(8):
        prompt = torch.tensor(lang.sample(10 + i))
        before = len(dec._layouts)
        out = dec.generate(prompt, 64)
        built.append(len(dec._layouts) - before)
        steps.append(out.num_steps)
        assert out.new_ids == ar_generate(model, prompt, 64, suppress_ids=spec.token_ids).new_ids
        assert len(out.step_host) == len(out.step_plan) == out.num_steps
        assert all(0 <= p <= h <= t for p, h, t in zip(out.step_plan, out.step_host, out.step_times))
    print(f"new layouts per generation {built}, steps {steps}")
    assert sum(built[4:]) <= 0.7 * sum(steps[4:])  # later generations reuse shapes (about half here)


# ---------------------------------------------------------------------------------------------
# prices, never starving, containing prompt lookup, provenance (issue 44)

# the shipped adapter's curve, in ms (1 thread): the 1 -> 2-row jump is 0.3 of an AR step, rows 2-4 free
SHIPPED_CURVE = ((1, 64.817), (2, 84.16), (4, 84.014), (6, 96.534), (8, 101.469), (12, 120.052), (16, 130.983),
                 (20, 139.747), (24, 153.194), (32, 164.63), (40, 188.241), (48, 213.394), (64, 269.809))


def test_prices_charge_the_jump_to_every_multi_row_block():
    """The 1 -> 2-row jump is the multi-row path's: a nodes-only block pays it as a block with a
    group does, and a group pays only the adapter's measured fixed cost. On the shipped curve the
    old prices (the jump charged to groups only) chose no group in each case below, so the next
    step had no drafts; the issue's table says the first group with 2-3 masks."""
    cost = StepCost(SHIPPED_CURVE)
    assert cost.adapter_overhead() == 0 and cost.multi_row() == pytest.approx((84.16 - 64.817 - 0) / 64.817, rel=1e-3)
    measured = StepCost(SHIPPED_CURVE, adapter=6.0)  # space-tree's 2 rows with and without mask rows
    assert measured.adapter_overhead() == pytest.approx(6.0 / 64.817)
    assert measured.multi_row() + measured.adapter_overhead() == pytest.approx(cost.multi_row())
    ids, probs = drafts([0.55, 0.15, 0.15, 0.075], k=3)
    cases = {"drafts + a different lookup": (ids, probs, [7, 8, 9, 10]), "drafts only": (ids, probs, []),
             "lookup only": ([], [], [7, 8, 9, 10])}
    for name, (i, p, found) in cases.items():
        plan = plan_step(i, p, 0, found, AcceptanceStats(3, 10, cost), budget=32, mask_num=3, max_groups=4,
                         room=1000, mask_rows_before=3)
        check_plan(plan, 32, 3, 4, 1000)
        assert plan.group_rows[:1] == (0,) and plan.group_len[0] >= 2, name
    for bad in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="adapter"):
            StepCost(SHIPPED_CURVE, adapter=bad)


def test_an_ar_step_only_when_the_block_does_not_pay_its_jump():
    """Drafts that were never right buy no group and no node (an AR step), unless a lookup
    continuation was found: prompt lookup would verify it, so the step does too."""
    stats = AcceptanceStats(3, 4, StepCost(SHIPPED_CURVE))
    stats.mask = [[0.0, 1000.0] for _ in range(3)]
    stats.ranked = [[0.0, 1000.0] for _ in range(3)]
    stats.said = [[0.0, 1000.0] for _ in range(3)]  # calibration 0: no draft is worth anything
    stats.lookup = [[0.0, 1000.0] for _ in range(4)]
    ids, probs = drafts([0.3, 0.2, 0.1], k=3)
    ar = plan_step(ids, probs, 0, [], stats, budget=32, mask_num=3, max_groups=4, room=100, mask_rows_before=3)
    assert ar.rows == 1 and ar.tokens == () and ar.group_rows == ()
    kept = plan_step(ids, probs, 0, [7, 8, 9], stats, budget=32, mask_num=3, max_groups=4, room=100, mask_rows_before=3)
    paths = node_paths(kept)
    assert all(kept.sources[paths.index(p)] == LOOKUP for p in [(7,), (7, 8), (7, 8, 9)])


def test_plans_contain_the_whole_lookup_continuation():
    """Whatever the rates say, every lookup token found (up to the budget) is a node on one chain
    from x_{n-1}, beside the mask drafts: a rejected lookup costs only its rows."""
    gen = torch.Generator().manual_seed(1)
    for case in range(200):
        stats = fresh_stats(3, lookup=10)
        stats.lookup = [[float(torch.rand(1, generator=gen)), 50.0] for _ in range(10)]  # rates near 0 too
        found = torch.randint(100, 104, (int(torch.randint(1, 11, (1,), generator=gen)),), generator=gen).tolist()
        ids = torch.randint(100, 104, (3, 4), generator=gen).tolist()
        probs = torch.rand(3, 4, generator=gen).softmax(-1).sort(-1, descending=True).values.tolist()
        budget = [2, 6, 12, 32][case % 4]
        plan = plan_step(ids, probs, 0, found, stats, budget, 3, 4, 100, 3)
        check_plan(plan, budget, 3, 4, 100)
        paths = node_paths(plan)
        for d in range(min(len(found), budget - 1)):
            assert tuple(found[: d + 1]) in paths, (case, found, paths)
            assert plan.sources[paths.index(tuple(found[: d + 1]))] & LOOKUP


def test_sampler_head_drafts_have_children_only_on_the_top1_path():
    """A sampler head drafts offset d+1 given offset d's top-1 draft, so a node off that path has
    no mask child: it was never drafted for that context (issue 44)."""
    stats = fresh_stats(3)
    stats.tokens = 1e-6  # λ ~ 0: every node pays
    ids, probs = drafts([0.5, 0.3, 0.2], k=3)
    plain = node_paths(plan_step(ids, probs, 0, [], stats, 64, 3, 0, 100, 3))
    headed = node_paths(plan_step(ids, probs, 0, [], stats, 64, 3, 0, 100, 3, chained=True))
    assert (101, 110) in plain
    assert all(p[:-1] in {(), (100,), (100, 110)} for p in headed) and (100, 110, 120) in headed
    assert {p for p in headed if len(p) == 1} == {(100,), (101,), (102,)}


def shipped_priced(k: int, lookup: int) -> DecodeConfig:
    return DecodeConfig(k, k + 1, tree="dynamic", lookup_tokens=lookup, row_budget=32, step_cost=SHIPPED_CURVE)


def test_never_starve_after_all_rejected(trained):
    """Priced with the shipped curve (a steep 1 -> 2-row jump), a step whose candidates were all
    rejected is never followed by a step without candidates: it kept the group on x_{n-1}, whose
    drafts the next step verifies. The old prices dropped every group there."""
    model, _, spec, language = trained
    dec = SpaceDecoder(model, spec, shipped_priced(TRAINED_K, 0))
    gen = torch.Generator().manual_seed(3)
    rejected = 0
    for _ in range(6):
        prompt = torch.tensor(language.sample(int(torch.randint(4, 20, (1,), generator=gen))))
        out = dec.generate(prompt, 60)
        assert out.new_ids == ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
        emitted = [sum(out.step_tokens[:i]) for i in range(len(out.step_tokens))]  # before each step
        for i in range(1, len(out.accept_lengths)):
            # a step with a token or none left to emit has no candidate to verify (nothing it can accept)
            if out.step_candidates[i - 1] and out.accept_lengths[i - 1] == 0 and 60 - emitted[i] > 1:
                rejected += 1
                assert out.step_candidates[i] > 0, (prompt.tolist(), i)
    assert rejected >= 3  # the case was exercised


def test_candidates_contain_prompt_lookups_and_provenance(trained):
    """Over a generation on repetitive text, every step's tree holds the whole continuation that
    prompt lookup (HF's, as the pld baseline runs it) finds for the same text, and the provenance
    records say which accepted tokens came from the masks, from lookup, or from both."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    model, _, spec, language = trained
    dec = SpaceDecoder(model, spec, shipped_priced(TRAINED_K, 10))
    pld = PromptLookupCandidateGenerator(num_output_tokens=10, max_matching_ngram_size=2, max_length=10_000)
    letters = Counter()
    for seed in range(3):
        prompt = language.sample(24) * 2  # the text repeats: lookup finds continuations
        out = dec.generate(torch.tensor(prompt), 50)
        assert out.new_ids == ar_generate(model, torch.tensor(prompt), 50, suppress_ids=spec.token_ids).new_ids
        text = list(prompt)
        for i, (emitted, src, (mask_depth, lookup_depth)) in enumerate(
                zip(out.step_tokens, out.step_sources, out.step_offered)):
            found = pld.get_candidates(torch.tensor([text]))[0][0, len(text):].tolist()
            # the whole continuation, as PLD verifies it, up to the tokens the generation can still emit
            # less its bonus (the planner plans no node past them)
            found = found[: 50 - (len(text) - len(prompt)) - 1]
            assert lookup_depth == len(found), (seed, i)
            assert len(src) == out.accept_lengths[i] and set(src) <= set("mlb")  # no datastore: no "d"
            assert out.accept_lengths[i] <= max(mask_depth, lookup_depth)
            accepted = out.new_ids[len(text) - len(prompt):][: len(src)]
            for d, ch in enumerate(src[: len(accepted)]):  # a lookup letter only on the found path
                assert (ch in "lb") == (found[: d + 1] == accepted[: d + 1]), (seed, i, d)
            letters.update(src)
            text += out.new_ids[len(text) - len(prompt): len(text) - len(prompt) + emitted]
    assert letters["m"] and letters["l"] + letters["b"]  # both sources were accepted


def test_bucket_rows_verify_nodes_even_when_only_a_group_paid():
    """A block of x_{n-1} and a group rounds up to a bucket; its free rows take the next-best
    nodes rather than padding (review of issue 44: the fill was skipped when no node paid)."""
    stats = fresh_stats(3)
    stats.tokens = 1e3  # λ large: no node pays its row, a group still may
    ids, probs = drafts([0.3, 0.2, 0.1], k=3)
    for budget in (4, 8, 32):
        plan = plan_step(ids, probs, 0, [], stats, budget, 3, 4, 100, 3)
        check_plan(plan, budget, 3, 4, 100)
        assert plan.rows == plan.used_rows or len(plan.tokens) == len(plan.parents) - 1 > 0


def test_sampler_head_lookup_merges_only_on_the_top1_path():
    """With a sampler head the drafts at depth d+1 were made given the top-1 draft at d: a lookup
    token after a non-top-1 one is not that draft, whatever its token (review of issue 44)."""
    stats = fresh_stats(3, lookup=3)
    stats.tokens = 1e-6
    ids = [[100, 101], [110, 111], [120, 121]]
    probs = [[0.6, 0.3], [0.9, 0.05], [0.9, 0.05]]
    rate1 = stats.lookup_rates()[1]
    plan = plan_step(ids, probs, 0, [101, 110, 120], stats, 64, 3, 0, 100, 3, chained=True)
    by_path = dict(zip(node_paths(plan), zip(plan.values, plan.sources)))
    assert by_path[(101,)][1] == MASK | LOOKUP
    assert by_path[(101, 110)] == (pytest.approx(0.3 * rate1), LOOKUP)  # not 0.3 * 0.9 as a draft
    plain = plan_step(ids, probs, 0, [101, 110, 120], stats, 64, 3, 0, 100, 3)
    assert dict(zip(node_paths(plain), plain.sources))[(101, 110)] == MASK | LOOKUP  # plain masks: any prefix


def test_adapter_cost_needs_a_curve():
    with pytest.raises(ValueError, match="adapter_cost"):
        DecodeConfig(3, tree="dynamic", adapter_cost=2.0)
    assert DecodeConfig(3, tree="dynamic", step_cost=SHIPPED_CURVE, adapter_cost=2.0).adapter_cost == 2.0


def test_a_sampled_chain_takes_no_planner(tiny):
    """A sampled chain verifies the drafts it drew with the p/q rule: another planner's nodes would
    not match the q it keeps, so the seam refuses it rather than sample wrongly."""
    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3))
    with pytest.raises(ValueError, match="p/q rule"):
        dec.generate(torch.tensor([5, 6]), 4, sampling=SamplingConfig(1.0), planner=dec.planner())
    assert len(dec.generate(torch.tensor([5, 6]), 4, planner=dec.planner()).new_ids) == 4  # greedy takes one


def test_a_planners_block_with_a_child_before_its_parent_is_refused(tiny):
    """``generate(planner=...)`` takes any planner, and the block layout trusted its order: a child
    laid out before its parent saw neither x_{n-1} nor its parent, a sampled step accepted it and
    drew the bonus token from it, and a greedy one failed after the forward with an IndexError. A new
    block shape is checked now; the same nodes in order decode."""
    from space.decoding.planner import Proposal

    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3, tree="dynamic"))

    class Planner:
        def __init__(self, parents):
            self.parents = parents

        def propose(self, drafts, found, cache_len):
            # row 0 is x_{n-1}; the nodes' tokens follow
            layout, tokens = dec.block_layout(self.parents, [], [], len(self.parents), [7, 8])
            return Proposal(layout, tokens, (0, 0))

        def observe(self, outcome):
            pass

    for parents in ((-1, 2, 0), (-1, 0, -1)):  # a parent after its child; a second root
        for sampling in (SamplingConfig(), SamplingConfig(1.0, seed=0)):
            with pytest.raises(ValueError, match="an earlier row for every other row"):
                dec.generate(torch.tensor([5, 6]), 4, sampling=sampling, planner=Planner(parents))
    assert len(dec.generate(torch.tensor([5, 6]), 4, planner=Planner((-1, 0, 1))).new_ids) == 4
    for rows, lens in (([3], [1]), ([0], [0])):  # a group past the nodes; a group of no mask
        with pytest.raises(ValueError, match="mask groups must hang off"):
            dec.block_layout((-1, 0, 1), rows, lens, 8)


def test_choose_groups_net_value_by_hand():
    """_choose_groups' prices on a tree small enough to work by hand (x_{n-1} and one node of
    value 0.6; λ = 1, a row 0.1, the adapter 0.05; top-R rates 0.9, 0.5, top-1 rates 0.6, 0.3).
    Catches a group priced without the adapter's fixed cost or without this step's row per mask,
    a reach from offset s that reads the rates from offset 0 (alpha[j - s]), the top-1 and top-R
    rates swapped between a sampler head and plain masks, and a group cut one mask short of
    ``room`` (mask j of G_g sits at depth g + 1 + j)."""
    from space.decoding.dynamic import _choose_groups

    stats = fresh_stats(k=2)
    stats.ranked = [[9.0, 10.0], [5.0, 10.0]]
    stats.mask = [[6.0, 10.0], [3.0, 10.0]]
    parents, depth, value = [-1, 0], [0, 1], [1.0, 0.6]
    args = dict(stats=stats, lam=1.0, mask_num=2, room=100, row_cost=0.1, overhead=0.05)
    # one group: paths end at x_{n-1} (0.4, offset 0) or at the node (0.6, offset 1);
    # mask 0: 0.4 (0.9 - 0.1) - 0.1 = 0.22; mask 1: 0.4 (0.45 - 0.1) + 0.6 (0.5 - 0.1) - 0.1 = 0.28
    groups, lens, net = _choose_groups(parents, depth, value, max_groups=1, **args)
    assert (groups, lens) == ([0], [2]) and net == pytest.approx(0.22 + 0.28 - 0.05)
    # two groups: G_0 takes the 0.4 (0.22, then 0.4 0.35 - 0.1 = 0.04), G_1 the 0.6 (0.38, then 0.11)
    groups, lens, net = _choose_groups(parents, depth, value, max_groups=2, **args)
    assert (groups, lens) == ([0, 1], [2, 2]) and net == pytest.approx(0.26 + 0.49 - 0.05)
    # a sampler head: the top-1 rates; mask 0: 0.4 (0.6 - 0.1) - 0.1 = 0.1; mask 1: 0.4 (0.18 - 0.1)
    # + 0.6 (0.3 - 0.1) - 0.1 = 0.052
    groups, lens, net = _choose_groups(parents, depth, value, max_groups=1, chained=True, **args)
    assert (groups, lens) == ([0], [2]) and net == pytest.approx(0.1 + 0.052 - 0.05)
    # room 1: one mask fits after x_{n-1}, and it pays
    groups, lens, net = _choose_groups(parents, depth, value, max_groups=1, **{**args, "room": 1})
    assert (groups, lens) == ([0], [1]) and net == pytest.approx(0.22 - 0.05)


def test_node_and_group_rows_are_priced_after_the_previous_steps_masks():
    """A node row is priced at the block row it takes, counting the mask rows the previous step
    had (``mask_rows_before``): on a curve whose rows are cheap up to 6 and then jump, node i
    (row 1 + i + mask_rows_before) pays until that row reaches 6. Catches a price that ignores
    the previous step's masks (then every plan below would keep the same nodes), and a group
    whose rows are priced without them (it would look cheap behind one node)."""
    curve = ((1, 1.0), (6, 1.05), (7, 2.0), (64, 4.0))
    ids, probs = drafts([0.6, 0.2, 0.1], k=4)
    kept = {}
    for before in (0, 2, 4):
        plan = plan_step(ids, probs, 0, [], AcceptanceStats(4, 0, StepCost(curve)), budget=32, mask_num=4,
                         max_groups=2, room=100, mask_rows_before=before)
        check_plan(plan, 32, 4, 2, 100)
        assert plan.group_len == ()  # a group's rows sit past row 6: they cost the jump
        kept[before] = len(plan.tokens)
    assert kept == {0: 5, 2: 3, 4: 1}


@pytest.mark.parametrize("budget", range(4, 11))
def test_a_tight_budget_splits_its_rows_between_nodes_and_the_first_group(budget):
    """Every row pays (λ ~ 0) and the budget is below 1 + nodes + k: the rows after x_{n-1} are
    split, the first group holding the smaller half (``(budget - 1) // 2``), and the block uses
    the whole budget. Catches a reserve of ``budget // 2`` (the group takes more than half) and
    a group shortened when the block fits the budget exactly."""
    stats = fresh_stats(4)
    stats.tokens = 1e-6
    ids, probs = drafts([0.9, 0.05, 0.03], k=4)
    plan = plan_step(ids, probs, 0, [], stats, budget=budget, mask_num=4, max_groups=1, room=100, mask_rows_before=4)
    check_plan(plan, budget, 4, 1, 100)
    assert plan.group_len == ((budget - 1) // 2,) and len(plan.tokens) == budget - 1 - (budget - 1) // 2
    assert plan.used_rows == plan.rows == budget
