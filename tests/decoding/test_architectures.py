"""Greedy SPACE == AR on the other LLaMA-family architectures (DESIGN §1): Qwen2 and Mistral, with
and without a sliding window small enough to matter (16 tokens, prompts of 40, 40 new tokens); the
models that scale or soft-cap their logits; and Llama 3's scaled rotary, Qwen3, Gemma, OLMo 2, Phi-3
and StarCoder2 at high acceptance, decoding and frozen-base training (:data:`FAMILIES`).

SPACE keeps full-attention cache layers (it crops and compacts them) and applies a sliding window
in its own 4-D mask; AR uses transformers' sliding cache layers, so the two paths are independent.
"""
import copy
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from space.adapter_layers import prepare_model
from space.config import SpaceSettings
from space.cpu_kernels import optimize_for_cpu
from space.data.collator import SpaceCollator
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.cache import attention_windows
from space.decoding.fused import fuse_trunk
from space.models import tiny_tokenizer
from space.tokens import add_mask_tokens
from space.masking import mask_rows
from space.train.steps import frozen_base_step, one_pass_step
from tests.conftest import TRAINED_K, CycleLanguage, random_frozen_base, train_drafter
from tests.decoding.test_lossless import oracle
from tests.oracle import oracle_generate

WINDOW = 16
ARCHS = {  # name: (model class, config class, overrides)
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen2-sliding-upper-layer": (Qwen2ForCausalLM, Qwen2Config,
                                  dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2-sliding-all-layers": (Qwen2ForCausalLM, Qwen2Config,
                                 dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
    "mistral-sliding": (MistralForCausalLM, MistralConfig, dict(sliding_window=WINDOW)),
    # Ministral-8B's config: Mistral's forward slides on every layer, whatever layer_types lists (transformers warns)
    "mistral-listing-layer-types": (MistralForCausalLM, MistralConfig,
                                    dict(sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"])),
}
CONFIGS = [DecodeConfig(4), DecodeConfig(4, 2), DecodeConfig(3, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
           DecodeConfig(3, 2, lookup_tokens=6),
           DecodeConfig(3, 4, tree="dynamic", lookup_tokens=6)]  # the shipped kind of layout (issue 44: untested here)


def tiny_model(arch: str, **overrides):
    """(model, MaskSpec): a 2-layer random model of ``arch`` (hidden 64, vocab 320), same weights
    for every window setting, with one mask token (k up to 8). Weights are drawn with std 0.2:
    at transformers' 0.02 such a model repeats one token whatever it attends to."""
    model_cls, config_cls, arch_overrides = ARCHS[arch]
    tok = tiny_tokenizer()
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               tie_word_embeddings=True, initializer_range=0.2, **arch_overrides)
    cfg.update(overrides)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_cls(config_cls(**cfg)).eval()
    return model, add_mask_tokens(model, tok, mask_num=8)


def prompts(n_cases: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for n in [40, 10][:n_cases]:
        yield torch.randint(11, 250, (n,), generator=gen)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_exact_other_architectures(arch):
    """A Mistral config listing layer_types crashed SPACE (a mask per kind of layer for a forward that
    takes one) and our AR loop past the window (transformers' cache kept the listed full layers, as
    in transformers' own generate, while the forward's masks slide on every layer)."""
    model, spec = tiny_model(arch)
    for prompt in prompts(2, seed=1):
        ar = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids)
        for config in CONFIGS:
            assert SpaceDecoder(model, spec, config).generate(prompt, 40).new_ids == ar.new_ids, (arch, config)


@pytest.mark.parametrize("arch", ["qwen2-sliding-upper-layer", "mistral-sliding"])
def test_sliding_window_exact_at_every_accept_length(arch):
    """Oracle drafts make steps accept 0..k candidates, so accepted entries stay in the cache and
    rows late in a block reach back across the window; a tree oracle puts the truth at rank 1, so
    the accepted path's entries are moved inside the cache (compaction)."""
    model, spec = tiny_model(arch)
    prompt = next(prompts(1, seed=2))
    truth = ar_generate(model, prompt, 60, suppress_ids=spec.token_ids).new_ids
    for corrupt_at in range(5):
        out = oracle_generate(SpaceDecoder(model, spec, DecodeConfig(4)), prompt, 60, override=oracle(truth, corrupt_at, 4))
        assert out.new_ids == truth
        assert max(out.accept_lengths) == corrupt_at

    def rank_one(generated, drafts):  # the true token as every mask's runner-up
        out = torch.stack([torch.arange(20, 22) + j for j in range(3)])
        for j, t in enumerate(truth[len(generated): len(generated) + 3]):
            out[j, 1] = t
        return out

    dec = SpaceDecoder(model, spec, DecodeConfig(3, 1, tree=[[0], [1], [1, 1], [1, 1, 1]]))
    out = oracle_generate(dec, prompt, 60, override=rank_one)
    assert out.new_ids == truth and max(out.accept_lengths) == 3


def test_the_window_matters_and_ar_matches_transformers():
    """The test window changes the output (so the tests above see it), and our AR loop equals
    transformers' own greedy generate on the sliding-window model."""
    windowed, spec = tiny_model("mistral-sliding")
    full, _ = tiny_model("mistral-sliding", sliding_window=None)
    prompt = next(prompts(1, seed=1))
    ar = ar_generate(windowed, prompt, 40, suppress_ids=spec.token_ids).new_ids
    assert ar != ar_generate(full, prompt, 40, suppress_ids=spec.token_ids).new_ids
    hf = windowed.generate(prompt[None], max_new_tokens=40, do_sample=False, suppress_tokens=list(spec.token_ids),
                           pad_token_id=0)[0, prompt.numel():].tolist()
    assert hf == ar


def test_ar_decodes_a_model_whose_blocks_are_not_layers():
    """Our AR loop (every method's reference) on GPT-2, whose decoder keeps its blocks as ``.h``:
    choosing its cache read ``.layers`` and failed (SPACE itself needs ``.layers``)."""
    config = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
    prompt = next(prompts(1, seed=1))
    hf = model.generate(prompt[None], max_new_tokens=20, do_sample=False, pad_token_id=0)[0, prompt.numel():].tolist()
    assert ar_generate(model, prompt, 20).new_ids == hf


def test_attention_windows():
    assert attention_windows(tiny_model("qwen2")[0].config) == {"full_attention": None}
    assert attention_windows(tiny_model("mistral-sliding")[0].config) == {"sliding_attention": WINDOW}
    listing = tiny_model("mistral-listing-layer-types")[0]
    assert attention_windows(listing.config) == {"sliding_attention": WINDOW}
    # the same weights without the list: the same AR answer (past the window)
    prompt = next(prompts(1, seed=1))
    assert (ar_generate(listing, prompt, 40).new_ids == ar_generate(tiny_model("mistral-sliding")[0], prompt, 40).new_ids
            != ar_generate(tiny_model("mistral-sliding", sliding_window=None)[0], prompt, 40).new_ids)
    assert attention_windows(tiny_model("qwen2-sliding-upper-layer")[0].config) == {
        "full_attention": None, "sliding_attention": WINDOW}
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_windows(SimpleNamespace(layer_types=["full_attention", "chunked_attention"], sliding_window=8))
    # a list of other kinds is refused even where the config class does not declare it (the model may
    # read it all the same: remote code, a subclass), not only where SPACE would use it
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_windows(transformers.MistralConfig(layer_types=["full_attention", "chunked_attention"],
                                                     sliding_window=8, num_hidden_layers=2))
    # transformers loads Gemma 3 from 4B up as Gemma3ForConditionalGeneration: its config keeps the
    # window in text_config, and read from the top it had none
    multimodal = transformers.Gemma3Config(text_config=dict(
        sliding_window=5, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    assert attention_windows(multimodal) == {"sliding_attention": 5, "full_attention": None}


def test_layer_types_are_read_where_the_model_reads_them_and_the_config_is_left_alone():
    """Catches ``reads_layer_types`` ignoring a config that is no dataclass (transformers before its
    dataclass configs, or any stand-in object): its listed kinds are taken at their word. And
    catches our AR loop's sliding cache overwriting the model's own config: a Mistral config listing
    layer_types (Ministral-8B) keeps its list after decoding (a model saved after a decode kept
    every layer sliding)."""
    from space.decoding.cache import reads_layer_types

    plain = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    assert reads_layer_types(plain)
    assert attention_windows(plain) == {"full_attention": None, "sliding_attention": 8}
    listing = tiny_model("mistral-listing-layer-types")[0]
    assert not reads_layer_types(listing.config)
    assert reads_layer_types(tiny_model("qwen2-sliding-upper-layer")[0].config)
    ar_generate(listing, next(prompts(1, seed=1)), 24)
    assert listing.config.layer_types == ["full_attention", "sliding_attention"]


def test_ar_sliding_cache_slides_as_the_forward_does():
    """Catches ``sliding_cache`` building its layers from anything but the layer kinds the forward
    uses: a Mistral config listing ``layer_types`` slides on every layer (and on none without a
    window), also as the text config of a multimodal Mistral 3, whose top-level config lists none;
    a Qwen2 config that declares its list keeps it (transformers' own cache kept the listed full
    layer whole while the forward slid it, and AR's masks stopped fitting past the window)."""
    from space.decoding.cache import sliding_cache

    def kinds(config):
        return [type(layer).__name__ for layer in sliding_cache(config).layers]

    listed = dict(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2)
    slides = ["DynamicSlidingWindowLayer"] * 2
    assert kinds(transformers.MistralConfig(sliding_window=8, **listed)) == slides
    assert kinds(transformers.MistralConfig(sliding_window=None, **listed)) == ["DynamicLayer"] * 2
    assert kinds(transformers.Mistral3Config(text_config=dict(model_type="mistral", sliding_window=8, **listed))) == slides
    assert kinds(transformers.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                          num_hidden_layers=2)) == ["DynamicLayer", "DynamicSlidingWindowLayer"]


def _causal_reference(model, ids: torch.Tensor, pos: torch.Tensor, start: int | None = None) -> torch.Tensor:
    """The model's own logits for the last of ``ids`` as one causal sequence at positions 0.. (transformers
    applies a sliding window there itself), the frozen-base LoRA acting from row ``start``."""
    assert pos.tolist() == list(range(len(ids)))  # a row and what it sees form one causal sequence
    with mask_rows(start):
        return model(input_ids=ids[None]).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen2-sliding-upper-layer", "qwen2-sliding-all-layers",
                                  "mistral-listing-layer-types"])
def test_sar_sft_sees_what_decoding_sees_past_a_sliding_window(arch, attn):
    """SAR-SFT on sequences up to three windows long. Every real row scores as the model's own
    causal forward scores it. Every mask row scores as a causal forward of the tokens up to its
    anchor and its group's masks up to itself: what a decode step's mask rows see. Both passes of
    a frozen-base step with a non-zero LoRA are checked. Before, the collator's plain 4-D mask let rows past the window see
    too far back, and the frozen-base prefix cache kept only a window of real tokens on sliding layers."""
    model, spec = tiny_model(arch)
    model.set_attn_implementation(attn)
    peft_model, spec = prepare_model(model, tiny_tokenizer(), "frozen-base", 3)
    with torch.no_grad():
        for key, p in peft_model.named_parameters():
            if "lora_B" in key:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(11, 250, (n,), generator=gen).tolist() for n in (3 * WINDOW, 2 * WINDOW + 5)]
    batch = SpaceCollator(spec.ids_for(3), 3, 0, spans_per_sample=8)(
        [{"input_ids": s, "prompt_len": 2, "idx": i} for i, s in enumerate(seqs)])
    T, ids, pos, allowed = batch["num_real"], batch["input_ids"], batch["position_ids"], batch["attention_mask"][:, 0]
    rows = batch["mask_offset"][:, T:] >= 0
    with torch.no_grad():
        one = one_pass_step(peft_model, batch, SpaceSettings(mask_num=3)).logits
        two = frozen_base_step(peft_model, batch, SpaceSettings(mask_num=3)).logits
        assert (one[:, T:][rows] - two[rows]).abs().max() < 1e-4
        checked = 0
        for b, seq in enumerate(seqs):
            real = peft_model(input_ids=torch.tensor([seq])).logits[0]
            assert (one[b, :len(seq)] - real).abs().max() < 1e-4, b
            for c in (T + rows[b].nonzero()[:, 0]).tolist():
                seen = allowed[b, c].nonzero()[:, 0]  # its anchor's prefix, then its group's masks up to itself
                want = _causal_reference(peft_model, ids[b, seen], pos[b, seen], start=int((seen < T).sum()))
                assert (one[b, c] - want).abs().max() < 1e-4, (b, c)
                checked += pos[b, c] >= WINDOW
        assert checked >= 8  # mask rows past the window were compared


def test_the_step_cost_curve_refuses_a_window_it_would_ignore():
    """The step-cost curve keeps plain 4-D masks: a sliding window is refused when its sequences
    reach past the window."""
    from space.decoding.cache import refuse_sliding_window

    cfg = MistralConfig(sliding_window=16)
    with pytest.raises(ValueError, match="slides over 16 tokens, sequences here reach 512"):
        refuse_sliding_window(cfg, "the step-cost measurement", 512)
    with pytest.raises(ValueError, match="sequences here reach 16"):  # the cache keeps 15 past tokens
        refuse_sliding_window(cfg, "the step-cost measurement", 16)
    refuse_sliding_window(cfg, "the step-cost measurement", 15)  # never past the window: the same masks
    refuse_sliding_window(MistralConfig(sliding_window=None), "the step-cost measurement", 4096)


def test_the_step_cost_is_measured_short_of_a_sliding_window():
    """``--step-cost measure`` (and ``auto`` on a GPU) times steps after a cache short of the model's
    window, where the plain timed masks are the sliding ones: a sliding-window model is priced, not
    refused (it was, whatever the cache). A window too short for the rows is still refused."""
    from space.eval.step_cost import price_at_load

    model, _ = tiny_model("mistral-sliding", sliding_window=64)
    decode = DecodeConfig(3, 4, tree="dynamic")  # up to 32 rows: a cache of 31 tokens fits the window
    priced, setup = price_at_load(model, decode, None, "measure", "stock")
    assert [q for q, _ in priced.step_cost] == [1, 2, 4, 8, 12, 16, 24, 32] and setup["measured"] == "at load"
    with pytest.raises(ValueError, match="slides over 16 tokens"):
        price_at_load(tiny_model("mistral-sliding")[0], decode, None, "measure", "stock")


@pytest.mark.parametrize("arch, overrides", [
    ("granite", dict(logits_scaling=4.0)),
    ("gemma2", dict(final_logit_softcapping=2.0, attn_implementation="eager", layer_types=["full_attention"] * 2)),
    ("cohere", dict(logit_scale=0.0625)),
    ("hyperclovax", dict(logits_scaling=4.0)),  # multiplies by it, where Granite divides
])
def test_the_models_own_logit_scaling_and_soft_capping(arch, overrides):
    """The decoders call the LM head on chosen rows themselves, so they must do what the model's
    forward does after it (Granite divides by logits_scaling, Gemma 2 soft-caps, Cohere scales).
    Greedy output cannot show a miss (each is increasing), sampling drew from another
    distribution: compared here as logits, SPACE's and the captured AR step's."""
    from space.decoding import SamplingConfig
    from space.decoding.graphs import StepGraphs

    names = {"granite": "Granite", "gemma2": "Gemma2", "cohere": "Cohere", "hyperclovax": "HyperCLOVAX"}
    config_cls = getattr(transformers, f"{names[arch]}Config")
    model_cls = getattr(transformers, f"{names[arch]}ForCausalLM")
    attn = overrides.pop("attn_implementation", None)
    tok = tiny_tokenizer()
    config = config_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        tie_word_embeddings=False, initializer_range=0.2, **overrides)
    if attn:
        config._attn_implementation = attn
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_cls(config).eval()
    spec = add_mask_tokens(model, tok, mask_num=3)
    prompt = torch.randint(11, 250, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=prompt[None]).logits[0]  # (seq, vocab)
        hidden = model.get_decoder()(input_ids=prompt[None]).last_hidden_state[0]
        got = SpaceDecoder(model, spec, DecodeConfig(3))._logits(hidden)
    real = torch.arange(want.shape[1]) != spec.token_ids[0]
    torch.testing.assert_close(got[:, real], want[:, real].float(), rtol=1e-4, atol=1e-4)
    assert (want[:, real] - model.get_output_embeddings()(hidden)[:, real]).abs().max() > 0.1  # it does matter
    sampling = SamplingConfig(temperature=1.0, seed=3)
    eager = ar_generate(model, prompt, 16, sampling, suppress_ids=spec.token_ids)
    captured = ar_generate(model, prompt, 16, sampling, suppress_ids=spec.token_ids,
                           graphs=StepGraphs(model, slots=64, sizes=[4]))
    assert captured.new_ids == eager.new_ids



@pytest.mark.parametrize("mode", ["lora", "frozen-base"])
def test_a_mask_embedding_starts_as_the_models_own_embedding_of_its_row(mode):
    """A mask token enters the trunk as the model embeds its row (DESIGN §3.7), in every mode.
    Gemma's embedding multiplies by sqrt(hidden): the trainable mask rows, unscaled, entered
    1/sqrt(hidden) of it in lora and frozen-base (8x too small here, 45x at Gemma 2 2B's size),
    where full mode's went through the scaled embedding."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          layer_types=["full_attention"] * 2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(config)
    model, spec = prepare_model(model, tiny_tokenizer(), mode, 3)
    embedding = model.get_input_embeddings()
    assert embedding.base.embed_scale == 8.0  # sqrt(64)
    ids = torch.arange(embedding.base.num_embeddings)[None]  # every token, the masks among them
    with torch.no_grad():
        torch.testing.assert_close(embedding(ids), embedding.base(ids))  # mask rows start as the rows copied
    assert all(0 <= i < ids.shape[1] for i in spec.token_ids)


def test_a_field_of_the_same_name_in_another_model_is_not_read():
    """MPT's logit_scale (a number or "inv_sqrt_d_model") is never applied by transformers: read
    by name alone it scaled MPT's logits, or failed to build the decoder."""
    from transformers import LlamaConfig, MptConfig

    from space.decoding.sampling import logit_transform

    assert logit_transform(MptConfig(logit_scale="inv_sqrt_d_model")) is None
    assert logit_transform(MptConfig(logit_scale=4.0)) is None and logit_transform(LlamaConfig()) is None


@pytest.mark.parametrize("model_type, field, factor", [
    ("cohere2", dict(logit_scale=0.25), 0.25),  # Cohere's scale, multiplied
    ("granitemoe", dict(logits_scaling=4.0), 0.25),  # Granite's, divided
    ("granitemoeshared", dict(logits_scaling=4.0), 0.25),
    ("granitemoehybrid", dict(logits_scaling=4.0), 0.25),
    ("minicpm3", dict(dim_model_base=640), 0.25),  # divides by hidden_size / dim_model_base = 2560 / 640
])
def test_every_model_of_a_scaled_family_gets_its_logit_scaling(model_type, field, factor):
    """Cohere 2, the Granite MoE models and MiniCPM3 scale their logits in their forward as
    Cohere and Granite do (tested on models above). Catches matching the family by its first
    model_type alone: the others' drafts and verification used unscaled logits, so sampling drew
    from another distribution than the model's (greedy output cannot show it)."""
    from transformers import AutoConfig

    from space.decoding.sampling import logit_transform

    transform = logit_transform(AutoConfig.for_model(model_type, **field))
    logits = torch.tensor([[1.0, -2.0, 3.0]])
    assert transform is not None
    torch.testing.assert_close(transform(logits), logits * factor)


# Families our users fine-tune beyond Llama 2 / Mistral / Qwen2, each with what sets it apart on
# SPACE's paths (the fused trunk, the norm swap, the gated LoRA, the frozen-base training passes):
# (config class, model class, config overrides, frozen-base LoRA targets: None = the Llama names)
FAMILIES = {
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(  # Llama 3.x's frequency bands
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)), None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), None),  # RMSNorms on q and k per head
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), None),  # (1 + weight) norms, scaled embedding
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, None),  # norms after attention and MLP, q/k norms
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0),  # q/k/v and gate/up already one linear each
             ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {},  # LayerNorm, biases, a plain MLP
                   ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")),
    # multi-head latent attention: it caches a latent (kv_lora_rank wide) as keys and a rotary key as
    # values, of other widths, which the slab cache refused; kv_b_proj runs on (batch, 1, seq, rank)
    # rows, which a frozen-base LoRA refuses (its gate needs (batch, seq, features)), and peft moves
    # gate/up/down_proj onto the MoE experts' fused weights (prepare_model refuses that)
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16), ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")),
    # full-attention layers of another head dim than the sliding ones (one slab could not hold them),
    # the last layer reading the last full layer's cache (no k/v of its own), per-layer input embeddings
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=5, head_dim=16, global_head_dim=32, num_kv_shared_layers=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=320), None),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_drafter(request):
    """(family, model, MaskSpec, CycleLanguage): a 2-layer model of the family (hidden 64, std 0.02),
    trained for about 10 s as the session's ``trained_drafter`` is, so its k=4 drafts are usually
    right and exactness is checked at high acceptance, not on rejected drafts."""
    config_cls, model_cls, overrides, _ = FAMILIES[request.param]
    config = getattr(transformers, config_cls)(**{**dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True), **overrides})
    torch.set_num_threads(2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
        spec = add_mask_tokens(model, tiny_tokenizer(), mask_num=TRAINED_K)
        cycle = (11 + torch.randperm(200, generator=torch.Generator().manual_seed(0))[:40]).tolist()
        train_drafter(model, spec, CycleLanguage(cycle, seed=0), TRAINED_K, steps=200)
    return request.param, model, spec, CycleLanguage(cycle, seed=1)


def test_exact_at_high_acceptance_on_more_families(family_drafter):
    """Greedy SPACE == AR of the same weights on Llama 3's scaled rotary, Qwen3, Gemma, OLMo 2, Phi-3,
    StarCoder2, DeepSeek-V3's latent attention and Gemma 4's layers of two head dims, at high
    acceptance: the trained model with stock kernels and as ``load_space`` runs it (the fused trunk
    and the CPU's fast kernels), and as a frozen base with its mask rows and a random gated LoRA on
    the family's own projections (``fuse_frozen_base``: the LoRA acts on mask rows only, so the
    output is still the base's), for a chain, two groups, a static tree and the shipped kind of
    layout (the dynamic tree with prompt lookup); the trees over a static cache too (Gemma 4's
    shared-cache layer has no cache of its own to compact: it failed there)."""
    name, model, spec, lang = family_drafter
    K = TRAINED_K
    fast = copy.deepcopy(model)
    fuse_trunk(fast)
    optimize_for_cpu(fast)
    targets = FAMILIES[name][3]
    gated, spec2 = random_frozen_base(model, tiny_tokenizer(), spec, K,
                                      **({"lora_targets": targets} if targets else {}))
    assert spec2.token_ids == spec.token_ids
    fuse_trunk(gated)
    optimize_for_cpu(gated)
    configs = [DecodeConfig(K), DecodeConfig(K, 2), DecodeConfig(K, 2, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
               DecodeConfig(3, 4, tree="dynamic", lookup_tokens=6)]
    prompts = [torch.tensor(lang.sample(2 + 3 * i)) for i in range(3)]
    truth = [ar_generate(model, p, 40, suppress_ids=spec.token_ids).new_ids for p in prompts]
    for trunk, decoded in [("stock", model), ("fused+fast", fast), ("frozen-base", gated)]:
        tokens = steps = 0
        for config in configs:
            dec = SpaceDecoder(decoded, spec, config)
            for prompt, want in zip(prompts, truth):
                out = dec.generate(prompt, 40)
                assert out.new_ids == want, (name, trunk, config, prompt.tolist())
                tokens, steps = tokens + len(out.new_ids), steps + out.num_steps
        for config in configs[2:] if trunk == "stock" else ():  # trees over a static cache: paths compacted in it
            assert SpaceDecoder(decoded, spec, config, static_cache=True).generate(prompts[-1], 40).new_ids == truth[-1]
        # the drafts were really accepted (about 3.6 a step; the frozen base's seeded random LoRA moves them)
        assert tokens / steps > 2.5, (name, trunk)


def test_frozen_base_training_passes_on_more_families(family_drafter):
    """SAR-SFT's frozen-base step on each family: its two passes (a no-grad real pass into a prefix
    cache, then the mask rows) give one gated forward's mask logits, and the teacher-target loss
    reaches the LoRA and the mask rows, and nothing else."""
    name, model, spec, _ = family_drafter
    targets = FAMILIES[name][3]
    peft_model, spec = prepare_model(copy.deepcopy(model), tiny_tokenizer(), "frozen-base", 3,
                                     **({"lora_targets": targets} if targets else {}))
    with torch.no_grad():
        for key, p in peft_model.named_parameters():
            if "lora_B" in key:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    collator = SpaceCollator(spec.ids_for(3), 3, 0, spans_per_sample=2)
    batch = collator([{"input_ids": list(range(30, 60)), "prompt_len": 5, "idx": 0},
                      {"input_ids": list(range(70, 90)), "prompt_len": 5, "idx": 1}])
    T, rows = batch["num_real"], batch["mask_offset"][:, batch["num_real"]:] >= 0
    with torch.no_grad():
        one = one_pass_step(peft_model, batch, SpaceSettings(mask_num=3)).logits[:, T:][rows]
        two = frozen_base_step(peft_model, batch, SpaceSettings(mask_num=3)).logits[rows]
    assert (one - two).abs().max() < 1e-4
    step = frozen_base_step(peft_model, batch, SpaceSettings(mask_num=3, mask_target="teacher", teacher_topk=5))
    assert torch.isfinite(step.loss)
    step.loss.backward()
    graded = {key for key, p in peft_model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert graded and all("lora_" in key or "mask_rows" in key for key in graded), sorted(graded)
    assert any("lora_A" in key for key in graded) and any("mask_rows" in key for key in graded)


@pytest.mark.parametrize("name, overrides", [
    ("phi3", {}),
    ("phi3", dict(sliding_window=16)),  # configs/train/tiny_smoke.yaml's sequences reach 384 tokens
    ("deepseek-v3", dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         n_group=1, topk_group=1)),  # a dense layer and an MoE layer
], ids=["phi3", "phi3-sliding-window", "deepseek-v3-moe"])
def test_space_train_then_space_eval_on_a_local_model_of_another_family(name, overrides, tmp_path, capsys):
    """What a user of another family runs: ``space-train`` (frozen-base, the family's own
    lora_targets) on a local HF folder, then ``space-eval`` of the artifact, exact against AR. A
    DeepSeek-V3 with an MoE layer and gate/up/down_proj targets trained to the end and failed only
    when it saved its adapter (peft had moved them onto the experts' fused weights); it is refused
    before the first step now, leaving no checkpoint. A sliding window shorter than the sequences
    was refused before training; SAR-SFT applies it in its masks now."""
    from space.eval.__main__ import main as eval_main
    from space.train.__main__ import main as train_main

    config_cls, model_cls, family_overrides, targets = FAMILIES[name]
    tok = tiny_tokenizer()
    config = getattr(transformers, config_cls)(**{**dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), **family_overrides, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        getattr(transformers, model_cls)(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    args = ["--config", "configs/train/tiny_smoke.yaml", "--model_name_or_path", str(tmp_path / "model"),
            "--max_steps", "2", "--limit", "8"]
    if "deepseek" in name:
        with pytest.raises(ValueError, match=r"peft retargets lora_targets \['down_proj', 'gate_proj', 'up_proj'\]"):
            train_main([*args, "--output_dir", str(tmp_path / "moved"),
                        "--lora_targets", ",".join([*targets, "gate_proj", "up_proj", "down_proj"])])
        assert not list((tmp_path / "moved").glob("checkpoint-*"))
    final = train_main([*args, "--output_dir", str(tmp_path / "run"), "--lora_targets", ",".join(targets)])
    assert sorted(json.loads((final / "adapter_config.json").read_text())["target_modules"]) == sorted(targets)
    summary = eval_main(["--adapter", str(final), "--dataset", "humaneval", "--limit", "2", "--max-new-tokens", "16",
                         "--methods", "ar,space", "--threads", "2", "--out", str(tmp_path / "eval")])
    assert summary["exact_match_rate"] == 1.0 and summary["methods"]["space"]["new_tokens"] > 0
