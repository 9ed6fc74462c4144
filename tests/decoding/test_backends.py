"""The attention backend chosen at load (issue 58, item 3, ``space.decoding.backends``)."""
import pytest
import torch

from space.decoding.backends import choose_sdpa


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_turns_cudnn_attention_off(cudnn_flag, dtype):
    assert choose_sdpa("cuda", dtype) == {"cudnn_sdp": False}
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_fp32_and_other_devices_change_nothing(cudnn_flag):
    assert choose_sdpa("cuda", torch.float32) == {"cudnn_sdp": True}
    assert choose_sdpa("cpu", torch.bfloat16) == {} and torch.backends.cuda.cudnn_sdp_enabled()


def test_load_records_the_choice(cudnn_flag):
    from space.loader import load_space

    model, _, _ = load_space("tiny-random-llama")
    assert model.space_sdpa == {} and torch.backends.cuda.cudnn_sdp_enabled()  # a CPU model leaves CUDA's flags


def test_load_chooses_by_the_trunk_s_dtype_under_an_adapter(tmp_path, monkeypatch):
    """A bf16 model with an adapter: its first parameter is the fp32 mask rows, so ``model.dtype``
    reads float32. Catches choosing the backend by it (cuDNN attention stayed on for every bf16
    space-eval run with an adapter on a GPU, and the run recorded that as the choice)."""
    import space.loader
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import TINY, tiny_random_llama

    model, tok = tiny_random_llama()
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=2)
    adapter = save_artifact(tmp_path / "a", peft_model, tok, spec, "frozen-base", {"base_model": TINY})
    seen = []
    monkeypatch.setattr(space.loader, "choose_sdpa", lambda device, dtype: seen.append(dtype) or {})
    loaded, _, _ = space.loader.load_space(adapter=adapter, dtype="bfloat16")
    assert loaded.dtype == torch.float32  # what misled it
    assert seen == [torch.bfloat16]


def test_a_position_bias_or_softcap_goes_to_transformers_sdpa_with_the_keys_cut():
    """SDPA_GQA's own CPU call has no place for a position bias or a softcap: with one it hands the
    call to transformers' ``sdpa`` (which adds the bias, or refuses the softcap), the keys and the
    bias cut at the mask's width, so a static cache's empty slots are still not read."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding.backends import sdpa_gqa_attention

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query, key, value = (torch.randn(1, h, q, 8, generator=gen) for h, q in ((4, 3), (2, 10), (2, 10)))
    mask = torch.zeros(1, 1, 3, 6)
    mask[..., 5] = torch.finfo(torch.float32).min
    bias = torch.randn(1, 4, 3, 10, generator=gen)
    out, _ = sdpa_gqa_attention(module, query, key, value, mask, position_bias=bias)
    want, _ = sdpa_attention_forward(module, query, key[:, :, :6], value[:, :, :6], mask, position_bias=bias[..., :6])
    assert torch.equal(out, want)
    plain, _ = sdpa_gqa_attention(module, query, key, value, mask)
    assert (out - plain).abs().max() > 1e-3  # the bias is really applied
    with pytest.raises(ValueError, match="softcap"):
        sdpa_gqa_attention(module, query, key, value, mask, softcap=30.0)


def test_a_left_padded_batch_over_sdpa_gqa_answers_each_prompt_as_alone():
    """A model whose attention is SDPA_GQA (the CPU's fast kernels, the fused trunk) takes HF's
    2-D padding mask in a batched ``generate`` (``space.distill.greedy_batches``, magpie's
    sampling): transformers makes the 4-D mask through the mask function registered with the
    attention. Catches registering the attention alone: transformers then passed no mask at all,
    the short prompt's row attended over its left padding, and its answer was another's."""
    from space.models import plain_generate, tiny_random_llama
    from tests.conftest import sdpa_gqa_copy

    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    gqa = sdpa_gqa_copy(model)
    short = [5, 6, 7]
    long = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": [short, long]}, return_tensors="pt")
    assert enc["attention_mask"][0, :17].sum() == 0  # the short row is mostly padding
    settings = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.inference_mode():
        batch = plain_generate(gqa, enc, **settings)[:, enc["input_ids"].shape[1]:]
        for row, prompt in zip(batch.tolist(), (short, long)):
            ids = torch.tensor([prompt])
            alone = plain_generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, **settings)
            assert row == alone[0, len(prompt):].tolist()


def test_on_the_cpu_a_masked_grouped_call_gives_sdpa_the_grouped_keys(monkeypatch):
    """On a device of ``GQA_WITH_MASK`` (the CPU) SDPA_GQA hands SDPA the key/value heads as they
    are (``enable_gqa``), cut at the mask's width: one call, no copy of the keys per query head
    (what transformers' ``sdpa`` makes for a masked block, ``repeat_kv``), and the same values as
    transformers' ``sdpa`` on the keys kept. Catches the CPU dropped from ``GQA_WITH_MASK``: every
    masked block's keys were then copied to each of the query heads."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding.backends import sdpa_gqa_attention

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query, key, value = (torch.randn(1, h, q, 8, generator=gen) for h, q in ((4, 3), (2, 10), (2, 10)))
    mask = torch.zeros(1, 1, 3, 6)
    mask[..., 5] = torch.finfo(torch.float32).min
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((key.shape[1], key.shape[2], enable_gqa))
        return sdpa(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    want, _ = sdpa_attention_forward(module, query, key[:, :, :6], value[:, :, :6], mask)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out, _ = sdpa_gqa_attention(module, query, key, value, mask)
    assert calls == [(2, 6, True)]  # the 2 key/value heads, 6 keys: the mask's width
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_a_half_model_on_another_accelerator_leaves_cudnn_alone(cudnn_flag, device):
    """cuDNN attention is CUDA's alone: a bf16 model on any other device records nothing and
    leaves the process-wide CUDA switch as it was. Catches the CUDA test written as "not the CPU"
    (an MPS or XPU model turned a CUDA setting off and recorded a cudnn_sdp it never used)."""
    assert choose_sdpa(device, torch.bfloat16) == {}
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("rows,masked", [(5, True), (1, True), (1, False), (5, False)])
def test_off_the_gqa_devices_a_grouped_call_folds_its_heads_into_the_batch(monkeypatch, rows, masked):
    """Off :data:`GQA_WITH_MASK` (CUDA) SDPA_GQA folds each key head's group of query heads into
    the batch: SDPA sees as many query as key heads, which CUDA's memory-efficient kernel takes
    (it has no GQA), the keys expanded over the batch, not copied, and no ``enable_gqa``. Its
    output is transformers' ``sdpa``'s on the same inputs: a block with its mask, one row, and a
    prefill without a mask (causal). Catches a fold that pairs a query head with another key head,
    or puts the heads back in another order (the end-to-end tests' tiny models emit the same
    tokens either way), and the keys copied per head."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding import backends

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    keys = 9
    query, key, value = (torch.randn(1, h, q, 8, generator=gen) for h, q in ((6, rows), (2, keys), (2, keys)))
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # as a model makes it: (batch, q, heads, dim) viewed
    mask = None
    if masked:
        mask = torch.zeros(1, 1, rows, 7)
        mask[..., 2] = mask[..., 0, -1] = torch.finfo(torch.float32).min
    # a mask's width; a causal prefill's rows see no key past their own, so the keys are cut there (as transformers')
    cut = 7 if masked else rows if rows > 1 else keys
    want, _ = sdpa_attention_forward(module, query, key[:, :, :cut if masked else keys],
                                     value[:, :, :cut if masked else keys], mask)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((query.shape[:2], key.shape[:3], key.stride(0), enable_gqa))
        return sdpa(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    out, _ = backends.sdpa_gqa_attention(module, query, key, value, mask)
    assert calls == [((3, 2), (3, 2, cut), 0, False)]  # 3 query heads a key head in the batch, 2 heads each
    assert out.shape == (1, rows, 6, 8) and out.is_contiguous()
    torch.testing.assert_close(out, want)
    assert (want[0, :, 0] - want[0, :, 1]).abs().max() > 1e-2  # two heads of a group differ: a swap shows


@pytest.mark.parametrize("slots", [None, 29])
def test_a_step_mask_is_written_into_rows_aligned_for_the_device(monkeypatch, slots):
    """CUDA's memory-efficient SDPA copies a mask in every layer unless its strides are multiples of
    8 (PyTorch's ``preprocess_mask``), and a step's mask is as wide as the cache plus the block, so
    ``with_cache`` writes it, and each sliding window's, into rows padded to ``MASK_ALIGN``: the
    same values as a mask built whole (the cache seen, the block's own mask, the slots past it
    and the keys out of a window hidden), every stride a multiple of 8. Run here with CUDA's
    alignment given to the CPU. Catches a mask concatenated (or a window's filled) into a tensor
    of its own width."""
    from space.decoding import backends
    from space.decoding.decoder import with_cache
    from space.masking import in_window

    monkeypatch.setattr(backends, "MASK_ALIGN", {"cpu": 8})
    low = torch.finfo(torch.float32).min
    block = torch.zeros(1, 1, 3, 3)
    block[..., 0, 1:] = block[..., 1, 2] = low  # causal rows
    pos, cached = torch.arange(3), 10
    width = cached + 3 if slots is None else slots
    whole = torch.cat([torch.zeros(1, 1, 3, cached), block, torch.full((1, 1, 3, width - cached - 3), low)], -1)
    keys = torch.cat([torch.arange(cached), pos + cached, torch.arange(cached + 3, width)])
    sliding = whole.masked_fill(~in_window(pos + cached, keys, 4), low)
    masks = with_cache(block, pos, cached, {"full_attention": None, "sliding_attention": 4}, slots)
    assert set(masks) == {"full_attention", "sliding_attention"}
    for got, want in ((masks["full_attention"], whole), (masks["sliding_attention"], sliding)):
        assert torch.equal(got, want) and all(s % 8 == 0 for s in got.stride()[:-1]) and got.stride(-1) == 1
    assert width % 8  # the widths themselves are not multiples of 8
    alone = with_cache(block, pos, cached, {"full_attention": None}, slots)
    assert torch.equal(alone, whole) and alone.stride(2) % 8 == 0


@pytest.mark.parametrize("case", ["batch of 2", "mask per head", "position bias", "value width"])
def test_off_the_gqa_devices_what_the_fold_cannot_take_goes_to_transformers(monkeypatch, case):
    """Off :data:`GQA_WITH_MASK` the fold takes one prompt with a mask shared by its heads; a batch
    of prompts, a mask per head and a position bias go to transformers' ``sdpa`` (its output,
    bit for bit), and values of another width than the keys fold with their own width. Catches the
    fold taken for a batch (its rows would read the first prompt's keys: stride 0) or for a
    per-head mask, a bias dropped, and the output shaped by the keys' width."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding import backends

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    batch = 2 if case == "batch of 2" else 1
    value_dim = 6 if case == "value width" else 8
    query, key = (torch.randn(batch, h, q, 8, generator=gen) for h, q in ((4, 3), (2, 6)))
    value = torch.randn(batch, 2, 6, value_dim, generator=gen)
    mask = torch.zeros(1, 4 if case == "mask per head" else 1, 3, 6)  # broadcast over a batch
    mask[..., 0, 4:] = torch.finfo(torch.float32).min
    if case == "mask per head":
        mask[:, 1, 1, :2] = torch.finfo(torch.float32).min
    extra = {"position_bias": torch.randn(1, 4, 3, 6, generator=gen)} if case == "position bias" else {}
    want, _ = sdpa_attention_forward(module, query, key, value, mask, **extra)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    out, _ = backends.sdpa_gqa_attention(module, query, key, value, mask, **extra)
    assert out.shape == (batch, 3, 4, value_dim)
    if case == "value width":
        torch.testing.assert_close(out, want)
    else:
        assert torch.equal(out, want)


def test_a_step_mask_refuses_a_static_cache_too_small_for_its_block():
    """A block that would run past a static cache's slots is refused with the sizes named, not
    masked wrongly: with one row, its own slot would have been left out of the mask (a copy into
    an empty slice), and with more a broadcast error named no cause."""
    from space.decoding.backends import mask_buffer
    from space.decoding.decoder import with_cache

    for rows in (1, 3):
        with pytest.raises(ValueError, match="10 slots cannot hold 10 cached tokens and a block of"):
            with_cache(torch.zeros(1, 1, rows, rows), torch.arange(rows), 10, {"full_attention": None}, slots=10)
    assert with_cache(torch.zeros(1, 1, 1, 1), torch.arange(1), 9, {"full_attention": None}, slots=10).shape[-1] == 10
    with pytest.raises(ValueError, match="-1"):
        mask_buffer(2, -1, torch.float32, "cpu")


def _grouped_call(heads=4, kv_heads=2, rows=3, keys=6, value_dim=8, batch=1, gen_seed=0):
    """(module, query, key, value) of a grouped-query call, as a model hands them to SDPA_GQA."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(gen_seed)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(batch, heads, rows, 8, generator=gen)
    key = torch.randn(batch, kv_heads, keys, 8, generator=gen)
    value = torch.randn(batch, kv_heads, keys, value_dim, generator=gen)
    return module, query, key, value


def _sdpa_spy(monkeypatch) -> list:
    """Record (query shape, key shape, value shape, enable_gqa, scale) of every SDPA call."""
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, enable_gqa=False, scale=None, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape), tuple(value.shape), enable_gqa, scale))
        return sdpa(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scale, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("case", ["batch of 2", "mask per head"])
def test_off_the_gqa_devices_what_the_fold_cannot_take_reaches_sdpa_with_the_heads_repeated(monkeypatch, case):
    """Off :data:`GQA_WITH_MASK` (CUDA) a call the fold cannot take goes to transformers' ``sdpa``,
    which repeats the key heads (``repeat_kv``) and hands SDPA no ``enable_gqa``: on CUDA a masked
    grouped SDPA call lands on the math kernel. Catches such a call sent to SDPA with the grouped
    heads and ``enable_gqa`` (the same values on the CPU, so the output comparison cannot tell)."""
    from space.decoding import backends

    module, query, key, value = _grouped_call(batch=2 if case == "batch of 2" else 1)
    mask = torch.zeros(1, 4 if case == "mask per head" else 1, 3, 6)
    mask[..., 0, 4:] = torch.finfo(torch.float32).min
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    calls = _sdpa_spy(monkeypatch)
    backends.sdpa_gqa_attention(module, query, key, value, mask)
    assert len(calls) == 1 and calls[0][1][1] == 4 and calls[0][3] is False, calls


@pytest.mark.parametrize("gqa_devices", [("cpu",), ()], ids=["cpu", "folded"])
def test_an_explicit_is_causal_overrides_the_modules(monkeypatch, gqa_devices):
    """transformers passes ``is_causal`` to the attention function where a call's causality is not
    the module's (an encoder pass, a bidirectional prefill): SDPA_GQA takes it over the module's
    attribute, as transformers' ``sdpa`` does, on the CPU's grouped call and on the fold. Catches
    the argument ignored (a non-causal prefill without a mask run causally)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding import backends

    module, query, key, value = _grouped_call(rows=6, keys=6)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", gqa_devices)
    for is_causal in (False, True):
        want, _ = sdpa_attention_forward(module, query, key, value, None, is_causal=is_causal)
        out, _ = backends.sdpa_gqa_attention(module, query, key, value, None, is_causal=is_causal)
        torch.testing.assert_close(out, want)
    causal, _ = backends.sdpa_gqa_attention(module, query, key, value, None, is_causal=True)
    plain, _ = backends.sdpa_gqa_attention(module, query, key, value, None, is_causal=False)
    assert (plain - causal).abs().max() > 1e-3  # the two differ: an ignored flag shows


def test_a_folded_causal_prefill_cuts_the_values_with_the_keys(monkeypatch):
    """A causal prefill without a mask over more keys than rows: the fold cuts the keys to the rows
    (as transformers' ``sdpa``), and the values with them, so SDPA gets keys and values of one
    length. Catches the values left whole (the CPU's SDPA reads only the keys' length of them, so
    the output cannot show it; CUDA's kernels refuse or read past)."""
    from space.decoding import backends

    module, query, key, value = _grouped_call(rows=4, keys=9)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    calls = _sdpa_spy(monkeypatch)
    backends.sdpa_gqa_attention(module, query, key, value, None)
    assert [(k[2], v[2]) for _, k, v, _, _ in calls] == [(4, 4)]


def test_the_fold_keeps_the_models_attention_scale(monkeypatch):
    """The fold hands SDPA the module's ``scaling`` (Gemma's ``query_pre_attn_scalar``, Granite's
    ``attention_multiplier``: not 1/sqrt(head_dim)), as transformers' ``sdpa`` does. Catches the
    scale dropped on the folded call (the tests' Llama-like models use the default scale, where it
    cannot show)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding import backends

    module, query, key, value = _grouped_call()
    mask = torch.zeros(1, 1, 3, 6)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.05)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    out, _ = backends.sdpa_gqa_attention(module, query, key, value, mask, scaling=0.05)
    torch.testing.assert_close(out, want)
    default, _ = backends.sdpa_gqa_attention(module, query, key, value, mask)
    assert (out - default).abs().max() > 1e-3


def test_a_folded_multi_query_call_returns_a_contiguous_output(monkeypatch):
    """One key/value head (multi-query attention): the folded output is still contiguous (the
    documented layout, what transformers' ``sdpa`` returns) and equals transformers'. Catches the
    final copy dropped: with one key head the fold's reshape is a strided view."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding import backends

    module, query, key, value = _grouped_call(heads=4, kv_heads=1)
    mask = torch.zeros(1, 1, 3, 6)
    mask[..., 1, 5] = torch.finfo(torch.float32).min
    want, _ = sdpa_attention_forward(module, query, key, value, mask)
    monkeypatch.setattr(backends, "GQA_WITH_MASK", ())
    out, _ = backends.sdpa_gqa_attention(module, query, key, value, mask)
    assert out.shape == (1, 3, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, want)


def test_mask_buffer_sizes_its_edges():
    """``mask_buffer`` takes 0 rows or 0 keys (an empty mask) and refuses a negative count of rows,
    as it does keys, with the sizes named. Catches the rows left unchecked (torch's own error named
    no cause) and an empty mask refused."""
    from space.decoding.backends import mask_buffer

    assert mask_buffer(0, 0, torch.float32, "cpu").shape == (1, 1, 0, 0)
    assert mask_buffer(2, 0, torch.float32, "cpu").shape == (1, 1, 2, 0)
    with pytest.raises(ValueError, match=r"-1 x 4"):
        mask_buffer(-1, 4, torch.float32, "cpu")


def test_cuda_attention_gives_the_cpu_cudas_path_and_restores_it(monkeypatch):
    """``op_count.cuda_attention`` (what ``test_op_budget`` and ``bench_ops --attention cuda`` count
    under): inside it a grouped masked call on the CPU folds its query heads into the batch (no
    ``enable_gqa``) and ``mask_buffer`` pads rows to CUDA's alignment of 8; on exit, also after an
    error, the CPU's own path is back. Catches the CPU left on ``GQA_WITH_MASK`` or without CUDA's
    alignment (the CUDA op counts were then the CPU's), CUDA's alignment changed, and a leak into
    every later test."""
    from space.decoding import backends
    from space.decoding.backends import mask_buffer
    from space.decoding.op_count import cuda_attention

    before = backends.GQA_WITH_MASK, dict(backends.MASK_ALIGN)
    assert before[1].get("cuda") == 8  # CUDA's memory-efficient kernel copies masks not aligned to 8
    module, query, key, value = _grouped_call()
    mask = torch.zeros(1, 1, 3, 6)
    want, _ = backends.sdpa_gqa_attention(module, query, key, value, mask)
    calls = _sdpa_spy(monkeypatch)
    with cuda_attention():
        assert mask_buffer(3, 13, torch.float32, "cpu").stride(2) == 16
        out, _ = backends.sdpa_gqa_attention(module, query, key, value, mask)
    # 2 query heads a key head in the batch, 2 key heads, no enable_gqa
    assert [(q[:2], gqa) for q, _, _, gqa, _ in calls] == [((2, 2), False)]
    torch.testing.assert_close(out, want)
    with pytest.raises(KeyError), cuda_attention():
        raise KeyError("an error inside")
    assert (backends.GQA_WITH_MASK, backends.MASK_ALIGN) == before
    assert mask_buffer(3, 13, torch.float32, "cpu").stride(2) == 13
