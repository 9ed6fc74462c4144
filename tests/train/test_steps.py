"""The SAR-SFT step's pieces (``space.train.steps``)."""
import torch

from space.adapter_layers import prepare_model
from space.data.collator import SpaceCollator
from space.masking import to_additive_4d
from space.models import tiny_random_llama
from space.train.steps import forward_mask


def test_eager_mask_under_autocast_is_in_the_compute_dtype():
    """Mixed precision (fp32 weights, bf16 autocast): eager attention adds the mask to bf16 scores,
    so its additive mask is bf16, with bf16's own minimum, not an fp32 one beside bf16 queries.
    Catches a mask built in the weights' dtype whatever autocast computes in."""
    model, tok = tiny_random_llama(seed=0, attn_implementation="eager")
    model, spec = prepare_model(model, tok, "full", 3)
    collator = SpaceCollator(spec.ids_for(3), 3, tok.pad_token_id, spans_per_sample=2)
    allowed = collator([{"input_ids": list(range(10, 50)), "prompt_len": 4, "idx": 0}])["attention_mask"]
    assert forward_mask(allowed, model).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mask = forward_mask(allowed, model)
    assert torch.equal(mask, to_additive_4d(allowed, torch.bfloat16))
