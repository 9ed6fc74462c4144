"""Half-precision decoding: the step's 4-D mask takes the trunk's dtype (not the LM head's), and
attention implementations that ignore a 4-D mask (flash attention) are refused."""
from copy import deepcopy

import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.models import tiny_random_llama
from space.tokens import add_mask_tokens

MARGIN = 0.05  # AR top-2 logit gap under which bf16 rounding may flip greedy's choice
CONFIGS = [DecodeConfig(4, 2), DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [0, 1]]),
           DecodeConfig(4, 2, tree="dynamic")]


def bf16_model(tie_word_embeddings: bool = True, fp32_head: bool = False):
    """A fresh tiny random Llama (not the session fixture's, which stays fp32) in bf16, with an
    fp32 LM head when ``fp32_head`` (the head's weight must then be its own, not tied)."""
    torch.set_num_threads(2)
    model, tok = tiny_random_llama(seed=0, tie_word_embeddings=tie_word_embeddings)
    spec = add_mask_tokens(model, tok, mask_num=8)
    model = model.to(torch.bfloat16)
    if fp32_head:
        model.lm_head.float()
    return model, spec


def record_masks(model) -> tuple[list[torch.Tensor], list[bool], list]:
    """Hooks that keep every float ``attention_mask`` the first attention layer gets and whether
    each trunk output is finite; returns (masks, finite, handles)."""
    masks, finite = [], []

    def pre(module, args, kwargs):
        m = kwargs.get("attention_mask")
        for t in (m.values() if isinstance(m, dict) else [m]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                masks.append(t)

    def post(module, args, kwargs, out):
        finite.append(bool(torch.isfinite(out.last_hidden_state).all()))

    handles = [model.model.layers[0].self_attn.register_forward_pre_hook(pre, with_kwargs=True),
               model.model.register_forward_hook(post, with_kwargs=True)]
    return masks, finite, handles


def prompts(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randint(11, 250, (int(torch.randint(4, 24, (1,), generator=gen)),), generator=gen)


@pytest.mark.parametrize("config", CONFIGS, ids=["chain", "tree", "dynamic"])
def test_bf16_decodes_like_ar_up_to_near_ties(config):
    model, spec = bf16_model()
    dec = SpaceDecoder(model, spec, config)
    masks, finite, handles = record_masks(model)
    try:
        for prompt in prompts(3, seed=5):
            gaps = []

            def gap(ids, scores):
                top = scores.float().topk(2, dim=-1).values[0]
                gaps.append(float(top[0] - top[1]))
                return scores

            ar = ar_generate(model, prompt, 32, suppress_ids=spec.token_ids, logits_processor=gap)
            finite.clear()
            out = dec.generate(prompt, 32)
            assert all(finite) and len(out.new_ids) == 32
            assert not set(out.new_ids) & set(spec.token_ids)
            # up to AR's first near-tie, bf16 SPACE must pick AR's tokens
            sure = next((i for i, g in enumerate(gaps) if g < MARGIN), len(gaps))
            assert out.new_ids[:sure] == ar.new_ids[:sure], (prompt.tolist(), sure)
    finally:
        for h in handles:
            h.remove()
    assert masks and {m.dtype for m in masks} == {torch.bfloat16}


def cast_to_head(module, args):
    """What fp32-head setups hang on the head (e.g. peft's kbit preparation casts its output; this
    casts its input): the bf16 hidden states go in as fp32."""
    return (args[0].to(module.weight.dtype),) + args[1:]


@pytest.mark.parametrize("head_hook", [True, False], ids=["head-casts", "bare-head"])
@pytest.mark.parametrize("config", CONFIGS, ids=["chain", "tree", "dynamic"])
def test_fp32_head_on_bf16_trunk_gets_a_bf16_mask(config, head_hook):
    """A common setup keeps the LM head in fp32 under a bf16 trunk: the step's mask must still be
    bf16 (SDPA takes a float mask only in the query's dtype), and decoding must run, whether or not
    the head casts its own input (the decoder casts the head's input itself)."""
    model, spec = bf16_model(tie_word_embeddings=False, fp32_head=True)
    if head_hook:
        model.lm_head.register_forward_pre_hook(cast_to_head)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    dec = SpaceDecoder(model, spec, config)
    masks, finite, handles = record_masks(model)
    try:
        for prompt in prompts(2, seed=6):
            out = dec.generate(prompt, 24)
            assert len(out.new_ids) == 24 and not set(out.new_ids) & set(spec.token_ids)
    finally:
        for h in handles:
            h.remove()
    assert masks and {m.dtype for m in masks} == {torch.bfloat16}
    assert finite and all(finite)


def test_fp32_mask_unchanged(tiny):
    model, _, spec = tiny
    assert SpaceDecoder(model, spec, DecodeConfig(4)).mask_dtype == torch.float32


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_is_refused(tiny, impl):
    model, _, spec = tiny
    flash = deepcopy(model)
    flash.config._attn_implementation = impl
    with pytest.raises(ValueError, match=rf"SpaceDecoder .*attn_implementation='{impl}': flash .*'sdpa' or 'eager'"):
        SpaceDecoder(flash, spec, DecodeConfig(4))


def test_static_steps_of_a_bf16_frozen_base_model_mask_in_the_trunks_dtype():
    """A bf16 frozen-base model keeps its mask embedding's rows in fp32
    (``space.adapter_layers.MaskEmbedding``), and they are its first parameter: ``model.dtype`` is
    fp32 while attention computes in bf16 (``cache.attention_dtype``, which reads the first layer's
    attention, not the first parameter). Over a static cache both ``ar_generate`` (its 1-row
    steps' own 4-D mask) and ``SpaceDecoder`` pass masks in bf16, the queries' dtype: an fp32 mask
    under bf16 queries is what cuDNN misreads (``space.decoding.backends``)."""
    from space.adapter_layers import fuse_frozen_base, prepare_model
    from space.decoding.cache import attention_dtype

    model, tok = tiny_random_llama(seed=0, num_hidden_layers=2)
    model, spec = prepare_model(model.to(torch.bfloat16), tok, "frozen-base", 3)
    model = fuse_frozen_base(model).eval()
    assert model.dtype == torch.float32 and attention_dtype(model.get_decoder()) == torch.bfloat16
    masks, finite, handles = record_masks(model)
    prompt = torch.arange(11, 20)
    try:
        ar_generate(model, prompt, 6, suppress_ids=spec.token_ids, static_cache=True)
        assert masks and {m.dtype for m in masks} == {torch.bfloat16}, {m.dtype for m in masks}
        masks.clear()
        SpaceDecoder(model, spec, DecodeConfig(3, 2), static_cache=True).generate(prompt, 6)
        assert masks and {m.dtype for m in masks} == {torch.bfloat16}, {m.dtype for m in masks}
    finally:
        for h in handles:
            h.remove()
