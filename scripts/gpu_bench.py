"""GPU measurements of issues 45 and 43, one JSON file per subcommand (``results/gpu_h200/``, ``results/gpu_compiled/``).

* ``step-cost``: latency of one SPACE-like forward against its query rows (1, 2, 4 ... 128) after
  a cache of 512 and 2,048 tokens, at a real shape with random weights (``smollm2``: 30 layers,
  hidden 576; ``llama2-7b``: 32 layers, hidden 4096), bf16, SDPA, with a random frozen-base LoRA
  of the shipped adapter's rank and targets on every mask row
  (``space.eval.step_cost.step_cost_curve``: 1 row is an AR step, no 4-D mask).
* ``host-time``: wall time per decoding step against the GPU's busy time in it (the sum of the
  step's kernel times, read by ``torch.profiler`` in a second, profiled run), for AR and SPACE
  layouts; ``1 - busy / wall`` is the share of the step the GPU waits for the host. On a random
  model of a real shape (``--shape``) or on the real SmolLM2 with an adapter (``--adapter``).
* ``train``: SAR-SFT throughput (real tokens per second) and peak GPU memory of a random 1B-class
  Llama (22 layers, hidden 2048, TinyLlama's shape) through ``SpaceTrainer``, bf16 autocast,
  frozen-base or full.

``step-cost`` and ``host-time`` take ``--compile [default|reduce-overhead]``: the same measurement
again with the trunk compiled (``space.decoding.compiled.compile_trunk``; reduce-overhead adds CUDA
graphs) over a preallocated cache, after the eager one, in the same process, on a second copy of
the model (the eager trunk is fused as ``space.loader.load_space`` fuses it; a compiled one is
not). ``step-cost --capture`` times the eager trunk's steps replayed from CUDA graphs too
(``space.decoding.graphs.StepGraphs``, one graph per row and slot bucket over a static cache, issue 58 item
4), with the seconds it took to capture them all. ``step-cost --profile`` adds, per curve and row count, the
GPU's busy time per step and its costliest kernels (:func:`step_profile`); ``step-cost --sdp both`` times
every curve again on SDPA's math path (:func:`sdp_backend`). ``host-time --cudnn-sdp both`` times every layout
with cuDNN attention on and off in turns and names the attention kernels that ran (issue 58, item 3:
``space.decoding.backends``).

Each prints one line per measurement and writes ``--out`` (JSON). Usage::

    python scripts/gpu_bench.py step-cost --shape llama2-7b --out step_cost_7b.json
    python scripts/gpu_bench.py host-time --adapter adapters/smollm2-135m-space --out host_smollm2.json
    python scripts/gpu_bench.py train --mode frozen-base --out train_1b.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from space.adapter_layers import apply_lora  # noqa: E402
from space.decoding.backends import choose_sdpa  # noqa: E402
from space.decoding.fused import fuse_trunk  # noqa: E402
from space.choices import COMPILE_MODES  # noqa: E402
from space.cli import console, output_file, positive_int, positive_ints  # noqa: E402
from space.jsonl import write_text_atomic  # noqa: E402
from space.models import parse_dtype, tiny_tokenizer  # noqa: E402
from space.tokens import add_mask_tokens  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
}
DEVICE = "cuda"  # --device cpu: a dry run of the commands on a machine without a GPU
LORA_R, LORA_TARGETS = 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def machine() -> dict:
    if DEVICE == "cpu":
        return {"device": "cpu", "torch": torch.__version__, "transformers": transformers.__version__}
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "driver": _driver()}


def _driver() -> str | None:
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def random_model(shape: str, dtype: torch.dtype, mask_num: int = 3, lora: bool = True, fuse: bool = True):
    """A random-weight Llama of ``shape`` on the GPU with a mask token and (``lora``) a random
    frozen-base LoRA of the shipped adapter's rank on every target linear, its trunk fused
    (``fuse``; leave it off for a model to compile) and its attention backend chosen as
    ``space.loader.load_space`` does. Returns (model, spec)."""
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device(DEVICE):  # init on the GPU: a 7B init on the host takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    spec = add_mask_tokens(model, tiny_tokenizer(), mask_num)
    if lora:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        updates = {}
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in LORA_TARGETS and isinstance(module, torch.nn.Linear):
                updates[name] = (torch.randn(LORA_R, module.in_features, device=DEVICE, generator=gen) * 0.01,
                                 torch.randn(module.out_features, LORA_R, device=DEVICE, generator=gen) * 0.01)
        apply_lora(model, updates, "frozen-base", "random LoRA")
    if fuse:  # what space.loader.load_space does to an eager model on one device
        fuse_trunk(model)
    choose_sdpa(DEVICE, dtype)
    return model, spec


def setups(args, dtype: torch.dtype):
    """(setup name, model, spec, tokenizer or None) for the eager trunk, then (``--compile``) a
    compiled one: separate models, one at a time, because the eager trunk is fused
    (``space.decoding.fused``) and a compiled one must not be. The real SmolLM2 with
    ``--adapter``, else a random ``--shape``."""
    from space.decoding.compiled import compile_trunk

    for compile in [False] + ([args.compile] if args.compile else []):
        if getattr(args, "adapter", None):
            from space.loader import load_space

            # stored: each stage prices (or times) its steps itself, within its time cap
            model, tok, spec = load_space(adapter=args.adapter, dtype=args.dtype, device=DEVICE, compile=compile,
                                          step_cost="stored")
        else:
            (model, spec), tok = random_model(args.shape, dtype, fuse=not compile), None
            if compile:  # a compiled trunk runs over a preallocated cache, as the decoder then does
                compile_trunk(model, mode=compile)
        yield ("eager" if not compile else f"compiled {compile}"), model, spec, tok
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def cmd_step_cost(args) -> dict:
    from space.eval.step_cost import step_cost_curve

    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    if args.profile and args.repeats < 2:
        raise SystemExit("--profile needs --repeats 2 or more (a 1-round run is what it subtracts)")
    out = {"shape": args.shape, "dtype": args.dtype, "lora_r": LORA_R, "compiled": args.compile,
           "repeats": args.repeats, "curves": {}}

    def record(key: str, curve: dict[int, float], graphs=None, static: bool = False, cache_len: int = 0) -> None:
        out["curves"][key] = {str(q): round(s * 1e3, 4) for q, s in curve.items()}
        print(f"step-cost {args.shape} {key}: " +
              ", ".join(f"{q} rows {s * 1e3:.2f} ms ({s / curve[1]:.2f}x)" for q, s in curve.items()), flush=True)
        if args.profile:
            for q in rows:
                prof = step_profile(model, q, cache_len, args.repeats, static, graphs)
                out.setdefault("profiles", {}).setdefault(key, {})[str(q)] = prof
                print(f"step-profile {args.shape} {key}, {q} rows: busy {prof['busy_ms']} ms of "
                      f"{curve[q] * 1e3:.2f}; {prof['kernels']}", flush=True)
        # each curve kept as it comes, as host-time keeps its layouts: a stage cut at its cap keeps what it timed
        write_text_atomic(Path(args.out), json.dumps({**header(), **out, "partial": True}, indent=1))

    for setup, model, _, _ in setups(args, dtype):
        out.setdefault("attention", {})[setup] = model.config._attn_implementation
        captured = args.capture and setup == "eager"
        if captured and args.profile and DEVICE == "cuda":
            # the profiler's CUDA state set up before any graph is captured (profiling a replay
            # after capture hit illegal memory accesses in pytorch/pytorch#75504)
            torch.profiler._utils._init_for_cuda_graphs()
        for sdp in SDP_CHOICES[args.sdp]:
            prefix = "" if sdp == "default" else f"{sdp} sdp, "
            with sdp_backend(sdp):  # a graph keeps the kernel it was captured with
                if captured:
                    from space.decoding.graphs import StepGraphs

                    for cache_len in (int(c) for c in args.caches.split(",")):
                        slots = cache_len + max(rows)
                        # one slot bucket: a step after cache_len tokens attends over them all, as timed here
                        graphs = StepGraphs(model, slots=slots, sizes=rows, min_slots=slots)
                        ready = graphs.capture()
                        out.setdefault("capture_s", {})[prefix + str(cache_len)] = round(ready, 2)
                        print(f"step-cost {args.shape} {prefix}captured cache {cache_len}: ready in {ready:.1f} s", flush=True)
                        curve = step_cost_curve(model, rows, cache_len, args.repeats, graphs=graphs)
                        record(f"{prefix}captured, {cache_len}", curve, graphs=graphs, cache_len=cache_len)
                for cache_len in (int(c) for c in args.caches.split(",")):
                    t0 = time.perf_counter()
                    curve = step_cost_curve(model, rows, cache_len=cache_len, repeats=args.repeats, static=setup != "eager")
                    key = prefix + (str(cache_len) if setup == "eager" else f"{setup}, {cache_len}")
                    out.setdefault("seconds", {})[key] = round(time.perf_counter() - t0, 1)  # a compiled one's includes compiling
                    record(key, curve, static=setup != "eager", cache_len=cache_len)
    return out


SDP_CHOICES = {"default": ["default"], "math": ["math"], "both": ["default", "math"]}


def sdp_backend(sdp: str):
    """SDPA's kernels while a step-cost curve is captured and timed: ``default``, torch's own choice
    (on CUDA in fp32 with a mask, the memory-efficient kernel), or ``math``, its matmul, softmax,
    matmul path. On an H200 the memory-efficient kernel took 7.6 ms of a captured fp32 SmolLM2-shaped
    step's 9.9 ms after 2,048 tokens with one query row (``results/gpu60``): it divides its work by
    query blocks and heads only, where the matmuls spread over the keys too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return contextlib.nullcontext() if sdp == "default" else sdpa_kernel([SDPBackend.MATH])


def step_profile(model, q: int, cache_len: int, repeats: int, static: bool = False, graphs=None, top: int = 8) -> dict:
    """Where one step of ``q`` rows after ``cache_len`` cached tokens spends the device's time (issue 58:
    a captured 1-row fp32 SmolLM2 step took 10.3 ms, far above its weights' cost): the
    ``step_cost.time_steps`` run of ``repeats`` rounds less a 1-round run (the prefill and the
    warm-up round), per step. On CUDA the kernels' durations (a graph's replayed kernels included);
    on the CPU (a dry run) the ops' own CPU time.

    Returns:
        ``{"busy_ms": device ms per step, "kernels": {name (60 characters): us per step}}``, the
        ``top`` names by time and ``"other"``.
    """
    from space.eval.step_cost import time_steps

    def per_name(rounds: int) -> Counter:
        times, short = device_events(lambda: time_steps(model, [(q, q > 1)], cache_len, rounds, static, graphs))[0], Counter()
        for name, t in times.items():
            short[name[:60]] += t
        return short

    steps = per_name(repeats)
    steps.subtract(per_name(1))
    us = {name: t / (repeats - 1) for name, t in steps.items() if t > 0}
    ranked = sorted(us.items(), key=lambda kv: -kv[1])
    kernels = {name: round(t, 1) for name, t in ranked[:top]}
    kernels["other"] = round(sum(t for _, t in ranked[top:]), 1)
    return {"busy_ms": round(sum(us.values()) / 1e3, 3), "kernels": kernels}


ATTENTION_KERNELS = ("fmha", "attention", "attn", "cudnn", "flash", "efficient")


def device_events(fn) -> tuple[Counter, Counter]:
    """The device's activity while ``fn()`` runs, read by torch.profiler: ({event name: us}, {event
    name: calls}). On CUDA the kernels (a CUDA graph's replayed kernels included); on the CPU (a dry
    run) the ops' own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
    # the device's activity alone: with the CPU's too on CUDA, reading a whole generation's events took
    # most of a 90 s stage on an H200 (results/gpu_h200_g58)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    times, calls = Counter(), Counter()
    for e in prof.events():
        if e.device_type == kind:
            times[e.name] += e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
            calls[e.name] += 1
    return times, calls


def gpu_busy_ms(fn, kernels: Counter | None = None) -> float:
    """Sum of the GPU kernels' durations (ms) while ``fn()`` runs (:func:`device_events`; 0 on a CPU).
    ``kernels``: adds the attention kernels' names (:data:`ATTENTION_KERNELS`) and counts to it, to
    see which SDPA backend ran."""
    if DEVICE == "cpu":
        return 0.0
    times, calls = device_events(fn)
    if kernels is not None:
        for name, n in calls.items():
            if any(k in name.lower() for k in ATTENTION_KERNELS):
                kernels[name[:80]] += n
    return sum(times.values()) / 1e3


def cmd_host_time(args) -> dict:
    from space.decoding import DecodeConfig, SpaceDecoder

    dtype = getattr(torch, args.dtype)
    what = f"SmolLM2 + {args.adapter}" if args.adapter else f"random {args.shape}"
    cudnn = {"on": [True], "off": [False], "both": [True, False], "load": [None]}[args.cudnn_sdp]
    if args.gqa != "fold" and args.compile:
        raise SystemExit("--gqa copy / both time an eager trunk's attention: a compiled trunk keeps transformers' own "
                         "sdpa (drop --compile)")
    out = {"model": what, "dtype": args.dtype, "new_tokens": args.new_tokens, "layouts": {}}
    for setup, model, spec, tok in setups(args, dtype):
        out["sdpa_at_load"] = {"cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled()}
        if args.adapter:
            from space.data.prompts import chat_ids, code_prompt
            from space.eval.tasks import load_tasks

            prompts = [torch.tensor(chat_ids(tok, [{"role": "user", "content": code_prompt(t.problem["prompt"])}]))
                       for t in load_tasks("humaneval", limit=args.prompts)]
            layouts = {"ar": None, "shipped": SpaceDecoder(model, spec).config, "chain k3 4 groups": DecodeConfig(3, 4)}
        else:
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 1000, (args.prompt_len,), generator=gen) for _ in range(args.prompts)]
            layouts = {"ar": None, "chain k3 4 groups": DecodeConfig(3, 4),
                       "static tree": DecodeConfig(2, 2, tree=((0,), (1,), (0, 0), (0, 1))),
                       "dynamic + lookup 10": DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10)}
        if args.layouts:
            unknown = set(args.layouts.split(",")) - set(layouts)
            if unknown:
                raise SystemExit(f"--layouts: unknown {sorted(unknown)}; known: {sorted(layouts)}")
            layouts = {name: layouts[name] for name in args.layouts.split(",")}
        turns = [(on, gqa) for on in cudnn for gqa in GQA_CHOICES[args.gqa]]
        for name, cfg in layouts.items():
            for on, gqa in turns:  # in turns per layout, so a drift of the machine touches each alike
                if on is not None:
                    torch.backends.cuda.enable_cudnn_sdp(on)
                key = (name + ("" if setup == "eager" else f", {setup}")
                       + ("" if on is None else f", cudnn sdp {'on' if on else 'off'}")
                       + ("" if args.gqa == "fold" else f", gqa {gqa}"))
                with gqa_path(model, gqa):
                    out["layouts"][key] = entry = host_time(model, spec, cfg, prompts, args.new_tokens)
                print(f"host-time {what} {key}: {entry}", flush=True)
                # each layout's entry kept as it comes: a stage cut at its time cap (g58 lost two) keeps
                # what it timed; main writes the whole result, without "partial", at the end
                write_text_atomic(Path(args.out), json.dumps({**header(), **out, "partial": True}, indent=1))
    return out


GQA_CHOICES = {"fold": ["fold"], "copy": ["copy"], "both": ["fold", "copy"]}


@contextlib.contextmanager
def gqa_path(model, gqa: str):
    """The attention a step runs: ``fold``, what the model loaded with (``space.decoding.backends``:
    on CUDA a grouped call's query heads folded into the batch, each step's mask in aligned rows),
    or ``copy``, what it ran before (transformers' own ``sdpa``, which copies a block's keys and
    values to every query head, ``repeat_kv``, over masks of their own width, which CUDA's
    memory-efficient kernel copies in every layer). An eager trunk's choice: ``cmd_host_time`` refuses
    ``copy`` with ``--compile``."""
    from space.decoding import backends

    if gqa == "fold":
        yield
        return
    impl, align = model.config._attn_implementation, backends.MASK_ALIGN
    model.set_attn_implementation("sdpa")
    backends.MASK_ALIGN = {}
    try:
        yield
    finally:
        model.set_attn_implementation(impl)
        backends.MASK_ALIGN = align


def host_time(model, spec, cfg, prompts: list, new_tokens: int) -> dict:
    """Wall time per step against the GPU's busy time per step, over ``prompts``: AR (``cfg`` None)
    or SPACE with ``cfg``. The first generation is a warm-up (it compiles a compiled trunk's shapes;
    its seconds are ``warm_s``)."""
    from space.decoding import SpaceDecoder, ar_generate

    if cfg is None:
        def run(p, n):
            return ar_generate(model, p, n, suppress_ids=spec.token_ids)
    else:
        def run(p, n, dec=SpaceDecoder(model, spec, cfg)):
            return dec.generate(p, n)
    t0 = time.perf_counter()
    for p in prompts[:2]:  # warm: the second prompt meets shapes (e.g. cache sizes) the first did not
        run(p, new_tokens)
    warm_s = time.perf_counter() - t0
    walls, steps, tokens, busy, rows, kernels = [], 0, 0, 0.0, [], Counter()
    for p in prompts:
        res = run(p, new_tokens)
        walls += res.step_times[1:]  # step 0 holds the prefill
        steps, tokens, rows = steps + res.num_steps - 1, tokens + len(res.new_ids), rows + res.step_rows[1:]
        # the steps' kernels: a whole generation's less a prefill-only one's
        busy += gpu_busy_ms(lambda: run(p, new_tokens), kernels) - gpu_busy_ms(lambda: run(p, 1))
    if not steps:
        raise ValueError(f"no step after the prefill in {len(prompts)} generations of {new_tokens} tokens: "
                         "raise --new-tokens")
    mean_wall_ms, busy_ms = statistics.fmean(walls) * 1e3, busy / steps
    return {"median_step_ms": round(statistics.median(walls) * 1e3, 3), "mean_step_ms": round(mean_wall_ms, 3),
            "gpu_busy_ms_per_step": round(busy_ms, 3),
            "host_share": round(max(0.0, 1 - busy_ms / mean_wall_ms), 3),
            "tokens_per_step": round(tokens / (steps + len(prompts)), 3), "steps": steps,
            "mean_rows": round(statistics.fmean(rows), 2) if rows else 1,
            "tokens_per_s": round(tokens / sum(walls), 1), "warm_s": round(warm_s, 1),
            "attention_kernels": dict(kernels.most_common(4))}


def cmd_train(args) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    from space.adapter_layers import prepare_model
    from space.data.collator import SpaceCollator
    from space.config import SpaceSettings
    from space.train.trainer import SpaceTrainer

    cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg)  # fp32 weights, bf16 autocast: what Trainer's bf16=True does
    tok = tiny_tokenizer()
    model, spec = prepare_model(model, tok, args.mode, args.mask_num, lora_r=LORA_R, lora_alpha=2 * LORA_R)
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 1000, (args.seq_len,), generator=gen).tolist(), "prompt_len": 16, "idx": i}
            for i in range(args.batch * (args.steps + 2))]
    collator = SpaceCollator(spec.ids_for(args.mask_num), args.mask_num, tok.pad_token_id or 0,
                             spans_per_sample=args.spans)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, bf16=DEVICE != "cpu", use_cpu=DEVICE == "cpu", per_device_train_batch_size=args.batch, max_steps=args.steps,
                                  learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none",
                                  remove_unused_columns=False, activation_checkpointing=args.checkpointing,
                                  dataloader_num_workers=0)
        trainer = SpaceTrainer(model=model, args=targs, train_dataset=rows, data_collator=collator,
                               space=SpaceSettings(mode=args.mode, mask_num=args.mask_num, suppress_ids=spec.token_ids),
                               callbacks=[clock])
        if DEVICE != "cpu":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    step_s = statistics.median(clock.times[2:])  # the first steps warm the kernels
    out = {"shape": args.shape, "mode": args.mode, "mask_num": args.mask_num, "batch": args.batch, "seq_len": args.seq_len,
           "spans_per_sample": args.spans, "activation_checkpointing": args.checkpointing,
           "params": sum(p.numel() for p in model.parameters()), "median_step_s": round(step_s, 4),
           "real_tokens_per_s": round(args.batch * args.seq_len / step_s, 1),
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE != "cpu" else None,
           "losses": [round(x, 4) for x in losses]}
    print(f"train {args.shape} {args.mode}: {out}", flush=True)
    return out


def dtype_name(text: str) -> str:
    """--dtype's value as torch names it (bf16 -> bfloat16): ``getattr(torch, ...)`` and the results read it."""
    try:
        return str(parse_dtype(text)).removeprefix("torch.")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def header() -> dict:
    """What every result file starts with: the command line and the machine."""
    return {"command": " ".join(sys.argv), "machine": machine()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step-cost", help="latency against query rows at a real shape")
    s.add_argument("--shape", choices=list(SHAPES), default="llama2-7b")
    s.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,96,128")
    s.add_argument("--caches", default="512,2048")
    s.add_argument("--repeats", type=positive_int, default=20)
    s.add_argument("--dtype", type=dtype_name, default="bfloat16", help="float32, bfloat16, float16 (or fp32, bf16, fp16)")
    s.add_argument("--capture", action="store_true",
                   help="also time the eager trunk's steps replayed from CUDA graphs (space.decoding.graphs)")
    s.add_argument("--sdp", choices=list(SDP_CHOICES), default="default",
                   help="SDPA's kernels: torch's choice, the math path, or both in turn (keys 'math sdp, ...')")
    s.add_argument("--profile", action="store_true",
                   help="per curve and row count, the device's busy ms per step and its costliest kernels (torch.profiler)")
    h = sub.add_parser("host-time", help="host time against GPU busy time per decoding step")
    h.add_argument("--shape", choices=list(SHAPES), default="llama2-7b")
    h.add_argument("--adapter", help="the real SmolLM2 with this adapter instead of a random --shape")
    h.add_argument("--prompts", type=positive_int, default=3)
    h.add_argument("--prompt-len", type=positive_int, default=200)
    h.add_argument("--new-tokens", type=positive_int, default=128)
    h.add_argument("--dtype", type=dtype_name, default="bfloat16", help="float32, bfloat16, float16 (or fp32, bf16, fp16)")
    h.add_argument("--layouts", help="comma-separated names of the layouts to time (default: all)")
    h.add_argument("--cudnn-sdp", choices=["load", "on", "off", "both"], default="load",
                   help="cuDNN attention as chosen at load (space.decoding.backends), on, off, or both in turns")
    h.add_argument("--gqa", choices=list(GQA_CHOICES), default="fold",
                   help="grouped-query attention as loaded (fold: query heads in the batch, aligned masks), as "
                        "transformers' sdpa runs it (copy: repeat_kv, masks padded by SDPA), or both in turns")
    for sp in (s, h):
        sp.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES,
                        help="then the same with the trunk compiled (space.decoding.compiled.compile_trunk; "
                             "reduce-overhead: with CUDA graphs)")
    t = sub.add_parser("train", help="SAR-SFT tokens/s and peak memory of a random 1B-class Llama")
    t.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    t.add_argument("--mode", choices=["frozen-base", "full"], default="frozen-base")
    t.add_argument("--mask-num", type=positive_int, default=5)
    t.add_argument("--batch", type=positive_int, default=4)
    t.add_argument("--seq-len", type=positive_int, default=1024)
    t.add_argument("--spans", type=positive_int, default=8)
    t.add_argument("--steps", type=positive_int, default=8,
                   help="optimizer steps, 3 or more (the first 2 warm the kernels and are not timed)")
    t.add_argument("--checkpointing", action="store_true")
    for sp in (s, h, t):
        sp.add_argument("--out", type=output_file, required=True)
        sp.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of the command (tiny shapes make sense there)")
    args = p.parse_args(argv)
    # checked before the model is built and timed: each failed after the work (a KeyError after the first
    # curve without a 1-row step, a median of no step after training 2 steps)
    if args.cmd == "step-cost":
        for flag, text in (("--rows", args.rows), ("--caches", args.caches)):
            try:
                values = positive_ints(text)
            except argparse.ArgumentTypeError as e:
                p.error(f"argument {flag}: {e}")
            if flag == "--rows" and 1 not in values:
                p.error(f"argument --rows: must include 1 (each curve is read against the 1-row step), got {text!r}")
    if args.cmd == "train" and args.steps < 3:
        p.error(f"argument --steps: must be >= 3 (the first 2 steps warm the kernels and are not timed), got {args.steps}")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu for a dry run)")
    result = {**header(), **{"step-cost": cmd_step_cost, "host-time": cmd_host_time, "train": cmd_train}[args.cmd](args)}
    write_text_atomic(Path(args.out), json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    console("gpu_bench", main)()
