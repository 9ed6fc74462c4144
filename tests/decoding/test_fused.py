"""The fused trunk (issue 58, ``space.decoding.fused``): one GEMM per q/k/v and gate/up group, the
LoRA packed under it, computing what the unfused layers compute, saved as the unfused model."""
import copy

import torch

from space.adapter_layers import GatedLoraLinear, fuse_frozen_base, prepare_model
from space.decoding.fused import ProjectionSlice, fuse_projections, fuse_trunk
from space.masking import mask_rows
from space.models import tiny_random_llama


def gated_tiny():
    model, tok = tiny_random_llama(seed=0)
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    return fuse_frozen_base(model), spec


def test_fused_trunk_computes_the_unfused_layers_and_saves_as_them():
    plain, spec = gated_tiny()
    fused = copy.deepcopy(plain)
    record = fuse_trunk(fused)
    assert record == {"fused_groups": 4, "attention": "space_sdpa_gqa"}
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
    assert attn.q_proj.shared._input is not None  # q and v not yet served for xs[0]: kept
