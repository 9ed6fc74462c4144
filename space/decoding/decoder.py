"""The SPACE auto-correct decoder: verify the last drafts and draft the next ones in one pass.

DESIGN §3.3-§3.5. Each step feeds ``[x_{n-1}] [candidates] [G_0..G_{g-1}]`` after a KV cache that
holds ``x_0..x_{n-2}``, with the layout core's 4-D mask and position ids, then

1. verifies the candidates on their rows (greedy or exact speculative sampling),
2. emits the a accepted candidates and the bonus (auto-correct) token,
3. keeps ``x_0..x_{n-1}`` and the accepted path in the cache (candidates come first in the block,
   so a chain's path is a crop; a tree's path is moved next to x_{n-1}, then cropped),
4. drafts the next candidates from the deepest group anchored on the accepted path, from the
   offset that follows it (a shift when the path went past the group's anchor: DESIGN §3.5).

The LM head runs on the verification rows, then on the chosen group's rows; or once on every row
when that wastes few rows (one read of the head's weight instead of two).

Exactness and precision: in fp32, greedy output is token for token the AR greedy output of the same
weights, and sampled output is distributed as AR sampling. In bf16 and fp16 the verification rows
are computed in one multi-row forward whose kernels round differently from AR's one-row forwards,
so a near-tie between the two best tokens can flip and the output can then differ from AR from
that token on; check exactness in fp32.

Sliding-window models (Mistral, Qwen2 with ``use_sliding_window``): the cache keeps every token on
every layer (``cache.SlabCache`` or ``cache.full_cache``), so it can be cropped and compacted, and
the window is applied in the step's 4-D mask by position, per kind of layer (:func:`with_cache`): each row sees what AR
decoding with transformers' sliding cache sees.

Device work: tokens, candidates, draft distributions and the sampling generator live on the
model's device. A block's layout is computed on the host (``space.masking.host_block``, one pass
over its rows) and goes up with its node tokens in one queued copy (:func:`upload`); a layout
seen before (every static one, most dynamic ones) is kept on the device and only its tokens go
up. A greedy step copies to the host once (the accepted row and the tokens to emit), which the
cache crop needs anyway; the accepted path's keys and values move by a gather whose order is
computed on the device before that copy, and the bonus token stays there. Host syncs per step,
counted as CUDA would make them (``tests/decoding/test_syncs.py``, issue 43): 1 for the chain, a
static tree and prompt lookup (uploads are queued, not waited for), 2 for the dynamic tree, whose
planner reads the drafts' top-R ids and probabilities.
Mask tokens are suppressed with ``index_fill_``: ``logits[:, ids] = -inf`` would upload the scalar.

KV cache: eagerly, every layer in one preallocated tensor (``cache.SlabCache``, issue 58): a step
writes its block, a crop lowers host integers, and moving the accepted path is one gather for all
layers; a ``DynamicCache`` when the model is spread over devices. With ``static_cache`` (the
default under a compiled trunk, ``space.decoding.compiled``) one preallocated per generation
(``cache.static_cache``, issue 43): the decoder counts its length on the host, writes each block
at that length, moves the accepted path inside the same tensors and crops by lowering the length,
so the cache is never reallocated and a step's shapes repeat. The step's mask then spans every slot,
or, when the trunk's attention reads the keys only up to the mask's width
(``space.decoding.backends.SDPA_GQA``: the fused trunk of every eager model, the fast kernels, a
CPU's compiled trunk), the cached tokens and the block alone (:func:`mask_slots`): the slots past them are
empty and cost attention time only.

Near the end of the context the step shrinks instead of refusing: no row is placed at a position
>= the model's context (fewer candidates, shorter mask groups, at the very end no group).

One step function (issue 31): every step verifies a token tree. The chain of top-1 drafts is the
tree with one node per depth, a static tree (issue #14, ``DecodeConfig.tree``) is pruned to the
drafts at hand, and the dynamic tree (``tree="dynamic"``, ``space.decoding.dynamic``) is chosen each
step from the drafts' probabilities and the machine's step cost. A planner
(``space.decoding.planner``, issue 44) proposes each step's block and learns from its outcome;
the decoder calls nothing else to decide what a step verifies. A step feeds
``[x_{n-1}] [tree nodes] [lookup branch] [groups] [padding]`` (layout:
``space.masking.host_block``); groups anchor on x_{n-1} and the top-1 chain (the
dynamic tree: its spine, with a length per group). The deepest node whose path matches the target
is accepted (greedy: the rows' argmaxes come to the host in the step's one copy, and the tree is
walked there), or siblings are tried in order with exact multi-candidate sampling
(``verify_tree_sampling``); a chain sampled with temperature > 0 keeps the draft distributions and
the p/q rule instead (``verify_rejection``). The accepted path's keys and values are moved next to
x_{n-1} in the cache (``compact_cache``; a chain's path is already there), then the rest is cropped.

Optional prompt lookup (``lookup_tokens``, our addition): when the last n-gram of the text so far
(prompt + output) occurred earlier, the tokens that followed it (what transformers'
``PromptLookupCandidateGenerator`` finds, kept incrementally by ``lookup.PromptLookup``) are one
more branch of the next step's tree, added to the mask drafts, so a failed lookup costs only its
rows. The dynamic tree may add what followed the n-gram's other occurrences too
(``lookup_branches``), priced like any node, and what followed the text's last tokens in a
datastore of the model's own answers (``datastore_branches``, ``datastore.Datastore``). The
candidates are deterministic, and the first step looks up the prompt, as prompt lookup decoding
does. Each step records where its accepted tokens came from, the masks, lookup, the datastore or
the masks and a lookup (:func:`provenance`).
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import Cache

from .backends import attends_mask_width, mask_buffer
from ..masking import (check_parents, host_block, in_window, mask_rows, pack_rows, to_additive_4d, tree_parents,
                       unpack_rows)
from ..sampler_head import sampler_head
from ..tokens import MaskSpec, check_mask_num, warn_untrained_offsets
from .cache import (SlabCache, StaticSlabCache, attention_dtype, attention_windows, cache_input, crop_cache, eager_cache,
                    cache_rebuild_at, longrope_switch, static_cache)
from .compiled import eager, is_compiled
from .config import DecodeConfig
from .dynamic import BUCKETS, DEFAULT_STEP_COST, LOOKUP, MASK, STORE, StepCost, bucket
from .lookup import PromptLookup
from .planner import DynamicPlanner, StaticPlanner, StepOutcome, StepPlanner
from .result import DecodeResult, check_prompt, model_time
from .sampling import SamplingConfig, check_sampling, logit_transform, logits_to_probs, sample
from .tree import anchored_group, chain_depth, group_rows, prune
from .verify import verify_rejection, verify_tree_greedy, verify_tree_sampling

# HF's logits-processor convention: (input_ids (rows, seq), scores (rows, vocab)) -> scores
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compact_cache(cache: Cache, start: int, rows: list[int], length: int | None = None) -> None:
    """Move the keys and values of block rows ``rows`` (the accepted path of a token tree) to the
    contiguous slots ``start + 1, start + 2, ...`` right after x_{n-1} (slot ``start``), then crop
    after them. A chain's path is already in place and is only cropped. A ``SlabCache`` (eager
    decoding on one device) or a ``StaticSlabCache`` (captured steps) moves every layer at once:
    one gather and one copy (issue 58), and the latter crops every layer in one op. Other
    caches (dynamic, static, a model spread over devices) move inside each layer's tensors, one
    gather per layer, its slots uploaded once per device; uploads never wait (:func:`upload`).

    Args:
        start: the cache length before the block (x_{n-1}'s slot).
        rows: block rows of the accepted nodes in depth order (row 0 is x_{n-1}), on the host.
        length: the cache length now (``start`` + the block's rows); None: asked of the cache
            (a static cache's answer is a device read).
    """
    if any(r != i for i, r in enumerate(rows, 1)):
        slots = [start + r for r in (0, *rows)]
        if isinstance(cache, SlabCache | StaticSlabCache):
            cache.gather(start, upload(slots, cache.device))
        else:
            on: dict[torch.device, torch.Tensor] = {}  # the slots to gather, once per device (not per layer)
            for layer in cache.layers:
                if not layer.is_initialized:  # it reads another layer's cache (Gemma 3n's, 4's last layers)
                    continue
                idx = on.get(layer.keys.device)
                if idx is None:
                    idx = on[layer.keys.device] = upload(slots, layer.keys.device)
                layer.keys[..., start: start + len(slots), :] = layer.keys.index_select(-2, idx)
                layer.values[..., start: start + len(slots), :] = layer.values.index_select(-2, idx)
    crop_cache(cache, start + 1 + len(rows), length)


def provenance(parents: tuple[int, ...], sources: tuple[int, ...], tokens: list[int], path: list[int]
               ) -> tuple[str, int, int]:
    """Where a step's accepted tokens came from (issue 44): the masks, prompt lookup, a datastore,
    or the masks and either lookup.

    Args:
        parents: (1+N,) parent row of each row of the block (-1 for x_{n-1}).
        sources: (N,) each node's sources (``dynamic.MASK`` / ``LOOKUP`` / ``STORE`` bits).
        tokens: (N,) node tokens on the host.
        path: the accepted rows, in depth order.

    Returns:
        (one letter per accepted token, ``m`` mask draft, ``l`` lookup token of the text's own (a
        datastore's too where both offered it), ``d`` a datastore's alone, ``b`` the masks and
        either lookup: the same token path offered by both, as one node or as two branches; the
        deepest node offered by the masks; the deepest offered by lookup, the datastore's included).
    """
    by_path: dict[tuple[int, ...], int] = {}
    paths = [()]
    for r in range(1, len(parents)):
        paths.append(paths[parents[r]] + (tokens[r - 1],))
        by_path[paths[r]] = by_path.get(paths[r], 0) | sources[r - 1]
    offered = [max((len(p) for p, s in by_path.items() if s & bits), default=0) for bits in (MASK, LOOKUP | STORE)]
    return "".join(_LETTER[by_path[paths[r]]] for r in path), offered[0], offered[1]


# a node's sources (bits) -> its provenance letter (:func:`provenance`); none (a custom planner's): " "
_LETTER = {0: " "} | {bits: "b" if bits & MASK and bits & (LOOKUP | STORE) else "l" if bits & LOOKUP else "d" if bits & STORE
           else "m" for bits in range(1, 8)}


def upload(values, device: torch.device) -> torch.Tensor:
    """Host integers as a (len,) long tensor on ``device`` without making the host wait (issue
    43): on CUDA the copy goes from pinned memory and is queued on the stream (a plain
    ``torch.tensor(..., device=)`` synchronizes; PyTorch's pinned-memory allocator keeps the block
    until the copy is done), and the kernels that read it run after it on the same stream.
    Elsewhere ``non_blocking`` changes nothing on the CPU; it marks the copy as one CUDA would
    queue for the sync counter (``tests/syncs.py``)."""
    # through an int64 buffer: ~4x faster than torch.tensor of a list of a hundred ints here
    host = torch.frombuffer(array("q", values), dtype=torch.long) if len(values) else torch.empty(0, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device, non_blocking=True)


def check_attention(model, caller: str = "SpaceDecoder") -> None:
    """Refuse attention implementations that ignore a 4-D mask: every SPACE step's layout is one,
    and so is every SAR-SFT batch (``space.train.steps.forward_mask``).

    Args:
        model: the model (or its config's owner) about to be decoded or trained.
        caller: who refuses, for the message (``SpaceDecoder``, ``space_generate``, ``SAR-SFT training``).

    Raises:
        ValueError: a flash-attention model (``attn_implementation="flash_attention_2"`` and kin).
    """
    impl = str(getattr(model.config, "_attn_implementation", None))
    if "flash" in impl:
        raise ValueError(f"{caller} cannot run with attn_implementation={impl!r}: flash attention takes no "
                         "4-D attention mask, which every SPACE step and SAR-SFT batch needs; load the model with "
                         "attn_implementation='sdpa' or 'eager' (or call model.set_attn_implementation('sdpa'))")


def mask_slots(trunk: torch.nn.Module, slots: int | None) -> int | None:
    """The ``slots`` a step's mask spans (:func:`with_cache`) over a static cache of ``slots``:
    None (the cached tokens and the block alone) when ``trunk``'s attention reads the keys only up
    to the mask's width (``space.decoding.backends.attends_mask_width``), else ``slots``. A cache sized
    for prompt + new tokens is about 40 % empty on average over a generation, and attending over
    its empty slots cost a SPACE step on a CPU about 1.2 ms of 36 (issue 58)."""
    return None if slots is not None and attends_mask_width(trunk) else slots


def with_cache(block_mask: torch.Tensor, position_ids: torch.Tensor, cache_len: int,
               windows: dict[str, int | None], slots: int | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The forward's ``attention_mask`` for a step block after a cache of ``cache_len`` tokens.

    Args:
        block_mask: (1, 1, q, q) additive mask of the block's rows among themselves.
        position_ids: (q,) position of each row minus ``cache_len``.
        windows: the model's attention kinds (``cache.attention_windows``).
        slots: a static cache's size (``cache.static_cache``), whose every slot the model attends
            over: the slots past the block are hidden. None: a dynamic cache, or a static one whose
            attention reads only the mask's width (:func:`mask_slots`).

    Returns:
        (1, 1, q, cache_len + q, or ``slots``) additive mask in which every row sees the cache; on a sliding-window
        model a row also sees only the keys less than the window behind its position (cache slot i
        holds position i: the cache is full-attention and compacted), which is what AR decoding
        sees. A model mixing full and sliding layers gets ``{layer type: mask}``, the form
        transformers' hybrid models take.

    Raises:
        ValueError: ``slots`` fewer than ``cache_len`` + the block's rows.
    """
    q = block_mask.shape[-1]
    width = cache_len + q if slots is None else slots
    if width < cache_len + q:
        raise ValueError(f"a static cache of {slots} slots cannot hold {cache_len} cached tokens and a block of {q}")
    low = torch.finfo(block_mask.dtype).min
    # written into a row-aligned buffer (mask_buffer): CUDA's SDPA would copy an unaligned mask in every layer
    full = mask_buffer(q, width, block_mask.dtype, block_mask.device)
    full[..., cache_len:cache_len + q].copy_(block_mask)
    if slots is not None:
        full[..., cache_len + q:].fill_(low)
    if all(w is None for w in windows.values()):
        return full
    query_pos = position_ids + cache_len
    key_pos = torch.cat([torch.arange(cache_len, device=query_pos.device), query_pos,
                         torch.arange(cache_len + q, width, device=query_pos.device)])

    def windowed(w: int) -> torch.Tensor:
        hidden = mask_buffer(q, width, full.dtype, full.device, fill=low)
        return torch.where(in_window(query_pos, key_pos, w), full, hidden, out=hidden)

    masks = {kind: full if w is None else windowed(w) for kind, w in windows.items()}
    return masks if len(masks) > 1 else next(iter(masks.values()))


LAYOUT_CACHE = 256  # block layouts a decoder keeps (each a few KB of small tensors)


@dataclass(frozen=True)
class StepLayout:
    """One step's block ``[x_{n-1}] [nodes] [groups] [padding]``: its device tensors and host facts.

    Attributes:
        parents: (1+N,) parent row of each real row (-1 for x_{n-1}), on the host.
        group_rows: anchor row of each mask group (x_{n-1}, then down the top-1 chain or spine).
        group_len: masks in each group.
        rows: q, the block's rows, padding included.
        mask_ids: (q - 1 - N,) ids of the mask rows, then of the padding rows.
        position_ids: (q,) position of each row minus the cache length.
        block_mask: (1, 1, q, q) additive mask of the rows among themselves (they all see the cache).
    """

    parents: tuple[int, ...]
    group_rows: tuple[int, ...]
    group_len: tuple[int, ...]
    rows: int
    mask_ids: torch.Tensor
    position_ids: torch.Tensor
    block_mask: torch.Tensor

    @property
    def num_real(self) -> int:
        return len(self.parents)

    @property
    def used_rows(self) -> int:
        """Rows that are not padding."""
        return self.num_real + sum(self.group_len)

    def group_start(self, g: int) -> int:
        """Block row of group g's mask 0."""
        return self.num_real + sum(self.group_len[:g])

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """(1+N,) depth of each real row (x_{n-1}: 0), on the host."""
        out = [0] * self.num_real
        for r in range(1, self.num_real):  # parents come first
            out[r] = out[self.parents[r]] + 1
        return tuple(out)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Per row, its child rows in block order: the order exact sampling tries them."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for r in range(1, self.num_real):
            kids[self.parents[r]].append(r)
        return tuple(map(tuple, kids))

    def attention_mask(self, cache_len: int, windows: dict[str, int | None],
                       slots: int | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        return with_cache(self.block_mask, self.position_ids, cache_len, windows, slots)

    def path(self, row: int) -> list[int]:
        """Rows from depth 1 down to ``row`` (empty for x_{n-1})."""
        out = []
        while row > 0:
            out.append(row)
            row = self.parents[row]
        return out[::-1]

    def draft_rows(self, best: int, tokens: Sequence[int]) -> tuple[int, int, int, int] | None:
        """Where the next drafts come from after the path to ``best`` is accepted: the group-shift
        rule (``tree.anchored_group``, DESIGN §3.5) on this block, whose groups anchor on
        x_{n-1} and down one chain (``group_rows``). ``tokens``: (N,) the node tokens on the host.
        The path is on the chain as deep as it spells the chain's tokens, not only through its rows:
        a static tree's lookup branch that repeats the top-1 drafts and runs deeper gives its groups
        the same context, so their masks draft past the path's end as they would on the chain. Only
        as deep as the anchors do form a chain down from x_{n-1} (a custom planner's may not).
        Returns (group, shift, first row, end row) in the block, or None without groups or when the
        group's masks all lie behind the path's end."""
        if not self.group_rows:
            return None
        path, chain = self.path(best), self.group_rows[1:]
        on_chain = 0
        while (on_chain < min(len(path), len(chain)) and self.parents[chain[on_chain]] == self.group_rows[on_chain]
               and tokens[path[on_chain] - 1] == tokens[chain[on_chain] - 1]):
            on_chain += 1
        g, shift = anchored_group(len(path), len(self.group_rows), on_chain)
        start, stop = self.group_start(g) + shift, self.group_start(g) + self.group_len[g]
        return (g, shift, start, stop) if start < stop else None


@dataclass(frozen=True)
class Drafts:
    """The drafts a step verifies, made by the previous step's mask group.

    Attributes:
        ids: (r, R) the top-R tokens of r masks (R = 1 for the chain; a sampled chain's drawn tokens);
            with a sampler head, offset i's given the top-1 drafts before it.
        probs: (r, R) their probabilities, for the dynamic tree; else None.
        q: (r, vocab) the distributions a sampled chain drew ``ids`` from (the p/q rule); else None.
        offset: mask offset of row 0 inside its group (the shift of DESIGN §3.5).
        nodes: (N,) with a sampler head and a static tree: the token of each node of the tree pruned
            to depth r (breadth-first, so a shallower pruning is a prefix), each drafted given its
            parent's token; else None.
    """

    ids: torch.Tensor
    probs: torch.Tensor | None = None
    q: torch.Tensor | None = None
    offset: int = 0
    nodes: torch.Tensor | None = None


class SpaceDecoder:
    """SPACE decoding for a HF causal LM with mask tokens (batch size 1).

    Args:
        model: a ``LlamaForCausalLM``-like model whose vocabulary contains the mask token(s) of
            ``mask`` (``space.loader.load_space`` gives one; a peft model is unwrapped).
        mask: the model's MaskSpec (``space.tokens.mask_spec``).
        config: the step layout (k, groups, tree or dynamic tree, prompt lookup). None: the model's
            recorded layout (``model.config.space_decode``, set by ``load_space`` from the adapter's
            ``space_config.json``), else k = the trained k (see ``DecodeConfig.of_model``).

        static_cache: preallocate the KV cache for each generation (``cache.static_cache``, issue
            43: sized prompt + max_new_tokens + the most rows a step can have, no allocation per
            step, shapes that repeat for a compiled forward); False: the eager cache (a
            ``cache.SlabCache``, or a ``DynamicCache`` for a model spread over devices);
            None: static when the trunk is compiled (``compiled.compile_trunk``). The output is
            the same either way.
        buckets: pad a static layout's block to a bucket size (``dynamic.BUCKETS``, DESIGN §3.11;
            padding rows are masked out), so the row counts a compiled forward meets are few (a
            pruned tree or a short lookup branch would otherwise make a new shape); None: when
            the trunk is compiled. The dynamic tree always pads to buckets. The same output
            either way; the records count the padding apart (``DecodeResult.step_padding``).
        graphs: run each step's trunk forward through captured steps (``graphs.StepGraphs``, issue
            58: one CUDA graph per row and slot bucket on a GPU, the same buffers eagerly on the CPU), over
            their static cache; implies ``static_cache`` and ``buckets``. None: the eager trunk.
        datastore: a ``datastore.Datastore`` of the model's own answers whose continuations join
            prompt lookup's, ``config.datastore_branches`` a step (our addition); None: none.

    Raises:
        ValueError: k larger than the model's per-offset mask tokens (mask_diff), a tree rank at or
            above the vocabulary size, a model with attention layers other than full and
            sliding-window ones (``cache.attention_windows``), or a flash-attention model
            (:func:`check_attention`: the step's 4-D mask needs ``sdpa`` or ``eager``); ``graphs``
            captured from another model, or whose buckets stop below this layout's rows; a ``datastore`` with a layout that takes
            no branch from it (``config.datastore_branches`` 0), or holding a token id outside the model's vocabulary.

    The step's additive mask takes the trunk's dtype (:func:`attention_dtype`, ``mask_dtype``), and
    the LM head's input is cast to the head's dtype, so an fp32 head on a bf16 trunk decodes.
    """

    def __init__(self, model, mask: MaskSpec, config: DecodeConfig | None = None,
                 static_cache: bool | None = None, buckets: bool | None = None, graphs=None, datastore=None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_attention(base)
        self.config = config if config is not None else DecodeConfig.of_model(base, mask.mask_num)
        check_mask_num(self.config.mask_num, mask)
        warn_untrained_offsets(self.config.mask_num, mask)
        self.model, self.decoder, self.head = model, base.get_decoder(), base.get_output_embeddings()
        self.head_transform = logit_transform(base.config)  # the model's own scaling / soft-capping, if any
        self.sampler, self.embed = sampler_head(base), base.get_input_embeddings()  # issue 34's optional head
        self.mask = mask
        self.context = base.config.max_position_embeddings
        self.windows = attention_windows(base.config)  # sliding windows go into the step's 4-D mask
        # a LongRoPE model switches its rotary factors by the largest position of a forward (cache.longrope_switch),
        # and transformers' generate recomputes a Phi-3's cache there (cache.cache_rebuild_at): no block straddles either
        self.rebuild_at = cache_rebuild_at(base.config)
        self.switches = tuple(sorted({longrope_switch(base.config), self.rebuild_at} - {None}))
        self.device = self.head.weight.device
        self.mask_dtype = attention_dtype(self.decoder)  # the trunk's, not the LM head's
        ids = mask.ids_for(self.config.mask_num).tolist()
        self.mask_ids = ids if len(ids) > 1 else ids * self.config.mask_num  # (k,) offset j's id, on the host
        self.suppress = torch.tensor(mask.token_ids, device=self.device)
        self.lookup = self.config.lookup_tokens > 0  # prompt lookup: one more branch of each step's tree
        if datastore is not None and not self.config.datastore_branches:  # it would be left unread
            raise ValueError("a datastore needs a layout with datastore_branches >= 1 (a dynamic tree with lookup)")
        vocab = self.head.weight.shape[0]
        if datastore is not None and int(datastore.tokens.max()) >= vocab:  # an IndexError mid-generation
            raise ValueError(f"the datastore holds token id {int(datastore.tokens.max())}, outside this model's "
                             f"vocabulary of {vocab}: its answers were tokenized for another model")
        self.datastore = datastore
        self.dynamic = self.config.tree == "dynamic"
        # a static step verifies the configured tree, else the chain of top-1 drafts as a tree
        self.tree = None if self.dynamic else (
            self.config.tree or tuple((0,) * d for d in range(1, self.config.mask_num + 1)))
        # R: drafts kept per mask
        self.draft_ranks = self.config.draft_ranks if self.dynamic else 1 + max(max(p) for p in self.tree)
        self.cost = StepCost(self.config.step_cost or DEFAULT_STEP_COST, self.config.adapter_cost) if self.dynamic else None
        if graphs is not None:
            graphs.check_model(base)
        self.graphs = graphs  # a captured step's buffers and cache (space.decoding.graphs)
        self.static_cache = graphs is not None or (is_compiled(base) if static_cache is None else static_cache)
        self.buckets = not self.dynamic and (graphs is not None or (is_compiled(base) if buckets is None else buckets))
        self.max_rows = self.config.max_rows()
        if self.buckets:
            self.max_rows = bucket(self.max_rows, BUCKETS[-1])
        missing = sorted(set(self.row_sizes) - set(graphs.sizes)) if graphs is not None else []
        if missing:
            raise ValueError(f"this layout's steps have {missing} rows, which the captured steps (sizes "
                             f"{graphs.sizes}) lack: capture with this decoder's row_sizes")
        vocab = self.head.weight.shape[0]
        if self.draft_ranks > vocab:  # a mask has only `vocab` ranked drafts
            if self.dynamic:  # its ranks are the config's draft_ranks, not a tree's
                raise ValueError(f"draft_ranks {self.draft_ranks} exceeds this model's vocabulary size {vocab}")
            raise ValueError(f"token tree: rank {self.draft_ranks - 1} is at or above this model's vocabulary "
                             f"size {vocab} (ranks count from 0)")
        self._static: dict[tuple[int, int, int, int], tuple[StepLayout, torch.Tensor]] = {}
        # block layouts by tree shape, least recently used first: a dynamic tree repeats many of
        # its shapes, and a kept layout needs no upload of its own (only its tokens go up)
        self._layouts: dict[tuple, StepLayout] = {}

    @property
    def row_sizes(self) -> tuple[int, ...]:
        """The row counts this decoder's blocks can have, padding included, when they are padded
        to buckets (a static layout with ``buckets``, the dynamic tree): what a captured step
        needs a graph for (``graphs.StepGraphs``)."""
        return tuple(sorted({bucket(r, self.max_rows) for r in range(1, self.max_rows + 1)}))

    def planner(self, end: int | None = None) -> StepPlanner:
        """A fresh planner for one generation, from this decoder's layout: the dynamic tree's
        (running rates, step-cost prices) or the static tree's (``space.decoding.planner``).
        ``end``: the sequence length the generation may reach (prompt + max_new_tokens), past which
        a dynamic tree plans no node or mask (None: the model's context)."""
        return DynamicPlanner(self, end) if self.dynamic else StaticPlanner(self)

    def room(self, L: int) -> int:
        """The deepest depth a row of a step after ``L`` cached tokens may take (x_{n-1} sits at
        position L): below the model's context, and on a LongRoPE model (:attr:`switches`) while
        the step's own token is scored with the short factors (n = L + 1 <= the switch), below the
        switch too, so no row of the block moves the forward to the long factors before AR would
        (and a Phi-3's cache is rebuilt at the step AR's generate rebuilds it)."""
        end = min([self.context, *(s for s in self.switches if L < s)])
        return end - L - 1

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 256, sampling: SamplingConfig = SamplingConfig(),
                 stop_token_ids: Iterable[int] | int = (), on_tokens: Callable[[list[int]], None] | None = None,
                 logits_processor: LogitsProcessor | None = None, planner: StepPlanner | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ((seq,) or (1, seq)).

        Args:
            sampling: greedy when temperature is 0, else exact speculative sampling (seeded
                generator on the model's device).
            stop_token_ids: generation ends after the first of these (one id, or several).
            on_tokens: streaming callback, called with each step's new tokens; raising
                ``result.StopDecoding(keep)`` keeps the first ``keep`` of them and ends generation.
            logits_processor: HF convention, ``(input_ids (1, seq), scores (1, vocab)) -> scores``
                (e.g. a ``LogitsProcessorList``). Applied to each verification row with exactly the
                tokens before the position it scores (x_0..x_{n-1} and the node's own path), as AR
                decoding would, so greedy output equals AR with the same processor (in fp32; see
                the module docstring for bf16 / fp16) and sampling stays exact; applied to draft
                rows with their group's context (drafts only need to be drawn from the q they report).
            planner: what each step verifies (``space.decoding.planner``, issue 44); None: a fresh
                one from this decoder's layout (:meth:`planner`). Greedy output and sampled trees
                are exact with any planner whose nodes come after their parents; a sampled chain
                (temperature > 0, no tree, no lookup) verifies its own drawn drafts by the p/q rule
                and takes no other planner.

        Returns:
            DecodeResult with the new ids and per-step statistics (times in s, rows per step).
            Greedy: the new ids equal ``ar_generate``'s token for token in fp32; in bf16 / fp16 a
            near-tie can flip.

        Raises:
            ValueError: empty prompt, batch > 1, a max_new_tokens that is not an integer >= 1, a
                prompt id outside the vocabulary, prompt + max_new_tokens over the context
                (``result.check_prompt``), or a ``planner`` with a sampled chain.
            TypeError: ``sampling`` that is not a SamplingConfig; ``stop_token_ids`` given as text or
                holding non-integers (``result.DecodeResult``).
        """
        check_sampling(sampling)
        ids = check_prompt(input_ids, max_new_tokens, self.context, self.head.weight.shape[0])
        res = DecodeResult(ids.numel(), max_new_tokens, stop_token_ids, on_tokens)
        gen = None if sampling.greedy else torch.Generator(device=self.device).manual_seed(sampling.seed)
        # a sampled chain drafts by sampling and verifies with the p/q rule; every other step
        # verifies deterministic candidates
        pq = not sampling.greedy and self.config.tree is None and not self.lookup
        if planner is not None and pq:
            raise ValueError("a sampled chain (temperature > 0, no tree, no lookup) verifies the drafts it drew with "
                             "the p/q rule, so it takes no planner: use greedy, a token tree or prompt lookup")
        planner = planner if planner is not None else self.planner(end=ids.numel() + max_new_tokens)
        size = ids.numel() + max_new_tokens + self.max_rows  # the most tokens a generation caches
        if self.graphs is not None:  # the captured steps' own cache, emptied
            self.graphs.check_fits(ids.numel() + max_new_tokens, self.max_rows)
            self.graphs.reset()
            cache, slots = self.graphs.cache, self.graphs.slots
        else:
            slots = size if self.static_cache else None
            cache = static_cache(len(self.decoder.layers), size) if self.static_cache else eager_cache(self.decoder, size)
        L = ids.numel() - 1  # tokens cached (x_0..x_{n-2}), counted on the host
        # prompt + output so far, kept on the host when prompt lookup or a logits processor needs it
        seq = ids.tolist() if self.lookup or logits_processor is not None else None
        cfg = self.config
        lookup = PromptLookup(seq, cfg.lookup_tokens, cfg.lookup_ngram, self.context,
                              cfg.lookup_branches if self.dynamic else 1, self.datastore,
                              cfg.datastore_branches) if self.lookup else None
        # host clock only: each step ends by copying its result to the host, which waits for the
        # device, so step times add up without a synchronize of their own (on CUDA, two per step)
        t0 = time.perf_counter()
        ids = ids.to(self.device)
        if ids.numel() > 1:  # prefill x_0..x_{n-2}; x_{n-1} enters the first step
            with eager():  # a compiled trunk would make a graph per prompt length
                if not self.switches:
                    self._forward(ids[:-1], None, None, cache, None)
                else:  # the whole prompt, as AR's prefill: its rotary factors are chosen by n, not n - 1 tokens
                    self._forward(ids, None, None, cache, None)
                    crop_cache(cache, L, L + 1)
        # generate() of a Phi-3 forwards the whole sequence again once its cache holds rebuild_at tokens
        rebuild_at = self.rebuild_at if self.rebuild_at is not None and ids.numel() <= self.rebuild_at else None
        prefill_s = time.perf_counter() - t0
        last = ids[-1:]
        drafts = self._no_drafts(pq)
        # the first step already verifies what the prompt repeats, as PLD's does
        found = lookup.continuations() if lookup else []
        # host time = a step minus the model (trunk, LM head, and the sampler head and its embedding)
        with model_time(self.decoder, self.head, *([self.sampler, self.embed] if self.sampler is not None else [])) as spent:
            while True:
                t0, model0 = time.perf_counter(), spent[0] + self._graph_s()
                if L == rebuild_at:  # x_0..x_{n-1} again in one forward (long factors), then x_{n-1} dropped
                    crop_cache(cache, 0, L)
                    with eager():
                        self._forward(torch.cat([ids, upload(res.new_ids, self.device)]), None, None, cache, None)
                    crop_cache(cache, L, L + 1)
                    rebuild_at = None
                block = planner.propose(drafts, found, L)
                lay, plan_s = block.layout, time.perf_counter() - t0
                q = drafts.q[: block.tokens.numel()] if pq else None
                last, nxt, emitted, path, host_tokens = self._step(cache, L, slots, last, lay, block.tokens, q,
                                                                   sampling, gen, logits_processor, seq)
                L += 1 + len(path)  # x_{n-1} and the accepted path stay
                planner.observe(StepOutcome(emitted, path, lay))
                if seq is not None:
                    seq.extend(emitted)
                found = lookup.continuations() if lookup else []
                sources = provenance(lay.parents, block.sources, host_tokens, path)
                step_s = time.perf_counter() - t0
                if res.emit(emitted, step_s + prefill_s, accepted=len(path), candidates=max(lay.depth), rows=lay.rows,
                            padding=lay.rows - lay.used_rows, host=step_s - (spent[0] + self._graph_s() - model0), plan=plan_s,
                            provenance=sources):
                    return res
                drafts = nxt if nxt is not None else self._no_drafts(pq)
                prefill_s = 0.0

    def _graph_s(self) -> float:
        """Seconds spent replaying captured steps so far (``graphs.StepGraphs.step_s``; 0 without
        them): the trunk's share of a step there, where no forward hook sees the replay."""
        return self.graphs.step_s if self.graphs is not None else 0.0

    def _no_drafts(self, pq: bool) -> Drafts:
        ids = torch.empty(0, self.draft_ranks, dtype=torch.long, device=self.device)
        vocab = self.head.weight.shape[0]
        return Drafts(ids, probs=ids.float() if self.dynamic else None,
                      q=torch.empty(0, vocab, device=self.device) if pq else None)

    def static_block(self, L: int, drafts: Drafts, found: list[int]) -> tuple[StepLayout, torch.Tensor, tuple[int, ...]]:
        """A static step: the configured tree (or the chain) pruned to the drafts at hand, then a
        lookup branch of ``found``; groups on x_{n-1} and the top-1 chain. Near the end of the
        context nodes, groups and masks shrink so no row reaches position ``context``. The layout
        is built once per shape and kept on the device. Returns (layout, node tokens on the device,
        node sources): :class:`planner.StaticPlanner`'s block."""
        room = self.room(L)  # deepest depth that fits
        found = found[:room]
        tree = prune(self.tree, min(drafts.ids.shape[0], room))
        groups = min(self.config.groups, chain_depth(tree) + 1, room)  # G_g's mask 0 sits at depth g+1
        k = min(self.config.mask_num, room - (groups - 1))
        key = (len(tree), len(found), groups, k)
        if key not in self._static:
            par = tree_parents(tree) + [0 if i == 0 else len(tree) + i for i in range(len(found))]
            rows = len(par) + groups * k
            lay, _ = self.block_layout(par, group_rows(tree, groups), [k] * groups, bucket(rows, self.max_rows) if self.buckets else rows)
            R = self.draft_ranks
            index = upload([(len(p) - 1) * R + p[-1] for p in tree], self.device)
            self._static[key] = (lay, index)
        lay, index = self._static[key]
        tokens = drafts.nodes[: len(tree)] if drafts.nodes is not None else drafts.ids.reshape(-1)[index]
        if found:
            tokens = torch.cat([tokens, upload(found, self.device)])
        return lay, tokens, (MASK,) * len(tree) + (LOOKUP,) * len(found)

    def block_layout(self, parents: list[int] | tuple[int, ...], group_rows, group_len, rows: int,
                     tokens: list[int] = ()) -> tuple[StepLayout, torch.Tensor]:
        """A planner's block, built: the device tensors of a block and its node ``tokens`` on the
        device. The layout is computed on the host (``space.masking.host_block``: one pass over
        the rows, no tensor op) and goes up with the tokens in one non-blocking copy
        (:func:`upload`), split into views; a tree shape seen before reuses its tensors.

        Raises:
            ValueError: a new shape that is no block: a parent after its child or a second root
                (``masking.check_parents``), a group anchored past the nodes or of no mask, or more
                rows than ``rows``. A planner given to :meth:`generate` may propose one; laid out,
                a child before its parent saw neither, and a sampled step accepted it.
        """
        dev, n1 = self.device, len(parents)
        key = (tuple(parents), tuple(group_rows), tuple(group_len), rows)
        if key in self._layouts:  # a tree shape seen before (most are): only its tokens go up
            self._layouts[key] = self._layouts.pop(key)  # most recently used last
            return self._layouts[key], upload(tokens, dev)
        check_parents(parents, n1)  # once per shape: host_block trusts it
        if (len(group_rows) != len(group_len) or any(not 0 <= r < n1 for r in group_rows)
                or any(n < 1 for n in group_len) or rows < n1 + sum(group_len)):
            raise ValueError(f"a block's mask groups must hang off its {n1} nodes with at least one mask each, within "
                             f"{rows} rows; got group rows {list(group_rows)}, lengths {list(group_len)}")
        positions, offsets, sees = host_block(parents, [r + 1 for r in group_rows], group_len, rows)
        mask_ids = [self.mask_ids[max(j, 0)] for j in offsets[n1:]]  # padding takes offset 0's id
        words = pack_rows(sees, rows)
        plan = upload([*positions, *mask_ids, *words, *tokens], dev)
        positions, mask_ids, words, node_tokens = plan.split([rows, rows - n1, len(words), len(tokens)])
        if len(self._layouts) >= LAYOUT_CACHE:
            del self._layouts[next(iter(self._layouts))]  # the least recently used
        self._layouts[key] = StepLayout(
            parents=tuple(parents), group_rows=tuple(group_rows), group_len=tuple(group_len), rows=rows,
            mask_ids=mask_ids, position_ids=positions, block_mask=to_additive_4d(unpack_rows(words, rows), self.mask_dtype))
        return self._layouts[key], node_tokens

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask, cache,
                 mask_start: int | None) -> torch.Tensor:
        """The one place the decoder runs the model: ids (q,) after the cache -> last hidden states
        (q, hidden). ``mask_start``: first mask row (the frozen-base LoRA acts from there); None
        for the prefill, a plain forward of the base model."""
        kwargs = {} if position_ids is None else {"position_ids": position_ids[None], "attention_mask": attention_mask}
        with mask_rows(mask_start):
            return self.decoder(input_ids=ids[None], **kwargs, **cache_input(cache), use_cache=True).last_hidden_state[0]

    def _step(self, cache, L: int, slots: int | None, last: torch.Tensor, lay: StepLayout, tokens: torch.Tensor,
              q: torch.Tensor | None, sampling: SamplingConfig, gen, processor: LogitsProcessor | None,
              seq: list[int] | None):
        """One forward pass: verify ``tokens`` (the block's nodes), emit, compact the cache, draft.

        Args:
            L: tokens in the cache (x_0..x_{n-2}).
            slots: a static cache's size, None for a dynamic cache.
            tokens: (N,) node tokens in block order.
            q: (N, vocab) for a sampled chain (the p/q rule), else None.
            seq: x_0..x_{n-1} on the host, needed only by ``processor``.

        Returns:
            (bonus (1,), next Drafts or None, emitted tokens, the accepted rows (a of them, in
            depth order), the node tokens on the host).
        """
        # 1. the block [x_{n-1}] [nodes] [mask groups] [padding] after the cache (DESIGN §3.3)
        n1 = lay.num_real
        if slots is not None and L + lay.rows > slots:
            raise ValueError(f"a planner's block of {lay.rows} rows after {L} cached tokens overflows the static "
                             f"cache's {slots} slots (sized for {self.max_rows} rows per step)")
        block = torch.cat([last, tokens, lay.mask_ids])
        # 2. one forward; the LM head on the verification rows (on every row, when that wastes few)
        # the frozen-base LoRA acts from the first mask row; a block without a group (prompt lookup
        # alone, the end of the context) has none: its padding rows are never read
        start = n1 if lay.group_len else None
        if self.graphs is not None:  # a captured step: the layout's own tensors go into its buffers
            hidden = self.graphs.step(block, lay.position_ids, lay.block_mask, L, start)
        else:
            mask = lay.attention_mask(L, self.windows, mask_slots(self.decoder, slots))
            hidden = self._forward(block, lay.position_ids + L, mask, cache, start)
        logits, target = self._head_rows(hidden, lay)
        # 3. each verification row scored as AR would score it (a processor sees the row's context)
        host_tokens = tokens.tolist() if processor is not None or (q is None and not sampling.greedy) else None
        contexts = self._contexts(lay, seq, host_tokens) if processor is not None else None
        if contexts is not None:
            target = torch.cat([processor(contexts[i][None], target[i:i + 1]) for i in range(n1)])
        # 4. verify: the accepted row and the bonus (auto-correct) token
        best, bonus, bonus_id, host_tokens = self._verify(lay, target, tokens, q, sampling, gen, host_tokens)
        # 5. emit the accepted path and the bonus
        path = lay.path(best)
        emitted = [host_tokens[r - 1] for r in path] + [bonus_id]
        # 6. keep x_0..x_{n-1} and the accepted path in the cache, drop the rest
        compact_cache(cache, L, path, L + lay.rows)
        # 7. draft from the deepest group anchored on the path, past the path's end (DESIGN §3.5)
        rows = lay.draft_rows(best, host_tokens)
        if rows is None:
            return bonus, None, emitted, path, host_tokens
        g, shift, start, stop = rows
        ctx = contexts[lay.group_rows[g]][None] if contexts is not None else None  # its anchor row's context
        drafts = self._draft(hidden, logits, start, stop, shift, bonus, sampling, gen, q is not None, processor, ctx)
        return bonus, drafts, emitted, path, host_tokens

    def _head_rows(self, hidden: torch.Tensor, lay: StepLayout) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits of every used row or None, the verification rows' logits (1+N, vocab)).

        The LM head's cost is mostly one read of its (vocab, hidden) weight, so when few rows would
        be wasted it runs once on every row, drafts included, rather than twice. Not with a sampler
        head, which drafts from its own output (the draft rows' head logits would be wasted)."""
        n1, used = lay.num_real, lay.used_rows
        once = self.sampler is None and used <= 2 * (n1 + max(lay.group_len, default=0))
        logits = self._logits(hidden[:used]) if once else None
        return logits, logits[:n1] if logits is not None else self._logits(hidden[:n1])

    def _contexts(self, lay: StepLayout, seq: list[int], host_tokens: list[int]) -> tuple[torch.Tensor, ...]:
        """Per verification row i, x_0..x_{n-1} and i's path (what a logits processor sees as AR
        would): every row's context in one upload, split into views on the device."""
        rows = [seq + [host_tokens[r - 1] for r in lay.path(i)] for i in range(lay.num_real)]
        return upload([t for row in rows for t in row], self.device).split([len(r) for r in rows])

    def _verify(self, lay: StepLayout, target: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None,
                sampling: SamplingConfig, gen, host_tokens: list[int] | None):
        """Verify the nodes against the target's rows (DESIGN §3.4).

        Returns:
            (best row, bonus (1,) on the device, its id, the node tokens on the host). Greedy and
            the sampled chain copy to the host once.
        """
        if q is not None:  # a sampled chain: node i is row i, the p/q rule
            best, bonus = verify_rejection(logits_to_probs(target, sampling), q, tokens, gen)
            best, bonus_id, *host_tokens = torch.cat([best.view(1), bonus.view(1), tokens]).tolist()  # one copy
            return best, bonus.view(1), bonus_id, host_tokens
        if sampling.greedy:  # the rows' argmaxes and the nodes in one copy, the tree walked on the host
            pred = target.argmax(dim=-1)
            host = torch.cat([pred, tokens]).tolist()
            pred_host, host_tokens = host[: lay.num_real], host[lay.num_real:]
            best = verify_tree_greedy(pred_host, host_tokens, lay.parents, lay.depth)
            return best, pred.narrow(0, best, 1), pred_host[best], host_tokens  # a view: no read, no upload
        # a sampled tree: siblings tried in order, exact multi-candidate sampling
        best, bonus = verify_tree_sampling(logits_to_probs(target, sampling), host_tokens, lay.children, gen)
        return best, bonus.view(1), int(bonus), host_tokens

    def _draft(self, hidden: torch.Tensor, logits: torch.Tensor | None, start: int, stop: int, shift: int,
               bonus: torch.Tensor, sampling: SamplingConfig, gen, pq: bool, processor: LogitsProcessor | None,
               ctx: torch.Tensor | None) -> Drafts:
        """The next step's drafts from the group's mask rows ``start:stop`` (offsets ``shift`` on):
        by the sampler head, sampled with their q (a sampled chain), top-R with probabilities (the
        dynamic tree prices nodes with them), or top-R ids."""
        if self.sampler is not None:
            return self._head_drafts(hidden[start:stop], bonus, shift, sampling, gen, pq, processor, ctx)
        draft_logits = logits[start:stop] if logits is not None else self._logits(hidden[start:stop])
        if processor is not None:
            draft_logits = processor(ctx.expand(draft_logits.shape[0], -1), draft_logits)
        if pq:
            q_next = logits_to_probs(draft_logits, sampling)
            return Drafts(sample(q_next, gen)[:, None], q=q_next, offset=shift)
        if self.dynamic:
            probs = torch.softmax(draft_logits, -1) if sampling.greedy else logits_to_probs(draft_logits, sampling)
            top = probs.topk(self.draft_ranks, dim=-1)
            return Drafts(top.indices, probs=top.values, offset=shift)
        return Drafts(draft_logits.topk(self.draft_ranks, dim=-1).indices, offset=shift)

    def _head_drafts(self, hidden: torch.Tensor, bonus: torch.Tensor, shift: int, sampling: SamplingConfig, gen,
                     pq: bool, processor: LogitsProcessor | None, ctx: torch.Tensor | None) -> Drafts:
        """Drafts from the sampler head (issue 34, ``space.sampler_head``), after the step's forward
        (no extra model forward): offset i drafts from its mask's hidden state and the token drafted
        at offset i-1 (the bonus token before the first), one head call per offset.

        * A sampled chain (``pq``) draws each offset from the head's distribution given the token
          drawn before it and reports those distributions for the p/q rule.
        * A static tree (the chain included) calls the head once per depth, batched over the nodes
          at that depth that have children, each given its own token (``Drafts.nodes``).
        * ``ids`` (and for the dynamic tree ``probs``) hold each offset's top-R given the top-1
          drafts before it; the dynamic planner prices every path with them.

        Args:
            hidden: (r, hidden) last hidden states of the group's masks from offset ``shift`` on.
            bonus: (1,) the step's bonus token.
            ctx: (1, seq) the group's context for ``processor`` (None without one).
        """
        tree = prune(self.tree, hidden.shape[0]) if self.tree is not None and not pq else ()
        token = {(): bonus}  # path of ranks -> (1,) its token; the top-1 path always
        ids, probs, qs = [], [], []
        for d in range(hidden.shape[0]):
            top1 = (0,) * d
            parents = list(dict.fromkeys([top1] + [p[:-1] for p in tree if len(p) == d + 1]))
            prev = torch.cat([token[p] for p in parents])  # (P,)
            logits = self._logits(self.sampler(hidden[d].expand(len(parents), -1), self.embed(prev)))
            if processor is not None:
                logits = processor(ctx.expand(len(parents), -1), logits)
            if pq:
                qs.append(logits_to_probs(logits, sampling))
                token[top1 + (0,)] = sample(qs[-1], gen)
                ids.append(token[top1 + (0,)])
                continue
            if self.dynamic:  # the planner prices nodes with probabilities
                logits = torch.softmax(logits, -1) if sampling.greedy else logits_to_probs(logits, sampling)
            top = logits.topk(self.draft_ranks, dim=-1)
            ids.append(top.indices[0])
            probs.append(top.values[0])
            token[top1 + (0,)] = top.indices[0, :1]
            for p in tree:
                if len(p) == d + 1:
                    token[p] = top.indices[parents.index(p[:-1]), p[-1]:p[-1] + 1]
        ids = torch.stack(ids)
        if pq:
            return Drafts(ids, q=torch.cat(qs), offset=shift)
        if self.dynamic:
            return Drafts(ids, probs=torch.stack(probs), offset=shift)
        return Drafts(ids, offset=shift, nodes=torch.cat([token[p] for p in tree]))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on selected rows only, mask tokens suppressed: (rows, hidden) -> (rows, vocab)."""
        weight = self.head.weight
        if weight.is_floating_point() and hidden.dtype != weight.dtype:  # e.g. an fp32 head on a bf16 trunk
            hidden = hidden.to(weight.dtype)
        logits = self.head(hidden).float()
        if self.head_transform is not None:
            logits = self.head_transform(logits)
        return logits.index_fill_(1, self.suppress, float("-inf"))  # a setitem of -inf would upload it (a CUDA sync)
