"""The SAR-SFT step's pieces (``space.train.steps``)."""
import pytest
import torch

from space.adapter_layers import prepare_model
from space.config import SpaceSettings
from space.data.collator import SpaceCollator
from space.masking import to_additive_4d
from space.models import tiny_random_llama
from space.train.steps import forward_mask, sar_step


def test_eager_mask_under_autocast_is_in_the_compute_dtype():
    """Mixed precision (fp32 weights, bf16 autocast): eager attention adds the mask to bf16 scores,
    so its additive mask is bf16, with bf16's own minimum, not an fp32 one beside bf16 queries.
    Catches a mask built in the weights' dtype whatever autocast computes in."""
    model, tok = tiny_random_llama(seed=0, attn_implementation="eager")
    model, spec = prepare_model(model, tok, "full", 3)
    collator = SpaceCollator(spec.ids_for(3), 3, tok.pad_token_id, spans_per_sample=2)
    batch = collator([{"input_ids": list(range(10, 50)), "prompt_len": 4, "idx": 0}])
    allowed, pos = batch["attention_mask"], batch["position_ids"]
    assert forward_mask(allowed, model, pos, pos).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mask = forward_mask(allowed, model, pos, pos)
    assert torch.equal(mask, to_additive_4d(allowed, torch.bfloat16))


def test_an_additive_mask_reaches_eager_attention_as_it_is():
    """Catches ``forward_mask`` converting every mask for eager attention: a mask that is already
    additive (float, 0 / min) is passed through unchanged; converting it again fails (a float
    tensor is no condition for ``torch.where``)."""
    model, tok = tiny_random_llama(seed=0, attn_implementation="eager")
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    additive, pos = to_additive_4d(allowed), torch.arange(4)[None]
    assert forward_mask(additive, model, pos, pos) is additive
    assert torch.equal(forward_mask(allowed, model, pos, pos), additive)


@pytest.mark.parametrize("mode", ["frozen-base", "lora", "full"])
@pytest.mark.parametrize("chunk_rows", [0, 6])
def test_a_batch_where_no_sample_drew_a_mask_group_trains(mode, chunk_rows):
    """``mask_prob`` < 1 (the paper's recipe: 0.5) or samples too short for a span can leave a
    batch without a mask group. Catches a collator that then gives no mask column: the
    frozen-base step's mask pass ran on zero rows and crashed inside attention. The step's loss
    is finite and every trainable weight gets a gradient (DDP waits for each)."""
    model, tok = tiny_random_llama(seed=0)
    model, spec = prepare_model(model, tok, mode, 3)
    collator = SpaceCollator(spec.ids_for(3), 3, tok.pad_token_id, mask_prob=0.0)
    batch = collator([{"input_ids": list(range(10, 30)), "prompt_len": 4, "idx": 0},
                      {"input_ids": list(range(10, 16)), "prompt_len": 5, "idx": 1}])
    step = sar_step(model.train(), batch, SpaceSettings(mode=mode, mask_num=3, mask_chunk_rows=chunk_rows))
    step.loss.backward()
    assert torch.isfinite(step.loss) and float(step.stats["mask_rows"]) == 0
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


@pytest.mark.parametrize("k, chunk_rows, starts", [(3, 4, [0, 3, 6, 9]), (3, 7, [0, 6]), (2, 5, [0, 4]),
                                                    (4, 3, [0, 4, 8, 12])])
def test_mask_chunks_hold_whole_groups(k, chunk_rows, starts):
    """Catches a wrong group size in ``mask_chunks`` (e.g. the largest offset, k-1, taken for k):
    a chunk that splits a group cuts a mask row off from its group's earlier masks (the mask pass
    leaves the other chunks' columns out), so the chunked loss silently trains another layout.
    Chunk sizes round ``chunk_rows`` down to whole groups of k, at least one group."""
    from space.train.steps import mask_chunks

    offsets = torch.arange(k).repeat(4)[None].expand(2, -1)  # (batch, 4 groups of k)
    chunks = mask_chunks(offsets, chunk_rows)
    assert [c.start for c in chunks] == starts and chunks[-1].stop == 4 * k
    assert all(c.start % k == 0 and (c.stop - c.start) % k == 0 for c in chunks)
    assert mask_chunks(offsets, 0) == [slice(0, 4 * k)] == mask_chunks(offsets, 4 * k)
