"""Captured steps (issue 58, item 4, ``space.decoding.graphs``): fixed buffers per row bucket over
one static cache, a tensor gate for the frozen-base LoRA, no host read in the captured region.

On the CPU the buffers run through the eager trunk (no CUDA graphs here), so these tests cover
every part but the replay, which ``tests/test_cuda.py`` checks on a GPU."""
import copy

import pytest
import torch

from space.adapter_layers import GatedLoraLinear
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.cache import cache_input, full_cache
from space.decoding.datastore import Datastore
from space.decoding.decoder import with_cache
from space.decoding.fused import fuse_trunk
from space.decoding.graphs import StepGraphs
from space.masking import mask_rows, to_additive_4d
from space.models import tiny_random_llama
from tests.conftest import CycleLanguage, fresh_language
from tests.decoding.test_fused import gated_tiny
from tests.syncs import SyncCounter

BUCKETS_32 = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32)  # dynamic.BUCKETS up to 32 rows
LAYOUTS = {
    "chain": DecodeConfig(4),
    "static-tree": DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "tree+lookup": DecodeConfig(3, 2, tree=[[0], [1], [0, 0]], lookup_tokens=6),
    "dynamic+lookup": DecodeConfig(4, tree="dynamic", lookup_tokens=8, row_budget=24),
}


@pytest.fixture(scope="module")
def captured(trained_drafter):
    model, _, spec, lang = trained_drafter
    lang = fresh_language(lang)
    return model, spec, lang, StepGraphs(model, slots=200, sizes=BUCKETS_32)


@pytest.mark.parametrize("name", LAYOUTS)
def test_captured_steps_equal_ar_and_the_eager_steps(captured, name):
    """One StepGraphs serves every generation (its cache is only reset): SPACE over it emits AR's
    tokens, in the eager decoder's steps, on the trained drafter (paths of several tokens move
    inside the cache), and AR over it emits AR's tokens too."""
    model, spec, lang, graphs = captured
    for n, new in [(12, 80), (1, 40), (30, 64)]:
        prompt = torch.tensor(lang.sample(n))
        truth = ar_generate(model, prompt, new, suppress_ids=spec.token_ids).new_ids
        assert ar_generate(model, prompt, new, suppress_ids=spec.token_ids, graphs=graphs).new_ids == truth
        eager = SpaceDecoder(model, spec, LAYOUTS[name]).generate(prompt, new)
        out = SpaceDecoder(model, spec, LAYOUTS[name], graphs=graphs).generate(prompt, new)
        assert out.new_ids == truth, (name, n)
        assert out.accept_lengths == eager.accept_lengths  # the same steps, not only the same text
        assert set(out.step_rows) <= set(graphs.sizes)  # every block is a bucket
        assert max(out.accept_lengths) >= 2


def test_captured_steps_with_a_datastore_decode_ar_and_accept_from_it(tiny_varied):
    """The datastore's branches over captured steps (``space-eval --capture --datastore``, timed by
    gpu_check.sh g58b): a random drafter and a store holding the AR answers, so steps accept deep
    through the datastore's paths, which move inside the one-slab cache. Catches a wrong slot kept
    there, or blocks outside the buckets."""
    model, _, spec = tiny_varied
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(11, 250, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
               for _ in range(4)]
    truths = [ar_generate(model, p, 40, suppress_ids=spec.token_ids).new_ids for p in prompts]
    store = Datastore([p.tolist()[-3:] + t for p, t in zip(prompts, truths)])
    cfg = DecodeConfig(2, tree="dynamic", lookup_tokens=6, datastore_branches=2)
    graphs = StepGraphs(model, slots=128, sizes=SpaceDecoder(model, spec, cfg, buckets=True).row_sizes)
    decoder = SpaceDecoder(model, spec, cfg, graphs=graphs, datastore=store)
    for p, truth in zip(prompts, truths):
        out = decoder.generate(p, 40)
        assert out.new_ids == truth, p.tolist()
        assert set(out.step_rows) <= set(graphs.sizes)
        assert max(out.accept_lengths) >= 4 and "d" in "".join(out.step_sources)


def _block(q: int):
    """A block of ``q`` rows, each seeing the rows before it: (position ids (q,), additive mask
    (1, 1, q, q))."""
    return torch.arange(q), to_additive_4d(torch.ones(q, q).tril().bool()[None, None])


@pytest.mark.parametrize("fused", [False, True], ids=["gated linears", "fused trunk"])
def test_the_gate_gives_mask_rows_their_lora_and_real_rows_none(fused, device="cpu"):
    """A captured step of a frozen-base adapter computes what the eager step computes: the mask
    rows with their LoRA update (gated), the real rows exactly the base model's. The step with no
    mask row gives every row without the update: the test sees the LoRA. The first mask row
    changes between two replays of one graph (``device="cuda"``: ``tests/test_cuda.py``)."""
    model, spec = gated_tiny()
    model.to(device)
    if fused:
        fuse_trunk(model)
    graphs = StepGraphs(model, slots=64, sizes=[8])
    trunk = model.get_decoder()
    prompt = torch.randint(11, 250, (1, 10), generator=torch.Generator().manual_seed(1)).to(device)
    ids = torch.randint(11, 250, (8,), generator=torch.Generator().manual_seed(2))
    ids[3:] = spec.token_ids[0]
    ids = ids.to(device)
    pos, block = (t.to(device) for t in _block(8))

    def eager(start):
        cache = full_cache()
        with torch.inference_mode():
            trunk(input_ids=prompt, **cache_input(cache), use_cache=True)
            with mask_rows(start):
                return trunk(input_ids=ids[None], position_ids=(pos + 10)[None], attention_mask=with_cache(block, pos, 10, {"full_attention": None}),
                             **cache_input(cache), use_cache=True).last_hidden_state[0]

    def captured(start):
        graphs.reset()
        with torch.inference_mode():
            trunk(input_ids=prompt, **cache_input(graphs.cache), use_cache=True)
            return graphs.step(ids, pos, block, 10, start).clone()

    gated, plain, later = captured(3), captured(None), captured(5)
    torch.testing.assert_close(gated, eager(3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, eager(None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(later, eager(5), rtol=1e-5, atol=1e-5)
    assert torch.equal(gated[:3], plain[:3])  # real rows: + 0, exactly
    assert (gated[3:] - plain[3:]).abs().max() > 1e-2  # mask rows: the LoRA is really there


def test_a_gated_linear_under_a_gate_equals_the_start_it_stands_for():
    lin = torch.nn.Linear(16, 12)
    gated = GatedLoraLinear(lin, torch.randn(4, 16), torch.randn(12, 4))
    x = torch.randn(1, 7, 16)
    with mask_rows(5):
        by_start = gated(x)
    with mask_rows(torch.tensor([0.0] * 5 + [1.0] * 2)[:, None]):
        by_gate = gated(x)
    assert torch.equal(by_gate[0, :5], lin(x)[0, :5])
    torch.testing.assert_close(by_gate, by_start)
    with pytest.raises(ValueError, match=r"\(rows, 1\) tensor"):
        with mask_rows(torch.ones(7)):
            pass


def test_a_gated_linear_in_a_compiled_graph_equals_the_start_it_stands_for():
    """Under ``torch.compile`` a gated linear adds its gated update out of place (the frozen
    trunk's gate, ``space.decoding.compiled``: inductor's frozen C++ GEMM failed to lower the
    in-place ``addmm_``). Traced whole (dynamo's eager backend: the traced graph, no inductor), it
    computes what the eager start computes: real rows the base's exactly, mask rows the base's
    plus their LoRA (a dropped gate or a flipped sign there only worsens SPACE's drafts, which
    lossless decoding hides)."""
    lin = torch.nn.Linear(16, 12)
    gated = GatedLoraLinear(lin, torch.randn(4, 16), torch.randn(12, 4))
    x = torch.randn(1, 7, 16)

    def step(x, gate):
        with mask_rows(gate):
            return gated(x)

    with torch.no_grad():
        with mask_rows(5):
            by_start = gated(x)
        by_graph = torch.compile(step, backend="eager", fullgraph=True)(x, torch.tensor([0.0] * 5 + [1.0] * 2)[:, None])
    assert torch.equal(by_graph[0, :5], lin(x)[0, :5])
    torch.testing.assert_close(by_graph, by_start)
    assert (by_start[0, 5:] - lin(x)[0, 5:]).abs().max() > 1e-2  # the LoRA is really there


def test_nothing_in_the_captured_region_reads_the_device(captured):
    """What a CUDA graph records must not read a device value on the host (a read would fail the
    capture or freeze a value into it): the sync counter around each captured forward counts 0,
    for AR's row and SPACE's blocks (a dynamic tree with lookup: every bucket kind of block)."""
    model, spec, lang, graphs = captured
    counts, real = [], graphs._run

    def counted(q, slots, gated):
        with SyncCounter(model, holders=[graphs]) as syncs:
            out = real(q, slots, gated)
        counts.append((q, gated, dict(syncs.kinds), list(syncs.where)[:3]))
        return out

    graphs._run = counted
    # prompts of its own: the shared sampler's state depends on which tests ran before, and which
    # buckets a generation visits on the prompt and on the CPU's rounding (one prompt saw no
    # 12-row gated block on an AVX2 AMD CPU, after the same tests as on an Intel one)
    own = CycleLanguage(lang.tokens, seed=5)
    try:
        for n in (20, 12, 30):
            prompt = torch.tensor(own.sample(n))
            ar_generate(model, prompt, 20, suppress_ids=spec.token_ids, graphs=graphs)
            SpaceDecoder(model, spec, LAYOUTS["dynamic+lookup"], graphs=graphs).generate(prompt, 40)
    finally:
        del graphs._run
    kinds = {(q, g) for q, g, *_ in counts}
    assert (1, False) in kinds and len({q for q, g in kinds if g and q > 1}) >= 2, kinds  # AR's row, gated blocks
    assert all(not kinds for *_, kinds, _ in counts), [c for c in counts if c[2]][:3]


def test_prompt_lookup_alone_over_captured_steps_is_pld(captured):
    """No mask group and a lookup branch (``num_groups=0``): prompt lookup decoding run by the
    decoder's step, the PLD baseline of a captured run. It emits AR's tokens and verifies only
    lookup candidates (every row is a real row: no mask), as transformers' PLD does."""
    model, spec, lang, graphs = captured
    pld = DecodeConfig(3, 0, lookup_tokens=10)
    assert pld.max_rows() == 11  # x_{n-1} and 10 candidates: no draft, no mask
    kinds, real = [], graphs._run
    graphs._run = lambda q, slots, gated: kinds.append((q, gated)) or real(q, slots, gated)
    try:
        for n in (8, 40):
            prompt = torch.tensor(lang.sample(n))
            truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
            out = SpaceDecoder(model, spec, pld, graphs=graphs).generate(prompt, 60)
            assert out.new_ids == truth
            assert set("".join(out.step_sources)) <= {"l", " "} and max(out.accept_lengths) >= 2
    finally:
        del graphs._run
    # no mask row, no LoRA: every block replays a plain graph, as eager PLD runs the base alone
    assert {g for _, g in kinds} == {False} and max(q for q, _ in kinds) == 12
    assert pld.max_tokens_per_step() == 1.0  # no mask draft (lookup is not bounded by a layout)
    with pytest.raises(ValueError, match="num_groups 0 .* needs lookup_tokens > 0 and a static layout"):
        DecodeConfig(3, 0)  # no group and no lookup: nothing would be drafted
    with pytest.raises(ValueError, match="num_groups 0 .* needs lookup_tokens > 0 and a static layout"):
        DecodeConfig(3, 0, tree="dynamic", lookup_tokens=10)


def test_captured_steps_refuse_what_they_cannot_hold(trained):
    model, _, spec, lang = trained
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"needs 8\.\.2048 cache slots"):
        StepGraphs(model, slots=context + 1, sizes=[8])
    with pytest.raises(ValueError, match=r"needs 8\.\.2048 cache slots"):
        StepGraphs(model, slots=7, sizes=[8])  # a warm-up of 8 rows must fit the cache
    with pytest.raises(ValueError, match="at least 1 row"):
        StepGraphs(model, slots=64, sizes=[0, 4])
    sliding = copy.deepcopy(model)
    sliding.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding-window"):
        StepGraphs(sliding, slots=64, sizes=[8])
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="StepGraphs cannot run with attn_implementation='flash_attention_2'"):
        StepGraphs(flash, slots=64, sizes=[8])
    graphs = StepGraphs(model, slots=64, sizes=BUCKETS_32[:5])
    assert graphs.sizes == (1, 2, 4, 6, 8) and graphs.num_graphs == 0  # the CPU captures nothing
    with pytest.raises(ValueError, match=r"steps have \[12\] rows"):
        SpaceDecoder(model, spec, DecodeConfig(3, 2), graphs=graphs)  # 1 + 3 + 2 x 3 = 10 rows -> 12
    budget = DecodeConfig(3, tree="dynamic", row_budget=10)  # the budget itself is a block size
    assert SpaceDecoder(model, spec, budget).row_sizes == (1, 2, 4, 6, 8, 10)
    with pytest.raises(ValueError, match=r"steps have \[10\] rows"):
        SpaceDecoder(model, spec, budget, graphs=StepGraphs(model, slots=64, sizes=BUCKETS_32[:6]))
    dec = SpaceDecoder(model, spec, DecodeConfig(2, 2), graphs=graphs)  # 7 rows -> 8
    with pytest.raises(ValueError, match="overflow the captured cache's 64 slots"):
        dec.generate(torch.tensor(lang.sample(40)), 20)
    with pytest.raises(ValueError, match="overflow the captured cache's 64 slots"):
        ar_generate(model, torch.tensor(lang.sample(40)), 30, graphs=graphs)
    with pytest.raises(ValueError, match=r"bucket's rows \(1, 2, 4, 6, 8\), got 3"):
        graphs.step(torch.zeros(3, dtype=torch.long), None, None, 0, None)


def test_the_cache_is_sized_from_the_config_before_any_forward():
    """The cache is allocated before any forward (a graph keeps its addresses), from the config:
    the key-value heads and a head size that is not hidden / heads, as the layers' keys have them."""
    model, _ = tiny_random_llama(head_dim=8)
    graphs = StepGraphs(model, slots=32, sizes=[1, 2, 4])
    keys = graphs.cache.layers[0].keys
    cfg = model.config
    assert keys.shape == (1, cfg.num_key_value_heads, 32, 8)
    with torch.inference_mode():
        out = ar_generate(model, torch.tensor([5, 6, 7]), 10, graphs=graphs).new_ids
    assert out == ar_generate(model, torch.tensor([5, 6, 7]), 10).new_ids


def test_space_eval_capture_flag_is_recorded_and_a_resume_key(tmp_path, capsys):
    """``space-eval --capture``: SPACE and AR run over the captured steps (on the CPU, their
    buffers eagerly), SPACE stays exact, the run records the cache size and how long capture took,
    and a rerun without it refuses to mix the timings."""
    import json

    from space.eval.__main__ import main as eval_main

    args = ["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "12",
            "--mask-num", "3", "--threads", "1", "--methods", "ar,pld,space", "--out", str(tmp_path)]
    summary = eval_main([*args, "--capture", "--capture-len", "600"])
    assert summary["exact_match_rate"] == 1.0 and summary["meta"]["capture"] == 600
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    tokens = {r["model_id"]: r["choices"][0]["token_ids"] for r in records}
    assert tokens["pld"] == tokens["ar"] == tokens["space"]  # PLD too runs over the captured steps, exactly
    assert next(r for r in records if r["model_id"] == "pld")["choices"][0]["accept_lengths"]  # by the decoder
    run = json.loads((tmp_path / "run_config.json").read_text())
    assert run["capture_ready"]["graphs"] == 0  # no CUDA here
    assert run["slot_buckets"] == [300, 600]  # the fused trunk reads the mask's width: 600 halved down to 256
    assert "[space-eval] captured 0 step graphs" in capsys.readouterr().out
    assert "captured steps over a cache of 600 slots (AR, SPACE, and PLD by the SPACE decoder" in (
        tmp_path / "summary.md").read_text()
    with pytest.raises(ValueError, match="'capture': \\(600, None\\)"):
        eval_main(args)  # the same run eager: its timings would mix
    # a prompt that fits the model but not the captured cache is skipped with why, not a crash mid-run;
    # every question skipped, the run then fails, after its report (nothing was measured)
    with pytest.raises(ValueError, match=r"all 1 question\(s\) were skipped.*or the captured cache"):
        eval_main([*args[:-1], str(tmp_path / "short"), "--capture", "--capture-len", "40"])
    records = [json.loads(line) for line in (tmp_path / "short" / "samples.jsonl").read_text().splitlines()]
    assert {r["model_id"] for r in records} == {"ar", "pld", "space"}
    assert all("exceeds the captured cache's 40 slots less a step's" in r["skipped"] for r in records)
    for bad, message in [(["--capture", "--compile"], "drop --compile and --device-map"),
                         (["--capture-len", "100"], "it needs --capture"),
                         (["--capture", "--capture-len", "0"], "--capture-len must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            eval_main([*args[:-1], str(tmp_path / "other"), *bad])


def test_bucket_sizes_and_cache_bounds_at_their_edges():
    """AR's 1-row bucket is always added (AR over graphs built for SPACE's blocks only); a cache of
    exactly the largest bucket's slots is allowed; a generation or a step that fills the slots
    exactly fits and one token more is refused with ValueError, not a shape error further in."""
    model, _ = tiny_random_llama()
    assert StepGraphs(model, slots=8, sizes=[8]).sizes == (1, 8)
    graphs = StepGraphs(model, slots=16, sizes=[4])
    assert graphs.sizes == (1, 4) and graphs.max_rows == 4
    graphs.check_fits(12, 4)  # 12 + 4 = 16 slots: fits
    with pytest.raises(ValueError, match="overflow the captured cache's 16 slots"):
        graphs.check_fits(13, 4)
    with pytest.raises(ValueError, match="steps of up to 5 rows"):
        graphs.check_fits(1, 5)
    with torch.inference_mode():
        out = ar_generate(model, torch.tensor([5, 6, 7]), 12, graphs=graphs).new_ids  # 3 + 12 + its row: 16 slots
        assert out == ar_generate(model, torch.tensor([5, 6, 7]), 12).new_ids
        graphs.reset()
        graphs.cache.lengths.fill_(12)  # 12 cached tokens, as a decoder's prefill leaves them
        assert graphs.step(torch.zeros(4, dtype=torch.long), *_block(4), 12, None).shape == (4, 64)
        graphs.cache.lengths.fill_(13)
        with pytest.raises(ValueError, match="a block of 4 rows after 13 cached tokens overflows"):
            graphs.step(torch.zeros(4, dtype=torch.long), *_block(4), 13, None)


@pytest.fixture(scope="module")
def bucketed(trained_drafter):
    """The trained drafter with an attention that reads the keys up to the mask's width (as every
    fused trunk has), over captured steps in slot buckets of 25, 50, 100 and 200 slots."""
    from tests.conftest import sdpa_gqa_copy

    model, _, spec, lang = trained_drafter
    model = sdpa_gqa_copy(model)
    graphs = StepGraphs(model, slots=200, sizes=BUCKETS_32, min_slots=16)
    return model, spec, fresh_language(lang), graphs


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_step_attends_over_the_smallest_slot_bucket_that_holds_it(bucketed, sdpa_calls, name):
    """Issue 58: a captured step attends over the smallest slot bucket holding the cache and its
    block, not over every slot of the cache, and its keys are cut there (SDPA sees as many keys as
    the bucket has slots); SPACE over slot buckets and AR over them emit eager AR's tokens while
    the generations cross from bucket to bucket."""
    model, spec, lang, graphs = bucketed
    assert graphs.slot_sizes == (25, 50, 100, 200)
    steps, real_step, real_run = [], graphs._step, graphs._run

    def step(ids, position_ids, block_mask, cache_len, mask_start):
        steps.append([cache_len, ids.shape[0]])
        return real_step(ids, position_ids, block_mask, cache_len, mask_start)

    def run(q, slots, gated):
        before = len(sdpa_calls)
        out = real_run(q, slots, gated)
        steps[-1] += [slots, {keys for _, keys, _ in sdpa_calls[before:]}]
        return out

    graphs._step, graphs._run = step, run
    try:
        for n, new in [(12, 80), (30, 120), (3, 20)]:
            prompt = torch.tensor(lang.sample(n))
            truth = ar_generate(model, prompt, new, suppress_ids=spec.token_ids).new_ids
            assert ar_generate(model, prompt, new, suppress_ids=spec.token_ids, graphs=graphs).new_ids == truth
            out = SpaceDecoder(model, spec, LAYOUTS[name], graphs=graphs).generate(prompt, new)
            assert out.new_ids == truth, (name, n)
            assert max(out.accept_lengths) >= 2
    finally:
        del graphs._step, graphs._run
    for cache_len, q, slots, keys in steps:
        assert slots == min(b for b in graphs.slot_sizes if cache_len + q <= b), (cache_len, q, slots)
        assert keys == {slots}, (cache_len, q, slots, keys)
    assert {s for _, _, s, _ in steps} == set(graphs.slot_sizes)  # every bucket was crossed


def test_slot_buckets_only_where_the_attention_reads_the_mask_width(trained):
    """transformers' own ``sdpa`` reads every slot of the cache (a narrower mask fails there): its
    captured steps keep one bucket of every slot. The smallest bucket's least size is checked."""
    model, _, _, _ = trained
    assert StepGraphs(model, slots=200, sizes=[1, 4], min_slots=16).slot_sizes == (200,)
    with pytest.raises(ValueError, match="min_slots 0"):
        StepGraphs(model, slots=200, sizes=[1, 4], min_slots=0)


def test_off_the_gqa_devices_grouped_heads_fold_into_the_batch(bucketed, monkeypatch):
    """On CUDA (torch 2.11) a grouped SDPA call with a mask (or in fp32) would land on the math
    kernel, and transformers' own ``sdpa`` copies a block's keys and values to every query head
    (``repeat_kv``). There the attention folds each key head's group of query heads into the batch:
    plain multi-head SDPA, which the memory-efficient kernel takes, over the keys expanded (not
    copied); and the masks it gets are rows aligned to 8 elements, which that kernel would
    otherwise copy in every layer. Run here by taking the CPU off ``backends.GQA_WITH_MASK`` and
    giving it CUDA's ``MASK_ALIGN``: still AR's tokens, eager and captured, still the bucket's keys
    alone. Catches ``repeat_kv`` back (keys copied per head) and a step's mask built unaligned (a
    fold that pairs a query head with another key head gives this tiny model's tokens all the same:
    ``test_backends`` catches that)."""
    from space.decoding import backends

    model, spec, lang, graphs = bucketed
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    assert kv_heads < heads
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append({"batch": query.shape[0], "heads": query.shape[1], "kv_heads": key.shape[1], "keys": key.shape[2],
                      "key_strides": key.stride(), "gqa": enable_gqa,
                      "mask": None if attn_mask is None else (attn_mask.shape[-1], attn_mask.stride())})
        return sdpa(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompt = torch.tensor(lang.sample(20))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    monkeypatch.setattr(backends, "MASK_ALIGN", {"cpu": 8})
    graphs = StepGraphs(model, slots=graphs.slots, sizes=graphs.sizes, min_slots=16)  # its buffers aligned
    calls.clear()
    assert ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids == truth
    assert SpaceDecoder(model, spec, LAYOUTS["chain"]).generate(prompt, 60).new_ids == truth
    assert SpaceDecoder(model, spec, LAYOUTS["dynamic+lookup"]).generate(prompt, 60).new_ids == truth
    eager = len(calls)
    assert ar_generate(model, prompt, 60, suppress_ids=spec.token_ids, graphs=graphs).new_ids == truth
    assert SpaceDecoder(model, spec, LAYOUTS["chain"], graphs=graphs).generate(prompt, 60).new_ids == truth
    group = heads // kv_heads
    # every call plain multi-head, the groups in the batch, the keys expanded over it (stride 0)
    assert all(c["batch"] == group and c["heads"] == c["kv_heads"] == kv_heads and not c["gqa"]
               and c["key_strides"][0] == 0 for c in calls)
    masked = [c for c in calls if c["mask"] is not None]
    assert masked
    # each mask's strides multiples of 8 though its width mostly is not: no copy per layer on CUDA
    assert all(all(s % 8 == 0 for s in strides[:-1]) for _, strides in (c["mask"] for c in masked))
    assert any(w % 8 for w, _ in (c["mask"] for c in masked))
    # the bucket's keys alone when captured: as many as the mask is wide, the cache's 200 slots not always
    captured = [c for c in calls[eager:] if c["mask"] is not None]
    assert all(c["keys"] == c["mask"][0] for c in captured) and {c["keys"] for c in captured} <= set(graphs.slot_sizes)
    assert min(c["keys"] for c in captured) < graphs.slots


def test_the_smallest_slot_bucket_may_hold_exactly_min_slots():
    """The slot buckets halve the cache's slots while the half holds at least ``min_slots``: a
    half of exactly ``min_slots`` is a bucket, one slot less is not. Catches an off-by-one in
    that bound (a strict comparison dropped the smallest bucket, and its steps attended over
    twice the slots)."""
    from tests.conftest import sdpa_gqa_copy

    model, _ = tiny_random_llama()
    gqa = sdpa_gqa_copy(model)
    assert StepGraphs(gqa, slots=200, sizes=[1, 4], min_slots=25).slot_sizes == (25, 50, 100, 200)
    assert StepGraphs(gqa, slots=200, sizes=[1, 4], min_slots=26).slot_sizes == (50, 100, 200)
    assert StepGraphs(gqa, slots=200, sizes=[1, 4], min_slots=200).slot_sizes == (200,)


def test_a_block_as_large_as_the_smallest_slot_bucket_fits_it_on_an_empty_cache():
    """A one-token prompt's first SPACE block starts at slot 0: a block of q rows then fits a slot
    bucket of exactly q slots, which has its buffers (a bucket of 16 slots for a 16-row block)."""
    from tests.conftest import sdpa_gqa_copy

    model, _ = tiny_random_llama()
    graphs = StepGraphs(sdpa_gqa_copy(model), slots=64, sizes=[16], min_slots=16)
    assert graphs.slot_sizes == (16, 32, 64)
    with torch.inference_mode():
        assert graphs.step(torch.zeros(16, dtype=torch.long), *_block(16), 0, None).shape == (16, 64)


def test_captured_steps_refuse_another_models_trunk_and_a_count_that_drifted(tiny):
    """Captured steps of model B given to a decoder of model A replayed B's trunk under A's head
    without an error; and a step told another cache length than the cache holds writes its block
    at one slot and masks at the other (rows attending to the wrong slots, which a confident model
    survives with AR's tokens). Both are refused: the first at construction, the second on the CPU
    at the step (reading the device's count on a GPU would be a sync)."""
    model, _, spec = tiny
    other, _ = tiny_random_llama(seed=7)
    graphs = StepGraphs(other, slots=64, sizes=[1, 4])
    with pytest.raises(ValueError, match="another model's trunk"):
        SpaceDecoder(model, spec, DecodeConfig(3, 1), graphs=graphs)
    with pytest.raises(ValueError, match="another model's trunk"):
        ar_generate(model, torch.tensor([5, 6, 7]), 4, graphs=graphs)
    graphs.reset()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="holds 0 tokens, the step was given 3"):
        graphs.step(torch.zeros(4, dtype=torch.long), *_block(4), 3, None)
