"""load_space: adapters read without peft, their recorded base model checked, CPU kernels on request."""
import warnings

import pytest
import torch
from peft import PeftModel

from space.adapter_layers import MaskEmbedding, fuse_frozen_base, prepare_model
from space.artifact import load_mask_rows, save_artifact
from space.cpu_kernels import PackedLinear, packing_available
from space.loader import load_space
from space.masking import mask_rows
from space.models import TINY, load_model, tiny_random_llama
from space.tokens import add_mask_tokens


def _artifact(path, mode):
    """A tiny-model adapter of ``mode`` with random (non-zero) LoRA weights, trained on TINY."""
    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, mode, mask_num=3)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "mask_rows" in name:
                p.normal_(0, 0.05)
    return save_artifact(path, peft_model, tok, spec, mode, {"base_model": TINY})


def _via_peft(adapter, mode):
    """What load_space built with peft before: PeftModel.from_pretrained, then merge or fuse."""
    base, tok = load_model(TINY)
    spec = add_mask_tokens(base, tok, 3)
    emb = MaskEmbedding(base.get_input_embeddings(), spec.token_ids)
    load_mask_rows(emb, adapter / "mask_embedding.safetensors")
    base.set_input_embeddings(emb)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    return peft_model.merge_and_unload() if mode == "lora" else fuse_frozen_base(peft_model)


@pytest.mark.parametrize("mode", ["frozen-base", "lora"])
def test_adapter_without_peft_equals_peft_load(tmp_path, mode):
    """Mask rows and real rows as peft's loader gave them (frozen-base bit for bit), and no
    FutureWarning (peft's wrapper asked transformers for a deprecated attribute on every load)."""
    adapter = _artifact(tmp_path / mode, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model, _, spec = load_space(adapter=adapter)
    ref = _via_peft(adapter, mode)
    ids = torch.tensor([[5, 70, 33, 200, *spec.token_ids * 3]])
    with torch.no_grad(), mask_rows(4):
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    if mode == "frozen-base":
        assert torch.equal(got, want)
    else:  # merged in another order of float operations
        assert torch.allclose(got, want, atol=1e-5)


def test_other_base_model_warns_naming_both(tmp_path):
    adapter = _artifact(tmp_path / "a", "frozen-base")
    other, tok = tiny_random_llama(seed=5)  # same shapes, other weights
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.warns(UserWarning, match="trained on base model 'tiny-random-llama'") as record:
        load_space(str(tmp_path / "other"), adapter)
    assert str(tmp_path / "other") in str(record[0].message)
    with warnings.catch_warnings():  # the recorded base, implicit or named, loads silently
        warnings.simplefilter("error", UserWarning)
        load_space(adapter=adapter)
        load_space(TINY, adapter)


def test_plain_model_without_adapter_warns_of_untrained_masks(tmp_path):
    """A plain model loaded without an adapter gets a new, untrained mask token: a UserWarning says
    so (a forgotten --adapter otherwise reads as a weak drafter); a model that has its mask token does not."""
    with pytest.warns(UserWarning, match="no SPACE mask token and no adapter"):
        model, tok, spec = load_space(TINY)
    model.save_pretrained(tmp_path / "sar")  # now with its mask token, as a SAR-SFT checkpoint has
    tok.save_pretrained(tmp_path / "sar")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert load_space(str(tmp_path / "sar"))[2].token_ids == spec.token_ids


@pytest.mark.skipif(not packing_available(), reason="torch build without a packed linear kernel")
def test_kernels_fast_packs_for_inference_and_generate_stays_exact(tmp_path):
    """kernels="fast" packs every linear (the gated LoRA layers too); plain greedy generate and
    SPACE on that model agree token for token; the default leaves the model as load_model gives it."""
    from space.hf import space_generate

    adapter = _artifact(tmp_path / "a", "frozen-base")
    model, _, _ = load_space(adapter=adapter, kernels="fast")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    ids = torch.tensor([[5, 70, 33, 200, 41]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20)
    assert torch.equal(model.generate(ids, do_sample=False, **kw), model.generate(ids, custom_generate=space_generate, **kw))
    stock, _, _ = load_space(adapter=adapter)
    assert not any(isinstance(m, PackedLinear) for m in stock.modules())
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_space(adapter=adapter, kernels="turbo")
