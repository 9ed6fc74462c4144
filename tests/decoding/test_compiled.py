"""The opt-in compiled trunk (issue 43, ``space.decoding.compiled``): SPACE over a compiled trunk
equals AR over the same compiled trunk in fp32, for the chain, a static tree and the dynamic tree
with lookup, on the trained drafter (long accepts, moving tree paths); both then preallocate their
caches, and the graphs stay few: one per kind of call, shared by every decoder layer (issue 58),
with sizes symbolic from the first compile (not one graph per layer, row count, mask row or
prompt)."""
import copy

import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.compiled import compile_trunk, is_compiled
from space.eval.step_cost import time_steps
from tests.conftest import CycleLanguage, fresh_language

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")


@pytest.fixture(scope="module")
def compiled(trained_drafter):
    model, tok, spec, lang = trained_drafter
    lang = fresh_language(lang)
    return compile_trunk(copy.deepcopy(model)), spec, lang


def test_compiled_trunk_is_exact_and_preallocates(compiled):
    from torch._dynamo.utils import counters

    model, spec, lang = compiled
    assert is_compiled(model) and compile_trunk(model) is model  # once
    graphs = counters["stats"]["unique_graphs"]
    lang = CycleLanguage(lang.tokens, seed=7)  # its own prompts: the shared language's depend on the tests before
    for config in [DecodeConfig(3, 4), DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0]]),
                   DecodeConfig(4, tree="dynamic", lookup_tokens=8, row_budget=24)]:
        dec = SpaceDecoder(model, spec, config)
        assert dec.static_cache  # a compiled trunk wants repeating shapes
        for n in (12, 30):
            prompt = torch.tensor(lang.sample(n))
            truth = ar_generate(model, prompt, 48, suppress_ids=spec.token_ids).new_ids
            out = dec.generate(prompt, 48)
            assert out.new_ids == truth, config
            assert max(out.accept_lengths) >= 2
    # symbolic sizes from the first compile: the 1-row AR graph (dynamo specializes a size of 1) and
    # the SPACE block graph, with mask rows and, on some prompts, without, each serving both layers
    # (a graph per layer would double it; dynamo's default would add a specialized graph per size
    # before its dynamic one: 5 on two prompts)
    assert counters["stats"]["unique_graphs"] - graphs <= 3, counters["stats"]["unique_graphs"] - graphs


def test_an_eager_trunk_is_not_compiled(trained):
    model, _, spec, _ = trained
    assert not is_compiled(model)
    assert not SpaceDecoder(model, spec, DecodeConfig(3)).static_cache
    with pytest.raises(ValueError, match="get_decoder"):
        compile_trunk(torch.nn.Linear(2, 2))


def test_compile_refuses_the_fast_cpu_kernels():
    """Inductor cannot lower the fast kernels' prepacked linears (it packs the stock ones itself)."""
    from space.loader import load_space

    with pytest.raises(ValueError, match="stock kernels"):
        load_space("tiny-random-llama", mask_num=3, kernels="fast", compile=True)


def test_compile_refuses_the_fused_trunk():
    """The fused trunk's groups keep their GEMM's outputs between member calls (module state): an
    eager ``load_space`` fuses, and compiling that trunk must be refused, not traced."""
    from space.loader import load_space

    model, _, _ = load_space("tiny-random-llama", mask_num=3)
    assert model.space_trunk["fused_groups"]
    with pytest.raises(ValueError, match="unfused trunk"):
        compile_trunk(model)
    assert not is_compiled(model)


def test_space_eval_compile_flag_is_recorded_and_a_resume_key(tmp_path, capsys):
    """``space-eval --compile``: every method runs over the compiled trunk in few graphs, SPACE stays
    exact, the run records it and says when it compiles, and a rerun without it refuses to mix the
    timings."""
    import json
    import re

    from torch._dynamo.utils import counters

    from space.eval.__main__ import main as eval_main

    args = ["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "12",
            "--mask-num", "3", "--threads", "1", "--methods", "ar,pld,space", "--out", str(tmp_path)]
    graphs = counters["stats"]["unique_graphs"]
    summary = eval_main([*args, "--compile"])
    # a graph per kind of call, each serving both layers: AR's step, PLD's verify and its 1-row step
    # (PLD's prefill runs eagerly, as the decoders' prompts do), SPACE's block
    assert counters["stats"]["unique_graphs"] - graphs <= 5, counters["stats"]
    assert summary["exact_match_rate"] == 1.0 and summary["meta"]["compile"] is True
    assert json.loads((tmp_path / "run_config.json").read_text())["compile"] is True
    assert summary["meta"]["trunk"] is None  # compiled unfused: the fused trunk keeps state no graph may hold
    out = capsys.readouterr().out
    assert re.search(r"\[space-eval\] compiling graph \d+/\d+ \(a new shape; may take minutes\)", out), out
    assert re.search(r"\[space-eval\] compiled graph \d+/\d+ in \d+ s", out), out
    with pytest.raises(ValueError, match="'compile': \\(True, False\\)"):
        eval_main([*args, "--kernels", "stock"])  # the same run but eager: its timings would mix
    with pytest.raises(ValueError, match="--compile takes --kernels stock"):
        eval_main([*args, "--compile", "--kernels", "fast"])
    with pytest.raises(ValueError, match="reduce-overhead records CUDA graphs and needs a CUDA"):
        eval_main([*args, "--compile", "reduce-overhead"])  # CUDA graphs: refused on a CPU (before the load)
    with pytest.raises(SystemExit):
        eval_main([*args, "--compile", "max-speed"])


def test_compile_modes(trained):
    model, *_ = trained
    with pytest.raises(ValueError, match="unknown compile mode 'max-speed'"):
        compile_trunk(copy.deepcopy(model), mode="max-speed")
    assert is_compiled(compile_trunk(copy.deepcopy(model), mode="reduce-overhead"))  # compiles at the first call


def test_compiled_frozen_base_reads_the_mask_rows_in_the_graph(monkeypatch):
    """The shipped kind of adapter: a frozen-base LoRA whose gate (``mask_rows``) is read inside the
    compiled layers, with the mask start changing from step to step. SPACE equals AR over the same
    compiled trunk, AR preallocated its cache as the decoder did, one graph serves all 4 layers (the
    layer index stays out of it: in it, each layer was a graph of its own), and the first mask row
    enters the graph as an argument: the graphs stay few (read as a global, each start made its own
    graph)."""
    from torch._dynamo.utils import counters

    import space.decoding.decoder as decoder_module
    from space.adapter_layers import fuse_frozen_base, prepare_model
    from space.decoding import autoregressive
    from space.models import tiny_random_llama

    torch._dynamo.reset()  # the graph count below is this test's: earlier tests' graphs and guards don't count
    model, tok = tiny_random_llama(num_hidden_layers=4)
    with torch.random.fork_rng():  # the LoRA sets the drafts, hence the starts counted below: seeded
        torch.manual_seed(0)
        model, spec = prepare_model(model, tok, "frozen-base", 3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # the mask rows really differ from the base's
    model = compile_trunk(fuse_frozen_base(model))
    made = []
    real = autoregressive.preallocated
    monkeypatch.setattr(autoregressive, "preallocated", lambda *a: made.append(a) or real(*a))
    prompt = torch.randint(11, 250, (14,), generator=torch.Generator().manual_seed(5))
    graphs = counters["stats"]["unique_graphs"]
    truth = ar_generate(model, prompt, 30, suppress_ids=spec.token_ids).new_ids
    assert made == [(4, 14 + 30)]
    assert counters["stats"]["unique_graphs"] - graphs == 1, counters["stats"]  # AR's step, every layer's
    starts = set()
    real_rows = decoder_module.mask_rows
    monkeypatch.setattr(decoder_module, "mask_rows", lambda start: starts.add(start) or real_rows(start))
    graphs = counters["stats"]["unique_graphs"]
    for config in [DecodeConfig(3, 2), DecodeConfig(3, tree="dynamic", lookup_tokens=6)]:
        assert SpaceDecoder(model, spec, config).generate(prompt, 30).new_ids == truth, config
    # blocks with and without mask rows (a start past the block), not one graph per start or layer
    assert len(starts - {None}) >= 4 and counters["stats"]["unique_graphs"] - graphs <= 3, (starts, counters["stats"])


def test_a_second_compile_keeps_the_first_and_raises_the_graph_limit():
    """Cheap, nothing compiled yet (compilation happens at the first call): a second
    ``compile_trunk`` returns the model as the first left it (a new compiled function would compile
    every graph again, and in ``reduce-overhead`` wrap the compiled trunk in another), and the
    per-function graph limit is raised to ``RECOMPILE_LIMIT`` from dynamo's lower default (past it
    dynamo runs eagerly without a word)."""
    from space.decoding.compiled import RECOMPILE_LIMIT
    from space.models import tiny_random_llama

    # dynamo's default, whatever ran before; patch() restores it (monkeypatch's undo deletes the key)
    with torch._dynamo.config.patch(recompile_limit=8):
        for mode in (None, "reduce-overhead"):
            model, _ = tiny_random_llama()
            model = compile_trunk(model, mode=mode)
            trunk = model.get_decoder()
            forwards = [trunk.forward, *(layer.forward for layer in trunk.layers)]
            assert compile_trunk(model, mode=mode) is model and is_compiled(model)
            assert [trunk.forward, *(layer.forward for layer in trunk.layers)] == forwards, mode
        assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT


def test_frozen_trunk_is_exact_on_every_prompt_in_few_graphs():
    """``compile_trunk(mode="frozen")`` (issue 58): the weights folded into the graph for
    inductor's C++ GEMM, the trunk whole and the LM head. On a frozen-base adapter with a strong
    LoRA and decisive logits, AR over the frozen trunk equals AR over the eager model on two
    prompts of different lengths, each its own static cache (transformers marks a static cache's
    tensors as static addresses, and freezing folded them into the graph: the second cache was
    then never written or read); SPACE's chain and dynamic tree equal that AR; and the graphs stay
    few: the slot count and the block's rows are symbolic and the first mask row enters as a gate,
    so AR's step is one graph for both prompts and SPACE's blocks one more, each with its head's."""
    from torch._dynamo.utils import counters

    from space.adapter_layers import fuse_frozen_base, prepare_model
    from space.models import tiny_random_llama

    torch._dynamo.reset()
    model, tok = tiny_random_llama(num_hidden_layers=3)
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # larger than the 0.02 init: logits far apart, so a wrong cache shows in the tokens
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "lora_B" in name else 0.15))
    eager = fuse_frozen_base(model).eval()
    frozen = compile_trunk(copy.deepcopy(eager), mode="frozen")
    assert is_compiled(frozen)
    prompts = [torch.randint(11, 250, (n,), generator=gen) for n in (14, 23)]
    graphs = counters["stats"]["unique_graphs"]
    truths = []
    for prompt in prompts:
        truth = ar_generate(frozen, prompt, 24, suppress_ids=spec.token_ids).new_ids
        assert truth == ar_generate(eager, prompt, 24, static_cache=True, suppress_ids=spec.token_ids).new_ids
        truths.append(truth)
    assert counters["stats"]["unique_graphs"] - graphs <= 2, counters["stats"]  # AR's step and its head row
    graphs = counters["stats"]["unique_graphs"]
    for config in [DecodeConfig(3, 2), DecodeConfig(3, tree="dynamic", lookup_tokens=6)]:
        for prompt, truth in zip(prompts, truths):
            assert SpaceDecoder(frozen, spec, config).generate(prompt, 24).new_ids == truth, config
    # SPACE's blocks and the head on their verification rows
    assert counters["stats"]["unique_graphs"] - graphs <= 2, counters["stats"]
    # the step-cost curve of a frozen trunk (space-tree --compile frozen) times these same graphs.
    # Each of these made graphs of its own (minutes each on SmolLM2), timing graphs no decoder runs:
    # its ids a view into a longer tensor, its 1-row step a gate where AR has none, its widest mask
    # as wide as its cache, its head on a block's rows as (1, rows, hidden)
    graphs = counters["stats"]["unique_graphs"]
    time_steps(frozen, [(1, False), (4, True)], cache_len=20, repeats=1, static=True)
    assert counters["stats"]["unique_graphs"] == graphs, counters["stats"]
    # a block without a mask row over a static cache (a lookup branch alone) takes SPACE's graph
    # with an all-zero gate, and a 1-row one AR's: the base's output, and no graph of its own
    # (minutes on a real model)
    from space.decoding.cache import attention_windows, cache_input, static_cache
    from space.decoding.decoder import mask_slots, with_cache
    from space.masking import mask_rows

    hidden = []
    for model in (frozen, eager):
        with torch.inference_mode(), mask_rows(None):  # the tensors as a decoder makes them (a graph guards on it)
            cache = static_cache(3, 40)
            block = torch.triu(torch.full((1, 1, 4, 4), torch.finfo(torch.float32).min), 1)
            mask = with_cache(block, torch.arange(4), 14, attention_windows(eager.config), mask_slots(model, 40))
            model(input_ids=prompts[1][None, :14], **cache_input(cache), use_cache=True)  # the prompt: eager
            graphs = counters["stats"]["unique_graphs"]
            ids, positions = prompts[1][14:18].clone()[None], torch.arange(14, 18)[None]
            out = model.get_decoder()(input_ids=ids, position_ids=positions, attention_mask=mask,
                                      **cache_input(cache), use_cache=True)
            hidden.append(out.last_hidden_state)
            assert counters["stats"]["unique_graphs"] == graphs, counters["stats"]
            # a 1-row block without a mask group, as the decoder calls the trunk (not through the
            # causal LM, which adds inputs_embeds=None): AR's step graph, not one more
            mask = with_cache(torch.zeros(1, 1, 1, 1), torch.arange(1), 18, attention_windows(eager.config),
                              mask_slots(model, 40))
            out = model.get_decoder()(input_ids=prompts[1][18:19].clone()[None], position_ids=torch.tensor([[18]]),
                                      attention_mask=mask, **cache_input(cache), use_cache=True)
            hidden.append(out.last_hidden_state)
            assert counters["stats"]["unique_graphs"] == graphs, counters["stats"]
            # a block whose mask rows start at its third row, in SPACE's graph: the LoRA's update on
            # those rows (and none on the real rows) is the eager model's. SPACE's tokens are AR's
            # whatever the mask rows compute, so only this comparison sees a wrong gate or update
            mask = with_cache(block, torch.arange(4), 19, attention_windows(eager.config), mask_slots(model, 40))
            with mask_rows(2):
                out = model.get_decoder()(input_ids=prompts[1][19:23].clone()[None], position_ids=torch.arange(19, 23)[None],
                                          attention_mask=mask, **cache_input(cache), use_cache=True)
            hidden.append(out.last_hidden_state)
            assert counters["stats"]["unique_graphs"] == graphs, counters["stats"]
    for frozen_hidden, eager_hidden in zip(hidden[:3], hidden[3:]):
        torch.testing.assert_close(frozen_hidden, eager_hidden, rtol=1e-4, atol=1e-4)


def test_two_frozen_models_keep_their_own_graphs():
    """The frozen trunk skips dynamo's guards on modules (the graph holds their weights as
    constants; the guards took 1.1 ms of a 20 ms SmolLM2 step). Dynamo keeps graphs on the
    compiled function's code object, so each frozen trunk compiles a code object of its own: a
    second model with other weights runs its own graph, not the first model's. AR over each
    frozen model equals AR over its eager twin, and the two differ."""
    from space.models import tiny_random_llama

    torch._dynamo.reset()
    prompt = torch.arange(11, 25)
    truths = []
    for seed in (0, 1):
        model, _ = tiny_random_llama(num_hidden_layers=2)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:  # decisive logits: another model's weights show in the tokens
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        model.eval()
        frozen = compile_trunk(copy.deepcopy(model), mode="frozen")
        truths.append(ar_generate(model, prompt, 12, static_cache=True).new_ids)
        assert ar_generate(frozen, prompt, 12).new_ids == truths[-1], seed
    assert truths[0] != truths[1]


@pytest.mark.parametrize("version, checks", [("2.11.0+cu130", False), ("2.12.1+cu130", False), ("2.13.0+cpu", True),
                                             ("2.13.0", True), ("2.14.1", True)])
def test_frozen_settings_keep_bound_checks_from_torch_2_13(version, checks):
    """Catches the bound checks of indirect indices left on under torch 2.11 / 2.12, whose C++ code
    generation then fails to compile PLD's frozen graphs (the test below, run on those versions),
    or turned off on a torch that compiles them."""
    from space.decoding.compiled import frozen_settings

    settings = frozen_settings(version)
    assert settings.get("assert_indirect_indexing", True) is checks
    assert settings["freezing"] and settings["max_autotune"]


def test_frozen_prompt_lookup_with_a_padded_mask_equals_eager():
    """HF's prompt lookup (transformers ``generate``, its dynamic cache and 2-D mask) over the
    frozen trunk equals it over the eager model, with a mask that pads the prompt's first token
    too. A block's rows are traced at their hint (``BLOCK_HINT``), so the 2-D mask's length is
    marked at the past plus that hint: marked at its real length, transformers' padding check
    compared the hinted rows with the mask's real length and the first compile failed dynamo's
    own guard check."""
    from transformers import GenerationConfig

    from space.models import tiny_random_llama

    torch._dynamo.reset()
    model, _ = tiny_random_llama(num_hidden_layers=2)
    model.eval()
    frozen = compile_trunk(copy.deepcopy(model), mode="frozen")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 5 + [5, 6, 7]])  # repeats: lookup drafts blocks
    config = GenerationConfig(max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=10, pad_token_id=0)
    for padded in (False, True):
        mask = torch.ones_like(prompt)
        mask[0, 0] = 0 if padded else 1
        with torch.inference_mode():
            out = frozen.generate(prompt, attention_mask=mask, generation_config=config)
            assert torch.equal(out, model.generate(prompt, attention_mask=mask, generation_config=config)), padded


def test_frozen_block_rows_are_marked_with_the_block_hint():
    """Pins the marks that make inductor autotune a frozen block for ``BLOCK_HINT`` rows
    (``hint_override``), not for the first block's size: tuned for the 2-6 rows of a first block,
    inductor's C++ GEMM made SmolLM2's 16-row forward slower than eager (``results/compile_cpu``).
    The ids', positions', 4-D mask's and gate's rows carry the hint; a 1-row step marks no rows
    (AR keeps its own graph); the slots stay dynamic without one. (That inductor tunes at the
    hint is measured there, not here.)"""
    from space.decoding.cache import CACHE_ARG, static_cache
    from space.decoding.compiled import BLOCK_HINT, _mark_rows, _mark_sizes

    assert BLOCK_HINT == 16  # SPACE's blocks hold 12-16 rows (the shipped layout), PLD's up to 11
    for rows in (5, 1):
        kwargs = {"input_ids": torch.zeros(1, rows, dtype=torch.long), "position_ids": torch.arange(rows)[None],
                  "attention_mask": torch.zeros(1, 1, rows, 40), CACHE_ARG: static_cache(2, 40)}
        assert _mark_sizes(kwargs) == rows
        hints = [getattr(kwargs[k], "_dynamo_hint_overrides", {}) for k in ("input_ids", "position_ids", "attention_mask")]
        assert hints == ([{1: BLOCK_HINT}, {1: BLOCK_HINT}, {2: BLOCK_HINT}] if rows > 1 else [{}, {}, {}])
        assert 3 in kwargs["attention_mask"]._dynamo_weak_dynamic_indices  # the slots: dynamic, no hint
    gate = torch.ones(5, 1)
    _mark_rows(gate, 0)
    assert gate._dynamo_hint_overrides == {0: BLOCK_HINT} and 0 in gate._dynamo_dynamic_indices
    # transformers generate's 2-D mask (PLD, 20 tokens cached): a block's mask length is hinted at
    # the past plus the rows' hint (the padding check compares it with the hinted rows); a 1-row
    # step's length is dynamic without one (else PLD's 1-row step recompiled as the mask grew)
    for rows, hint in ((5, {1: 20 + BLOCK_HINT}), (1, {})):
        mask = torch.ones(1, 20 + rows, dtype=torch.long)
        assert _mark_sizes({"input_ids": torch.zeros(1, rows, dtype=torch.long), "attention_mask": mask}) == rows
        assert getattr(mask, "_dynamo_hint_overrides", {}) == hint
        assert 1 in (mask._dynamo_dynamic_indices if rows > 1 else mask._dynamo_weak_dynamic_indices)


def test_frozen_bf16_trunk_gates_in_the_layers_dtype():
    """A bf16 frozen-base model keeps its mask embedding's rows in fp32
    (``space.adapter_layers.MaskEmbedding``), and they are the trunk's first parameter. The frozen
    call's gate took that dtype: the LoRA's outputs, and so the queries, became fp32 over the bf16
    cache's keys, and the first SPACE block failed to compile (SDPA: "Expected query, key, and
    value to have the same dtype"; ``space-eval --dtype bfloat16 --compile frozen``). The gate now
    has the layers' dtype: SPACE's chain and dynamic tree decode over the frozen bf16 trunk and,
    on this decisive model, equal AR over it."""
    from space.adapter_layers import fuse_frozen_base, prepare_model
    from space.models import tiny_random_llama

    torch._dynamo.reset()
    model, tok = tiny_random_llama(num_hidden_layers=2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # decisive logits: bf16's rounding does not move an argmax
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model, spec = prepare_model(model.to(torch.bfloat16), tok, "frozen-base", 3)
    frozen = compile_trunk(fuse_frozen_base(model).eval(), mode="frozen")
    assert next(frozen.get_decoder().parameters()).dtype == torch.float32  # the mask rows, first
    prompt = torch.randint(11, 250, (15,), generator=gen)
    truth = ar_generate(frozen, prompt, 16, suppress_ids=spec.token_ids).new_ids
    for config in [DecodeConfig(3, 2), DecodeConfig(3, tree="dynamic", lookup_tokens=6)]:
        assert SpaceDecoder(frozen, spec, config).generate(prompt, 16).new_ids == truth, config


def test_frozen_compile_is_refused_off_the_cpu():
    """``compile="frozen"`` runs on one CPU: refused on a GPU and with a device map, taken on
    ``cpu`` and on ``cpu:0`` (a device string --device accepts; the check compares the device's
    type, not the whole string, which refused it)."""
    from space.loader import check_compile

    with pytest.raises(ValueError, match="frozen packs the weights for inductor's C\\+\\+ GEMM"):
        check_compile("frozen", "cuda")
    with pytest.raises(ValueError, match="device_map"):
        check_compile("frozen", "cpu", "auto")
    check_compile("frozen", "cpu")
    check_compile("frozen", "cpu:0")
    with pytest.raises(ValueError, match="frozen packs the weights"):
        check_compile("frozen", "cuda:0")


def test_frozen_builds_take_both_shortcuts_and_put_inductor_back(monkeypatch):
    """Two of inductor's costs in a frozen build (``compiled._build_shortcuts``), cut inside a
    frozen trunk's and head's calls, with inductor's own methods back after them:

    * it compiled the jinja source of its C++ GEMM template anew for every GEMM it tried or
      emitted (8,394 compiles of 32 sources in a frozen build of SmolLM2, about 12 % of SPACE's
      block graph build): each source is compiled once;
    * the C++ choice autotuning times for a GEMM went through its plain C++ code cache, which
      precompiled no header (about 2x the g++ time of each): each gets ``cpp_prefix.h``
      precompiled, as inductor's kernels do. The local autotuning cache is off, so that the
      choices are timed (compiled) whatever an earlier build left on this machine."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.common import KernelTemplate

    import space.decoding.compiled as compiled_mod
    from space.adapter_layers import fuse_frozen_base, prepare_model
    from space.models import tiny_random_llama

    plain, sources, entered = KernelTemplate._template_from_string, [], []

    def counted(source):
        if KernelTemplate.__dict__["_template_from_string"].__func__ is not counted:  # inside a frozen call
            sources.append(source)
        return plain(source)

    plain_load, plain_precompile = codecache.CppCodeCache.load_async.__func__, codecache._precompile_header
    headers, precompiled, inside = [], [], []

    def load_async(cls, *args, **kwargs):
        is_plain = cls is codecache.CppCodeCache  # a benchmark's (or a kernel's without Python bindings)
        if is_plain:
            headers.append(cls._get_uncompiled_header("cpu"))
            inside.append(1)
        try:
            return plain_load(cls, *args, **kwargs)
        finally:
            if is_plain:
                inside.pop()

    def precompile(header, *args, **kwargs):
        if inside:
            precompiled.append(header)
        return plain_precompile(header, *args, **kwargs)

    kept = compiled_mod._build_shortcuts

    def entering():
        entered.append(1)
        return kept()

    monkeypatch.setattr(KernelTemplate, "_template_from_string", staticmethod(counted))
    monkeypatch.setattr(codecache.CppCodeCache, "load_async", classmethod(load_async))
    monkeypatch.setattr(codecache.CppCodeCache, "cache", {})  # what earlier tests loaded would skip the header
    monkeypatch.setattr(codecache, "_precompile_header", precompile)
    monkeypatch.setattr(compiled_mod, "_build_shortcuts", entering)
    model, tok = tiny_random_llama(num_hidden_layers=2)
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    frozen = compile_trunk(fuse_frozen_base(model).eval(), mode="frozen")
    prompt = torch.arange(11, 25)
    # inductor's own patch: pytest's monkeypatch would undo it by deleting the entry (not in __dict__)
    with inductor_config.patch(autotune_local_cache=False):
        truth = ar_generate(frozen, prompt, 8, suppress_ids=spec.token_ids).new_ids
        assert SpaceDecoder(frozen, spec, DecodeConfig(3, 2)).generate(prompt, 8).new_ids == truth
    assert len(sources) > 1 and len(sources) == len(set(sources)), (len(sources), len(set(sources)))
    assert KernelTemplate.__dict__["_template_from_string"].__func__ is counted
    prefix = codecache._get_cpp_prefix_header("cpu")
    assert headers and set(headers) == {prefix} and set(precompiled) == {prefix}, (headers, precompiled)
    assert codecache.CppCodeCache._get_uncompiled_header("cpu") is None
    before = len(entered)
    with torch.inference_mode():
        frozen.get_output_embeddings()(torch.zeros(1, 3, model.config.hidden_size))  # the head alone
    assert len(entered) == before + 1


def _filled(cache, layers: int = 2, tokens: int = 5):
    """``cache`` with ``tokens`` written in each of its ``layers`` (what a prefill leaves)."""
    kv = torch.randn(1, 2, tokens, 8, generator=torch.Generator().manual_seed(0))
    for i in range(layers):
        cache.update(kv, kv.clone(), i)
    return cache


def test_frozen_call_hands_its_graph_the_gate_and_one_set_of_arguments():
    """Pins what the frozen trunk's call (``compiled._frozen_call``) hands its graph, with a
    stand-in graph (nothing compiles here; the frozen tests above take minutes):

    * a call without a cache, over a cache that holds nothing yet (a prefill) or over a
      ``SlabCache`` (a host length: a graph per step) runs the eager forward, never the graph;
    * AR's 1-row step goes in without a gate (a gate made it SPACE's graph, the LoRA computed and
      multiplied by 0 on every AR step), without the arguments that are None (the causal LM's
      ``inputs_embeds=None``: else AR's step and SPACE's 1-row block are two graphs);
    * a block over a static cache gets a (rows, 1) gate in the given dtype, 1 from the first mask
      row on (a gate one row late left the first mask row without its LoRA: a worse draft, and
      SPACE stays lossless, so no decoding test sees it), all 0 without a mask row (one row early
      gave the last real row of a lookup-only block the LoRA), its rows marked with the block hint;
    * the graph runs under ``FROZEN``'s inductor settings (without them inductor packs no weight),
      put back after the call, and with ``mask_rows`` cleared: only the graph's argument says where
      masks start (a start read inside the graph is a guard, a graph per start);
    * a block over transformers' dynamic cache (PLD's) gets no gate."""
    from torch._inductor import config as inductor_config
    from transformers import DynamicCache

    from space.decoding.cache import CACHE_ARG, SlabCache, static_cache
    from space.decoding.compiled import BLOCK_HINT, FROZEN, _frozen_call
    from space.masking import mask_rows, mask_rows_start

    calls, eager_calls = [], []

    def graph(start, forward, *args, **kwargs):
        calls.append({"start": start, "keys": list(kwargs), "inside": mask_rows_start(),
                      "settings": {k: inductor_config.get_config_copy()[k] for k in FROZEN}})
        return "graph"

    call = _frozen_call(graph, lambda *a, **k: eager_calls.append(k) or "eager", torch.bfloat16)

    def step(rows: int, cache, **extra):
        return {"input_ids": torch.zeros(1, rows, dtype=torch.long), "position_ids": torch.arange(5, 5 + rows)[None],
                "attention_mask": torch.zeros(1, 1, rows, 5 + rows), CACHE_ARG: cache, "use_cache": True, **extra}

    before = {k: inductor_config.get_config_copy()[k] for k in FROZEN}
    assert before != FROZEN  # the settings hold inside a frozen call only
    for cache in (None, static_cache(2, 40), _filled(SlabCache(2, 40))):
        with mask_rows(3):
            assert call(**step(4, cache)) == "eager"
    assert not calls and len(eager_calls) == 3
    # AR's step through the causal LM: every argument named, inputs_embeds None
    with mask_rows(None):
        assert call(**step(1, _filled(static_cache(2, 40)), inputs_embeds=None)) == "graph"
    assert calls[-1]["start"] is None and calls[-1]["inside"] is None
    assert sorted(calls[-1]["keys"]) == sorted(["input_ids", "position_ids", "attention_mask", CACHE_ARG, "use_cache"])
    assert calls[-1]["settings"] == FROZEN
    assert {k: inductor_config.get_config_copy()[k] for k in FROZEN} == before
    for start, want in ((None, [0, 0, 0, 0]), (2, [0, 0, 1, 1]), (0, [1, 1, 1, 1])):
        with mask_rows(start):
            call(**step(4, _filled(static_cache(2, 40))))
        gate = calls[-1]["start"]
        assert gate.dtype == torch.bfloat16 and gate.shape == (4, 1) and gate[:, 0].tolist() == want, (start, gate)
        assert gate._dynamo_hint_overrides == {0: BLOCK_HINT} and calls[-1]["inside"] is None
    with mask_rows(None):  # PLD's block over transformers' dynamic cache
        call(**step(4, _filled(DynamicCache())))
    assert calls[-1]["start"] is None


def test_frozen_head_marks_a_blocks_rows_and_patches_inductor():
    """The frozen LM head's call (``compiled._frozen_head``), with a stand-in graph: it runs under
    ``FROZEN``'s inductor settings (the head is the step's largest GEMM: without them its weight is
    not packed), put back after; a block's rows carry the block hint, a single row none (AR's
    head row keeps a graph of its own)."""
    from torch._inductor import config as inductor_config

    from space.decoding.compiled import BLOCK_HINT, FROZEN, _frozen_head

    seen = []

    def graph(hidden):
        seen.append(({k: inductor_config.get_config_copy()[k] for k in FROZEN},
                     dict(getattr(hidden, "_dynamo_hint_overrides", {}))))
        return hidden

    head = _frozen_head(graph)
    before = {k: inductor_config.get_config_copy()[k] for k in FROZEN}
    head(torch.zeros(1, 3, 8))
    head(torch.zeros(1, 1, 8))
    assert seen == [(FROZEN, {1: BLOCK_HINT}), (FROZEN, {})]
    assert {k: inductor_config.get_config_copy()[k] for k in FROZEN} == before


def test_nested_build_shortcuts_keep_the_swap_until_the_last_exit():
    """``compiled._build_shortcuts`` is entered once per frozen call, and calls may nest or overlap
    (threads): the first entry swaps inductor's two methods, an inner entry swaps nothing more
    (swapping again saved the swapped methods as the originals, and inductor never got its own
    back), and only the last exit puts them back (an inner exit that restored them left the outer
    call's build without its shortcuts)."""
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.codegen.common import KernelTemplate

    from space.decoding.compiled import _build_shortcuts

    def methods():
        return KernelTemplate.__dict__.get("_template_from_string"), CppCodeCache.__dict__.get("_get_uncompiled_header")

    plain = methods()
    with _build_shortcuts():
        swapped = methods()
        assert swapped[0] is not plain[0] and swapped[1] is not plain[1]  # this torch has both to swap
        with _build_shortcuts():
            assert methods() == swapped
        assert methods() == swapped
    assert methods() == plain


def test_frozen_cache_inputs_are_plain_contiguous_and_dynamic():
    """``compiled._cache_inputs``: transformers marks a static cache's keys, values and length as
    static addresses (for CUDA graphs), which freezing folds into the graph as it folds a weight (a
    second generation's cache was then never written); every mark is cleared. A dynamic cache's
    cropped layer (a view, not contiguous) is made contiguous with the same entries (a graph holds
    its inputs' strides: PLD's step after a rejection compiled one more), and the keys' and values'
    slots are marked dynamic (else a graph per cache size)."""
    from transformers import DynamicCache

    from space.decoding.cache import static_cache
    from space.decoding.compiled import _cache_inputs

    cache = _filled(static_cache(2, 40))
    tensors = [getattr(layer, name) for layer in cache.layers for name in ("keys", "values", "cumulative_length")]
    assert all(hasattr(t, "_dynamo_static_input_type") for t in tensors)  # transformers' marks
    _cache_inputs(cache)
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in tensors)
    assert all(2 in t._dynamo_weak_dynamic_indices for layer in cache.layers for t in (layer.keys, layer.values))
    dynamic = _filled(DynamicCache())
    dynamic.crop(-2)  # drop the last 2 tokens: a view of the first 3
    cropped = [(layer.keys.clone(), layer.values.clone()) for layer in dynamic.layers]
    assert not dynamic.layers[0].keys.is_contiguous()
    _cache_inputs(dynamic)
    for layer, (keys, values) in zip(dynamic.layers, cropped):
        assert layer.keys.is_contiguous() and layer.values.is_contiguous()
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert 2 in layer.keys._dynamo_weak_dynamic_indices
