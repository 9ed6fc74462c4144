"""LongRoPE models (Phi-3/3.5-mini-128k, Phi-4-mini; any config with rope_type="longrope"):
transformers picks the short or long rotary factors once per forward, by its largest position id.
A SPACE block holds candidates and mask rows ahead of x_{n-1}, so before the fix a block reaching
``original_max_position_embeddings`` switched its verification rows to the long factors steps
before AR does, and the prefill of n - 1 tokens chose by n - 1 where AR's chooses by n: greedy
SPACE differed from AR from the switch on. And transformers' generate of a Phi-3 recomputes its
whole cache at the switch, which our AR loop did not: ``ar_generate`` differed from ``generate``."""
import pytest
import torch
import transformers

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.models import tiny_tokenizer
from space.tokens import add_mask_tokens
from tests.decoding.test_lossless import oracle
from tests.oracle import oracle_generate

SWITCH = 32
HALF = 8  # head_dim 16 / 2


def longrope_model(kind: str):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=3 * SWITCH, tie_word_embeddings=True,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * HALF,
                long_factor=[1.0 + 3 * i for i in range(HALF)], original_max_position_embeddings=SWITCH)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if kind == "phi3":
            model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
                **common, original_max_position_embeddings=SWITCH, rope_parameters=rope))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope))
    model.eval()
    return model, add_mask_tokens(model, tiny_tokenizer(), mask_num=8)


@pytest.fixture(scope="module", params=["llama", "phi3"])
def longrope(request):
    return (request.param, *longrope_model(request.param))


def test_the_switch_is_read_from_the_config():
    from space.decoding.cache import cache_rebuild_at, longrope_switch

    llama, _ = longrope_model("llama")
    phi3, _ = longrope_model("phi3")
    assert longrope_switch(llama.config) == longrope_switch(phi3.config) == SWITCH
    assert cache_rebuild_at(phi3.config) == SWITCH and cache_rebuild_at(llama.config) is None
    assert longrope_switch(transformers.LlamaConfig()) is None


@pytest.mark.parametrize("plen", [6, SWITCH - 2, SWITCH + 1])
def test_greedy_space_equals_ar_and_generate_across_the_switch(longrope, plen):
    kind, model, spec = longrope
    prompt = torch.randint(11, 250, (plen,), generator=torch.Generator().manual_seed(plen))
    new = SWITCH + 8  # past the switch (from below it) and on
    ar = ar_generate(model, prompt, new, suppress_ids=spec.token_ids).new_ids
    hf = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=new,
                        do_sample=False, suppress_tokens=list(spec.token_ids), eos_token_id=None)[0, plen:].tolist()
    assert ar == hf, kind  # a Phi-3's generate recomputes its cache at the switch: so does ar_generate
    for cfg, static in ((DecodeConfig(1, 1), False), (DecodeConfig(4), True),
                        (DecodeConfig(3, tree=[[0], [1], [0, 0], [1, 0]]), False),
                        (DecodeConfig(4, tree="dynamic", lookup_tokens=4), True)):
        out = SpaceDecoder(model, spec, cfg, static_cache=static).generate(prompt, new).new_ids
        assert out == ar, (kind, plen, cfg, static)


def test_no_block_reaches_the_switch_before_ar_does(longrope):
    """With drafts that are always right, every block before the switch stops short of it (no row
    at position >= the switch while x_{n-1} is below it), and the output is still AR's."""
    kind, model, spec = longrope
    prompt = torch.randint(11, 250, (10,), generator=torch.Generator().manual_seed(1))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    blocks = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: blocks.append(kwargs["position_ids"][0].tolist())
        if kwargs.get("position_ids") is not None else None, with_kwargs=True)
    try:
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(5)), prompt, 60, override=oracle(truth, 5, 5))
    finally:
        hook.remove()
    assert out.new_ids == truth
    assert all(max(p) < SWITCH for p in blocks if p[0] < SWITCH), blocks
    assert max(out.accept_lengths) == 5  # the oracle's drafts were verified deep
