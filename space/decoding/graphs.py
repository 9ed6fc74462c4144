"""Captured decode steps (issue 58, item 4): the trunk's forward replayed from one CUDA graph per
row bucket and slot bucket, over one preallocated KV cache, for SPACE and the AR baseline alike.

On a GPU an eager step of a small model is launch-bound: SmolLM2's AR step keeps the GPU busy
about 2 ms of 22 (issue 58). A CUDA graph records the step's kernels once and replays them with
one launch. Captured from the eager trunk with ``torch.cuda.graph`` (gpt-fast's pattern), it needs
no compiler: a bucket costs three eager forwards (two warm-ups and the capture), where
``torch.compile``'s whole-trunk graph did not finish its first prompt in 300 s on an H200
(``results/gpu_compiled``). On an H200, 19 graphs (one slot bucket) were ready in 2.1 s and a
captured fp32 AR step of the real SmolLM2 took 10.3 ms against 26.4 eager
(``results/gpu_h200_g58``); the slot buckets came after that run.

What a graph fixes, and how a step fits it:

* **Shapes.** One graph per row count and slot bucket: a step's block is padded to a row bucket
  (``dynamic.bucket``; ``SpaceDecoder.row_sizes`` lists a decoder's), and the cache is one
  ``cache.StaticSlabCache`` of ``slots`` slots, kept from one generation to the next
  (:meth:`StepGraphs.reset` only sets its lengths to 0; stale slots are always masked). A step
  attends over the smallest slot bucket that holds the cache and its block (``slots`` halved
  while at least :data:`MIN_SLOTS`; the 4-D mask hides the slots past the block) where the
  trunk's attention reads the keys only up to the mask's width (``backends.attends_mask_width``:
  every fused trunk), else over every slot. Attention over a slot costs time whether it holds a
  token or not: a HumanEval answer fills about 300 of the 2,048 slots a run captured, and the
  memory-efficient kernel walks a query row's keys in one block of threads.
* **Addresses.** The inputs are fixed buffers (:class:`_Inputs`): ids, position ids, the mask and
  the mask-row gate, written in place before each replay; the output is the graph's own tensor,
  read before the next replay. The cache's tensors are allocated before capture and never again:
  every layer's keys and values are views of one slab, and its length an element of one (layers,)
  tensor on the device, which the graph advances. So what the decoder does to the cache between
  replays is one op for every layer: a crop, one ``sub_``; a tree path's compaction, one gather
  and one copy (86 -> 23 ops outside the graph a shipped-layout SPACE step on SmolLM2, AR 8).
* **The first mask row.** It changes from step to step, so the frozen-base LoRA reads it as a
  (rows, 1) gate (``space.masking.mask_rows`` with a tensor; 1 on mask rows, 0 elsewhere) instead
  of a Python integer a graph would freeze: the update is computed on every row and multiplied by
  the gate, rejected and real rows masked rather than cropped. A real row gets ``+ 0``, exactly
  its base output. A block without a mask row (AR's row, a prompt-lookup block) replays a plain
  graph of its size instead, the base model alone, which costs what the eager base costs.
* **No host reads.** Nothing in the captured region reads a device value on the host
  (``tests/decoding/test_graphs.py`` counts with ``tests/syncs.py``); the decoder's one copy per
  step comes after the replay, as before.

On the CPU there are no graphs: :class:`StepGraphs` runs the same buffers through the eager
trunk, so the whole path but the replay itself is tested here; the replay is tested on a GPU
(``tests/test_cuda.py``, ``scripts/gpu_check.sh``).

Exactness: a graph replays the kernels the eager trunk launched at capture, so a captured step
computes what an eager step over the same buffers computes. Greedy SPACE over the captured trunk
equals greedy AR over it in fp32, as eagerly (each row's result does not depend on the other
rows; a real row's LoRA term is an exact zero): on the real SmolLM2 with the shipped adapter, AR,
PLD and SPACE emit the same tokens over the CPU's buffers (``results/capture_cpu``).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..masking import mask_rows
from .backends import attends_mask_width, mask_buffer
from .cache import StaticSlabCache, attention_dtype, attention_windows, cache_input, full_cache

MIN_SLOTS = 256  # the smallest slot bucket's least size: the buckets halve the cache's slots down to it


@dataclass(frozen=True)
class _Inputs:
    """A bucket's fixed input buffers, written in place before each replay: ids (1, q), position
    ids (1, q), the additive mask (1, 1, q, s) over its s slots in the trunk's dtype, the mask-row
    gate (q, 1)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    gate: torch.Tensor


def cached_shapes(trunk: torch.nn.Module, device: torch.device) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shapes of every layer's cached keys and values after one token, ``(batch 1, heads, 1,
    dim)`` each, as a set: what the trunk really caches, which a model with multi-head latent
    attention (DeepSeek-V2/V3, MiniCPM3, Mistral 4: a latent and a rotary key) does not read from
    its config's heads and head_dim, and Gemma 4 caches in two head dims (its full layers' own).
    Layers that read another layer's cache (Gemma 3n's, Gemma 4's shared ones) cache nothing. One
    eager forward of one token on a ``cache.full_cache``."""
    cache = full_cache()
    with torch.no_grad():
        trunk(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **cache_input(cache), use_cache=True)
    return {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers if layer.is_initialized}


class StepGraphs:
    """The trunk's decode step, one CUDA graph per row bucket, slot bucket and kind (gated: a block
    with mask rows; plain: a block without, AR's row among them), over one static KV cache of
    ``slots`` slots.

    Args:
        model: a HF causal LM (a peft model is unwrapped), on one device, full attention on every
            layer, ``sdpa`` (the fused trunk's ``backends.SDPA_GQA`` among them) or ``eager`` attention;
            the eager trunk as ``load_space`` gives it
            (fused or not, never ``compile_trunk``'s).
        slots: the cache's size in tokens: prompt + new tokens + a step's rows must fit
            (:meth:`check_fits`).
        sizes: the row counts a step may have, one graph each (``SpaceDecoder.row_sizes`` of
            every decoder that will run through it; 1, AR's row, is always added).
        min_slots: the slot buckets are ``slots`` halved while at least ``min_slots``
            (:data:`MIN_SLOTS`); one bucket of ``slots`` where the trunk's attention reads every
            slot (``backends.attends_mask_width``).

    Raises:
        ValueError: slots below the largest size or above the model's context; a size or
            min_slots < 1; a model spread over devices, with sliding-window layers (a captured
            step's mask is one tensor of full attention), with an attention that takes no 4-D
            mask, or with dynamic RoPE (its length check reads the device); a compiled trunk.
    """

    def __init__(self, model, slots: int, sizes: Iterable[int], min_slots: int = MIN_SLOTS):
        from .compiled import is_compiled  # compiled imports the CPU kernels; this module stays light
        from .decoder import check_attention

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_attention(base, "StepGraphs")
        self.sizes = tuple(sorted({1, *sizes}))
        self.max_rows = self.sizes[-1]
        context = base.config.max_position_embeddings
        if self.sizes[0] < 1:
            raise ValueError(f"a captured step has at least 1 row, got sizes {self.sizes}")
        if min_slots < 1:
            raise ValueError(f"a slot bucket holds at least 1 slot, got min_slots {min_slots}")
        if not self.max_rows <= slots <= context:
            raise ValueError(f"a captured step needs {self.max_rows}..{context} cache slots (its most rows .. the "
                             f"model's context), got {slots}")
        if len({p.device for p in base.parameters()}) != 1:
            raise ValueError("captured steps need the model on one device (no device_map)")
        if set(attention_windows(base.config).values()) != {None}:
            raise ValueError("captured steps need full attention on every layer: this model has sliding-window "
                             "layers (decode it eagerly)")
        if is_compiled(base):
            raise ValueError("captured steps record the eager trunk: load the model without compile")
        self.trunk = base.get_decoder()
        if "dynamic" in str(getattr(getattr(self.trunk, "rotary_emb", None), "rope_type", "")):
            raise ValueError("captured steps cannot hold dynamic RoPE scaling (it reads the sequence length on the "
                             "host): decode this model eagerly")
        self.slots = slots
        buckets = [slots]
        if attends_mask_width(base):
            while buckets[0] // 2 >= min_slots:
                buckets.insert(0, buckets[0] // 2)
        self.slot_sizes = tuple(buckets)
        self.device = next(base.parameters()).device
        self.dtype = attention_dtype(self.trunk)
        self.use_graphs = self.device.type == "cuda"
        # the cache is allocated from what the trunk really caches, not the config's heads and head_dim
        # (a Gemma 4 config answers head_dim per layer only)
        cached = cached_shapes(self.trunk, self.device)
        keys, values = next(iter(cached))
        if len(cached) != 1 or keys != values:
            raise ValueError(f"captured steps hold keys and values of one shape on every layer; this model caches "
                             f"{sorted(cached)} (keys, values) a token (multi-head latent attention, layers of other "
                             f"head dims, say): decode it eagerly, without --capture")
        _, kv_heads, _, head_dim = keys
        with torch.no_grad():  # built outside inference mode, normal tensors: writable in and out of it
            self.cache = StaticSlabCache(len(self.trunk.layers), slots)
            # allocated now, once: a graph holds the addresses it was captured with
            self.cache.early_initialization(1, kv_heads, head_dim, self.dtype, self.device)
            # a block of q rows fits a bucket of at least q slots (it starts at slot 0 at the earliest)
            self._inputs = {(q, n): self._buffers(q, n) for q in self.sizes for n in self.slot_sizes if q <= n}
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # one memory pool for every graph (they never run at once)
        # host seconds inside step() replaying graphs: the model's share of a step, which forward
        # hooks (result.model_time) time in an eager forward but never see in a replay; on the CPU
        # the trunk runs eagerly and its hooks see it, so this stays 0
        self.step_s = 0.0
        self.capture_s = 0.0  # seconds spent capturing graphs, in capture() or at a bucket's first step

    def _buffers(self, q: int, slots: int) -> _Inputs:
        dev = self.device
        return _Inputs(ids=torch.zeros(1, q, dtype=torch.long, device=dev),
                       positions=torch.zeros(1, q, dtype=torch.long, device=dev),
                       mask=mask_buffer(q, slots, self.dtype, dev),  # row-aligned: SDPA reads it in place
                       gate=torch.zeros(q, 1, dtype=self.dtype, device=dev))

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (0 on the CPU, which has none)."""
        return len(self._graphs)

    def check_model(self, model) -> None:
        """Refuse ``model`` (a HF causal LM, a peft model unwrapped) unless these steps were captured
        from its trunk: another model's trunk would replay.

        Raises:
            ValueError: ``model``'s decoder is not :attr:`trunk`.
        """
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if self.trunk is not base.get_decoder():
            raise ValueError("these captured steps (StepGraphs) were made for another model's trunk: capture them "
                             "from this model")

    def check_fits(self, tokens: int, rows: int) -> None:
        """Refuse a generation that could outgrow the cache or the buckets.

        Args:
            tokens: prompt + new tokens; rows: the decoder's most rows per step.

        Raises:
            ValueError: ``tokens + rows`` over ``slots``, or ``rows`` over ``max_rows``.
        """
        if rows > self.max_rows:
            raise ValueError(f"steps of up to {rows} rows need graphs captured for them; these go up to {self.max_rows}")
        if tokens + rows > self.slots:
            raise ValueError(f"a prompt and its new tokens ({tokens}) plus a step's {rows} rows overflow the captured "
                             f"cache's {self.slots} slots: capture with more slots (space-eval --capture-len)")

    def reset(self) -> None:
        """An empty cache for the next generation (its lengths to 0; the slots stay, always masked)."""
        self.cache.lengths.zero_()

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every graph now (on a GPU; on the CPU nothing to do): for each row and slot
        bucket, the plain graph and, above 1 row, the gated one (a block's row 0 is always a real
        row). Leaves the cache empty. Returns the seconds it took."""
        t0 = time.perf_counter()
        self.reset()  # the warm-ups write from the cache's length: from slot 0, whatever ran before
        if self.use_graphs:
            keys = [(q, n, g) for q, n in self._inputs for g in (False, True) if q > 1 or not g]
            for q, n, g in keys:
                buf = self._inputs[q, n]
                buf.mask.zero_()  # warm-up rows see every slot: finite garbage, masked later
                buf.positions.copy_(torch.arange(q, device=self.device)[None])
                buf.gate.fill_(1.0)
                self._graph(q, n, g)
            self.cache.slab.zero_()  # what the warm-ups wrote is never read, but start clean
        self.reset()
        return time.perf_counter() - t0

    def _run(self, q: int, slots: int, gated: bool) -> torch.Tensor:
        """The eager trunk on the buffers of ``q`` rows over ``slots`` slots -> last hidden states
        (1, q, hidden): what a graph records."""
        buf = self._inputs[q, slots]
        with mask_rows(buf.gate if gated else None):
            return self.trunk(input_ids=buf.ids, position_ids=buf.positions, attention_mask=buf.mask,
                              **cache_input(self.cache), use_cache=True).last_hidden_state

    def _graph(self, q: int, slots: int, gated: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of ``q`` rows over ``slots`` slots of kind ``gated``, captured at its first
        use: two warm-up runs on
        a side stream (lazy allocations, library handles), then the capture. Each warm-up writes
        the slots past the cache's length and advances it; the lengths are put back after each
        (so a warm-up never writes past slot length + q, which ``step`` checked) and after the
        capture, which records the advance without running it."""
        key = (q, slots, gated)
        if key not in self._graphs:
            t0 = time.perf_counter()
            lengths = self.cache.lengths.clone()

            def put_back():
                self.cache.lengths.copy_(lengths)

            with torch.cuda.device(self.device), torch.inference_mode():  # no autograd in a graph
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._run(q, slots, gated)
                        put_back()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self._pool):
                        out = self._run(q, slots, gated)
                finally:
                    put_back()
            self._pool = graph.pool()
            self._graphs[key] = (graph, out)
            self.capture_s += time.perf_counter() - t0
        return self._graphs[key]

    def step(self, ids: torch.Tensor, position_ids: torch.Tensor | None, block_mask: torch.Tensor | None,
             cache_len: int, mask_start: int | None) -> torch.Tensor:
        """One decode step's trunk forward after ``cache_len`` cached tokens, written to the cache.

        Args:
            ids: (q,) the block's ids on the device, q one of ``sizes``.
            position_ids: (q,) each row's position minus ``cache_len`` (a SPACE block's); None: one
                row at position ``cache_len`` (AR).
            block_mask: (1, 1, q, q) additive mask of the rows among themselves, in the trunk's
                dtype; None with one row.
            mask_start: the block's first mask row (``space.masking.mask_rows``); None: no mask row.

        Returns:
            (q, hidden) last hidden states: the graph's output tensor, overwritten by the next step.

        Raises:
            ValueError: q not a bucket size, or the block past the cache's slots.
            RuntimeError: on the CPU, ``cache_len`` is not the tokens the cache holds (checked only
                there: reading the device's count on a GPU is a sync).
        """
        t0, captured = time.perf_counter(), self.capture_s
        hidden = self._step(ids, position_ids, block_mask, cache_len, mask_start)
        if self.use_graphs:  # a graph captured lazily in it: its runs fired the trunk's hooks, timed there
            self.step_s += time.perf_counter() - t0 - (self.capture_s - captured)
        return hidden

    def _step(self, ids, position_ids, block_mask, cache_len: int, mask_start: int | None) -> torch.Tensor:
        q = ids.shape[0]
        if q not in self.sizes:
            raise ValueError(f"a captured step takes a bucket's rows {self.sizes}, got {q}")
        if cache_len + q > self.slots:
            raise ValueError(f"a block of {q} rows after {cache_len} cached tokens overflows the captured cache's "
                             f"{self.slots} slots")
        if not self.use_graphs and int(self.cache.lengths[0]) != cache_len:  # free on the CPU (a sync on a GPU)
            # the block would be written at the cache's length and masked at cache_len: rows attending
            # to the wrong slots, which a confident model can survive with AR's tokens
            raise RuntimeError(f"the captured cache holds {int(self.cache.lengths[0])} tokens, the step was given "
                               f"{cache_len}: the cache was written outside the decoder, or its count drifted")
        # the smallest slot bucket that holds the cache and the block
        slots = next(n for n in self.slot_sizes if cache_len + q <= n)
        buf = self._inputs[q, slots]
        buf.ids[0].copy_(ids)
        if position_ids is None:
            buf.positions.fill_(cache_len)
        else:
            torch.add(position_ids, cache_len, out=buf.positions[0])
        # the row sees the cache, the block as its mask says, and no slot past the block
        buf.mask[..., :cache_len].zero_()
        if block_mask is None:
            buf.mask[..., cache_len: cache_len + q].zero_()
        else:
            buf.mask[..., cache_len: cache_len + q].copy_(block_mask)
        buf.mask[..., cache_len + q:].fill_(torch.finfo(self.dtype).min)
        # a block with mask rows replays the gated graph, one for every first mask row; a block
        # without (AR, prompt lookup alone) the plain one, which skips the LoRA as eagerly
        start = q if mask_start is None else min(mask_start, q)
        gated = start < q
        if gated:
            buf.gate[:start].zero_()
            buf.gate[start:].fill_(1.0)
        if not self.use_graphs:
            return self._run(q, slots, gated)[0]
        graph, out = self._graph(q, slots, gated)
        with torch.cuda.device(self.device):
            graph.replay()
        return out[0]
