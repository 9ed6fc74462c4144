"""An opt-in compiled forward (issue 43): ``torch.compile`` of the model's trunk, shared by SPACE
and the AR baseline, so a speedup stays the method's and not the compiler's.

What is compiled (issue 58). In inductor's default mode, each decoder layer's forward: one
compiled function serves every layer, which passes itself as an argument (dynamo inlines nn
modules, so a layer's weights are graph inputs), and gets its own KV-cache entry instead of the
whole cache (transformers' attention writes ``cache.update(..., self.layer_idx)``: the index in
the graph made every layer a graph of its own). A graph is made per kind of call, not per layer:
on SmolLM2 with the shipped adapter, AR, PLD and SPACE need 9, ready in about 2 minutes from a
cold cache on 2 CPU cores, where compiling the trunk whole took about 5 minutes a graph (15
minutes in all: ``results/compile_cpu``). The embeddings, rotary tables, mask and final norm run
eagerly between the layers, and so do forward hooks and the LM head, which the decoder runs on
selected rows only. With CUDA graphs (``mode="reduce-overhead"``) the trunk's forward is compiled
whole instead, so that a step replays one graph, not one per layer.

A compiled trunk wants shapes that repeat: ``SpaceDecoder`` and ``ar_generate`` then default to a
preallocated KV cache (``cache.static_cache``), whose key length is fixed per generation, and
every layout pads its rows to buckets (``dynamic.BUCKETS``; ``SpaceDecoder(buckets=...)`` for
static layouts, whose trees are pruned near a rejection and whose lookup branches vary). The
sizes that still vary (the bucket, the cache's slot count per prompt, the first mask row) are
symbolic from the first compile (``dynamic=True``): one graph for the 1-row AR step and one for
SPACE's blocks, where dynamo's default compiles each size's specialized graph first and a
dynamic one at its second value. The frozen-base adapter's first mask row
(``space.masking.mask_rows``, a thread's global) enters the graph as an argument: read inside
it, every value was a guard and a graph of its own (SmolLM2's dynamic tree was still compiling
new graphs after 45 minutes). CUDA graphs record one graph per concrete shape. Prompts run
eagerly (:func:`eager` in the decoders; a layer whose cache entry holds nothing yet, as in
transformers' ``generate``): their lengths would only add graphs, and a prefill runs once.

The frozen mode (``mode="frozen"``, on a CPU; issue 58). A 1-row step reads every weight once,
and the eager GEMVs read them at about half the memory's bandwidth. With inductor's ``freezing``
the weights are constants of the graph, which inductor packs for its own C++ GEMM micro-kernels
(autotuned against MKL's per shape, :data:`FROZEN`): on SmolLM2 at 2 threads an AR step took
about 24 ms against about 50 ms eager on the fast kernels. The trunk is compiled whole, and the
LM head too. Freezing holds the weights, so the mode takes sizes from inputs only: the slot
count from the step's own 4-D mask (``ar_generate`` passes one over a static cache, as the
decoder does: over the slots that hold tokens, ``decoder.mask_slots``), the rows past 1 and the
slots marked dynamic, the first mask row as a (rows, 1) gate (:func:`_frozen_call`). That is one
graph for AR's step on every prompt, one for SPACE's blocks, one for PLD's; a graph takes minutes
to build, SPACE's (with the LoRA's updates) the longest (``results/compile_cpu``; two shortcuts
in inductor while a frozen call runs, :func:`_build_shortcuts`, cut about 25 s from its build and
26-27 s more from a cold cache's). Dynamo keeps no guards on the trunk's modules (each compiled
trunk has a code object of its own, so its graphs are its own): any change to the model after its
first call (weights, dtype, attributes, submodules, hooks inside the trunk) is ignored, not
recompiled; compile a fresh copy instead.

Exactness: a compiled forward computes the same function with other kernels and fusions. SPACE's
multi-row graphs and AR's one-row graph are different graphs, as SPACE's and AR's eager forwards
run different kernels: greedy SPACE equals greedy AR of the same compiled model in fp32 for the
same reason it does eagerly (each row's result does not depend on the other rows), which
``tests/decoding/test_compiled.py`` checks; against an eager model either can differ by float
rounding, like two kernels.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from ..choices import COMPILE_MODES
from ..cpu_kernels import PackedLinear
from ..masking import mask_rows, mask_rows_start
from .backends import SDPA_GQA, register_attention
from .cache import CACHE_ARG, attention_dtype

RECOMPILE_LIMIT = 64  # graphs per compiled function (see compile_trunk)


def frozen_settings(version: str = torch.__version__) -> dict:
    """Inductor's settings in the frozen mode (issue 58) for a torch ``version`` ("2.12.1+cu130"):
    the weights folded into the graph as constants, which inductor packs for its C++ GEMM
    micro-kernels, autotuned against MKL's per shape; the linears that read one input (q/k/v,
    gate/up) concatenated into one GEMM, as the eager fused trunk does."""
    settings = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                "cpp.enable_concat_linear": True, "max_autotune_report_choices_stats": False}
    if torch.torch_version.TorchVersion(version) < "2.13":
        # the C++ code generation of torch 2.11 and 2.12 puts the bound check of the padding mask's
        # index (PLD's graphs: transformers' mask over a DynamicCache) before the index is defined, a
        # compile error. Off there only; 2.13 compiles it (tests/decoding/test_compiled.py, run on all three)
        settings["assert_indirect_indexing"] = False
    return settings


FROZEN = frozen_settings()  # this torch's
# the row count a frozen block graph is autotuned for (``hint_override``, :func:`_mark_rows`); its
# rows stay symbolic. Tuned at the first block's size (often 2-6 rows), inductor chose its C++ GEMM
# for the linears, whose blocking for few rows ran 16 rows in 61-100 ms against oneDNN's 36-41 (a
# toy of SmolLM2's linears); tuned at 16 it keeps oneDNN's packed GEMM for the weights and makes
# the LoRA's small B products its own loops: 4 external GEMMs a layer (results/compile_cpu).
# SPACE's blocks hold 12-16 rows, PLD's up to 11
BLOCK_HINT = 16


def compile_trunk(model, mode: str | None = None):
    """Compile ``model``'s decoder trunk in place, once; returns ``model``. Inductor's default
    mode compiles the decoder layers' forward, one graph for every layer of a shape (seconds each
    at SmolLM2's size on 2 CPU cores); ``"reduce-overhead"`` compiles the trunk's forward whole
    (``model.get_decoder().forward``), so that a step replays one CUDA graph, not one per layer.
    Compilation happens on the first calls, so time a compiled model after a warm-up generation.
    ``mode``: ``torch.compile``'s, one of ``space.choices.COMPILE_MODES`` (None or ``"default"``:
    inductor's default; ``"reduce-overhead"`` adds CUDA graphs on a GPU, one per shape, over the
    static cache's fixed tensors; ``"frozen"``: the trunk whole and the LM head with the weights
    folded in, on a CPU, see the module's docstring). A trunk is compiled once: a second call with a known ``mode``
    returns ``model`` as the first call compiled it.

    Raises:
        ValueError: a model without ``get_decoder`` (not a HF causal LM), or, in the default mode,
            whose trunk has no ``layers`` ModuleList; the fast CPU kernels applied
            (``space.cpu_kernels``: their packed weights are opaque tensors, not compiled here;
            inductor packs the stock linears itself); the fused trunk (``space.decoding.fused``: its groups keep their
            GEMM's outputs between member calls, module state no graph may hold; load with
            ``load_space(compile=...)``, which leaves the trunk unfused); an unknown ``mode``.
    """
    if mode not in (None, *COMPILE_MODES):
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {COMPILE_MODES}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_decoder"):
        raise ValueError(f"compile_trunk needs a HF causal LM with get_decoder(), got {type(base).__name__}")
    trunk = base.get_decoder()
    from .fused import SharedProjection  # here, not at import: fused imports the adapter layers (peft)

    if any(isinstance(m, SharedProjection) for m in trunk.modules()):
        raise ValueError("compile_trunk needs an unfused trunk with the stock kernels: the fused trunk's groups keep "
                         "their GEMM's outputs as module state; load with load_space(compile=...), which loads it "
                         "unfused")
    if any(isinstance(m, PackedLinear) for m in trunk.modules()):
        raise ValueError("compile_trunk needs the stock kernels (kernels='stock'): the fast kernels' "
                         "packed weights are opaque tensors, not compiled here; inductor packs the stock linears itself")
    if is_compiled(base):
        return model
    if next(trunk.parameters()).device.type == "cpu" and base.config._attn_implementation == "sdpa":
        # grouped-query attention without repeat_kv's copy of the cache in every layer, as the eager
        # fused trunk attends (space.decoding.fused.fuse_trunk): AR's step 0.86x the time with it
        register_attention()
        base.set_attn_implementation(SDPA_GQA)
    if mode == "reduce-overhead":
        trunk.forward = _compiled_call(torch.compile(_in_mask_rows, mode=mode, dynamic=True), trunk.forward)
    elif mode == "frozen":
        # the trunk whole, its sizes symbolic from the first graph (rows past 1, slots) and the
        # first mask row a gate: a graph per kind of call, never per prompt; and the LM head, the
        # step's largest GEMM (SmolLM2: 49152 x 576)
        # the gate's dtype is the layers' (a bf16 trunk's); not the first parameter's, which is the
        # mask embedding's fp32 rows (space.adapter_layers.MaskEmbedding): an fp32 gate turned the
        # LoRA's outputs, and so the queries, fp32 over bf16 keys, and SDPA refused the graph
        dtype = attention_dtype(trunk)
        # no guards on the modules, whose weights the graph holds as constants anyway: a step's
        # guards took 1.1 ms of a 20 ms AR step, 0.26 ms without them. The graphs are this model's
        # alone (dynamo keeps them on the code object; another model's call would find them)
        graph = torch.compile(_own_code(_in_mask_rows),
                              options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        trunk.forward = _frozen_call(graph, trunk.forward, dtype)
        head = base.get_output_embeddings()
        head.forward = _frozen_head(torch.compile(head.forward, dynamic=True))
    elif not isinstance(getattr(trunk, "layers", None), torch.nn.ModuleList):
        raise ValueError(f"compile_trunk compiles the decoder layers of a trunk's `layers` ModuleList; "
                         f"{type(trunk).__name__} has none")
    else:
        # one compiled function for every layer, the layer an argument: dynamo inlines nn modules,
        # so a layer's parameters are graph inputs and every layer of a shape reuses its graph
        graph = torch.compile(_in_mask_rows, dynamic=True)
        for index, layer in enumerate(trunk.layers):
            layer.forward = _compiled_call(graph, type(layer).forward.__get__(layer), index)
    # dynamo's default of 8 graphs per function is below what one model meets when SPACE, AR and
    # transformers' generate (PLD, HF) all call it (another set of arguments each, static and
    # dynamic variants); past the limit it would run eagerly without a word
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return model


def _compiled_call(graph, forward, layer_index: int | None = None):
    """A forward that runs ``forward`` through ``graph`` (``_in_mask_rows`` compiled), with the
    first mask row (:func:`space.masking.mask_rows_start`) an argument: read inside the graph, each
    value was a guard and a graph of its own. ``dynamic=True`` makes it symbolic from the first
    graph, as the row and slot counts, so a new prompt, bucket or tree reuses the graph instead of
    compiling a specialized one and then a dynamic one.

    A decoder layer's forward (``layer_index`` given) gets its own entry of the KV cache
    (:class:`_LayerCache`), and runs eagerly while that entry holds nothing yet: a prompt's
    prefill (transformers' ``generate`` for PLD, whose prefill no ``eager()`` wraps), whose
    graph would be one more to compile for a forward that runs once per prompt. (So does a layer
    of a cache that offloads, whose ``update`` moves the layers between devices.)"""

    def compiled_forward(*args, **kwargs):
        if layer_index is not None and kwargs.get(CACHE_ARG) is not None:
            entry = _cache_entry(kwargs[CACHE_ARG], layer_index)
            if entry is None:
                return forward(*args, **kwargs)
            kwargs[CACHE_ARG] = _LayerCache(entry)
        start = mask_rows_start()
        with mask_rows(None):  # cleared around the graph: only its argument says where masks start
            return graph(start, forward, *args, **kwargs)

    compiled_forward.graph = graph
    return compiled_forward


def _frozen_head(graph):
    """The LM head's forward through ``graph`` (its forward compiled) under :data:`FROZEN`'s
    inductor settings, patched around each call; a block's rows (batch, rows, hidden) autotuned
    as :data:`BLOCK_HINT`."""
    from torch._inductor import config  # here, not at import: inductor loads only to compile

    def frozen_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-2] > 1:
            _mark_rows(hidden, hidden.dim() - 2)
        with config.patch(FROZEN), _build_shortcuts():
            return graph(hidden)

    frozen_forward.graph = graph
    return frozen_forward


def _frozen_call(graph, forward, dtype: torch.dtype):
    """The trunk's ``forward`` through ``graph`` (``_in_mask_rows`` compiled) under
    :data:`FROZEN`'s inductor settings, patched around each call (a graph compiles inside its
    first call; nothing is set for the rest of the process), and

    * the first mask row enters as a (rows, 1) gate in ``dtype`` (``space.masking.mask_rows``,
      as a captured step's): the frozen-base LoRA's update is computed on every row and
      multiplied by it, so no first-row value or branch on it is in the graph;
    * the sizes that vary (rows past 1, the cache's slots) are symbolic from the first graph
      (:func:`_mark_sizes`), a block's rows autotuned as :data:`BLOCK_HINT`: a graph per kind of
      call (AR's 1-row step, SPACE's blocks, PLD's blocks over transformers' dynamic cache),
      never one per prompt or bucket;
    * the cache's tensors are plain, contiguous inputs with dynamic slots (:func:`_cache_inputs`);
    * a call whose cache holds nothing yet (a prefill: transformers' ``generate`` for PLD, which
      no ``eager()`` wraps) or that has no cache runs eagerly, as in the default mode, and so does
      one over a :class:`space.decoding.cache.SlabCache` (``static_cache=False``), whose length is
      a host integer: a graph per step."""
    from torch._inductor import config  # here, not at import: inductor loads only to compile

    def frozen_forward(*args, **kwargs):
        cache = kwargs.get(CACHE_ARG)
        if _cache_entry(cache, 0) is None or not isinstance(cache.layers[0], (StaticLayer, DynamicLayer)):
            return forward(*args, **kwargs)
        _cache_inputs(cache)
        # the arguments that are set, in one order: AR's step (through the causal LM, which passes
        # inputs_embeds=None) and SPACE's 1-row block without a mask group (the decoder's own call)
        # are then one graph, not two of a minute each
        kwargs = {k: kwargs[k] for k in sorted(kwargs) if kwargs[k] is not None}
        rows = _mark_sizes(kwargs)
        start = mask_rows_start()
        if start is None and rows > 1 and isinstance(cache.layers[0], StaticLayer):
            # a block over a static cache without a mask row is SPACE's (AR's step has one row, PLD
            # runs over transformers' dynamic cache): SPACE's graph with an all-zero gate, an exact
            # + 0 on every row, not a graph of its own (minutes to build)
            start = rows
        if isinstance(start, int):
            start = (torch.arange(rows, device=cache.layers[0].keys.device) >= start).to(dtype)[:, None]
        if isinstance(start, torch.Tensor) and rows > 1:  # a gate, ours or a caller's (rows, 1)
            _mark_rows(start, 0)
        with mask_rows(None), config.patch(FROZEN), _build_shortcuts():
            return graph(start, forward, *args, **kwargs)

    frozen_forward.graph = graph
    return frozen_forward


_SHORTCUTS = {"depth": 0, "template": None, "header": None}  # frozen calls inside, and inductor's methods swapped out
_SHORTCUTS_LOCK = threading.Lock()


@functools.cache
def _kept_compiler(compile_source) -> staticmethod:
    """``compile_source`` (inductor's jinja compiler) keeping what it compiled, per source."""
    return staticmethod(functools.lru_cache(maxsize=None)(compile_source))


def _prefix_header(cls, device: str) -> str | None:
    """The header inductor precompiles for its own CPU kernels' modules (``cpp_prefix.h``), given
    to its plain C++ code cache too (:func:`_build_shortcuts`)."""
    from torch._inductor.codecache import _get_cpp_prefix_header

    return _get_cpp_prefix_header(device)


@contextlib.contextmanager
def _build_shortcuts():
    """Inside, two of inductor's costs in a frozen build are cut, its output unchanged:

    * each jinja source of its C++ GEMM templates is compiled once, not at every GEMM it tries
      or emits. A frozen build of SmolLM2's graphs compiled 32 sources 8,394 times, about 41 s
      of a 225 s profile; with them kept, SPACE's block graph built in 171-176 s against 196-197
      s, alternating. A compiled template holds no state between renders;
    * the C++ choice that autotuning times for a GEMM is compiled with inductor's prefix header
      precompiled, as its kernels' modules are: its plain code cache (``CppCodeCache``, which
      the benchmarks load through) precompiled none, and each such compile took 5.4-6.0 s on this
      2-core CPU against 2.8-3.1 s. Cold, SPACE's block graph has 11 of them: it built in 241 and
      188 s against 268 and 214 s, two pairs (``results/compile_cpu``). A warm autotuning cache
      times nothing.

    The outermost entry, of any thread, swaps in what it finds on inductor's classes, and the last
    exit puts that back; a method a torch does not define (``KernelTemplate``'s
    ``_template_from_string``, ``CppCodeCache``'s ``_get_uncompiled_header``), or a header method
    that already names a header, is left alone. The swap is the process's: while a frozen call
    runs, another thread's plain C++ compile gets the header too (only its compile time changes)."""
    # here, not at import: inductor loads only to compile
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.codegen.common import KernelTemplate

    with _SHORTCUTS_LOCK:
        if _SHORTCUTS["depth"] == 0:
            template = KernelTemplate.__dict__.get("_template_from_string")
            # each kept only where swapped: the last exit puts back what it keeps
            template = _SHORTCUTS["template"] = template if isinstance(template, staticmethod) else None
            if template is not None:
                KernelTemplate._template_from_string = _kept_compiler(template.__func__)
            header = CppCodeCache.__dict__.get("_get_uncompiled_header")
            # swapped only where inductor precompiles nothing for the plain cache (torch 2.11 to 2.13)
            header = _SHORTCUTS["header"] = (header if isinstance(header, classmethod)
                                             and header.__func__(CppCodeCache, "cpu") is None else None)
            if header is not None:
                CppCodeCache._get_uncompiled_header = classmethod(_prefix_header)
        _SHORTCUTS["depth"] += 1
    try:
        yield
    finally:
        with _SHORTCUTS_LOCK:
            _SHORTCUTS["depth"] -= 1
            if _SHORTCUTS["depth"] == 0:
                if _SHORTCUTS["template"] is not None:
                    KernelTemplate._template_from_string = _SHORTCUTS["template"]
                if _SHORTCUTS["header"] is not None:
                    CppCodeCache._get_uncompiled_header = _SHORTCUTS["header"]


def _mark_sizes(kwargs: dict) -> int:
    """Mark a trunk call's varying sizes dynamic: the rows of the ids, positions (and
    ``cache_position``, which transformers before 5.x's rename passed) and 4-D mask when above 1
    (:func:`_mark_rows`, every input of the rows' size: a strict mark refuses an unmarked one;
    AR's single row keeps a graph of its own, where the C++ GEMM is a GEMV), the mask's slots
    (``torch._dynamo.maybe_mark_dynamic``; a 4-D mask, one per layer kind on a hybrid model, or
    transformers generate's 2-D one; the cache's: :func:`_cache_inputs`). Returns the rows."""
    mark = torch._dynamo.maybe_mark_dynamic
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs["inputs_embeds"]
    rows = ids.shape[1]
    if rows > 1:
        for t, dim in ((ids, 1), (kwargs.get("position_ids"), 1), (kwargs.get("cache_position"), 0)):
            if t is not None:
                _mark_rows(t, dim)
    mask = kwargs.get("attention_mask")
    for m in mask.values() if isinstance(mask, dict) else (mask,):  # {layer kind: mask} on hybrid models
        if isinstance(m, torch.Tensor) and m.dim() == 4:
            if rows > 1:
                _mark_rows(m, 2)
            mark(m, 3)
        elif isinstance(m, torch.Tensor) and m.dim() == 2 and rows > 1:  # transformers generate's (batch, past + rows)
            # traced at the past + the rows' hint: the hint is the value dynamo traces with, and
            # transformers compares the mask's length with the cache's plus the rows (a padded
            # mask's check failed on the real length)
            torch._dynamo.mark_dynamic(m, 1, hint_override=m.shape[1] - rows + BLOCK_HINT)
        elif isinstance(m, torch.Tensor) and m.dim() == 2:
            mark(m, 1)
    return rows


def _mark_rows(tensor: torch.Tensor, dim: int) -> None:
    """Mark a block's row dimension dynamic, autotuned as :data:`BLOCK_HINT` rows whatever the
    first block's size (``torch._dynamo.mark_dynamic``'s ``hint_override``). The hint is also the
    value dynamo traces the rows with (torch 2.13), so every input sized by the rows is marked
    alike (:func:`_mark_sizes`)."""
    torch._dynamo.mark_dynamic(tensor, dim, hint_override=BLOCK_HINT)


def _cache_inputs(cache) -> None:
    """Make a cache's tensors plain graph inputs, in one pass over its layers:

    * clear the static-address marks transformers' ``StaticLayer`` puts on them
      (``torch._dynamo.mark_static_address``, for CUDA graphs). Freezing folds a marked input into
      the graph as it folds a weight: a frozen graph then kept writing into the first
      generation's cache and left a second cache object untouched, without an error (a toy;
      ``results/compile_cpu``);
    * make a dynamic cache's cropped layers contiguous (transformers crops a ``DynamicLayer`` to
      a view, and its next update concatenates): a graph holds its inputs' strides, so PLD's step
      after a rejection compiled a graph of its own;
    * mark the keys' and values' slots dynamic (``torch._dynamo.maybe_mark_dynamic``)."""
    for layer in cache.layers:
        for name in ("keys", "values", "cumulative_length"):  # a DynamicLayer (PLD's) has no length
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                vars(tensor).pop("_dynamo_static_input_type", None)
        if isinstance(layer, DynamicLayer) and not layer.keys.is_contiguous():
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(tensor, 2)


def _own_code(fn):
    """``fn`` with a code object of its own: dynamo keeps a function's compiled graphs and their
    guards on its code object, shared by every ``torch.compile`` of that function."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _in_mask_rows(start: int | None, forward, *args, **kwargs):
    with mask_rows(start):
        return forward(*args, **kwargs)


def _cache_entry(cache, index: int):
    """Layer ``index``'s entry of a transformers ``Cache`` once it holds tokens, else None (not
    written yet, or a cache that offloads its layers)."""
    layers = getattr(cache, "layers", ())
    if index >= len(layers) or getattr(cache, "offloading", False) or not layers[index].is_initialized:
        return None
    return layers[index]


class _LayerCache:
    """A transformers ``Cache`` as one decoder layer's attention uses it: ``update`` writes the
    layer's own entry, whatever layer index the modeling code passes. The index is what differs
    between the layers' calls: read in the graph, it was a guard, and every layer compiled a graph
    of its own."""

    def __init__(self, entry):
        self.entry = entry

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.entry.update(key_states, value_states, *args, **kwargs)


def eager():
    """A context in which a compiled trunk runs eagerly (``torch.compiler.set_stance``): the
    prompt's forward, whose length changes with every prompt."""
    return torch.compiler.set_stance("force_eager")


def is_compiled(model) -> bool:
    """Whether ``model``'s trunk was compiled by :func:`compile_trunk`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk = base.get_decoder() if hasattr(base, "get_decoder") else base
    layers = getattr(trunk, "layers", None) or ()
    return any(hasattr(getattr(m.forward, "graph", None), "_torchdynamo_orig_callable") for m in (trunk, *layers[:1]))
