"""The fused trunk (issue 58, ``space.decoding.fused``): one GEMM per q/k/v and gate/up group, the
LoRA packed under it, computing what the unfused layers compute, saved as the unfused model."""
import copy
import threading

import pytest
import torch

from space.adapter_layers import GatedLoraLinear, fuse_frozen_base, prepare_model
from space.decoding.fused import ProjectionSlice, SharedProjection, fuse_projections, fuse_trunk
from space.masking import mask_rows
from space.models import tiny_random_llama


def gated_tiny(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), bias=False):
    model, tok = tiny_random_llama(seed=0)
    if bias:  # q/k/v with a bias on q only, as a group whose members differ
        attn = model.model.layers[0].self_attn
        q = attn.q_proj
        attn.q_proj = torch.nn.Linear(q.in_features, q.out_features, bias=True)
        with torch.no_grad():
            attn.q_proj.weight.copy_(q.weight)
            attn.q_proj.bias.normal_(generator=torch.Generator().manual_seed(1))
    with torch.random.fork_rng():  # peft draws lora_A from the global generator: the same model in any test order
        torch.manual_seed(0)
        model, spec = prepare_model(model, tok, "frozen-base", 3, lora_targets=targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    return fuse_frozen_base(model), spec


@pytest.mark.parametrize("targets, bias", [
    (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (("q_proj", "v_proj", "up_proj"), True),  # groups of gated and plain members, one bias among them
])
def test_fused_trunk_computes_the_unfused_layers_and_saves_as_them(targets, bias):
    plain, spec = gated_tiny(targets, bias)
    fused = copy.deepcopy(plain)
    record = fuse_trunk(fused)
    assert record == {"fused_groups": 4, "attention": "space_sdpa_gqa", "rms_norms": 0}  # on CUDA only
    assert isinstance(fused.model.layers[0].self_attn.k_proj, ProjectionSlice)
    assert isinstance(fused.model.layers[0].mlp.gate_proj.shared.fused, GatedLoraLinear)
    ids = torch.tensor([[5, 6, 7, 8] + [spec.token_ids[0]] * 3])
    with torch.no_grad():
        for start in (None, 4):  # AR (no mask row), then a SPACE block: real rows, then masks
            with mask_rows(start):
                want, got = plain(input_ids=ids).logits, fused(input_ids=ids).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mine, theirs = fused.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert not any(m.holds_outputs() for m in fused.modules() if isinstance(m, SharedProjection))  # none kept alive


def test_a_fused_model_deep_copies_and_pickles():
    """load_space fuses every eager single-device model. Catches a thread-local in the shared
    projection and a closure as its state-dict hook: ``copy.deepcopy`` and ``torch.save`` of a
    loaded model raised. The copy computes what the original does, and saves as it."""
    import io

    fused, spec = gated_tiny()
    fuse_trunk(fused)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    ids = torch.tensor([[5, 6, 7, 8] + [spec.token_ids[0]] * 3])
    for other in (copy.deepcopy(fused), torch.load(buf, weights_only=False)):
        with torch.no_grad(), mask_rows(4):
            torch.testing.assert_close(other(input_ids=ids).logits, fused(input_ids=ids).logits, rtol=0, atol=0)
        mine, theirs = other.state_dict(), fused.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_member_called_on_another_input_recomputes():
    """The group's GEMM is kept for the tensor the first member saw; a member given another
    tensor gets its own columns of that tensor, never the kept ones."""
    model, _ = tiny_random_llama(seed=0)
    attn = model.model.layers[0].self_attn
    want = [torch.nn.functional.linear(x, m.weight) for x, m in
            zip(torch.randn(3, 1, 2, 64, generator=torch.Generator().manual_seed(0)),
                (attn.q_proj, attn.k_proj, attn.v_proj))]
    xs = torch.randn(3, 1, 2, 64, generator=torch.Generator().manual_seed(0))
    assert fuse_projections(model) == 4
    with torch.no_grad():
        got = [attn.q_proj(xs[0]), attn.k_proj(xs[1]), attn.v_proj(xs[2])]
        same = attn.k_proj(xs[0])  # the first member called gets its own slice of a fresh GEMM
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(same, torch.nn.functional.linear(xs[0], attn.k_proj.weight))
    assert attn.q_proj.shared.holds_outputs()  # q and v not yet served for xs[0]: kept


def test_an_input_edited_in_place_or_another_thread_recomputes():
    """The kept outputs belong to the input as it was, in the thread that asked: after an
    in-place edit, or from another thread in between, a member gets its columns of what it is
    given now."""
    model, _ = tiny_random_llama(seed=0)
    attn = model.model.layers[0].self_attn
    assert fuse_projections(model) == 4
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attn.q_proj(x)
        x.add_(1.0)
        torch.testing.assert_close(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight))
        gemms = []
        attn.q_proj.shared.fused.register_forward_hook(lambda *_: gemms.append(threading.get_ident()))
        attn.q_proj(x)  # this thread now holds k and v of x
        y = x.clone() * 3
        other = {}
        thread = threading.Thread(target=lambda: other.update(q=attn.q_proj(y)))  # leaves its own k and v held
        thread.start()
        thread.join()
        torch.testing.assert_close(other["q"], torch.nn.functional.linear(y, attn.q_proj.weight))
        torch.testing.assert_close(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight))
        assert len(gemms) == 2  # k came from this thread's kept GEMM: the other thread's did not replace it
        torch.testing.assert_close(attn.v_proj(x), torch.nn.functional.linear(x, attn.v_proj.weight))


def test_a_gated_linear_moves_and_reloads_as_one_packed_tensor():
    """``.to`` keeps the base's weight a view of the packed tensor (W held once), and the state
    dict it saves loads back into the packed tensors."""
    model, _ = gated_tiny()
    layer = model.model.layers[0].self_attn.q_proj
    model.to(torch.float64)
    assert layer.base.weight.data_ptr() == layer.packed.data_ptr() and layer.lora_bt.dtype == torch.float64
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        layer.packed.zero_()
        layer.lora_bt.zero_()
    model.load_state_dict(state)
    torch.testing.assert_close(layer.lora_a, state["model.layers.0.self_attn.q_proj.lora_a"], rtol=0, atol=0)
    torch.testing.assert_close(layer.lora_b, state["model.layers.0.self_attn.q_proj.lora_b"], rtol=0, atol=0)
    torch.testing.assert_close(layer.base.weight, state["model.layers.0.self_attn.q_proj.base.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("batch, blockwise", [(1, False), (1, True), (2, False)])
def test_gated_linear_updates_exactly_the_rows_from_the_first_mask_row(batch, blockwise):
    """``GatedLoraLinear`` on each of its paths (a decode step's one ``addmm_``, its block by block
    update, a batch of 2): rows before ``mask_rows_start()`` are the base linear's, bit for bit,
    and every row from it on is ``W x + B A x``. Catches an update that starts a row late or
    early, or that reaches real rows, on any path (the batched one is not a decode step's, so
    the decoding tests never run it)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(16, 12)
    a, b = torch.randn(4, 16, generator=gen), torch.randn(12, 4, generator=gen)
    blocks = ((0, 2, 0, 5), (2, 4, 5, 12))  # B block-diagonal, as a fused group's
    if blockwise:
        b[:5, 2:] = 0
        b[5:, :2] = 0
    layer = GatedLoraLinear(base, a, b, blocks=blocks)
    layer.blockwise = blockwise
    x = torch.randn(batch, 6, 16, generator=gen)
    with torch.no_grad():
        plain = torch.nn.functional.linear(x, base.weight, base.bias)
        for start in (0, 2, 5):
            with mask_rows(start):
                y = layer(x)
            assert torch.equal(y[:, :start], plain[:, :start]), start
            torch.testing.assert_close(y[:, start:], plain[:, start:] + x[:, start:] @ a.T @ b.T)


def test_fused_members_with_biases_keep_their_own():
    """A group whose every member has a bias (Qwen2's q/k/v): each member's ``bias`` and saved
    state are its own slice of the fused bias, not the first member's, and its outputs are its
    linear's. Catches a member's bias (and weight) read from the wrong columns of the fused tensor."""
    model, _ = tiny_random_llama(seed=0)
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.normal_(generator=gen)
        setattr(attn, name, new)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 3, attn.q_proj.in_features, generator=gen)
    with torch.no_grad():
        outs = [getattr(attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")]
        assert fuse_projections(model) == 4
        for name, out in zip(("q_proj", "k_proj", "v_proj"), outs):
            member = getattr(attn, name)
            assert torch.equal(member.bias, want[f"model.layers.0.self_attn.{name}.bias"])
            assert torch.equal(member.weight, want[f"model.layers.0.self_attn.{name}.weight"])
            torch.testing.assert_close(member(x), out)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_member_without_a_bias_reports_none_in_a_mixed_group():
    """A group where only k has a bias: the fused GEMM holds a zero bias for q and v, but q's and
    v's ``bias`` stay None (as their linears had), and k's is its own. ``weight_of`` returned the
    zero slice for q and v."""
    model, _ = tiny_random_llama(seed=0)
    attn = model.model.layers[0].self_attn
    old = attn.k_proj
    k = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        k.weight.copy_(old.weight)
        k.bias.normal_(generator=torch.Generator().manual_seed(1))
    attn.k_proj = k
    want = k.bias.detach().clone()
    assert fuse_projections(model) == 4  # q/k/v and gate/up of both layers: the mixed group is fused
    assert attn.q_proj.bias is None and attn.v_proj.bias is None
    assert torch.equal(attn.k_proj.bias, want)


def test_a_group_whose_members_differ_in_dtype_or_input_is_left_unfused():
    """``fuse_projections`` fuses a group only when its members share input size, dtype and device.
    Catches the dtype check dropped: ``torch.cat`` promotes mixed weights silently, so a member kept
    in another dtype (an fp32 ``k_proj`` under a bf16 trunk, a ``keep_in_fp32_modules`` layer) was
    fused into one GEMM of the promoted dtype, and every member's output changed dtype."""
    model, _ = tiny_random_llama(seed=0)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    attn.k_proj.double()
    mlp.up_proj = torch.nn.Linear(mlp.up_proj.in_features + 1, mlp.up_proj.out_features, bias=False)
    assert fuse_projections(model) == 2  # layer 1's two groups only
    assert type(attn.q_proj) is type(attn.k_proj) is type(mlp.gate_proj) is torch.nn.Linear
    assert attn.k_proj.weight.dtype == torch.float64 and attn.q_proj.weight.dtype == torch.float32
    assert isinstance(model.model.layers[1].self_attn.k_proj, ProjectionSlice)


def test_a_norm_swapped_to_rounding_must_agree_and_keep_each_rows_bits(monkeypatch):
    """``swap_rms_norms(exact=False)``, what the fused trunk does on CUDA, where the native norm is one
    kernel that rounds otherwise than transformers: a Llama norm is swapped in fp32 and bf16, a norm
    of another formula is not (Gemma's ``1 + weight``, Cohere's mean-subtracting one, in bf16 too), nor
    one of another dtype than the trunk's; and no norm is when the
    native one would give a row other bits (one ulp) with another row count: alone, or only among 16
    rows (then a step's rows and AR's one row would be normalized differently)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from space.rms_norm import swap_rms_norms

    class OnePlusRMSNorm(LlamaRMSNorm):  # Gemma's formula under Llama's names
        def forward(self, x):
            return super().forward(x) + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def norms():
        model = torch.nn.Sequential(LlamaRMSNorm(64), LlamaRMSNorm(64).to(torch.bfloat16), OnePlusRMSNorm(64))
        with torch.no_grad():
            for m in model:
                m.weight.normal_(generator=torch.Generator().manual_seed(0))
        return model

    model = norms()
    assert swap_rms_norms(model, exact=False) == 2
    assert [type(m).__name__ for m in model] == ["NativeRMSNorm", "NativeRMSNorm", "OnePlusRMSNorm"]
    assert swap_rms_norms(model) == 0  # exact: already swapped, and bf16 is never swapped to the bit
    kept_fp32 = norms()
    assert swap_rms_norms(kept_fp32, exact=False, dtype=torch.bfloat16) == 1  # the fp32 norm is left alone
    assert [type(m).__name__ for m in kept_fp32] == ["LlamaRMSNorm", "NativeRMSNorm", "OnePlusRMSNorm"]
    # a mean-subtracting norm (Cohere's), which zero-mean rows would let through within bf16's rounding
    cohere = torch.nn.Sequential(CohereLayerNorm(576), CohereLayerNorm(576).to(torch.bfloat16))
    assert swap_rms_norms(cohere, exact=False) == 0
    native = torch.nn.functional.rms_norm

    def one_ulp_up(out):  # the tolerance cannot tell it from the true result, in either dtype
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    def rows(x):
        return x.numel() // x.shape[-1]

    # by any row count; by 16 or 37 rows only; for a row that does not start the input (a kernel that
    # reads unaligned rows otherwise); for a batch of sequences (3-D) only
    for bumped in (lambda x: rows(x) > 1, lambda x: rows(x) == 16, lambda x: rows(x) == 37,
                   lambda x: x.storage_offset() > 0, lambda x: x.dim() == 3):
        monkeypatch.setattr(torch.nn.functional, "rms_norm",
                            lambda x, *a, bumped=bumped: (one_ulp_up if bumped(x) else (lambda out: out))(native(x, *a)))
        assert swap_rms_norms(norms(), exact=False) == 0
    monkeypatch.setattr(torch.nn.functional, "rms_norm", native)

    class SlightlyOff(LlamaRMSNorm):  # 0.1 % off: far past fp32's rounding, within bf16's
        def forward(self, x):
            return super().forward(x) * 1.001

    assert swap_rms_norms(torch.nn.Sequential(SlightlyOff(64)), exact=False) == 0


def test_the_fused_trunk_swaps_the_norms_where_one_is_one_kernel(monkeypatch):
    """On a device of ``ONE_KERNEL_NORM`` (CUDA; here the CPU stands in) the fused trunk swaps every
    RMSNorm for the native one and records how many; greedy SPACE still equals AR over it."""
    import space.decoding.fused as fused_module
    from space.decoding import DecodeConfig, SpaceDecoder, ar_generate

    plain, spec = gated_tiny()
    monkeypatch.setattr(fused_module, "ONE_KERNEL_NORM", ("cpu",))
    fused = copy.deepcopy(plain)
    assert fuse_trunk(fused)["rms_norms"] == 2 * fused.config.num_hidden_layers + 1
    assert type(fused.model.norm).__name__ == "NativeRMSNorm"
    # a bf16 trunk whose final norm is kept in fp32: that norm would meet bf16 inputs its probe never had
    mixed = copy.deepcopy(plain).to(torch.bfloat16)
    mixed.model.norm.float()
    assert fuse_trunk(mixed)["rms_norms"] == 2 * mixed.config.num_hidden_layers
    assert type(mixed.model.norm).__name__ == "LlamaRMSNorm"
    prompt = torch.tensor([5, 6, 7, 8, 9, 10])
    ar = ar_generate(fused, prompt, 16, suppress_ids=spec.token_ids)
    assert SpaceDecoder(fused, spec, DecodeConfig(3, 4)).generate(prompt, 16).new_ids == ar.new_ids


def test_a_mean_subtracting_norm_of_a_real_width_is_not_swapped():
    """At a wide model's width (16384, Llama-405B's) a row of zero mean differs from RMSNorm by about
    1/sqrt(hidden), within bf16's rounding: the probe's rows must have means far from 0 for a
    mean-subtracting norm (Cohere's) to be told apart and kept."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from space.rms_norm import swap_rms_norms

    cohere = torch.nn.Sequential(CohereLayerNorm(16384).to(torch.bfloat16))
    assert swap_rms_norms(cohere, exact=False) == 0
    assert type(cohere[0]).__name__ == "CohereLayerNorm"


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_a_norm_of_another_formula_is_kept_whatever_its_weights_scale(dtype, scale):
    """The rounding check's tolerance scales with the norm's own output and weight: a
    mean-subtracting norm (Cohere's) with tiny weights is still kept, and a Llama norm with the
    same weights still swapped. Catches a tolerance with a fixed scale of 1 in place of the
    weight's, which let such a norm through (its outputs, all near 0, within 1e-4 or 3e-2 of the truth)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from space.rms_norm import swap_rms_norms

    model = torch.nn.Sequential(CohereLayerNorm(64).to(dtype), LlamaRMSNorm(64).to(dtype))
    with torch.no_grad():
        for m in model:
            m.weight.normal_(generator=torch.Generator().manual_seed(0)).mul_(scale)
    assert swap_rms_norms(model, exact=False) == 1
    assert [type(m).__name__ for m in model] == ["CohereLayerNorm", "NativeRMSNorm"]


@pytest.mark.parametrize("exact", [True, False])
def test_a_norm_whose_call_fails_is_kept_not_raised(exact):
    """A module that looks like an RMSNorm (1-D weight, ``variance_epsilon``, one argument) but
    whose probe call raises (a norm that needs state it lacks, or another input shape) is left as
    it is, and the others are still swapped. Catches the probe's failure let out of
    ``swap_rms_norms``: loading such a model failed instead of keeping that one norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from space.rms_norm import NativeRMSNorm, swap_rms_norms

    class Broken(LlamaRMSNorm):
        def forward(self, hidden_states):
            raise RuntimeError("needs more than its input")

    model = torch.nn.Sequential(Broken(16), LlamaRMSNorm(16))
    assert swap_rms_norms(model, exact=exact) == 1
    assert type(model[0]) is Broken and isinstance(model[1], NativeRMSNorm)
