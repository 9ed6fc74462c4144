"""Parts of a step pinned on hand-made inputs (issue 58), where the end-to-end exactness tests are
blind: a confident model emits AR's tokens even when the cache keeps a wrong row, and the
chi-square reference of the sampling tests shares ``logits_to_probs`` with the decoder."""
import pytest
import torch
from transformers import DynamicCache

from space.decoding import DecodeConfig, SpaceDecoder
from space.decoding.cache import SlabCache, StaticSlabCache, static_cache
from space.decoding.decoder import Drafts, compact_cache
from space.decoding.dynamic import LOOKUP, MASK, STORE
from space.decoding.sampling import SamplingConfig, logits_to_probs

LAYERS, HEADS, DIM = 3, 2, 4


def filled(kind: str, tokens: int):
    """A cache of ``kind`` holding ``tokens`` tokens whose keys are layer * 1000 + slot and
    values the negatives, so every kept slot names where it came from."""
    cache = {"slab": lambda: SlabCache(LAYERS, 32), "dynamic": DynamicCache,
             "static": lambda: static_cache(LAYERS, 32), "static slab": lambda: StaticSlabCache(LAYERS, 32)}[kind]()
    slot = torch.arange(tokens, dtype=torch.float32)[None, None, :, None].expand(1, HEADS, tokens, DIM)
    for layer in range(LAYERS):
        cache.update(layer * 1000 + slot, -(layer * 1000 + slot), layer)
    return cache


@pytest.mark.parametrize("kind", ["slab", "dynamic", "static", "static slab"])
@pytest.mark.parametrize("rows", [[2, 5], [1, 3, 4], [1, 2], [4], [], [2, 3]])
def test_compaction_keeps_the_accepted_path(kind, rows):
    """Block of 7 rows after 10 cached tokens: x_{n-1} (slot 10) stays, the path's rows move to
    slots 11.. in depth order, the earlier slots are untouched, and the length is 11 + len(path).
    Gathering ``start + r - 1`` instead of ``start + r``, or any other wrong kept row, fails here;
    [2, 3] (a runner-up and its child: contiguous, but one slot off) fails a chain test that is off by one."""
    start, block = 10, 7
    cache = filled(kind, start + block)
    compact_cache(cache, start, rows, start + block)
    want = list(range(start + 1)) + [start + r for r in rows]
    for layer in range(LAYERS):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        kept = int(cache.get_seq_length(layer))  # the static cache counts it on the device
        assert kept == len(want)
        assert keys[0, :, :kept, 0].tolist() == [[layer * 1000 + s for s in want]] * HEADS
        assert values[0, :, :kept, 0].tolist() == [[-(layer * 1000 + s) for s in want]] * HEADS


@pytest.mark.parametrize("kind", ["slab", "static slab"])
@pytest.mark.parametrize("rows", [[1, 2, 3], [1], []])
def test_compaction_of_a_chain_path_only_crops(monkeypatch, kind, rows):
    """A chain's accepted path already sits right after x_{n-1}: compaction crops and moves nothing
    (issue 58: a gather over every layer for nothing each step). The content is the same either way,
    so only the missing gather tells."""
    start, block = 10, 7
    cache = filled(kind, start + block)

    def no_gather(*args):
        raise AssertionError("a chain path was gathered")

    monkeypatch.setattr(cache, "gather", no_gather)
    compact_cache(cache, start, rows, start + block)
    assert [int(cache.get_seq_length(i)) for i in range(LAYERS)] == [start + 1 + len(rows)] * LAYERS


def test_static_slab_cache_layers_are_views_of_one_slab_and_one_lengths_tensor():
    """What lets a captured step touch every layer in one op: each layer's keys, values and length
    are views of the cache's slab and lengths (a write through a layer lands in the slab, a crop of
    the lengths crops every layer), and the cache is refused without a slot."""
    cache = StaticSlabCache(LAYERS, 8)
    cache.early_initialization(1, HEADS, DIM, torch.float32, torch.device("cpu"))
    assert cache.slab.shape == (LAYERS, 2, 1, HEADS, 8, DIM) and cache.lengths.tolist() == [0] * LAYERS
    for layer in range(LAYERS):
        cache.update(torch.full((1, HEADS, 3, DIM), layer + 1.0), torch.full((1, HEADS, 3, DIM), -1.0), layer)
    assert cache.lengths.tolist() == [3] * LAYERS
    assert [float(cache.slab[i, 0, 0, 0, 2, 0]) for i in range(LAYERS)] == [1.0, 2.0, 3.0]
    assert float(cache.slab[:, 1, ..., :3, :].sum()) == -LAYERS * HEADS * 3 * DIM
    cache.crop(-2)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [1] * LAYERS
    with pytest.raises(ValueError, match="negative"):
        cache.crop(1)
    with pytest.raises(ValueError, match="at least 1 slot"):
        StaticSlabCache(LAYERS, 0)


@pytest.mark.parametrize("call", [lambda c: c.reorder_cache(torch.tensor([0])),
                                  lambda c: c.batch_repeat_interleave(2), lambda c: c.batch_select_indices(torch.tensor([0])),
                                  lambda c: c.offload(0), lambda c: c.prefetch(0)],
                         ids=["reorder_cache", "batch_repeat_interleave", "batch_select_indices", "offload", "prefetch"])
def test_static_slab_cache_refuses_what_would_unlink_a_layer_from_the_slab(call):
    """transformers' beam, batch and offload methods give each layer new keys / values tensors: a
    layer would then read a copy while crops, compaction and the captured graphs write the slab.
    They are refused, and the layers still view the slab after the refusal."""
    cache = StaticSlabCache(LAYERS, 8)
    cache.early_initialization(1, HEADS, DIM, torch.float32, torch.device("cpu"))
    for layer in range(LAYERS):
        cache.update(torch.ones(1, HEADS, 2, DIM), torch.ones(1, HEADS, 2, DIM), layer)
    with pytest.raises(NotImplementedError, match="one slab"):
        call(cache)
    assert all(layer.keys._base is cache.slab and layer.values._base is cache.slab for layer in cache.layers)


def test_static_slab_layers_set_what_a_static_layer_sets_and_follow_the_lengths_device():
    """A layer of the slab cache, initialized, has every attribute transformers' own StaticLayer
    has then (what the model's forward may read), and its length is a view of the lengths as they
    stand on the slab's device (built on the CPU, moved at allocation: a layer left on the CPU
    tensor would advance a copy no one reads)."""
    own = static_cache(LAYERS, 8)
    own.early_initialization(1, HEADS, DIM, torch.float32, torch.device("cpu"))
    cache = StaticSlabCache(LAYERS, 8)
    cache.early_initialization(1, HEADS, DIM, torch.float32, torch.device("meta"))
    assert set(vars(own.layers[0])) <= set(vars(cache.layers[0])), set(vars(own.layers[0])) - set(vars(cache.layers[0]))
    assert cache.lengths.device.type == "meta"
    assert all(layer.cumulative_length._base is cache.lengths and layer.keys._base is cache.slab
               for layer in cache.layers)


def test_slab_cache_grows_and_crops():
    cache = SlabCache(LAYERS, 4)
    for _ in range(2):  # 6 tokens into 4 slots: the first write past them grows every layer
        for layer in range(LAYERS):
            cache.update(torch.full((1, HEADS, 3, DIM), layer + 1.0), torch.zeros(1, HEADS, 3, DIM), layer)
    assert cache.get_seq_length() == 6 and cache.slab.slots >= 6
    assert all(torch.equal(cache.layers[i].keys, torch.full((1, HEADS, 6, DIM), i + 1.0)) for i in range(LAYERS))
    cache.crop(-2)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [4] * LAYERS


def test_lookup_branch_hangs_from_x_and_chains(tiny):
    """A static step's lookup branch: its first token's parent is x_{n-1} (row 0), each next
    token's the one before it, after the tree's nodes; its sources say lookup."""
    model, _, spec = tiny
    tree = [[0], [1], [0, 0]]
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 2, tree=tree, lookup_tokens=4))
    drafts = Drafts(torch.tensor([[7, 8], [9, 10], [11, 12]]))
    lay, tokens, sources = dec.static_block(20, drafts, [40, 41, 42])
    assert lay.parents == (-1, 0, 0, 1, 0, 4, 5)  # x; (0), (1), (0,0); lookup 40 <- x, 41 <- 40, 42 <- 41
    assert tokens.tolist() == [7, 8, 9, 40, 41, 42]
    assert sources == (MASK, MASK, MASK, LOOKUP, LOOKUP, LOOKUP)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("top_k", [0, 5])
def test_top_p_probabilities_sum_to_one_over_the_smallest_set(top_p, top_k):
    """Each row sums to 1, and keeps exactly the most likely tokens up to the first whose
    cumulative probability reaches ``top_p`` (among the top ``top_k``), computed here by hand."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    cfg = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p)
    probs = logits_to_probs(logits, cfg)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6), rtol=0, atol=1e-6)
    for row, p in zip(logits, probs):
        full = torch.softmax(row.double() / 0.7, -1)
        order = full.argsort(descending=True).tolist()
        if top_k:
            order = order[:top_k]
            full = torch.zeros_like(full).index_fill(0, torch.tensor(order), 1) * full
            full = full / full.sum()
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += float(full[t])
            if mass >= top_p:
                break
        assert sorted(p.nonzero().flatten().tolist()) == sorted(kept)
        torch.testing.assert_close(p[kept].double(), full[kept] / full[kept].sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("logits,top_p,kept", [([0.0, 0.0, 0.0, 0.0], 0.5, 2), ([0.0, 0.0, -1e9, -1e9], 0.5, 1),
                                               ([0.0] * 4, 0.75, 3), ([0.0] * 4, 0.7, 3)])
def test_top_p_stops_at_the_token_that_reaches_it_exactly(logits, top_p, kept):
    """Uniform probabilities are exact in fp32, so the cumulative mass meets ``top_p`` exactly at a
    token: that token completes the set and the next one is dropped. Testing the mass before a
    token with ``> top_p`` instead of ``>= top_p`` keeps one token too many, which random logits
    (the test above) never show. The 0.7 case is a control: no token reaches it exactly."""
    probs = logits_to_probs(torch.tensor([logits]), SamplingConfig(temperature=1.0, top_p=top_p))[0]
    assert int((probs > 0).sum()) == kept
    torch.testing.assert_close(probs[probs > 0], torch.full((kept,), 1.0 / kept), rtol=0, atol=1e-7)


@pytest.mark.parametrize("config", [DecodeConfig(3, 2), DecodeConfig(3, 2, tree="dynamic", lookup_tokens=4)],
                         ids=["chain", "dynamic+lookup"])
def test_the_lora_acts_from_the_first_mask_row(tiny, config):
    """Each step's forward declares its first mask row (``space.masking.mask_rows``, what the
    frozen-base LoRA reads) as the row after x_{n-1} and the nodes, the first of the block's mask
    ids; a block without a group declares none, and the prefill none. Exactness tests are blind
    to a wrong row (a draft without its LoRA is only rejected more often)."""
    from space.masking import mask_rows_start

    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, config)
    seen = []
    hook = dec.decoder.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs["input_ids"][0].tolist(), mask_rows_start())),
        with_kwargs=True)
    try:
        prompt = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6])  # a repeat: lookup finds continuations
        out = dec.generate(prompt, 12)
    finally:
        hook.remove()
    masks = set(spec.token_ids)
    assert seen[0][1] is None and len(seen) == 1 + out.num_steps  # the prefill: no mask row
    for ids, start in seen[1:]:  # no draft is a mask id: the first mask id is the first mask row
        assert start == next((i for i, t in enumerate(ids) if t in masks), None), (ids, start)
        assert start is not None or config.tree == "dynamic"  # a chain step always has G_0
    assert any(start is not None for _, start in seen[1:])


def test_slab_cache_edges():
    """Catches a growth check one slot late (a write that ends one past the slab fails), a crop
    past the start that leaves a negative length, a positive crop count taken silently, and a
    zero-slot slab accepted."""
    with pytest.raises(ValueError, match="at least 1 slot"):
        SlabCache(LAYERS, 0)
    cache = SlabCache(LAYERS, 4)
    for n in (4, 1):  # exactly full, then one past: that write grows the slab
        for layer in range(LAYERS):
            cache.update(torch.ones(1, HEADS, n, DIM), torch.ones(1, HEADS, n, DIM), layer)
    assert cache.get_seq_length() == 5 and cache.slab.slots >= 5
    with pytest.raises(ValueError, match="negative count"):
        cache.layers[0].crop(2)
    cache.crop(-9)
    assert [layer.get_seq_length() for layer in cache.layers] == [0] * LAYERS
    assert [layer.keys.shape[-2] for layer in cache.layers] == [0] * LAYERS


def test_slab_cache_holds_keys_and_values_of_other_widths():
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Mistral 4) caches a latent as keys and a
    rotary key as values, of other widths (and heads): the slab holds them in two tensors, and a
    write, a growth, a crop and a tree path's compaction keep both, each slot where it came from.
    The slab refused them, so even AR stopped on such a model."""
    cache = SlabCache(LAYERS, 4)
    slot = torch.arange(8, dtype=torch.float32)[None, None, :, None]
    for part in (slot[..., :4, :], slot[..., 4:, :]):  # 8 tokens into 4 slots: the second write grows both tensors
        for layer in range(LAYERS):
            keys, values = layer * 1000 + part, -(layer * 1000 + part)
            cache.update(keys.expand(1, 1, 4, 8), values.expand(1, HEADS, 4, 3), layer)
    assert len(cache.slab.parts) == 2 and cache.slab.slots >= 8
    compact_cache(cache, 2, [3, 5], 8)  # x_{n-1} at slot 2, a block of rows 0-5: the path's rows 3 and 5 kept
    assert cache.get_seq_length() == 5
    for layer in range(LAYERS):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == (1, 1, 5, 8) and values.shape == (1, HEADS, 5, 3)
        assert keys[0, 0, :, 0].tolist() == [layer * 1000 + s for s in (0, 1, 2, 5, 7)]
        assert torch.equal(values[0, :, :, 0], -keys[0, 0, :, 0].expand(HEADS, 5))  # moved alike


def test_slab_cache_of_one_shape_is_one_tensor_and_refuses_another_batch_or_dtype():
    """Keys and values of one shape share one tensor (a gather or a grow is one op, the op budget's
    premise), keys at [:, 0] and values at [:, 1]; keys and values of another batch or dtype are
    refused at the first write with both shapes named. Catches every model given two tensors, and
    a mismatch let through (a batch or a dtype the two tensors would not share)."""
    cache = SlabCache(LAYERS, 8)
    cache.update(torch.ones(1, HEADS, 2, DIM), -torch.ones(1, HEADS, 2, DIM), 0)
    (slab,) = cache.slab.parts
    assert slab.shape == (LAYERS, 2, 1, HEADS, 8, DIM)
    assert cache.slab.keys.data_ptr() == slab[:, 0].data_ptr() and cache.slab.values.data_ptr() == slab[:, 1].data_ptr()
    for keys, values in [(torch.ones(1, HEADS, 2, DIM), torch.ones(2, HEADS, 2, DIM)),
                         (torch.ones(1, HEADS, 2, DIM), torch.ones(1, HEADS, 2, 3, dtype=torch.float64))]:
        with pytest.raises(ValueError, match="one batch and dtype"):
            SlabCache(LAYERS, 8).update(keys, values, 0)


def test_static_slab_cache_refuses_keys_and_values_of_other_widths():
    """The captured steps' cache holds keys and values in one slab: written keys and values of other
    widths (multi-head latent attention) are refused at the first write, with what to do. Catches
    the check dropped (the values would be written into key-wide slots) or narrowed to the heads."""
    with pytest.raises(ValueError, match="one shape.*without --capture"):
        StaticSlabCache(LAYERS, 8).update(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 3), 0)


def test_captured_steps_refuse_a_cache_their_config_does_not_describe():
    """Captured steps allocate the cache from the config's heads and head_dim; a latent-attention
    model caches other shapes, and its first replay failed inside index_copy_; a model whose layers
    cache two head dims passed the check of its first layer. Both are refused at setup with what to do."""
    import transformers

    from space.decoding.graphs import StepGraphs

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"caches \[\(\(1, 1, 1, 16\), \(1, 1, 1, 8\)\)\] .*without --capture"):
        StepGraphs(model, slots=32, sizes=[4])
    # a second layer caching other shapes (Gemma 4's full layers have their own head dim, but its
    # sliding layers are refused first): the first layer's shapes are the config's, and only it was checked
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    model.model.layers[1].self_attn = transformers.models.llama.modeling_llama.LlamaAttention(
        transformers.LlamaConfig(**{**config.to_dict(), "num_key_value_heads": 1}), layer_idx=1)
    with pytest.raises(ValueError, match=r"caches \[\(\(1, 1, 1, 16\), .*\(1, 2, 1, 16\), .*without --capture"):
        StepGraphs(model, slots=32, sizes=[4])


def test_one_slab_only_where_every_layer_caches_one_shape_on_one_device():
    """Catches ``one_slab`` answering without looking at the layers: a Llama's layers cache one shape
    (a slab holds them), GPT-2's blocks are no ``.layers`` (AR's slab), a Gemma 4 whose full layers
    have their own head dim does not, nor a model with a layer on another device."""
    import transformers

    from space.decoding.cache import SlabCache, eager_cache, full_cache, one_slab

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)).eval()
    assert one_slab(llama.model) and isinstance(eager_cache(llama.model, 8), SlabCache)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    assert one_slab(gpt2.get_decoder())
    gemma4 = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=16, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, hidden_size_per_layer_input=0)).eval()
    assert not one_slab(gemma4.model) and type(eager_cache(gemma4.model, 8)) is type(full_cache())
    llama.model.layers[1].to("meta")  # a layer placed elsewhere (a device map)
    assert not one_slab(llama.model)


def test_captured_steps_take_the_cache_shape_from_the_trunk():
    """A Gemma 4 config answers ``head_dim`` per layer only (transformers raises where captured steps
    read it); its all-full layers cache their own head dim (16, the config's global one) and its last
    layer reads another's cache. Captured steps allocated from what the trunk caches: SPACE over
    them equals AR at every accept length up to k, and AR over them too."""
    import transformers

    from space.decoding import ar_generate
    from space.decoding.graphs import StepGraphs
    from space.models import tiny_tokenizer
    from space.tokens import add_mask_tokens
    from tests.decoding.test_lossless import oracle
    from tests.oracle import oracle_generate

    config = transformers.Gemma4TextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=16, layer_types=["full_attention"] * 3,
        num_kv_shared_layers=1, hidden_size_per_layer_input=0, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    spec = add_mask_tokens(model, tiny_tokenizer(), mask_num=4)
    prompt = torch.randint(11, 250, (20,), generator=torch.Generator().manual_seed(3))
    truth = ar_generate(model, prompt, 30, suppress_ids=spec.token_ids).new_ids
    layout = DecodeConfig(4)
    graphs = StepGraphs(model, slots=128, sizes=SpaceDecoder(model, spec, layout, buckets=True).row_sizes)
    for corrupt_at in (2, 4):
        out = oracle_generate(SpaceDecoder(model, spec, layout, graphs=graphs), prompt, 30,
                              override=oracle(truth, corrupt_at, 4))
        assert out.new_ids == truth and max(out.accept_lengths) == corrupt_at
    assert ar_generate(model, prompt, 30, suppress_ids=spec.token_ids, graphs=graphs).new_ids == truth


def test_slab_cache_forward_equals_the_dynamic_cache(tiny):
    """A model run on a SlabCache (prefill, then a 3-token block) gives the logits of a
    DynamicCache. Catches wrong mask sizes or views reported to the attention."""
    from space.decoding.cache import cache_input

    model = tiny[0]
    ids = torch.arange(20, 32)[None]
    logits = []
    for cache in (SlabCache(model.config.num_hidden_layers, 8), DynamicCache()):
        with torch.inference_mode():
            model(input_ids=ids[:, :9], **cache_input(cache), use_cache=True)
            logits.append(model(input_ids=ids[:, 9:], **cache_input(cache), use_cache=True).logits)
    torch.testing.assert_close(logits[0], logits[1])


def test_provenance_of_a_path_offered_by_the_masks_and_the_lookup_branch():
    """A static tree with a lookup branch can offer one token path twice, as a mask node and as a
    lookup node: its accepted tokens come from both (``b``), whichever branch was accepted. A bug
    that kept only the last branch's source wrote ``l`` (or ``m``) for them. Also pins which
    deepest candidate is the masks' and which the lookup's."""
    from space.decoding.decoder import provenance

    parents = (-1, 0, 1, 0, 3)  # rows 1-2: the mask chain, rows 3-4: the lookup branch
    sources = (MASK, MASK, LOOKUP, LOOKUP)
    assert provenance(parents, sources, [5, 6, 5, 6], [1, 2]) == ("bb", 2, 2)
    assert provenance(parents, sources, [5, 6, 5, 6], [3, 4]) == ("bb", 2, 2)
    assert provenance(parents, sources, [5, 6, 5, 7], [3, 4]) == ("bl", 2, 2)  # the branches part at depth 2
    assert provenance(parents, sources, [5, 6, 5, 7], [1, 2]) == ("bm", 2, 2)
    assert provenance((-1, 0, 1, 0), (MASK, MASK, LOOKUP), [5, 6, 8], [3]) == ("l", 2, 1)
    assert provenance((-1, 0), (MASK | LOOKUP,), [5], []) == ("", 1, 1)
    # a datastore's token: its own letter alone, "b" with a mask draft, the text's "l" with the text's
    assert provenance((-1, 0), (STORE,), [5], [1]) == ("d", 0, 1)
    assert provenance((-1, 0), (MASK | STORE,), [5], [1]) == ("b", 1, 1)
    assert provenance((-1, 0, 0), (LOOKUP, STORE), [5, 5], [2]) == ("l", 0, 1)
    assert provenance((-1, 0), (0,), [5], [1]) == (" ", 0, 0)  # a custom planner's node of no source


def test_step_times_count_the_prefill_once_and_host_time_leaves_the_model_out(tiny, monkeypatch):
    """On a fake clock (no real timing): each trunk forward takes 1 s, the prefill 100 s. The
    first step's time holds the prefill and no later one does (a prefill time never reset after
    the first step was added to every step), and a step's host time leaves its forward out (a
    host time equal to the step's time counted the model as host work)."""
    import types

    import space.decoding.decoder as decoder_mod
    import space.decoding.result as result_mod

    model, _, spec = tiny
    now = [0.0]

    def tick():  # every reading of the clock moves it 1 ms on
        now[0] += 1e-3
        return now[0]

    clock = types.SimpleNamespace(perf_counter=tick)
    monkeypatch.setattr(decoder_mod, "time", clock)
    monkeypatch.setattr(result_mod, "time", clock)  # model_time's forward hooks

    def forward_takes_time(module, args, kwargs, out):  # runs inside model_time's hooks (registered first)
        now[0] += 100.0 if kwargs.get("position_ids") is None else 1.0

    hook = model.get_decoder().register_forward_hook(forward_takes_time, with_kwargs=True)
    try:
        out = SpaceDecoder(model, spec, DecodeConfig(3)).generate(torch.arange(11, 30), 12)
    finally:
        hook.remove()
    assert out.num_steps >= 3
    assert 101 <= out.step_times[0] < 101.5  # the prefill and the first step's forward
    assert all(1 <= t < 1.5 for t in out.step_times[1:]), out.step_times
    assert len(out.step_host) == out.num_steps and all(0 <= h < 0.5 for h in out.step_host), out.step_host
    assert all(0 <= p <= h for p, h in zip(out.step_plan, out.step_host))


def test_model_time_counts_a_call_inside_another_once(monkeypatch):
    """model_time over a trunk and its own embedding (as a sampler head's decoder passes both): the
    embedding's 2 s inside the trunk's 5 s count once, and its 3 s called alone count too, so the
    model's time is 8 s (counting the nested call twice made it 10 and host time 2 s short)."""
    import types

    import space.decoding.result as result_mod
    from space.decoding.result import model_time

    now = [0.0]
    monkeypatch.setattr(result_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Embed(torch.nn.Module):
        def forward(self, x, seconds):
            now[0] += seconds
            return x

    class Trunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embed()

        def forward(self, x):
            now[0] += 1.5
            x = self.embed(x, 2.0)
            now[0] += 1.5
            return x

    trunk = Trunk()
    with model_time(trunk, trunk.embed) as spent:
        trunk(torch.zeros(1))
        now[0] += 4.0  # host work between the calls
        trunk.embed(torch.zeros(1), 3.0)
    assert spent[0] == 8.0
    assert not trunk._forward_hooks and not trunk.embed._forward_pre_hooks  # removed on exit


def test_top_k_above_the_vocabulary_keeps_every_token():
    """Catches ``logits_to_probs`` passing ``top_k`` to ``torch.topk`` unclamped: a top_k larger
    than the vocabulary (a config written for a large model, run on a small one) raised instead
    of keeping every token, which is what top_k = 0 gives."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.8, top_k=50))
    torch.testing.assert_close(probs, logits_to_probs(logits, SamplingConfig(temperature=0.8)))
