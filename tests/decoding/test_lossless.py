"""Greedy SPACE == AR greedy, token for token, in every configuration (DESIGN §3.4)."""
import inspect
import warnings

import pytest
import torch

import space.decoding.decoder as space_mod
from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.cache import CACHE_ARG
from space.decoding.lookup import PromptLookup
from tests.oracle import oracle_generate

STOP = 10  # an ordinary byte id used as the stop token, so EOS lands inside steps


def cases(n_cases, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_cases):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        yield torch.randint(11, 250, (n,), generator=gen), int(torch.randint(1, 48, (1,), generator=gen))


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("which", ["tiny", "tiny_varied"])
def test_greedy_exact_all_k_and_groups(request, which, k):
    """``tiny``'s answers repeat one token, which its untrained masks draft too (drafts accepted);
    ``tiny_varied``'s vary (drafts mostly rejected, tokens in an order to keep)."""
    model, _, spec = request.getfixturevalue(which)
    for prompt, max_new in cases(3, seed=k):
        ar = ar_generate(model, prompt, max_new, stop_token_ids=[STOP], suppress_ids=spec.token_ids)
        for groups in range(1, k + 2):
            out = SpaceDecoder(model, spec, DecodeConfig(k, groups)).generate(prompt, max_new, stop_token_ids=[STOP])
            assert out.new_ids == ar.new_ids, (k, groups, prompt.tolist(), max_new)
            assert len(out.new_ids) <= max_new and sum(out.step_tokens) == len(out.new_ids)


def test_untied_head_exact(tiny_untied):
    model, _, spec = tiny_untied
    for prompt, max_new in cases(4, seed=99):
        ar = ar_generate(model, prompt, max_new, suppress_ids=spec.token_ids)
        assert SpaceDecoder(model, spec, DecodeConfig(4)).generate(prompt, max_new).new_ids == ar.new_ids


def test_cache_goes_in_under_the_installed_name(tiny):
    """transformers 5.24 renamed the forward's past_key_values to cache (the old name warns, then goes in
    5.40): every forward of a decode uses the name the installed version takes, so none warns."""
    model, _, spec = tiny
    assert CACHE_ARG in inspect.signature(model.model.forward).parameters
    prompt = torch.arange(11, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ar_generate(model, prompt, 12, suppress_ids=spec.token_ids)
        SpaceDecoder(model, spec, DecodeConfig(2, 2, tree=[[0], [1], [0, 0]], lookup_tokens=4)).generate(prompt, 12)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


@pytest.mark.parametrize("k,groups,lookup", [(1, 1, 4), (3, 2, 10)])
def test_prompt_lookup_exact(tiny, k, groups, lookup):
    model, _, spec = tiny
    gen = torch.Generator().manual_seed(7)
    dec = SpaceDecoder(model, spec, DecodeConfig(k, groups, lookup_tokens=lookup))
    for _ in range(4):
        pattern = torch.randint(11, 250, (6,), generator=gen)
        prompt = torch.cat([pattern.repeat(3), torch.randint(11, 250, (5,), generator=gen)])  # n-grams recur
        ar = ar_generate(model, prompt, 60, stop_token_ids=[STOP], suppress_ids=spec.token_ids)
        assert dec.generate(prompt, 60, stop_token_ids=[STOP]).new_ids == ar.new_ids
    found = PromptLookup([5, 6, 7, 8, 9, 5, 6], lookup, 2, dec.context).continuation()
    assert found == [7, 8, 9, 5, 6][:lookup]  # the tokens after the earlier "5 6"
    assert dec.tree is not None  # lookup is a branch of the step's tree, next to the mask drafts
    with pytest.raises(ValueError, match="lookup_tokens"):
        SpaceDecoder(model, spec, DecodeConfig(k, lookup_tokens=-1))


def oracle(truth, corrupt_at, k):
    """Candidates from the true AR continuation, with candidate ``corrupt_at`` (0-based) wrong."""
    def override(generated, drafts):
        c = list(truth[len(generated): len(generated) + k])
        c += [11] * (k - len(c))
        if corrupt_at < len(c):
            c[corrupt_at] = (c[corrupt_at] + 1) % 250
        return torch.tensor(c)
    return override


@pytest.mark.parametrize("k,groups", [(3, 4), (5, 6), (5, 2), (4, 1)])
def test_every_accept_length_and_cache_crop(tiny_varied, monkeypatch, k, groups):
    """Every accept length 0..k, the oracle's drafts (the truth with one candidate wrong) on a
    model whose answer varies, so tokens out of order or a bonus from the wrong row show."""
    model, _, spec = tiny_varied
    prompt = torch.randint(11, 250, (9,), generator=torch.Generator().manual_seed(3))
    truth = ar_generate(model, prompt, 120, suppress_ids=spec.token_ids).new_ids
    assert len(set(truth)) > 20
    crops = []
    real_crop = space_mod.crop_cache

    def spy(cache, keep, length=None):
        assert length is None or length == cache.get_seq_length()  # the decoder's host count is right
        crops.append(keep)
        real_crop(cache, keep, length)
        assert cache.get_seq_length() == keep

    monkeypatch.setattr(space_mod, "crop_cache", spy)
    seen = set()
    for corrupt_at in range(k + 1):  # k + 1: no corruption, every candidate accepted
        crops.clear()
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(k, groups)), prompt, 120, override=oracle(truth, corrupt_at, k))
        assert out.new_ids == truth
        seen.update(out.accept_lengths)
        # the cache keeps exactly prompt + accepted tokens: n-1 before a step, n+a after it
        n = len(prompt)
        for keep, a, emitted in zip(crops, out.accept_lengths, out.step_tokens):
            assert keep == n + a
            n += emitted
        if corrupt_at < k:
            assert max(out.accept_lengths[1:]) == corrupt_at
    assert seen == set(range(k + 1))


def test_eos_and_max_new_tokens_inside_a_step(tiny_varied):
    """A stop token first seen at every place inside a step (the oracle accepts all 5 drafts: steps
    of 6 tokens), and max_new_tokens cuts inside one."""
    model, _, spec = tiny_varied
    prompt = torch.randint(11, 250, (6,), generator=torch.Generator().manual_seed(5))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    # after the first step's 1 token, steps of 6 start at 1, 7, ...: one stop at each place in a step
    firsts = {}
    for i, t in enumerate(truth):
        if t not in truth[:i]:
            firsts.setdefault(i % 6, i)
    assert len(firsts) == 6
    for i in sorted(firsts.values()):
        stop = truth[i]
        ar = ar_generate(model, prompt, 60, stop_token_ids=[stop], suppress_ids=spec.token_ids)
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(5)), prompt, 60, stop_token_ids=[stop],
                              override=oracle(truth, 9, 5))
        assert ar.new_ids == truth[: i + 1] and out.new_ids == ar.new_ids and out.stop_reason == "eos", i
    for max_new in (1, 2, 7, 13):
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(5)), prompt, max_new, override=oracle(truth, 9, 5))
        assert out.new_ids == truth[:max_new] and out.stop_reason == "length"


def test_mask_token_never_emitted(tiny_untied):
    model, _, spec = tiny_untied
    mask_id = spec.token_ids[0]

    def boost(module, args, out):  # the mask token's logit becomes the largest on every row
        out[..., mask_id] += 1e4
        return out

    hook = model.get_output_embeddings().register_forward_hook(boost)
    try:
        prompt = torch.tensor([20, 30, 40])
        with torch.no_grad():
            assert int(model(input_ids=prompt[None]).logits[0, -1].argmax()) == mask_id
        out = SpaceDecoder(model, spec, DecodeConfig(3)).generate(prompt, 20)
        assert mask_id not in out.new_ids and len(out.new_ids) == 20
        assert out.new_ids == ar_generate(model, prompt, 20, suppress_ids=spec.token_ids).new_ids
    finally:
        hook.remove()


def test_streaming_callback(tiny):
    model, _, spec = tiny
    chunks = []
    out = SpaceDecoder(model, spec, DecodeConfig(3)).generate(torch.tensor([40, 41]), 15, on_tokens=chunks.append)
    assert sum(chunks, []) == out.new_ids and len(chunks) == out.num_steps


@pytest.mark.parametrize("k,groups", [(3, 4), (5, 2)])
def test_context_end_shrinks_the_step(tiny, k, groups):
    """A prompt that fits AR fits SPACE: near the context end the step drops candidates and
    shortens its groups, so no row gets a position >= the context, and output stays exact."""
    model, _, spec = tiny
    context = model.config.max_position_embeddings
    prompt = torch.randint(11, 250, (context - 12,), generator=torch.Generator().manual_seed(2))
    truth = ar_generate(model, prompt, 12, suppress_ids=spec.token_ids).new_ids
    positions = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: positions.append(int(kwargs["position_ids"].max())) if kwargs.get("position_ids") is not None else None,
        with_kwargs=True)
    try:
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(k, groups)), prompt, 12, override=oracle(truth, k, k))
    finally:
        hook.remove()
    assert out.new_ids == truth and max(positions) == context - 1  # the last steps ran right at the end


def test_context_end_step_uses_every_position_left(tiny):
    """Near the context end a static step keeps as many candidates and masks as still fit (groups
    of equal length), not fewer: with room for depth 2, the chain of 2 drafts and two groups of one
    mask each (a step that gave up a group or a mask there drafted nothing for the next step, the
    output unchanged); at the last position, x_{n-1} alone. No row reaches the context."""
    from space.decoding.decoder import Drafts

    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3))
    context = dec.context
    drafts = Drafts(torch.tensor([[21], [22], [23]]))
    for room, parents, group_len, deepest in [(100, (-1, 0, 1, 2), (3, 3, 3, 3), 6), (3, (-1, 0, 1, 2), (1, 1, 1), 3),
                                              (2, (-1, 0, 1), (1, 1), 2), (1, (-1, 0), (1,), 1), (0, (-1,), (), 0)]:
        L = context - 1 - room  # x_{n-1} sits at position L
        lay, tokens, sources = dec.static_block(L, drafts, [])
        assert (lay.parents, lay.group_len) == (parents, group_len), room
        assert tokens.tolist() == [21, 22, 23][: len(parents) - 1] and sources == (1,) * (len(parents) - 1)
        assert int(lay.position_ids.max()) == deepest and lay.rows == lay.used_rows

def test_bad_input(tiny):
    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3))
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate(torch.tensor([], dtype=torch.long), 5)
    with pytest.raises(ValueError, match="batch size"):
        dec.generate(torch.ones(2, 4, dtype=torch.long), 5)
    with pytest.raises(ValueError, match=r"prompt \(2044 tokens\) \+ max_new_tokens \(5\) = 2049 exceeds"):
        dec.generate(torch.ones(2044, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="exceeds the model context"):
        ar_generate(model, torch.ones(2046, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="mask_num"):
        SpaceDecoder(model, spec, DecodeConfig(0))
    with pytest.raises(ValueError, match="maximum"):
        SpaceDecoder(model, spec, DecodeConfig(17))
    with pytest.raises(ValueError, match="num_groups"):
        SpaceDecoder(model, spec, DecodeConfig(3, num_groups=5))
