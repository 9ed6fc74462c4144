"""The sampler head in decoding and in the probe (issue 34): drafts conditioned on the token drafted
before them, greedy == AR (chain, static tree, dynamic tree) with deep accepts, exact sampling, the
tree's per-node drafts against a naive recursion, and the probe's ranks against ranks by hand."""
import copy

import pytest
import torch

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.data.collator import SpaceCollator
from space.eval.probe import anchor_ranks
from space.masking import previous_ids, to_additive_4d, train_layout
from space.sampler_head import add_sampler_head, sampler_head
from tests.conftest import TRAINED_K, CycleLanguage, fresh_language
from tests.decoding.test_sampling import ALPHA, chi2_pvalue, exact_distribution, sampled, small_vocab_model  # noqa: F401

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def headed(trained_drafter):
    """The trained tiny drafter plus a sampler head trained (alone, teacher-forced on the true
    previous token) on the same language: after a jump in the cycle the masks anchored before it
    are wrong, the head given the token before the target is not. The head trains on the drafter's
    own samples (seed 0); each test takes ``fresh_language``, so its prompts do not depend on which
    tests of the module ran before it."""
    model, tok, spec, language = trained_drafter
    model, samples = copy.deepcopy(model).requires_grad_(False), CycleLanguage(language.tokens, seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = add_sampler_head(model, 64)
        collator = SpaceCollator(spec.ids_for(TRAINED_K), TRAINED_K, pad_id=0, spans_per_sample=16)
        opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
        for step in range(150):
            batch = collator([{"input_ids": samples.sample(48), "prompt_len": 1, "idx": step * 16 + b}
                              for b in range(16)])
            T = batch["num_real"]
            hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                 attention_mask=batch["attention_mask"]).last_hidden_state[:, T:]
            prev = model.get_input_embeddings()(previous_ids(batch["input_ids"][:, :T], batch["position_ids"][:, T:]))
            logits = model.lm_head(head(hidden, prev))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, T:].flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval(), spec, language


@pytest.mark.parametrize("cfg", [DecodeConfig(TRAINED_K), DecodeConfig(TRAINED_K, 3, tree=TREE),
                                 DecodeConfig(TRAINED_K, 3, tree=TREE, lookup_tokens=4),
                                 DecodeConfig(TRAINED_K, tree="dynamic"),
                                 DecodeConfig(TRAINED_K, tree="dynamic", lookup_tokens=4)],
                         ids=["chain", "tree", "tree+lookup", "dynamic", "dynamic+lookup"])
def test_greedy_with_head_equals_ar(headed, cfg):
    model, spec, language = headed
    language = fresh_language(language)
    dec = SpaceDecoder(model, spec, cfg)
    assert dec.sampler is sampler_head(model) is not None
    accepts, steps, tokens = [], 0, 0
    for n in (1, 5, 13, 30):
        prompt = torch.tensor(language.sample(n))
        truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
        out = dec.generate(prompt, 60)
        assert out.new_ids == truth
        accepts += out.accept_lengths
        steps, tokens = steps + len(out.accept_lengths), tokens + len(out.new_ids)
    assert max(accepts) >= 3 and tokens / steps > 2.5, (accepts, tokens / steps)


def test_head_lifts_accept_length(trained, headed):
    """The head is used, and given the right tokens: on the same prompts the chain with the head
    accepts far more than the same masks without it (a head fed the wrong previous token drafts
    worse than none)."""
    model, spec, language = headed
    per_step = {}
    for name, m in (("masks", trained[0]), ("head", model)):
        dec, gen_lang = SpaceDecoder(m, spec, DecodeConfig(TRAINED_K)), fresh_language(language)
        outs = [dec.generate(torch.tensor(gen_lang.sample(n)), 60) for n in (1, 5, 13, 30)]
        per_step[name] = sum(len(o.new_ids) for o in outs) / sum(len(o.accept_lengths) for o in outs)
    assert per_step["head"] > 1.2 * per_step["masks"], per_step


def test_head_drafts_follow_the_drafted_path(headed):
    """Each node of a static tree is drafted from its depth's hidden state and its parent's token:
    the batched per-depth drafts equal a naive recursion over the nodes, and ids hold the top-R
    along the top-1 path."""
    model, spec, _ = headed
    dec = SpaceDecoder(model, spec, DecodeConfig(TRAINED_K, tree=TREE))
    head, lm = sampler_head(model), model.lm_head
    gen = torch.Generator().manual_seed(0)
    for r in (1, 2, 4):
        hidden = torch.randn(r, model.config.hidden_size, generator=gen)
        bonus = torch.randint(11, 250, (1,), generator=gen)
        with torch.no_grad():
            drafts = dec._head_drafts(hidden, bonus, 0, SamplingConfig(), None, False, None, None)
        tree = [tuple(p) for p in TREE if len(p) <= r]
        tree.sort(key=lambda p: (len(p), p))

        def ranked(d, prev):
            with torch.no_grad():
                logits = lm(head(hidden[d:d + 1], model.get_input_embeddings()(torch.tensor([prev])))).float()
            logits[:, list(spec.token_ids)] = float("-inf")
            return logits[0].argsort(descending=True).tolist()

        token = {(): int(bonus)}
        for p in tree:
            token[p] = ranked(len(p) - 1, token[p[:-1]])[p[-1]]
        assert drafts.nodes.tolist() == [token[p] for p in tree]
        prev = int(bonus)
        for d in range(r):
            assert drafts.ids[d].tolist() == ranked(d, prev)[: dec.draft_ranks]
            prev = drafts.ids[d, 0].item()


def with_head(model, std: float):
    """A copy of ``model`` with an untrained sampler head, its fc2 drawn with ``std`` so its drafts
    depend on the previous token (the larger, the more)."""
    model = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        head = add_sampler_head(model, 16)
        torch.nn.init.normal_(head.fc2.weight, std=std)
    return model


@pytest.fixture(scope="module")
def small_headed(small_vocab_model):
    model, spec = small_vocab_model
    return with_head(model, 0.3), spec


@pytest.mark.parametrize("temperature,top_p,lookup,tree", [(1.0, 1.0, 0, None), (1.5, 0.9, 2, "dynamic"),
                                                           (1.0, 1.0, 0, [[0], [1], [0, 0]])])
def test_sampling_with_head_matches_ar_distribution(small_headed, temperature, top_p, lookup, tree):
    """A sampled chain draws each offset from the head given the token drawn before it (the p/q
    rule with those distributions); trees verify the head's deterministic candidates. Either way
    t1..t3 follow AR sampling's exact joint distribution. The dynamic tree runs with full blocks to
    the context's end (its own planner stops at what 3 tokens can emit: no 2-deep tree after the
    first step) and with its own."""
    model, spec = small_headed
    prompt = [1, 3, 0, 2]
    exact = exact_distribution(model, prompt, SamplingConfig(temperature, top_p=top_p))
    n = 1000
    dec = SpaceDecoder(model, spec, DecodeConfig(3, lookup_tokens=lookup, tree=tree))
    full = dec.planner if tree == "dynamic" else None  # a sampled chain takes no planner
    counts, outs = sampled(dec, prompt, n, planner=full, temperature=temperature, top_p=top_p)
    assert max(a for out in outs for a in out.accept_lengths[1:]) >= 2
    assert chi2_pvalue(counts, exact, n) > ALPHA
    if full is not None:
        assert chi2_pvalue(sampled(dec, prompt, n, temperature=temperature, top_p=top_p)[0], exact, n) > ALPHA


def test_sampled_chain_with_head_one_group_shifts(small_vocab_model):
    """One mask group (DESIGN §3.5): after a step accepts a < k drafts, the next step's drafts are
    the same group's masks from offset a on, drawn by the head given the bonus token, and verified
    with the p/q rule against the q each was drawn from. t1..t6 follow AR sampling exactly. With
    this head the offsets' q differ widely, so a shifted step that pairs its drafts with another
    offset's q (rolled by one) gives p < 1e-6 here; unshifted steps are not enough to see it."""
    model, spec = small_vocab_model
    model = with_head(model, 1.0)
    k, prompt, length, n = 3, [1, 3, 0, 2], 6, 2000
    exact = exact_distribution(model, prompt, SamplingConfig(1.0), length=length)
    dec = SpaceDecoder(model, spec, DecodeConfig(k, 1))
    assert dec.sampler is not None
    counts, outs = sampled(dec, prompt, n, length, temperature=1.0)
    # a step verifying 0 < m < k candidates drew them from offsets k - m.. of the one group
    shifted = sum(0 < m < k for out in outs for m in out.step_candidates)
    assert shifted >= n // 4, shifted
    assert chi2_pvalue(counts, exact, n) > ALPHA


def test_probe_ranks_with_head_by_hand(headed):
    """anchor_ranks with a head: mask j anchored at e is ranked by the head given the true x_{e+j};
    here each group runs alone, without a cache, and is ranked by hand."""
    model, spec, language = headed
    ids = torch.tensor(fresh_language(language).sample(20))
    P, k = 6, 3
    got = anchor_ranks(model, ids, P, spec.ids_for(k), k, spec.token_ids, chunk_groups=5)
    head, n = sampler_head(model), ids.numel()
    for i, e in enumerate(range(P, n - 1)):
        lay = train_layout(n, [e], k)
        with torch.no_grad():
            hidden = model.model(input_ids=lay.input_ids(ids, spec.ids_for(k))[None], position_ids=lay.position_ids[None],
                                 attention_mask=to_additive_4d(lay.allowed)).last_hidden_state[0, n:]
            prev = ids[[min(e + j, n - 1) for j in range(k)]]  # x_{e+j}; no target past the end
            logits = model.lm_head(head(hidden, model.get_input_embeddings()(prev)))
        logits[:, list(spec.token_ids)] = float("-inf")
        for j in range(k):
            if e + j + 1 >= n:
                assert got[i, j] == -1
                continue
            true = logits[j, ids[e + j + 1]]
            assert got[i, j] == int((logits[j] > true).sum()), (e, j)


@pytest.mark.parametrize("entry", [{"width": 0}, {"width": -3}, {"width": True}, {"width": 2.5}, {}, 24])
def test_a_bad_sampler_head_entry_is_refused(entry):
    """An adapter's ``sampler_head`` entry must name a width >= 1: width 0 would build a head of the
    model's width (``SamplerHead``'s default) whatever the saved weights are. Catches a bound
    check that lets 0 through."""
    from space.artifact import sampler_width

    with pytest.raises(ValueError, match="bad sampler_head entry"):
        sampler_width({"sampler_head": entry}, "adapter/space_config.json")
    assert sampler_width({"sampler_head": {"width": 24}}) == 24 and sampler_width({}) is None


def test_a_sampler_head_of_another_width_is_refused_naming_the_file(tmp_path):
    """Weights saved from a head of width 24 loaded into one of width 32: a ValueError naming the
    file and the width, not torch's bare size-mismatch RuntimeError (or a silent partial copy)."""
    from space.artifact import load_sampler_head, save_sampler_head
    from space.sampler_head import SamplerHead

    path = tmp_path / "sampler_head.safetensors"
    save_sampler_head(SamplerHead(16, 24), path)
    with pytest.raises(ValueError, match=r"sampler_head\.safetensors.*width 32"):
        load_sampler_head(SamplerHead(16, 32), path)
    head = SamplerHead(16, 24)
    load_sampler_head(head, path)  # the same width loads


def test_the_head_trains_in_fp32_and_returns_the_models_dtype():
    """On a bf16 model the head's weights are fp32, as the mask rows are (a bf16 head lost Adam's
    late small updates to rounding), and its output takes the hidden states' dtype: an fp32 output
    fed the bf16 LM head a dtype error. Its gradient reaches fp32 weights through bf16 inputs."""
    from space.models import tiny_random_llama

    model, _ = tiny_random_llama(seed=0)
    model = model.to(torch.bfloat16)
    head = add_sampler_head(model, 8)
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    assert sampler_head(model) is head
    with torch.no_grad():
        head.fc2.weight.normal_(0, 0.5)
    hidden = torch.randn(2, 3, model.config.hidden_size, dtype=torch.bfloat16)
    out = head(hidden, torch.randn_like(hidden))
    assert out.dtype == torch.bfloat16
    model.get_output_embeddings()(out).float().sum().backward()
    assert head.fc1.weight.grad.dtype == torch.float32 and head.fc1.weight.grad.abs().sum() > 0


def test_the_head_computes_its_formula_by_hand():
    """``SamplerHead(d, width)`` is ``hidden + W2 silu(W1 [hidden; prev_embeds] + b1) + b2`` with
    W1 (width, 2d), width 0 meaning d, and a negative size refused as a ValueError naming the
    sizes. Catches the concatenation's halves swapped (a saved head then reads the previous token
    as the hidden state), another activation or a dropped bias, and width 0 kept as 0 (an MLP of
    no units: a head that never learns anything)."""
    from space.sampler_head import SamplerHead

    assert SamplerHead(8).width == 8 and SamplerHead(8).fc1.out_features == 8
    for bad in ((8, -1), (0, 4)):
        with pytest.raises(ValueError, match="need hidden >= 1 and width >= 0"):
            SamplerHead(*bad)
    gen = torch.Generator().manual_seed(0)
    head = SamplerHead(4, 3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    hidden, prev = torch.randn(2, 5, 4, generator=gen), torch.randn(2, 5, 4, generator=gen)
    w1, b1, w2, b2 = head.fc1.weight, head.fc1.bias, head.fc2.weight, head.fc2.bias
    pre = hidden @ w1[:, :4].T + prev @ w1[:, 4:].T + b1
    want = hidden + (pre * torch.sigmoid(pre)) @ w2.T + b2
    torch.testing.assert_close(head(hidden, prev).detach(), want.detach())
