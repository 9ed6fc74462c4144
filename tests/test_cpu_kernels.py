"""CPU kernels (space/cpu_kernels.py): same numbers as the stock kernels, and SPACE stays exact on them."""
import copy

import pytest
import torch
from torch import nn

from space.adapter_layers import fuse_frozen_base, prepare_model
from space.cpu_kernels import (MIN_ROWS_CHOICES, PACKED_KERNELS, PackedLinear, apply_kernels, has_kernel,
                               optimize_for_cpu, packed_kernel, packing_available)
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.backends import SDPA_GQA, register_attention
from space.masking import mask_rows, to_additive_4d
from space.rms_norm import NativeRMSNorm, swap_rms_norms
from space.models import load_model
from space.tokens import add_mask_tokens

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without a packed linear kernel")
KERNELS = [k for k in PACKED_KERNELS if has_kernel(k)]  # MKL and oneDNN on x86 builds


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [96, 1536])
@pytest.mark.parametrize("min_rows", MIN_ROWS_CHOICES)
def test_packed_linear_matches_f_linear_and_ignores_row_count(bias, kernel, width, min_rows):
    """Each kernel's rows do not depend on how many rows share the call: 1-6 rows, 14, and 300 (a
    prefill, past MKL's pack of 128 rows), whatever the fewest rows a call is padded to. Some counts
    take another path in both kernels on some shapes and CPUs, whose rounding differs: PackedLinear
    pads them (``ROW_MULTIPLE``)."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(width, 80, bias=bias)
    extra = torch.randn(16, width, generator=gen)
    plain = PackedLinear(lin, kernel=kernel, min_rows=min_rows)
    with_extra = PackedLinear(lin, extra=extra, kernel=kernel, min_rows=min_rows)
    x = torch.randn(2, 7, width, generator=gen)
    with torch.no_grad():
        y = plain(x)
        y2, xa = with_extra.forward_extra(x)
        assert y.shape == (2, 7, 80) and xa.shape == (2, 7, 16)
        assert torch.allclose(y, lin(x), atol=1e-4) and torch.allclose(xa, x @ extra.T, atol=1e-4)
        assert torch.equal(y2, y) and torch.equal(with_extra(x), y)  # the extra rows change no W column
        one_row = torch.cat([plain(x[i, j][None]) for i in range(2) for j in range(7)])
        assert torch.equal(one_row, y.reshape(-1, 80))  # a row's result does not depend on its call's size
        for n in (2, 3, 4, 5, 6):  # nor in calls of other sizes (MKL on an AVX2 AMD CPU: rows past a multiple of 4)
            assert torch.equal(plain(x.reshape(-1, width)[:n]), y.reshape(-1, 80)[:n]), n
        prefill = torch.randn(1, 300, width, generator=gen)
        prefill[0, :14] = x.reshape(-1, width)
        assert torch.equal(plain(prefill)[0, :14], one_row)
    with pytest.raises(ValueError, match="fp32"):
        PackedLinear(nn.Linear(4, 4).to(torch.bfloat16))


@pytest.mark.skipif(not has_kernel("mkl"), reason="no MKL kernel in this build")
def test_mkl_calls_are_padded_to_a_multiple_of_4_rows(monkeypatch):
    """What MKL's kernel is handed: at least 2 rows and a multiple of 4 (``ROW_MULTIPLE``), the
    padding zeros dropped from the result. On an Intel CPU the unpadded counts round alike, so
    the row-count test above cannot see a lost padding there; this one can."""
    from space.cpu_kernels import ROW_MULTIPLE

    real, seen = torch.ops.mkl._mkl_linear, []

    def spy(rows, *args):
        seen.append(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", spy)
    lin = nn.Linear(32, 24)
    packed = PackedLinear(lin, kernel="mkl")
    x = torch.randn(13, 32)
    with torch.no_grad():
        for n in range(1, 14):
            assert torch.allclose(packed(x[:n]), lin(x[:n]), atol=1e-5)
    assert ROW_MULTIPLE["mkl"] == 4 and seen == [max(2, -(-n // 4) * 4) for n in range(1, 14)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_packed_call_is_padded_to_min_rows(monkeypatch, kernel):
    """What the kernel is handed with ``min_rows`` 4: calls of 1-3 rows padded to 4 (AR's step on
    the Zen 4 EPYC: 44.9 ms padded to 2 rows, 36.2 padded to 4), larger ones as before, the
    padding dropped from the result; fewer than 2 refused (one row takes another path). Catches
    ``min_rows`` not reaching the call."""
    from space.cpu_kernels import ROW_MULTIPLE

    op = (torch.ops.mkl, "_mkl_linear") if kernel == "mkl" else (torch.ops.mkldnn, "_linear_pointwise")
    real, seen = getattr(*op), []

    def spy(rows, *args):
        seen.append(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(*op, spy)
    lin = nn.Linear(32, 24)
    packed = PackedLinear(lin, kernel=kernel, min_rows=4)
    x = torch.randn(9, 32)
    with torch.no_grad():
        for n in range(1, 10):
            assert torch.allclose(packed(x[:n]), lin(x[:n]), atol=1e-5)
    mult = ROW_MULTIPLE[kernel]
    assert seen == [max(4, -(-n // mult) * mult) for n in range(1, 10)]
    with pytest.raises(ValueError, match="min_rows must be >= 2"):
        PackedLinear(lin, kernel=kernel, min_rows=1)


def test_choose_min_rows_weighs_each_shape_by_its_count_and_packs_with_it(monkeypatch):
    """The fewest rows a packed call is padded to is the choice with the least total time over the
    model's linears, each shape counted as often as the model has it; ``pack_linears`` gives it to
    every packed linear and times stock against calls padded to it. Times are stubbed."""
    import space.cpu_kernels as kernels

    us = {(128, 2): 10.0, (128, 4): 30.0, (128, 8): 40.0, (32, 2): 5.0, (32, 4): 4.0, (32, 8): 6.0}

    def probe(weight, kernel=None, min_rows=2):
        return lambda x: us[weight.shape[0], x.shape[0]]

    monkeypatch.setattr(kernels, "_probe_linear", probe)
    monkeypatch.setattr(kernels, "_median_us", lambda fn, repeats: fn())
    shapes = {"128x64": (torch.zeros(128, 64), 1), "32x64": (torch.zeros(32, 64), 30)}
    rows, timings = kernels.choose_min_rows(shapes)
    assert timings == {"128x64": {2: 10.0, 4: 30.0, 8: 40.0}, "32x64": {2: 5.0, 4: 4.0, 8: 6.0}}
    assert rows == 4  # 2: 10 + 30 x 5 = 160 us, 4: 30 + 30 x 4 = 150, 8: 40 + 180 (unweighted: 2 wins)
    shapes["32x64"] = (shapes["32x64"][0], 1)
    assert kernels.choose_min_rows(shapes)[0] == 2
    us.update({(128, 4): 10.0, (32, 4): 5.0})  # 2 and 4 tie at 15 us: the fewer rows (the docstring's rule)
    assert kernels.choose_min_rows(shapes)[0] == 2
    monkeypatch.undo()
    stock_seen = []
    monkeypatch.setattr(kernels, "choose_min_rows", lambda shapes, kernel=None: (8, {k: {} for k in shapes}))
    monkeypatch.setattr(kernels, "choose_stock_rows", lambda weight, kernel=None, min_rows=2:
                        stock_seen.append(min_rows) or (0, {}))
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    assert kernels.pack_linears(model, choose=True)[3] == 8 and stock_seen == [8, 8]
    assert [m.min_rows for m in model] == [8, 8]


def test_packed_linear_refuses_a_kernel_it_lacks(monkeypatch):
    import space.cpu_kernels as kernels

    monkeypatch.setattr(kernels, "has_kernel", lambda kernel: kernel == "onednn")  # a build without MKL (aarch64)
    assert kernels.packed_kernel() == "onednn" and PackedLinear(nn.Linear(8, 8)).kernel == "onednn"
    with pytest.raises(ValueError, match="no packed linear kernel 'mkl'"):
        PackedLinear(nn.Linear(8, 8), kernel="mkl")


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_linear_few_rows_with_extra_take_the_stock_path(kernel):
    """``forward_extra`` at most ``stock_rows`` rows runs stock ``F.linear`` on ``[W; extra]``, as
    ``forward`` runs it on W: a 2-row step with a mask row took the packed kernel (oneDNN then) while
    one without took MKL's stock path, and the adapter cost measured on SmolLM2 was that kernel gap
    (28 ms, not ~8). The stacked weight is a view when extra's rows follow W's (``GatedLoraLinear``'s
    layout), not a copy."""
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(96, 80)
    both = torch.cat([lin.weight.detach(), torch.randn(16, 96, generator=gen)])
    lin.weight = nn.Parameter(both[:80], requires_grad=False)
    bias = torch.cat([lin.bias.detach(), torch.zeros(16)])
    packed = PackedLinear(lin, extra=both[80:], stock_rows=2, kernel=kernel)
    assert packed.stacked.data_ptr() == both.data_ptr() and packed.stacked.shape == both.shape
    separate = PackedLinear(lin, extra=both[80:].clone(), stock_rows=2, kernel=kernel)
    assert torch.equal(separate.stacked, both) and separate.stacked.data_ptr() != both.data_ptr()
    assert PackedLinear(lin, extra=both[80:].clone(), kernel=kernel).stacked is None  # a copy nothing reads is not kept
    packed_call = packed._all

    def only_above_stock_rows(x):
        assert x.numel() > packed.stock_rows * packed.in_features, "a few-row call took the packed kernel"
        return packed_call(x)

    packed._all = only_above_stock_rows  # the routing, whether or not the two kernels round alike
    with torch.no_grad():
        for rows in (1, 2):
            x = torch.randn(1, rows, 96, generator=gen)
            y, xa = packed.forward_extra(x)
            stock = nn.functional.linear(x, both, bias)
            assert torch.equal(y, stock[..., :80]) and torch.equal(xa, stock[..., 80:])
        x = torch.randn(1, 5, 96, generator=gen)
        y, xa = packed.forward_extra(x)  # above stock_rows: the packed kernel, W and extra in one call
        assert torch.allclose(y, lin(x), atol=1e-5) and torch.allclose(xa, x @ both[80:].T, atol=1e-5)


def test_packed_gated_lora_shares_its_weights_and_refuses_a_later_load():
    """``pack_linears`` on a ``GatedLoraLinear``: the stock path's ``[W; A]`` is the layer's own packed
    tensor (W is not held twice), and loading a LoRA state afterwards is refused, since the packed
    copy would keep the old A while the few-row path read the new one."""
    from space.adapter_layers import GatedLoraLinear
    from space.cpu_kernels import pack_linears

    gen = torch.Generator().manual_seed(2)
    layer = nn.Sequential(GatedLoraLinear(nn.Linear(64, 48), torch.randn(8, 64, generator=gen), torch.randn(48, 8, generator=gen)))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert pack_linears(layer)[0] == 1
    gated = layer[0]
    assert isinstance(gated.base, PackedLinear) and gated.base.stacked.data_ptr() == gated.packed.data_ptr()
    with pytest.raises(ValueError, match="before the CPU kernels"):
        layer.load_state_dict(state)


def test_pack_linears_leaves_a_hooked_linear_with_its_hook():
    """A linear under an accelerate hook (what a device map places) stays itself and keeps calling
    its hook; a replacement would have dropped the hook. The unhooked one beside it is packed."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from space.cpu_kernels import pack_linears

    calls = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    hooked = add_hook_to_module(model[1], Count())
    assert pack_linears(model)[0] == 1
    assert isinstance(model[0], PackedLinear) and model[1] is hooked and type(hooked) is nn.Linear
    model(torch.randn(5, 64))
    assert calls == [hooked]


def test_kernels_flag(tiny):
    model, _, _ = tiny
    stock, fast = copy.deepcopy(model), copy.deepcopy(model)
    assert apply_kernels(stock, "stock") == {"choice": "stock", "packed_linears": 0, "attention": "sdpa"}
    assert not any(isinstance(m, PackedLinear) for m in stock.modules())  # stock leaves the model alone
    record = apply_kernels(fast, "fast")
    norms = 2 * model.config.num_hidden_layers + 1
    chosen = record["packed_kernel"]  # timed on this machine: the build's kernels, or its one
    assert chosen in PACKED_KERNELS and has_kernel(chosen)
    assert {m.kernel for m in fast.modules() if isinstance(m, PackedLinear)} == {chosen}
    min_rows = record["packed_min_rows"]  # timed too
    assert min_rows in MIN_ROWS_CHOICES and {m.min_rows for m in fast.modules() if isinstance(m, PackedLinear)} == {min_rows}
    assert record.pop("stock_rows") and record == {"choice": "fast", "packed_linears": 15,
                                                   "packed_kernel": chosen, "packed_min_rows": min_rows,
                                                   "attention": SDPA_GQA, "rms_norms": norms, "blockwise_lora": 0}
    with pytest.raises(ValueError, match="kernels"):
        apply_kernels(stock, "turbo")


@pytest.mark.parametrize("kernel", [k for k in PACKED_KERNELS if has_kernel(k)])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_exact_on_optimized_model(tiny_varied, k, kernel):
    """Greedy SPACE on the fast kernels equals AR on them, with either packed kernel. On the varied
    tiny model: ``tiny`` repeats one token, and noise of 3e-3 of a weight's std on the packed
    many-row outputs passed every case there (6 of 8 fail here)."""
    model, _, spec = tiny_varied
    fast = copy.deepcopy(model)
    record = optimize_for_cpu(fast, kernel=kernel)
    assert {m.kernel for m in fast.modules() if isinstance(m, PackedLinear)} == {kernel}
    assert record.pop("packed_min_rows") in MIN_ROWS_CHOICES
    assert record.pop("stock_rows") and record == {"packed_linears": 15, "packed_kernel": kernel,
                                                   "attention": SDPA_GQA,
                                                   "rms_norms": 2 * model.config.num_hidden_layers + 1,
                                                   "blockwise_lora": 0}
    gen = torch.Generator().manual_seed(k)
    for _ in range(3):
        prompt = torch.randint(11, 250, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        max_new = int(torch.randint(1, 48, (1,), generator=gen))
        ar = ar_generate(fast, prompt, max_new, stop_token_ids=[10], suppress_ids=spec.token_ids)
        stock = ar_generate(model, prompt, max_new, stop_token_ids=[10], suppress_ids=spec.token_ids)
        assert ar.new_ids == stock.new_ids
        for groups in (1, k + 1):
            out = SpaceDecoder(fast, spec, DecodeConfig(k, groups)).generate(prompt, max_new, stop_token_ids=[10])
            assert out.new_ids == ar.new_ids, (k, groups, prompt.tolist(), max_new)


class OnePlusRMSNorm(nn.Module):
    """Gemma's formula (``1 + weight``) under Llama's attribute names: not the function
    torch's rms_norm computes."""

    def __init__(self, hidden):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(hidden)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_native_rms_norm_gives_transformers_bits():
    """The swapped norm computes what transformers' LlamaRMSNorm computes, bit for bit in fp32, at
    every scale and shape (a Qwen3-style per-head norm's 4-D, non-contiguous input included); a
    norm of another formula, a gated norm (forward(x, gate)), a norm under an accelerate hook, or
    one not in fp32 is left alone."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    # transformers 5.25 renamed it Mamba2RMSNormGated
    MambaRMSNormGated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated

    gen = torch.Generator().manual_seed(0)
    hooked = LlamaRMSNorm(576)
    hooked._hf_hook = object()  # what accelerate's device-map placement sets
    # MambaRMSNormGated with one group gives Llama's bits when called without a gate
    model = nn.Sequential(LlamaRMSNorm(576, eps=1e-5), OnePlusRMSNorm(576), LlamaRMSNorm(64).to(torch.bfloat16),
                          MambaRMSNormGated(576, group_size=576), Qwen3NextRMSNormGated(576), hooked,
                          LlamaRMSNorm(64))
    with torch.no_grad():
        model[0].weight.normal_(generator=gen)
        model[6].weight.normal_(generator=gen)
    hf, head_norm, weight = copy.deepcopy(model[0]), copy.deepcopy(model[6]), model[0].weight
    assert swap_rms_norms(model) == 2
    assert [type(m).__name__ for m in model] == ["NativeRMSNorm", "OnePlusRMSNorm", "LlamaRMSNorm",
                                                 MambaRMSNormGated.__name__, "Qwen3NextRMSNormGated", "LlamaRMSNorm",
                                                 "NativeRMSNorm"]
    assert model[0].weight is weight  # the norm's own parameter, not a copy
    assert list(model[0].state_dict()) == ["weight"]
    with torch.no_grad():
        for shape, scale in [((1, 1, 576), 1.0), ((2, 7, 576), 1e-3), ((1, 300, 576), 1e3), ((16, 576), 40.0)]:
            x = torch.randn(*shape, generator=gen) * scale
            assert torch.equal(model[0](x), hf(x)), (shape, scale)
        heads = torch.randn(1, 16, 9, 64, generator=gen).transpose(1, 2)  # (batch, heads, rows, head_dim), strided
        assert torch.equal(model[6](heads), head_norm(heads))
    assert swap_rms_norms(model) == 0  # already swapped


def test_an_exact_swap_refuses_a_norm_one_ulp_off(monkeypatch):
    """The fast kernels keep the output transformers' to the bit: a native norm that is one ulp off
    on the probe (close by any tolerance) is not swapped in with ``exact`` (the default)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    native = torch.nn.functional.rms_norm
    model = nn.Sequential(LlamaRMSNorm(64))
    monkeypatch.setattr(torch.nn.functional, "rms_norm",
                        lambda x, *a: torch.nextafter(native(x, *a), torch.full_like(x, float("inf"))))
    assert swap_rms_norms(model) == 0 and type(model[0]).__name__ == "LlamaRMSNorm"
    monkeypatch.setattr(torch.nn.functional, "rms_norm", native)
    assert swap_rms_norms(model) == 1  # the same bits: swapped


def test_gqa_attention_equals_sdpa_with_a_4d_mask(tiny):
    model, _, _ = tiny
    fast = copy.deepcopy(model)
    register_attention()
    fast.set_attn_implementation(SDPA_GQA)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(11, 250, (1, 12), generator=gen)
    allowed = torch.ones(12, 12).tril().bool() & (torch.rand(12, 12, generator=gen) > 0.3)
    allowed |= torch.eye(12, dtype=torch.bool)  # a SPACE-like pattern: causal, some keys hidden
    mask = to_additive_4d(allowed, torch.float32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(fast(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
        got = fast(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert torch.allclose(got, want, atol=1e-5)


def test_packed_frozen_base_equals_unpacked():
    """A frozen-base model's packed layers (LoRA A packed under W) give the unpacked logits on a
    SPACE block (mask rows last, declared with ``mask_rows``), batch 1 (the one-gemm path) and 2;
    real rows stay the base model's, bit for bit, and the update really reaches the mask rows."""
    model, tok = load_model("tiny-random-llama")
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    fused = fuse_frozen_base(model)
    fast = copy.deepcopy(fused)
    assert optimize_for_cpu(fast)["packed_linears"] == 15
    base, _ = load_model("tiny-random-llama")
    add_mask_tokens(base, tok, 3)
    mask = spec.token_ids[0]
    with torch.no_grad():
        for batch in (1, 2):
            ids = torch.tensor([[5, 6, 7, 8, mask, mask, mask]] * batch)
            with mask_rows(4):
                got, want = fast(input_ids=ids).logits, fused(input_ids=ids).logits
            assert torch.allclose(got, want, atol=1e-5)
            plain = base(input_ids=ids).logits
            assert torch.equal(want[:, :4], plain[:, :4])  # real rows: exactly the base
            assert not torch.allclose(want[:, 4:], plain[:, 4:], atol=1e-3)  # mask rows: updated
            # outside a mask_rows block no row is updated (AR, HF generate): the base model exactly
            assert torch.equal(fused(input_ids=ids).logits, plain)


@pytest.mark.parametrize("kernel", KERNELS)
def test_stock_rows_take_f_linear_and_more_rows_take_the_packed_kernel(kernel):
    """Issue 43: a PackedLinear calls MKL's stock path up to ``stock_rows`` rows (where it is
    faster on some CPUs) and the packed kernel above, the LoRA path (``forward_extra``) too; each
    path gives exactly what it gives alone."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 80)
    extra = torch.randn(16, 96, generator=gen)
    always = PackedLinear(lin, extra=extra, kernel=kernel)
    mixed = PackedLinear(lin, extra=extra, stock_rows=2, kernel=kernel)
    with torch.no_grad():
        for rows in (1, 2, 3, 7):
            x = torch.randn(1, rows, 96, generator=gen)
            want = lin(x) if rows <= 2 else always(x)
            assert torch.equal(mixed(x), want), rows
            stacked = nn.functional.linear(x, torch.cat([lin.weight, extra]), torch.cat([lin.bias, torch.zeros(16)]))
            want_extra = stacked[..., :80] if rows <= 2 else always.forward_extra(x)[0]
            assert torch.equal(mixed.forward_extra(x)[0], want_extra), rows


def test_choose_stock_rows_is_recorded(tiny):
    from space.cpu_kernels import PROBE_ROWS, choose_stock_rows

    n, timings = choose_stock_rows(torch.randn(128, 64), repeats=3)
    assert n in (0, *PROBE_ROWS) and list(timings) == list(PROBE_ROWS)
    assert all(len(t) == 2 and min(t) > 0 for t in timings.values())
    fast = copy.deepcopy(tiny[0])
    record = apply_kernels(fast, "fast")
    shapes = {"x".join(map(str, m.weight.shape)) for m in fast.modules() if isinstance(m, PackedLinear)}
    assert set(record["stock_rows"]) == shapes  # one timed choice per weight shape, in the run record
    if all(has_kernel(k) for k in PACKED_KERNELS):  # and the kernels' times it chose the packed kernel by
        assert all(set(e["kernel_us"]) == set(PACKED_KERNELS) for e in record["stock_rows"].values())
    for m in fast.modules():
        if isinstance(m, PackedLinear):
            assert m.stock_rows == record["stock_rows"]["x".join(map(str, m.weight.shape))]["stock_rows"]


@pytest.mark.skipif(not all(has_kernel(k) for k in PACKED_KERNELS), reason="needs both packed kernels")
def test_choose_packed_kernel_weighs_each_shape_by_its_count(monkeypatch):
    """The kernel with the least total time over the model's linears wins, each shape counted as
    often as the model has it: here MKL is faster on the one big shape, oneDNN on the shape the
    model holds 30 of, so oneDNN wins by count (an unweighted sum would pick MKL). Times are
    stubbed per (kernel, shape, rows); the real timing is covered by test_kernels_flag."""
    import space.cpu_kernels as kernels

    us = {("mkl", 128): 10.0, ("onednn", 128): 60.0, ("mkl", 32): 4.0, ("onednn", 32): 1.0}

    def probe(weight, kernel=None):  # a "linear" whose call returns its stubbed time in us
        return lambda x: us[kernel, weight.shape[0]] * x.shape[0]

    monkeypatch.setattr(kernels, "_probe_linear", probe)
    monkeypatch.setattr(kernels, "_median_us", lambda fn, repeats: fn())
    shapes = {"128x64": (torch.zeros(128, 64), 1), "32x64": (torch.zeros(32, 64), 30)}
    kernel, timings = kernels.choose_packed_kernel(shapes, rows=(4, 16))
    assert timings == {"128x64": {"mkl": [40.0, 160.0], "onednn": [240.0, 960.0]},
                       "32x64": {"mkl": [16.0, 64.0], "onednn": [4.0, 16.0]}}
    assert kernel == "onednn"  # mkl 200 + 30 x 80 = 2600 us, onednn 1200 + 30 x 20 = 1800 (unweighted: 280, 1220)
    shapes["32x64"] = (shapes["32x64"][0], 1)
    assert kernels.choose_packed_kernel(shapes, rows=(4, 16))[0] == "mkl"  # one of each: mkl 280, onednn 1220


def test_gated_lora_without_mask_rows_is_the_base_alone():
    """AR rows (no mask_rows block, or a block whose mask rows start past the call's rows) never
    compute the packed LoRA A: the call is the base linear's, bit for bit."""
    from space.adapter_layers import GatedLoraLinear

    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48)
    a, b = torch.randn(8, 64, generator=gen), torch.randn(48, 8, generator=gen)
    gated = GatedLoraLinear(PackedLinear(lin, extra=a), a, b)
    calls = []
    gated.base.forward_extra = lambda x, f=gated.base.forward_extra: calls.append(x.shape) or f(x)
    x = torch.randn(1, 3, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(gated(x), gated.base(x)) and not calls
        with mask_rows(3):
            assert torch.equal(gated(x), gated.base(x)) and not calls
        with mask_rows(1):
            y = gated(x)
        assert calls and torch.equal(y[:, :1], gated.base.forward_extra(x)[0][:, :1])
        assert torch.allclose(y[:, 1:], lin(x[:, 1:]) + x[:, 1:] @ a.T @ b.T, atol=1e-4)


def test_blockwise_lora_update_reads_no_zero_block():
    """A fused group's decode-step update block by block (``blockwise_lora``, the fast kernels'
    item 4) gives the one-call update's rows and never reads B's zero blocks: with NaN written
    into them the mask rows stay finite and equal to the one-call rows before the NaN (to fp32
    rounding), where the one-call update turns every mask row into NaN. The fast kernels switch
    every fused group (q/k/v and gate/up of each layer)."""
    from space.adapter_layers import GatedLoraLinear
    from space.cpu_kernels import blockwise_lora
    from space.decoding.fused import fuse_trunk

    def fused_model():  # a fused model keeps per-thread state: built twice, not deep-copied
        model, tok = load_model("tiny-random-llama")
        model, _ = prepare_model(model, tok, "frozen-base", 3)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5, generator=gen)
        model = fuse_frozen_base(model)
        fuse_trunk(model)
        return model

    model, fast = fused_model(), fused_model()
    gen = torch.Generator().manual_seed(1)
    groups = [m for m in model.modules() if isinstance(m, GatedLoraLinear) and m.blocks]
    assert len(groups) == 2 * model.config.num_hidden_layers
    for gated in groups:
        x = torch.randn(1, 6, gated.base.in_features, generator=gen)
        with torch.no_grad(), mask_rows(2):
            want = gated(x).clone()
            zeros = torch.ones_like(gated.lora_bt, dtype=torch.bool)
            for r0, r1, c0, c1 in gated.blocks:
                zeros[r0:r1, c0:c1] = False
            assert zeros.any()  # a fused B has zero blocks
            gated.lora_bt[zeros] = float("nan")
            assert gated(x)[0, 2:].isnan().all(dim=-1).any()  # the one-call update reads them
            assert blockwise_lora(gated) == 1 and gated.blockwise
            got = gated(x)
        assert torch.equal(got[0, :2], want[0, :2]) and torch.allclose(got, want, atol=1e-5)
    assert optimize_for_cpu(fast)["blockwise_lora"] == 2 * model.config.num_hidden_layers
    assert all(m.blockwise for m in fast.modules() if isinstance(m, GatedLoraLinear) and m.blocks)


def test_stacked_weight_is_a_copy_when_extra_is_not_right_after_w():
    """``[W; extra]`` is a view only when extra's rows directly follow W's: an ``extra`` in the same
    storage but further on (a gap of rows) must be copied, or the few-row stock path of
    ``forward_extra`` reads the rows between W and extra as the LoRA A."""
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(32, 24, bias=False)
    storage = torch.randn(24 + 4 + 8, 32, generator=gen)
    lin.weight = nn.Parameter(storage[:24], requires_grad=False)
    extra = storage[28:]  # 4 rows of something else between W and extra
    packed = PackedLinear(lin, extra=extra, stock_rows=2)
    assert torch.equal(packed.stacked, torch.cat([storage[:24], extra]))
    x = torch.randn(1, 2, 32, generator=gen)
    with torch.no_grad():
        y, xa = packed.forward_extra(x)  # 2 rows: the stock path over the stacked weight
    assert torch.equal(y, nn.functional.linear(x, storage[:24])) and torch.allclose(xa, x @ extra.T, atol=1e-5)


def test_choose_stock_rows_stops_at_the_first_count_where_stock_loses(monkeypatch):
    """stock_rows is the largest probed count up to which stock won at every probed count: stock
    winning again at a larger count (timing noise, another MKL path) must not route the counts in
    between, where it lost, to stock. Times are stubbed (stock, packed per row count, in order)."""
    import space.cpu_kernels as kernels

    times = iter([1.0, 2.0,  # 1 row: stock wins
                  5.0, 3.0,  # 2 rows: stock loses
                  1.0, 2.0,  # 4 rows: stock wins again
                  9.0, 4.0])  # 8 rows: stock loses
    monkeypatch.setattr(kernels, "_median_us", lambda fn, repeats: next(times))
    n, timings = kernels.choose_stock_rows(torch.zeros(16, 8), rows=(1, 2, 4, 8))
    assert n == 1 and timings == {1: [1.0, 2.0], 2: [5.0, 3.0], 4: [1.0, 2.0], 8: [9.0, 4.0]}


def test_pack_linears_counts_each_shape_for_the_kernel_choice(monkeypatch):
    """The kernel choice weighs each weight shape by how many linears have it
    (``choose_packed_kernel``), so ``pack_linears`` must hand it the count, not 1 per shape."""
    import space.cpu_kernels as kernels

    seen = {}

    def choose(shapes):
        seen.update({key: count for key, (_, count) in shapes.items()})
        return kernels.packed_kernel(), {}

    monkeypatch.setattr(kernels, "choose_packed_kernel", choose)
    monkeypatch.setattr(kernels, "choose_stock_rows", lambda weight, kernel=None, min_rows=2: (0, {}))
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 64))
    assert kernels.pack_linears(model, choose=True)[0] == 4
    assert seen == {"64x64": 2, "32x64": 1, "64x32": 1}


def test_gqa_attention_one_row_after_a_cache_equals_sdpa(tiny):
    """A one-row step over a filled cache (AR, HF generate) with no mask: the row attends to every
    cached key. SDPA's ``is_causal`` aligns its triangle top-left, so with it set one query row
    would see the first key only: it must be set only for blocks of several rows."""
    from transformers import DynamicCache

    from space.decoding.cache import cache_input

    model, _, _ = tiny
    fast = copy.deepcopy(model)
    register_attention()
    fast.set_attn_implementation(SDPA_GQA)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = []
        for m in (model, fast):
            cache = DynamicCache(config=m.config)
            m(input_ids=ids, **cache_input(cache), use_cache=True)
            logits.append(m(input_ids=torch.tensor([[11]]), **cache_input(cache), use_cache=True).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_gqa_attention_keeps_a_padding_mask(tiny):
    """A left-padded batch's 2-D attention mask reaches the attention as sdpa's own 4-D mask: the
    attention's name is registered with transformers' mask functions too (unregistered,
    transformers builds no mask for it and the padded row attends to its padding)."""
    model, _, _ = tiny
    fast = copy.deepcopy(model)
    register_attention()
    fast.set_attn_implementation(SDPA_GQA)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 7, 8, 9]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        got, want = fast(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(got[:, 3:], want[:, 3:], atol=1e-5)


def test_optimize_for_cpu_leaves_other_dtypes_and_eager_attention_alone(tiny, monkeypatch):
    """A bf16 model is left as it is (its attention included: "no-op on other devices / dtypes"),
    and an fp32 model loaded with eager attention keeps it (eager may be chosen for what SDPA lacks,
    e.g. a logit soft-cap); only ``sdpa`` is replaced by the GQA attention."""
    import space.cpu_kernels as kernels

    monkeypatch.setattr(kernels, "choose_stock_rows", lambda weight, kernel=None, min_rows=2: (0, {}))  # no timing here
    model, _, _ = tiny
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert optimize_for_cpu(half) == {"packed_linears": 0, "attention": "sdpa"}
    assert half.config._attn_implementation == "sdpa"
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    record = optimize_for_cpu(eager, kernel=packed_kernel())
    assert record["packed_linears"] == 15 and record["attention"] == "eager"
    assert eager.config._attn_implementation == "eager"
