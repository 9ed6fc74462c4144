"""The preallocated KV cache (issue 43, ``cache.static_cache``): the same output as the growing
cache and AR, for every kind of layout, on the trained drafter (long accepts, so tree paths move
inside the cache) and on sliding-window models; its tensors are allocated once per generation; a
planner whose block overflows it gets a clear error."""
import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.cache import crop_cache, static_cache
from tests.conftest import CycleLanguage, sdpa_gqa_copy
from tests.decoding.test_architectures import tiny_model
from tests.oracle import oracle_generate

LAYOUTS = {
    "chain": DecodeConfig(4),
    "chain-2-groups": DecodeConfig(4, 2),
    "static-tree": DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "tree+lookup": DecodeConfig(3, 2, tree=[[0], [1], [0, 0]], lookup_tokens=6),
    "dynamic+lookup": DecodeConfig(4, tree="dynamic", lookup_tokens=8, row_budget=24),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_static_cache_equals_ar_and_the_dynamic_cache(trained, name):
    model, _, spec, lang = trained
    config = LAYOUTS[name]
    for n, new in [(12, 80), (1, 40), (30, 64)]:
        prompt = torch.tensor(lang.sample(n))
        truth = ar_generate(model, prompt, new, suppress_ids=spec.token_ids).new_ids
        grown = SpaceDecoder(model, spec, config).generate(prompt, new)
        static = SpaceDecoder(model, spec, config, static_cache=True).generate(prompt, new)
        assert static.new_ids == grown.new_ids == truth, (name, n)
        assert static.accept_lengths == grown.accept_lengths  # the same steps, not only the same text
        assert max(static.accept_lengths) >= 2  # drafts are accepted: the cache compacts and crops


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.startswith("dynamic")])
def test_row_buckets_pad_static_layouts_and_change_nothing_else(trained, name):
    """Issue 43, item 3: with ``buckets`` (a compiled decoder's default) a static layout's block is
    rounded up to a bucket size, so a pruned tree or a short lookup branch makes no new shape; the
    padding rows are masked out, so the steps and the output are those of the unpadded block, and
    the records count the padding apart from the real rows."""
    from space.decoding.dynamic import BUCKETS, bucket

    model, _, spec, lang = trained
    padded = SpaceDecoder(model, spec, LAYOUTS[name], static_cache=True, buckets=True)
    plain = SpaceDecoder(model, spec, LAYOUTS[name], static_cache=True)
    assert padded.buckets and not plain.buckets and padded.max_rows in BUCKETS
    padding = []
    for n, new in [(12, 80), (30, 64)]:
        prompt = torch.tensor(lang.sample(n))
        out, ref = padded.generate(prompt, new), plain.generate(prompt, new)
        assert out.new_ids == ref.new_ids == ar_generate(model, prompt, new, suppress_ids=spec.token_ids).new_ids
        assert out.accept_lengths == ref.accept_lengths
        assert out.step_rows == [bucket(r, padded.max_rows) for r in ref.step_rows]
        assert [r - p for r, p in zip(out.step_rows, out.step_padding)] == ref.step_rows
        assert not any(ref.step_padding)
        padding += out.step_padding
    assert any(padding)  # every layout here meets off-bucket blocks (9 -> 12 rows for the chain, ...)


def test_static_cache_holds_what_a_fresh_forward_gives_and_never_reallocates(trained):
    """After every step the first L slots equal a fresh forward of the tokens kept, through a tree
    whose accepted paths move (rank-1 siblings); the layers' tensors keep their storage. Prompts
    are drawn until a rank-1 path has been accepted."""
    model, _, spec, lang = trained
    lang = CycleLanguage(lang.tokens, seed=3)
    seen = []
    for _ in range(8):
        dec = SpaceDecoder(model, spec, DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0], [1, 1]]), static_cache=True)
        prompt = torch.tensor(lang.sample(15))
        truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
        original, storage = dec._step, []

        def checked(cache, L, slots, *args, original=original, prompt=prompt, truth=truth, storage=storage):
            out = original(cache, L, slots, *args)
            kept = L + 1 + len(out[3])
            ids = torch.cat([prompt, torch.tensor(truth)])[:kept]
            fresh = model.get_decoder()(input_ids=ids[None], use_cache=True).past_key_values
            for mine, ref in zip(cache.layers, fresh.layers):
                assert mine.keys.shape[-2] == slots and int(mine.cumulative_length) == kept
                torch.testing.assert_close(mine.keys[..., :kept, :], ref.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(mine.values[..., :kept, :], ref.values, rtol=1e-4, atol=1e-5)
            storage.append(tuple(layer.keys.data_ptr() for layer in cache.layers))
            seen.append([r - 1 for r in out[3]])
            return out

        dec._step = checked
        assert dec.generate(prompt, 60).new_ids == truth
        assert len(set(storage)) == 1  # allocated at the prefill, written in place ever after
        if any(path and path[0] == 1 for path in seen):
            break
    assert any(path and path[0] == 1 for path in seen)  # a rank-1 path was accepted: entries moved


@pytest.mark.parametrize("arch", ["qwen2-sliding-upper-layer", "mistral-sliding"])
def test_static_cache_on_sliding_window_models(arch):
    """The window is applied in the step's mask over every slot; prompts cross the 16-token window."""
    model, spec = tiny_model(arch)
    prompt = torch.randint(11, 250, (40,), generator=torch.Generator().manual_seed(1))
    truth = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids).new_ids
    for config in [DecodeConfig(4), DecodeConfig(3, tree=[[0], [1], [0, 0], [1, 0]]),
                   DecodeConfig(3, 4, tree="dynamic", lookup_tokens=6)]:
        assert SpaceDecoder(model, spec, config, static_cache=True).generate(prompt, 40).new_ids == truth, config


def test_a_block_that_overflows_the_static_cache_is_refused(trained):
    """A planner proposing more rows than the decoder sized the cache for is a clear error, not an
    index out of range inside the model."""
    model, _, spec, lang = trained
    dec = SpaceDecoder(model, spec, DecodeConfig(2, 1), static_cache=True)
    dec.max_rows = 0  # the cache is sized for no block rows: the chain's 1 + 2 + 2 overflow near the end
    with pytest.raises(ValueError, match="overflows the static cache"):
        dec.generate(torch.tensor(lang.sample(5)), 20)


def test_static_cache_crop_by_host_length():
    cache = static_cache(2, 8)
    with pytest.raises(ValueError, match="at least 1 slot"):
        static_cache(2, 0)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
        layer.cumulative_length.fill_(6)
    crop_cache(cache, 4, length=6)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [4, 4]
    crop_cache(cache, 5, length=4)  # keeping more than there is drops nothing
    assert [int(layer.cumulative_length) for layer in cache.layers] == [4, 4]


def test_oracle_planner_with_static_cache(trained):
    """Forced accepts at every length keep the static cache exact (the oracle's planner seam)."""
    model, _, spec, lang = trained
    prompt = torch.tensor(lang.sample(9))
    truth = ar_generate(model, prompt, 50, suppress_ids=spec.token_ids).new_ids
    for corrupt_at in range(4):
        def override(generated, drafts, corrupt_at=corrupt_at):
            c = list(truth[len(generated): len(generated) + 3]) + [11] * 3
            c = c[:3]
            if corrupt_at < 3:
                c[corrupt_at] = (c[corrupt_at] + 1) % 250
            return torch.tensor(c)
        dec = SpaceDecoder(model, spec, DecodeConfig(3), static_cache=True)
        out = oracle_generate(dec, prompt, 50, override=override)
        assert out.new_ids == truth
        if corrupt_at < 3:
            assert max(out.accept_lengths[1:]) == corrupt_at


def test_ar_generate_honours_static_cache_true(tiny, monkeypatch):
    """ar_generate(static_cache=True) on an eager model preallocates prompt + max_new_tokens slots
    (the flag was silently ignored when only ``is_compiled`` chose the cache), with the same tokens."""
    import space.decoding.autoregressive as ar_mod

    model, _, spec = tiny
    made = []

    def spy(layers, slots):
        made.append((layers, slots))
        return static_cache(layers, slots)

    monkeypatch.setattr(ar_mod, "preallocated", spy)
    prompt = torch.arange(11, 20)
    truth = ar_generate(model, prompt, 6, suppress_ids=spec.token_ids).new_ids
    assert made == []  # the default on an eager model: the growing cache
    assert ar_generate(model, prompt, 6, suppress_ids=spec.token_ids, static_cache=True).new_ids == truth
    assert made == [(model.config.num_hidden_layers, 9 + 6)]


def test_ar_generate_never_emits_a_suppressed_id(tiny):
    """suppress_ids (the mask tokens) are never emitted: suppressing the greedy first token changes it
    (a dropped suppression left the AR baseline free to emit mask tokens)."""
    model, _, _ = tiny
    prompt = torch.arange(11, 20)
    free = ar_generate(model, prompt, 4).new_ids
    out = ar_generate(model, prompt, 4, suppress_ids=[free[0]]).new_ids
    assert free[0] not in out and len(out) == 4


@pytest.mark.parametrize("name", ["chain-2-groups", "dynamic+lookup"])
def test_steps_attend_only_over_the_slots_that_hold_tokens(trained, sdpa_calls, name):
    """Issue 58: over a static cache, a trunk whose attention reads the keys up to the mask's width
    (``space.decoding.backends.SDPA_GQA``: the fused trunk, the fast kernels, a CPU's compiled
    trunk) gets a step mask over the cached tokens and the block alone (each step's width is
    the cached count plus its rows), and attends over those keys only, not over the empty slots
    past them; SPACE and AR stay AR's tokens. Stock ``sdpa`` reads every slot, so its mask spans
    them all."""
    model, _, spec, lang = trained
    gqa, seen = sdpa_gqa_copy(model), sdpa_calls
    prompt = torch.tensor(lang.sample(12))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    for m, narrow in [(gqa, True), (model, False)]:
        dec = SpaceDecoder(m, spec, LAYOUTS[name], static_cache=True)
        slots = 12 + 60 + dec.max_rows
        seen.clear()
        out = dec.generate(prompt, 60)
        assert out.new_ids == truth and max(out.accept_lengths) >= 2
        layers = m.config.num_hidden_layers
        steps = seen[layers:]  # after the prefill's forward (transformers' own mask over the cache)
        assert len(steps) == len(out.accept_lengths) * layers
        if narrow:  # each step's keys: the cached tokens and the block, well short of the cache
            cached = [11 + sum(1 + a for a in out.accept_lengths[:i]) for i in range(len(out.accept_lengths))]
            assert [width for _, _, width in steps[::layers]] == [c + r for c, r in zip(cached, out.step_rows)]
            assert all(keys == width < slots for _, keys, width in steps), steps[:3]
            assert min(keys for _, keys, _ in steps) < slots / 2
        else:
            assert all(keys == width == slots for _, keys, width in steps), steps[:3]
        seen.clear()
        assert ar_generate(m, prompt, 60, suppress_ids=spec.token_ids, static_cache=True).new_ids == truth
        assert all(keys == width for _, keys, width in seen[layers:]), seen[layers:][:4]
        widths = [width for _, _, width in seen[layers:]]  # AR's 59 one-row steps after the prompt
        assert widths == ([13 + i for i in range(59) for _ in range(layers)] if narrow else [12 + 60] * 59 * layers)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-sliding-upper-layer", "mistral-sliding"])
def test_ar_static_steps_score_as_over_the_growing_cache(arch):
    """``ar_generate`` over a static cache gives each 1-row step its own position and 4-D mask
    (over every slot with stock ``sdpa``, over the cached tokens with ``SDPA_GQA``; on a
    sliding-window model with the window applied in it, prompts crossing the 16-token window): every
    step's logits are those over the growing cache. Compared as logits, not tokens: a step placed
    one position late kept the trained drafter's tokens (its cyclic language barely reads
    positions) and every other test's."""
    model, spec = tiny_model(arch)
    prompt = torch.randint(11, 250, (40,), generator=torch.Generator().manual_seed(1))

    def scores(m, static):
        seen = []

        def keep(ids, logits):
            seen.append(logits.clone())
            return logits

        out = ar_generate(m, prompt, 24, suppress_ids=spec.token_ids, logits_processor=keep, static_cache=static)
        return out.new_ids, torch.cat(seen)

    truth, want = scores(model, False)
    for m in (model, sdpa_gqa_copy(model)):
        new_ids, got = scores(m, True)
        assert new_ids == truth
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
