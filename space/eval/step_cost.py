"""The step-cost curve: what one SPACE step of q rows costs on this machine, measured, and when a
run measures it at load (issue 44: a dynamic tree prices its rows by it; issue 58: a GPU's
launch-bound steps are priced by their own). ``space-tree`` stores curves in an adapter;
``space.loader.load_space``, ``space-eval`` and ``space-chat`` measure one at load
(:func:`price_at_load`).
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..decoding.config import DecodeConfig


def step_cost_curve(model, rows: list[int], cache_len: int = 300, repeats: int = 15,
                    static: bool = False, graphs=None) -> dict[int, float]:
    """Median seconds of one SPACE-like forward of q rows after ``cache_len`` cached tokens: an
    additive 4-D mask, the frozen-base LoRA on rows 1.. (``mask_rows(1)``: every row but the first
    treated as a mask row, an upper bound on a step's adapter work) and the LM head on every row.
    q = 1 is timed as an AR step (no mask rows). ``static``: after a preallocated cache of
    ``cache_len + max(rows) + 1`` slots (``cache.static_cache``), as a compiled decoder runs its steps
    (the mask spans every slot on stock attention; the cached tokens and the block where the attention
    reads only the mask's width, ``decoder.mask_slots``). ``graphs``: through these captured steps
    (``space.decoding.graphs.StepGraphs``, with a size for each of ``rows`` and ``cache_len +
    max(rows)`` slots), as ``space-eval --capture`` runs them. Returns {q: seconds}
    (:func:`time_steps`).
    """
    timed = time_steps(model, [(q, q > 1) for q in rows], cache_len, repeats, static, graphs)
    return {q: timed[q, q > 1] for q in rows}


def time_steps(model, shapes: list[tuple[int, bool]], cache_len: int = 300, repeats: int = 15,
               static: bool = False, graphs=None) -> dict[tuple[int, bool], float]:
    """Median seconds of one forward of each ``(rows, with mask rows)`` shape after ``cache_len``
    cached tokens, the LM head on every row. The shapes take turns, in alternating order, for
    ``repeats`` rounds after one warm-up round: a step's cost drifts by 10-20 % over seconds on a
    shared CPU, and timing each shape in its own block put that drift into the curve's ratios
    (the 1-row point of two runs differed by 15 %), while the decoder too changes shape every step.

    Which ids and which visibility the rows have does not change the cost, only their number.
    The cache is the one the decoder would hold (``space.decoding.cache.eager_cache``): a
    ``SlabCache`` on one device, whose step writes only its block (a ``DynamicCache`` concatenates
    the whole cache in every layer, which the decoder does only for a model spread over devices);
    with ``static`` a static cache, every step (1 row too) with the 4-D mask a decoder passes
    over it (``space.decoding.decoder.mask_slots``). The trunk and the head get their inputs as the
    decoders pass them (a fresh block of ids; the head on a block's (rows, hidden), on AR's
    (1, 1, hidden)), so a compiled trunk times the graphs a decoding run builds, and builds none of its own.
    ``graphs``: each forward is a captured step (``StepGraphs.step``) over its cache, the rows a
    causal block (``static`` does not apply).
    """
    import torch
    from tqdm import tqdm
    from ..decoding.cache import attention_dtype, cache_input, crop_cache, eager_cache, refuse_sliding_window, static_cache
    from ..decoding.compiled import eager
    from ..decoding.decoder import mask_slots
    from ..masking import mask_rows, to_additive_4d

    most = max(q for q, _ in shapes)
    with torch.inference_mode():
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder, head = base.get_decoder(), base.get_output_embeddings()
        device = head.weight.device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, min(base.config.vocab_size, 1000), (cache_len + most,), generator=gen).to(device)
        refuse_sliding_window(base.config, "the step-cost measurement", cache_len + most)
        # a slot past the widest block, as a decoder's cache always has: where the attention reads only
        # the mask's width, a compiled graph traced with the mask as wide as the cache holds that
        # equality (dynamo's duck sizing), a graph of its own (stock attention's mask spans every slot)
        slots = cache_len + most + 1 if static else None
        if graphs is not None:
            graphs.reset()
            cache = graphs.cache
        else:
            cache = (static_cache(base.config.num_hidden_layers, slots) if static
                     else eager_cache(decoder, cache_len + most))
        with eager():  # the cached prefix, as a decoder's prefill (a compiled trunk would make a graph for it)
            decoder(input_ids=ids[None, :cache_len], **cache_input(cache), use_cache=True)
        inputs, blocks = {}, {}
        for q, _ in shapes:
            if graphs is not None:  # (positions past the cache, the rows' own causal mask) for a captured step
                causal = torch.ones(q, q, dtype=torch.bool).tril()[None, None]
                blocks[q] = torch.arange(q, device=device), to_additive_4d(causal, graphs.dtype).to(device) if q > 1 else None
            causal = torch.ones(q, mask_slots(decoder, slots) or cache_len + q, dtype=torch.bool).tril(cache_len)
            # the ids a fresh tensor, as a decoder's block is: a compiled graph guards on the ids'
            # strides, and a view into the longer ``ids`` built a graph of its own (minutes, frozen)
            inputs[q] = dict(input_ids=ids[cache_len:cache_len + q].clone()[None],
                             position_ids=torch.arange(cache_len, cache_len + q, device=device)[None],
                             attention_mask=to_additive_4d(causal, attention_dtype(decoder)).to(device)
                             if q > 1 or static else None)
        times = {shape: [] for shape in shapes}
        for round_ in tqdm(range(repeats + 1), desc="step cost", unit="round"):  # round 0 warms every shape up
            for q, masks in shapes if round_ % 2 else shapes[::-1]:
                t0 = time.perf_counter()
                if graphs is not None:  # the block's own mask and positions, as a decoder's step gives them
                    hidden = graphs.step(inputs[q]["input_ids"][0], blocks[q][0], blocks[q][1], cache_len,
                                         1 if masks else None)
                else:
                    with mask_rows(1 if masks else None):  # None: no mask row, as AR and a lookup block call it
                        hidden = decoder(**inputs[q], **cache_input(cache), use_cache=True).last_hidden_state
                    # the head on the rows as each method calls it: AR's causal LM on (1, 1, hidden),
                    # a SPACE block's on (rows, hidden) (a compiled head guards on the rank)
                    hidden = hidden if q == 1 and not masks else hidden[0]
                head(hidden.to(head.weight.dtype))  # an fp32 head on a bf16 trunk, as the decoders cast
                if device.type == "cuda":  # the head's device: the current one may be another GPU
                    torch.cuda.synchronize(device)
                elif device.type == "mps":
                    torch.mps.synchronize()
                if round_:
                    times[q, masks].append(time.perf_counter() - t0)
                crop_cache(cache, cache_len, cache_len + q)
        return {shape: statistics.median(t) for shape, t in times.items()}


def adapter_cost(model, cache_len: int = 300, repeats: int = 15, graphs=None, static: bool = False) -> float:
    """The adapter's fixed cost per step in ms (issue 44): a 2-row step with a mask row minus one
    without (never below 0), timed in turns (:func:`time_steps`), the part of the curve's 1 -> 2-row
    jump that only blocks with mask groups pay (``DecodeConfig.adapter_cost``). ``graphs``: through
    these captured steps (the gated graph against the plain one). ``static``: after a static cache,
    as a compiled trunk runs (under ``compile="frozen"`` both are the gated graph, the gate zero
    without mask rows: about 0)."""
    timed = time_steps(model, [(2, True), (2, False)], cache_len, repeats, static, graphs)
    return round(max(timed[2, True] - timed[2, False], 0.0) * 1e3, 3)


def curve_points(max_rows: int, sizes=None) -> list[int]:
    """The row counts a step-cost curve is timed at, up to ``max_rows`` (which is one of them): the
    dynamic tree interpolates between them (``dynamic.StepCost``). ``sizes``: captured steps' row
    buckets (``graphs.StepGraphs.sizes``), the only counts they can time (``max_rows`` among them)."""
    points = {1, 2, 4, 8, 12, 16, 24, 32, 48, max_rows} & set(range(1, max_rows + 1))
    return sorted(points if sizes is None else points & set(sizes))


def measure_step_cost(model, max_rows: int, cache_len: int = 300, repeats: int = 15, graphs=None) -> dict:
    """This machine's step-cost curve and adapter cost, measured now for a dynamic tree of up to
    ``max_rows`` rows (issue 58: an adapter's stored curves are a CPU's, and a GPU's steps are
    launch-bound: on an H200 a SPACE step of about 14 rows cost 1.32x an AR step eagerly and 1.41x
    captured, where the CPU curve prices 14 rows at 1.6x one, so the planner chose smaller trees than
    the GPU pays for; a flat curve took the same questions from 2.46 to 2.66 tokens/step,
    ``results/step_cost_pricing_cpu``). Eager trunk, or the captured steps ``graphs`` (their row
    buckets, ``max_rows`` among them).

    Returns:
        ``{"step_cost": [[rows, ms], ...], "adapter_cost": ms, "seconds": s}``: a ``DecodeConfig``'s
        ``step_cost`` and ``adapter_cost`` (:func:`step_cost_curve`, :func:`adapter_cost`) and the
        wall time the two measurements took.
    """
    t0 = time.perf_counter()
    sizes = graphs.sizes if graphs is not None else None
    curve = step_cost_curve(model, curve_points(max_rows, sizes), cache_len, repeats, graphs=graphs)
    fixed = adapter_cost(model, cache_len, repeats, graphs=graphs)
    return {"step_cost": step_cost_points(curve), "adapter_cost": fixed,
            "seconds": round(time.perf_counter() - t0, 2)}


def step_cost_points(curve: dict[int, float]) -> list[list]:
    """A measured curve {rows: seconds} as a DecodeConfig ``step_cost``: ``[[rows, ms], ...]``, rows
    ascending, ms rounded to 3 decimals (at least 0.001, a cost must be > 0)."""
    return [[q, max(round(seconds * 1e3, 3), 0.001)] for q, seconds in sorted(curve.items())]


def step_cost_mismatch(setup: dict | None, threads: int, kernels: str, compiled: bool | str = False,
                       trunk: str = "fused", device: str = "cpu", capture: bool = False,
                       packed_kernel: str | None = None, cpu: str | None = None, gpu: str | None = None,
                       dtype: str | None = None) -> str | None:
    """Why a stored step-cost curve may not price this run's rows: the threads, kernels,
    compilation, trunk, device type or captured steps it was measured with differ from the run's
    (a curve at 1 thread prices rows wrong at 2; space-tree measures eagerly unless given ``--compile``,
    and a ``--compile`` run attends over a preallocated cache with other kernels; a curve recorded without a trunk
    predates the fused trunk, ``space.decoding.fused``, whose steps cost less; a CPU's steps are
    compute-bound where a GPU's are launch-bound, and a replayed graph's are not). ``trunk``: the
    run's, ``"fused"`` or ``"unfused"`` (:func:`trunk_of`). ``packed_kernel``: the run's fast
    CPU kernel, timed on its CPU (``cpu_kernels.choose_packed_kernel``; on an AVX-512 Intel CPU a
    16-row step cost 1.65x a 1-row one on MKL's, 1.88x on oneDNN's), compared when both it and the
    curve name one. ``cpu``: the run's CPU (None: this machine's, ``cpu_kernels.cpu_identity``),
    compared on a CPU when the curve names one (an AVX2 EPYC's curve cost a Zen 4 EPYC 10 %); ``gpu``
    likewise on a CUDA GPU (None: this machine's, ``models.gpu_identity``); ``dtype``: the trunk's
    (:func:`trunk_dtype`; None: not compared), a curve naming none being fp32's. None when they
    agree or nothing was recorded."""
    if not setup:
        return None
    from ..artifact import compile_setup
    from ..cpu_kernels import cpu_identity

    from ..models import gpu_identity

    cpu = (cpu or cpu_identity()) if device == "cpu" else None
    gpu = (gpu or gpu_identity()) if device == "cuda" else None

    # a curve recorded without a compile mode is eager; one recorded before issue 58 was measured on a CPU
    recorded = {"compile": False, "trunk": "unfused", "device": "cpu", "capture": False, "dtype": "float32", **setup}
    recorded["compile"], compiled = compile_setup(recorded["compile"]), compile_setup(compiled)  # "default" is True
    off_cpu = device != "cpu" and recorded["device"] != "cpu"  # a GPU's steps barely depend on the host's threads
    diff = [f"{key} {recorded[key]} (run: {now})"
            for key, now in (("threads", threads), ("kernels", kernels), ("compile", compiled), ("trunk", trunk),
                             ("device", device), ("capture", capture), ("packed_kernel", packed_kernel), ("cpu", cpu),
                             ("gpu", gpu), ("dtype", dtype))
            if key in recorded and recorded[key] != now and not (key == "threads" and off_cpu)
            and not (key in ("packed_kernel", "cpu", "gpu", "dtype") and now is None)]
    if not diff:
        return None
    return ("the adapter's step-cost curve was measured with " + ", ".join(diff) + ": the dynamic tree prices "
            "rows by it; re-measure with space-tree --write-adapter under this run's setup")


def warn_step_cost_mismatch(setup: dict | None, model, threads: int, kernels: str, compiled: bool | str = False,
                            capture: bool = False, packed_kernel: str | None = None, stacklevel: int = 2) -> None:
    """Warn (``UserWarning``, at the caller's caller for the default ``stacklevel``) when the curve
    that priced ``model``'s dynamic tree was measured with another setup than this run's
    (:func:`step_cost_mismatch`; the trunk and the device read from ``model``). ``space-eval``,
    ``space-chat`` and ``load_space`` call it."""
    import warnings

    from ..models import model_gpu

    mismatch = step_cost_mismatch(setup, threads, kernels, compiled, trunk_of(model),
                                  next(model.parameters()).device.type, capture, packed_kernel,
                                  gpu=model_gpu(model), dtype=trunk_dtype(model))
    if mismatch:
        warnings.warn(mismatch, stacklevel=stacklevel + 1)


def curve_setup(model, kernels: str, capture: bool) -> dict:
    """What a step-cost curve measured now on ``model`` is measured with (``artifact.setup_key``'s
    fields): this process's torch threads, the ``kernels`` choice, the device type, ``capture``
    (captured steps), the trunk (:func:`trunk_of`) and, on a CPU, which CPU
    (``cpu_kernels.cpu_identity``), on a CUDA GPU which GPU (``models.gpu_identity``), and the
    trunk's dtype (:func:`trunk_dtype`)."""
    import torch

    from ..cpu_kernels import cpu_identity
    from ..models import model_gpu

    device = next(model.parameters()).device
    chip = {"cpu": cpu_identity()} if device.type == "cpu" else {}
    if device.type == "cuda":
        chip = {"gpu": model_gpu(model)}  # the model's GPU, not the current one
    return {"threads": torch.get_num_threads(), "kernels": kernels, "device": device.type,
            "capture": capture, "trunk": trunk_of(model), **chip, "dtype": trunk_dtype(model)}


# devices whose step cost ``auto`` measures at load when the adapter stores no curve for them: a
# GPU's steps take seconds to time (a CPU's curves are stored, and a CPU takes about 10 s)
AUTO_MEASURED = ("cuda",)


def price_at_load(model, decode: DecodeConfig, setup: dict | None, mode: str, kernels: str, capture: bool = False,
                  graphs=None, compiled: bool | str = False, sharded: bool = False,
                  tool: str = "space-eval") -> tuple[DecodeConfig, dict | None]:
    """A dynamic tree priced by this machine's step cost, measured now, where ``mode`` asks for it
    (issue 58): ``"measure"``; ``"auto"`` on a device of :data:`AUTO_MEASURED` (a GPU, whose
    eager steps are launch-bound where the stored CPU curves price 14 rows at 1.6x one) when the
    stored curve's setup is not this run's (:func:`step_cost_mismatch`) or none is stored, never
    on a compiled trunk or in shards; ``"stored"`` never. Eager trunk, or the captured steps
    ``graphs`` (:func:`measure_step_cost`). ``space-eval`` and ``space-chat`` call it.

    Args:
        decode: the layout, priced by the stored curve (``artifact.priced_for_setup``).
        setup: that curve's setup (``priced_for_setup``'s second value; None: none stored).
        mode: one of ``choices.STEP_COST_CHOICES``.
        tool: the name the measurement's one line (stdout) starts with.

    Returns:
        (the layout, the curve's setup: with ``"measured": "at load"`` and its seconds when measured),
        else ``(decode, setup)`` unchanged.

    Raises:
        ValueError: ``"measure"`` with a static layout, whose steps no curve prices.
    """
    if mode == "stored":
        return decode, setup
    if decode.tree != "dynamic":
        if mode == "measure":
            raise ValueError("--step-cost measure prices the dynamic tree's steps; this layout is static "
                             "(add --tree dynamic)")
        return decode, setup
    here = curve_setup(model, kernels, capture)
    if mode == "auto" and (here["device"] not in AUTO_MEASURED or compiled or sharded or (
            setup and not step_cost_mismatch(setup, here["threads"], kernels, False, here["trunk"], here["device"],
                                             capture, cpu=here.get("cpu"), gpu=here.get("gpu"), dtype=here["dtype"]))):
        return decode, setup
    # a typical cache behind the timed rows (HumanEval's prompts and answers), within the context or
    # the captured cache, and short of a sliding window (the timed steps' masks do not slide)
    from ..decoding.cache import attention_windows

    room = (graphs.slots if graphs is not None else model.config.max_position_embeddings) - decode.max_rows() - 1
    windows = [w for w in attention_windows(model.config).values() if w is not None]
    room = min([room] + [w - decode.max_rows() - 1 for w in windows])
    measured = measure_step_cost(model, decode.max_rows(), cache_len=max(1, min(300, room)), graphs=graphs)
    first, last = measured["step_cost"][0], measured["step_cost"][-1]
    print(f"[{tool}] measured this machine's step cost in {measured['seconds']:.1f} s: 1 row {first[1]} ms, "
          f"{last[0]} rows {last[1]} ms ({last[1] / first[1]:.2f}x); adapter cost {measured['adapter_cost']} ms",
          flush=True)
    return (decode.override(step_cost=tuple(map(tuple, measured["step_cost"])), adapter_cost=measured["adapter_cost"]),
            {**here, "measured": "at load", "seconds": measured["seconds"]})


def trunk_dtype(model) -> str:
    """The dtype ``model``'s trunk computes in, as a step-cost curve records it (``"float32"``,
    ``"bfloat16"``; ``cache.attention_dtype``: not an fp32 LM head's on a bf16 trunk; a module
    without a decoder: its first parameter's)."""
    from ..decoding.cache import attention_dtype

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = attention_dtype(base.get_decoder()) if hasattr(base, "get_decoder") else next(base.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def trunk_of(model) -> str:
    """``"fused"`` when ``space.loader.load_space`` fused ``model``'s trunk (``model.space_trunk``),
    else ``"unfused"`` (a compiled trunk, a model spread over devices, a model loaded otherwise)."""
    return "fused" if getattr(model, "space_trunk", None) else "unfused"
