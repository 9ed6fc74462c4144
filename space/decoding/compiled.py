"""An opt-in compiled forward (issue 43): ``torch.compile`` of the model's trunk, shared by SPACE
and the AR baseline, so a speedup stays the method's and not the compiler's.

The trunk's ``forward`` is replaced on the instance by its compiled version (inductor on CPU and
CUDA). Forward hooks stay outside the graph (the decoder's host-time hooks, device-map hooks),
and so does the LM head, which the decoder runs on selected rows only.

A compiled trunk wants shapes that repeat: ``SpaceDecoder`` and ``ar_generate`` then default to a
preallocated KV cache (``cache.static_cache``), whose key length is fixed per generation, and
every layout pads its rows to buckets (``dynamic.BUCKETS``; ``SpaceDecoder(buckets=...)`` for
static layouts, whose trees are pruned near a rejection and whose lookup branches vary). The
sizes that still vary (the bucket, the cache's slot count per prompt, the first mask row) are
symbolic from the first compile (``dynamic=True``): one graph for the 1-row AR step and one for
SPACE's blocks, where dynamo's default compiles each size's specialized graph first and a
dynamic one at its second value (5 graphs instead of 2 on the tiny model, and a graph of
SmolLM2 takes minutes on 2 CPU cores). The frozen-base adapter's first mask row
(``space.masking.mask_rows``, a thread's global) enters the graph as an argument: read inside
it, every value was a guard and a graph of its own (SmolLM2's dynamic tree was still compiling
new graphs after 45 minutes). CUDA graphs (``mode="reduce-overhead"``) record one graph per
concrete shape. Prompts run eagerly (:func:`eager`): their lengths would only add graphs, and a
prefill runs once.

Exactness: a compiled forward computes the same function with other kernels and fusions. SPACE's
multi-row graphs and AR's one-row graph are different graphs, as SPACE's and AR's eager forwards
run different kernels: greedy SPACE equals greedy AR of the same compiled model in fp32 for the
same reason it does eagerly (each row's result does not depend on the other rows), which
``tests/decoding/test_compiled.py`` checks; against an eager model either can differ by float
rounding, like two kernels.
"""
from __future__ import annotations

import torch

from ..choices import COMPILE_MODES
from ..cpu_kernels import PackedLinear
from ..masking import mask_rows, mask_rows_start

RECOMPILE_LIMIT = 64  # graphs per compiled function (see compile_trunk)


def compile_trunk(model, mode: str | None = None):
    """Compile ``model``'s decoder trunk in place (``model.get_decoder().forward``), once; returns
    ``model``. Compilation happens on the first calls (seconds on the tiny model, minutes per
    graph at SmolLM2's size on 2 CPU cores), so time a compiled model after a
    warm-up generation. ``mode``: ``torch.compile``'s, one of ``space.choices.COMPILE_MODES``
    (None or ``"default"``: inductor's default; ``"reduce-overhead"`` adds CUDA graphs on a GPU,
    one per shape, over the static cache's fixed tensors). A trunk is compiled once: a second call
    with a known ``mode`` returns ``model`` as the first call compiled it.

    Raises:
        ValueError: a model without ``get_decoder`` (not a HF causal LM), or with the fast CPU
            kernels applied (``space.cpu_kernels``: inductor cannot lower oneDNN's prepacked
            linears; it packs the stock ones itself), or an unknown ``mode``.
    """
    if mode not in (None, *COMPILE_MODES):
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {COMPILE_MODES}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_decoder"):
        raise ValueError(f"compile_trunk needs a HF causal LM with get_decoder(), got {type(base).__name__}")
    trunk = base.get_decoder()
    if any(isinstance(m, PackedLinear) for m in trunk.modules()):
        raise ValueError("compile_trunk needs the stock kernels (kernels='stock'): inductor cannot lower the fast "
                         "kernels' oneDNN-prepacked linears, and packs the stock ones itself")
    if not is_compiled(base):
        forward = trunk.forward

        def with_mask_rows(start: int | None, *args, **kwargs):
            with mask_rows(start):
                return forward(*args, **kwargs)

        # dynamic=True: the row count, the slot count and the first mask row are symbolic from the
        # first graph, so a new prompt, bucket or tree reuses it instead of compiling a specialized
        # graph and then a dynamic one
        graph = torch.compile(with_mask_rows, mode=None if mode == "default" else mode, dynamic=True)

        def compiled_forward(*args, **kwargs):
            start = mask_rows_start()
            with mask_rows(None):  # cleared around the graph: only its argument says where masks start
                return graph(start, *args, **kwargs)

        compiled_forward.graph = graph
        trunk.forward = compiled_forward
        # dynamo's default of 8 graphs per function is below what one model meets when SPACE, AR and
        # transformers' generate (PLD, HF) all call it (another set of arguments each, static and
        # dynamic variants); past the limit it would run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return model


def eager():
    """A context in which a compiled trunk runs eagerly (``torch.compiler.set_stance``): the
    prompt's forward, whose length changes with every prompt."""
    return torch.compiler.set_stance("force_eager")


def is_compiled(model) -> bool:
    """Whether ``model``'s trunk was compiled by :func:`compile_trunk`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk = base.get_decoder() if hasattr(base, "get_decoder") else base
    return hasattr(getattr(trunk.forward, "graph", None), "_torchdynamo_orig_callable")
