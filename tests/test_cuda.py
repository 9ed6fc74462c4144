"""The decoders on a GPU (issue 45). Marked ``cuda`` and skipped without CUDA (CI has none); on a
GPU machine: ``pytest -m cuda -rA -s tests/test_cuda.py``.

Covered: greedy SPACE == AR in fp32 for the chain, a static tree, lookup, the dynamic tree and the
shipped adapter on the real SmolLM2 (TF32 pinned off, so fp32 means fp32); seeded sampling on the
device; bf16 (finite logits, the step mask in bf16, tokens equal to AR up to the first near-tie,
the rate printed); flash attention refused; a 2-way ``device_map`` equal to one device (needs 2
GPUs); and the sync budget of ``tests/decoding/test_syncs.py`` checked by CUDA itself
(``torch.cuda.set_sync_debug_mode``), as a marginal count per step between two lengths; grouped
query heads folded into the batch on the memory-efficient kernel, a step's aligned mask read in place.
"""
import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.cache import attention_dtype
from space.eval.__main__ import main as eval_main
from tests.conftest import TRAINED_K as K, fresh_language

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-space"
STATIC_TREE = ((0,), (1,), (0, 0), (0, 1))
LAYOUTS = {"chain": DecodeConfig(K, K + 1), "chain 2 groups": DecodeConfig(K, 2),
           "static tree": DecodeConfig(2, 2, tree=STATIC_TREE),
           "lookup": DecodeConfig(2, 2, tree=STATIC_TREE, lookup_tokens=10),
           "dynamic": DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10),
           # the shipped adapter's layout verifies four lookup continuations
           "dynamic, 4 continuations": DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10, lookup_branches=4)}


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 exactness is a claim about fp32: TF32 matmuls round the inputs to 10 bits."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def on_gpu(trained_drafter):
    model, tok, spec, lang = trained_drafter
    lang = fresh_language(lang)
    return copy.deepcopy(model).cuda(), tok, spec, lang


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_exact_on_cuda_at_high_acceptance(on_gpu, layout):
    model, _, spec, lang = on_gpu
    dec = SpaceDecoder(model, spec, LAYOUTS[layout])
    steps = tokens = 0
    for i in range(6):
        prompt = torch.tensor(lang.sample(3 + 3 * i))
        ar = ar_generate(model, prompt, 48, suppress_ids=spec.token_ids)
        out = dec.generate(prompt, 48)  # a CPU prompt for a CUDA model: the decoder moves it
        assert out.new_ids == ar.new_ids, (layout, i)
        steps, tokens = steps + out.num_steps, tokens + len(out.new_ids)
    print(f"cuda greedy {layout}: exact, {tokens / steps:.2f} tokens/step")
    assert tokens / steps > 1.5  # the drafts are accepted, so the cache really compacts


def test_fused_trunk_swaps_the_norms_on_cuda_and_stays_exact(on_gpu):
    """The fused trunk on CUDA (``space.decoding.fused.fuse_trunk``, what load_space does): every
    RMSNorm is the one-kernel native norm (``space.rms_norm``, its rows' bits checked at load), and
    greedy SPACE still equals AR over it, at high acceptance."""
    from space.decoding.fused import fuse_trunk

    model, _, spec, lang = on_gpu
    fused = copy.deepcopy(model)
    assert fuse_trunk(fused)["rms_norms"] == 2 * fused.config.num_hidden_layers + 1
    for layout in ("chain", "dynamic"):
        dec = SpaceDecoder(fused, spec, LAYOUTS[layout])
        for i in range(4):
            prompt = torch.tensor(lang.sample(4 + 3 * i))
            ar = ar_generate(fused, prompt, 48, suppress_ids=spec.token_ids)
            assert dec.generate(prompt, 48).new_ids == ar.new_ids, (layout, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 16])
def test_grouped_attention_runs_on_the_memory_efficient_kernel_and_reads_its_mask_in_place(dtype, rows):
    """SDPA_GQA on CUDA (``space.decoding.backends``) folds a grouped call's query heads into the
    batch: with only the memory-efficient kernel allowed it runs (a masked ``enable_gqa`` call
    would find no kernel and fall to the math one), its output is transformers' ``sdpa``'s
    (``repeat_kv``), and a step's mask in aligned rows (``mask_buffer``) is read in place, where the
    same mask of its own width is padded (copied) by SDPA in every call. SmolLM2's heads: 9 query
    heads on 3 key heads of 64."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding.backends import mask_buffer, sdpa_gqa_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    keys = 301  # not a multiple of 8, as most steps' widths
    query, key, value = (torch.randn(1, h, n, 64, generator=gen, device="cuda", dtype=dtype)
                         for h, n in ((9, rows), (3, keys), (3, keys)))
    aligned = mask_buffer(rows, keys, dtype, "cuda")
    aligned[..., keys - rows:] = torch.full((rows, rows), torch.finfo(dtype).min, device="cuda").triu(1)
    assert aligned.stride(2) % 8 == 0
    plain = aligned.contiguous()  # the same values at its own width
    want, _ = sdpa_attention_forward(module, query, key, value, plain)

    def pads(mask) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sdpa_gqa_attention(module, query, key, value, mask)
        return [e.name for e in prof.events() if "pad" in e.name]

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out, _ = sdpa_gqa_attention(module, query, key, value, aligned)
        in_place, copied = pads(aligned), pads(plain)
    torch.testing.assert_close(out, want, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
    assert not in_place and copied, (in_place, copied)


@pytest.mark.parametrize("rows", [1, 16])
def test_grouped_attention_without_a_mask_runs_on_flash_in_bf16(rows):
    """AR's one-row step and a prefill pass no mask: in bf16 the folded call (stride-0 keys over
    the batch) runs with only flash attention allowed, as transformers' grouped call did, and
    equals transformers' output (a prefill causal, its rows seeing no key past their own)."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from space.decoding.backends import sdpa_gqa_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    keys = rows if rows > 1 else 301
    query, key, value = (torch.randn(1, h, n, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for h, n in ((9, rows), (3, keys), (3, keys)))
    want, _ = sdpa_attention_forward(module, query, key, value, None)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out, _ = sdpa_gqa_attention(module, query, key, value, None)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_sampling_runs_on_the_device(on_gpu):
    model, _, spec, lang = on_gpu
    dec = SpaceDecoder(model, spec, DecodeConfig(K, 2))
    prompt, cfg = torch.tensor(lang.sample(6)), SamplingConfig(0.8, top_p=0.95, seed=1)
    out, again = dec.generate(prompt, 40, sampling=cfg), dec.generate(prompt, 40, sampling=cfg)
    assert out.new_ids == again.new_ids  # a seeded generator on the device
    assert len(out.new_ids) == 40 and max(out.accept_lengths) >= 1


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_bf16_finite_and_equal_up_to_a_near_tie(on_gpu):
    """bf16 rounds differently for 1 row (AR) and a block of rows (SPACE), so greedy outputs may
    part at a near-tie, never elsewhere: where they first differ, AR's top-2 logits are within
    bf16's rounding of each other."""
    model, _, spec, lang = on_gpu
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert attention_dtype(half.get_decoder()) == torch.bfloat16  # the step mask's dtype
    dec = SpaceDecoder(half, spec, DecodeConfig(K, K + 1))
    equal, gaps = 0, []
    for i in range(10):
        prompt = torch.tensor(lang.sample(4 + 2 * i))
        with torch.no_grad():
            assert torch.isfinite(half(prompt[None].cuda()).logits).all()
        ar, out = ar_generate(half, prompt, 48, suppress_ids=spec.token_ids), dec.generate(prompt, 48)
        at = first_difference(ar.new_ids, out.new_ids)
        if at is None:
            equal += 1
            continue
        with torch.no_grad():
            ids = torch.cat([prompt, torch.tensor(ar.new_ids[:at])])[None].cuda()
            logits = half(ids).logits[0, -1].float()
        logits[list(spec.token_ids)] = -torch.inf
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        assert gaps[-1] <= 0.05 * float(top[0].abs()) + 0.25, (i, at, gaps[-1])  # bf16 keeps 8 bits
    print(f"cuda bf16: {equal}/10 generations equal to AR; gaps at the first difference {gaps}")


def test_flash_attention_is_refused(on_gpu):
    model, _, spec, _ = on_gpu
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash attention"):
        SpaceDecoder(flash, spec)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-way device_map needs 2 GPUs")
def test_two_way_device_map_equals_one_device(trained):
    from space.models import dispatch

    model, _, spec, lang = trained
    one = copy.deepcopy(model).cuda()
    two = copy.deepcopy(model)
    dispatch(two, {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                   "model.rotary_emb": 1, "lm_head": 1})
    prompt = torch.tensor(lang.sample(8))
    want = SpaceDecoder(one, spec, DecodeConfig(K, 2)).generate(prompt, 32).new_ids
    assert SpaceDecoder(two, spec, DecodeConfig(K, 2)).generate(prompt, 32).new_ids == want
    # AR's cache too: its slab holds one device's layers (cache.one_slab), a split model keeps a tensor per layer
    assert (ar_generate(two, prompt, 32, suppress_ids=spec.token_ids).new_ids
            == ar_generate(one, prompt, 32, suppress_ids=spec.token_ids).new_ids)


def cuda_syncs(dec: SpaceDecoder, prompt: torch.Tensor, new: int) -> tuple[int, int]:
    """(synchronizing CUDA calls, steps) of one greedy generation, as CUDA's sync debug mode sees them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = dec.generate(prompt, new)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen), out.num_steps


@pytest.mark.parametrize("layout,budget", [("chain", 1), ("static tree", 1), ("lookup", 1), ("dynamic", 2)])
def test_sync_budget_seen_by_cuda(on_gpu, layout, budget):
    """Marginal synchronizing calls per step between a short and a long generation (the prompt's
    upload and the cache's first allocation cancel out): the budgets that ``tests/syncs.py``
    counts on the CPU. Before the index_fill_ fix CUDA saw 2.98 / 2.00 / 2.58 / 7.55 per step here,
    then 0.98 / 1.00 / 1.58 / 2.55 before the uploads went non-blocking, and 0.98 / 1.00 / 1.00 / 1.55
    after (``results/gpu_compiled``)."""
    model, _, spec, lang = on_gpu
    dec = SpaceDecoder(model, spec, LAYOUTS[layout])
    prompt = torch.tensor(lang.sample(12))
    dec.generate(prompt, 64)  # warm
    short, long = cuda_syncs(dec, prompt, 16), cuda_syncs(dec, prompt, 96)
    per_step = (long[0] - short[0]) / max(long[1] - short[1], 1)
    print(f"cuda sync debug mode, {layout}: {per_step:.2f} synchronizing calls per step "
          f"({short[0]} in {short[1]} steps, {long[0]} in {long[1]} steps)")
    assert per_step <= budget


def test_upload_is_queued_behind_the_gpu_work():
    """``decoder.upload`` returns while a long kernel still runs: the copy went from pinned memory
    and was queued on the stream (CUDA's sync debug mode does not flag an unpinned non-blocking
    copy, which can still make the host wait while the driver stages it)."""
    from space.decoding.decoder import upload

    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the stream
    out = upload(list(range(64)), device)
    assert not torch.cuda.current_stream().query()  # the host did not wait for the sleep
    assert out.tolist() == list(range(64)) and out.dtype == torch.long


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_trunk_exact_on_cuda(on_gpu, mode):
    """Issue 43, item 4 on CUDA: SPACE over a compiled trunk (inductor, and with CUDA graphs) equals AR
    over the same compiled trunk in fp32, with moving tree paths (the static cache compacts)."""
    from space.decoding.compiled import compile_trunk

    model, _, spec, lang = on_gpu
    model = compile_trunk(copy.deepcopy(model), mode=mode)
    for layout in ("chain", "static tree", "dynamic"):
        dec = SpaceDecoder(model, spec, LAYOUTS[layout])
        assert dec.static_cache
        steps = tokens = 0
        for i in range(3):
            prompt = torch.tensor(lang.sample(6 + 5 * i))
            ar = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids)
            out = dec.generate(prompt, 40)
            assert out.new_ids == ar.new_ids, (mode, layout, i)
            steps, tokens = steps + out.num_steps, tokens + len(out.new_ids)
        print(f"cuda compiled ({mode or 'default'}) {layout}: exact, {tokens / steps:.2f} tokens/step")


def test_captured_steps_exact_on_cuda(on_gpu):
    """Issue 58, item 4: SPACE over captured steps (one CUDA graph per row bucket and slot bucket,
    ``space.decoding.graphs``) equals AR over the same graphs and eager AR in fp32, at high
    acceptance (tree paths move inside the static cache; the generations cross slot buckets of 40,
    80 and 160 slots, the kept keys through transformers' ``sdpa`` on CUDA); the graphs are one per
    bucket and kind, captured once, and a second generation replays them."""
    from space.decoding.graphs import StepGraphs
    from tests.conftest import sdpa_gqa_copy

    model, _, spec, lang = on_gpu
    model = sdpa_gqa_copy(model)  # reads the keys up to the mask's width, as every fused trunk
    layouts = ("chain", "static tree", "lookup", "dynamic", "dynamic, 4 continuations")
    sizes = {q for layout in layouts for q in SpaceDecoder(model, spec, LAYOUTS[layout], buckets=True).row_sizes}
    graphs = StepGraphs(model, slots=160, sizes=sizes, min_slots=32)
    assert graphs.slot_sizes == (40, 80, 160)
    seconds = graphs.capture()
    made = graphs.num_graphs
    print(f"cuda captured: {made} graphs in {seconds:.2f} s")
    # a plain graph per row and slot bucket, a gated one above 1 row
    assert made == sum(1 + (q > 1) for q in graphs.sizes for n in graphs.slot_sizes if q <= n)
    for layout in layouts:
        dec = SpaceDecoder(model, spec, LAYOUTS[layout], graphs=graphs)
        steps = tokens = 0
        for i in range(3):
            prompt = torch.tensor(lang.sample(6 + 5 * i))
            truth = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids).new_ids
            assert ar_generate(model, prompt, 40, suppress_ids=spec.token_ids, graphs=graphs).new_ids == truth
            out = dec.generate(prompt, 40)
            assert out.new_ids == truth, (layout, i)
            steps, tokens = steps + out.num_steps, tokens + len(out.new_ids)
        print(f"cuda captured {layout}: exact, {tokens / steps:.2f} tokens/step")
    assert graphs.num_graphs == made  # every block was a bucket already captured


def test_captured_frozen_base_gate_on_cuda():
    """The frozen-base LoRA's gate inside a graph: replayed with other first mask rows, a captured
    step gives what the eager step gives (mask rows with their update, real rows without)."""
    from tests.decoding.test_graphs import test_the_gate_gives_mask_rows_their_lora_and_real_rows_none as on_cpu

    on_cpu(fused=True, device="cuda")


def test_shipped_adapter_exact_on_cuda():
    """The shipped adapter on the real SmolLM2, fp32 on the GPU: SPACE == AR on 2 HumanEval prompts."""
    from space.data.prompts import chat_ids, code_prompt
    from space.eval.tasks import load_tasks
    from space.loader import load_space
    from space.models import cache_dir

    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():
        pytest.skip("the converted SmolLM2 is not in $SPACE_CACHE here")
    model, tok, spec = load_space(adapter=ADAPTER, device="cuda")
    decoder = SpaceDecoder(model, spec)  # the adapter's tuned layout
    for task in load_tasks("humaneval", limit=2):
        ids = torch.tensor(chat_ids(tok, [{"role": "user", "content": code_prompt(task.problem["prompt"])}]))
        ar = ar_generate(model, ids, 64, stop_token_ids=[tok.eos_token_id], suppress_ids=spec.token_ids)
        out = decoder.generate(ids, 64, stop_token_ids=[tok.eos_token_id])
        assert out.new_ids == ar.new_ids
        print(f"cuda shipped adapter, {task.question_id}: exact, {len(out.new_ids) / out.num_steps:.2f} tokens/step")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_space_eval_on_cuda(tmp_path, dtype):
    s = eval_main(["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "2", "--max-new-tokens", "16",
                   "--device", "cuda", "--dtype", dtype, "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "run_config.json").read_text())
    assert torch.cuda.get_device_name() in json.dumps(meta["machine"])
    assert set(s["methods"]) == {"ar", "hf", "pld", "space"}
    if dtype == "float32":
        assert s["exact_match_rate"] == 1.0
