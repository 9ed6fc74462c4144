"""The SPACE auto-correct decoder: verify the last drafts and draft the next ones in one pass.

DESIGN §3.3-§3.5. Each step feeds ``[x_{n-1}] [c_1..c_m] [G_0..G_{g-1}]`` after a KV cache that
holds ``x_0..x_{n-2}``, with the layout core's 4-D mask and position ids, then

1. verifies c_1..c_m on the m+1 verification rows (greedy or exact speculative sampling),
2. emits the a accepted candidates and the bonus (auto-correct) token,
3. crops the cache to ``x_0..x_{n-1}, c_1..c_a`` (candidates come first in the block, so this is
   a crop, never a gather),
4. drafts the next candidates from group G_a (or, when G_a was not attached, from the deepest
   group by shifting: DESIGN §3.5).

The LM head runs on the m+1 verification rows, then on the chosen group's rows; or once on every
row when that wastes few rows (one read of the head's weight instead of two).

Exactness and precision: in fp32, greedy output is token for token the AR greedy output of the same
weights, and sampled output is distributed as AR sampling. In bf16 and fp16 the verification rows
are computed in one multi-row forward whose kernels round differently from AR's one-row forwards,
so a near-tie between the two best tokens can flip and the output can then differ from AR from
that token on; check exactness in fp32.

Sliding-window models (Mistral, Qwen2 with ``use_sliding_window``): the cache keeps every token on
every layer (``cache.full_cache``), so it can be cropped and compacted, and the window is applied
in the step's 4-D mask by position, per kind of layer (:func:`with_cache`): each row sees what AR
decoding with transformers' sliding cache sees.

Device work: tokens, candidates, draft distributions and the sampling generator live on the
model's device, and the layout's tensors are built once per shape and kept there. A step copies
to the host once (the accept length and the tokens to emit), which the cache crop needs anyway.

Near the end of the context the step shrinks instead of refusing: no row is placed at a position
>= the model's context (fewer candidates, shorter mask groups, at the very end no group).

Token trees (issue #14, ``DecodeConfig.tree``): the step verifies a static tree of the draft
masks' top-ranked tokens instead of one chain: ``[x_{n-1}] [tree nodes] [lookup branch] [groups]``
(layout: ``space.masking.build_layout(parents=...)``), groups on x_{n-1} and the top-1 chain. The
deepest node whose path matches the target is accepted (greedy), or siblings are tried in order
with exact multi-candidate sampling (``verify_tree_sampling``); the accepted path's keys and values
are moved next to x_{n-1} in the cache (``compact_cache``), then the rest is cropped.

Optional prompt lookup (``lookup_tokens``, our addition): when the last n-gram of the text so far
(prompt + output) occurred earlier, the tokens that followed it (transformers'
``PromptLookupCandidateGenerator`` finds them) are one more branch of the next step's tree, added
to the mask drafts, so a failed lookup costs only its rows. Lookup runs through the tree step
(with the chain as the tree when none is configured); its candidates are deterministic.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..masking import build_layout, in_window, mask_rows, to_additive_4d, tree_parents
from ..tokens import MaskSpec, check_mask_num
from .cache import attention_windows, cache_input, crop_cache, full_cache
from .config import DecodeConfig
from .result import DecodeResult, check_prompt, clock
from .sampling import SamplingConfig, logits_to_probs, sample
from .tree import chain_depth, prune
from .verify import verify_greedy, verify_rejection, verify_tree_greedy, verify_tree_sampling

# HF's logits-processor convention: (input_ids (rows, seq), scores (rows, vocab)) -> scores
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compact_cache(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Move the keys and values of block rows ``rows`` (the accepted path of a token tree) to the
    contiguous slots ``start + 1, start + 2, ...`` right after x_{n-1} (slot ``start``), on each
    layer's own device, then crop after them. O(accepted) per layer; a chain's path is already in
    place and is only cropped.

    Args:
        start: the cache length before the block (x_{n-1}'s slot).
        rows: block rows of the accepted nodes in depth order (row 0 is x_{n-1}).
    """
    moved = [i for i, r in enumerate(rows, 1) if r != i]
    if moved:
        for layer in cache.layers:
            src = torch.tensor([start + rows[i - 1] for i in moved], device=layer.keys.device)
            dst = torch.tensor([start + i for i in moved], device=layer.keys.device)
            layer.keys[..., dst, :] = layer.keys[..., src, :]
            layer.values[..., dst, :] = layer.values[..., src, :]
    crop_cache(cache, start + 1 + len(rows))


def with_cache(block_mask: torch.Tensor, position_ids: torch.Tensor, cache_len: int,
               windows: dict[str, int | None]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The forward's ``attention_mask`` for a step block after a cache of ``cache_len`` tokens.

    Args:
        block_mask: (1, 1, q, q) additive mask of the block's rows among themselves.
        position_ids: (q,) position of each row minus ``cache_len``.
        windows: the model's attention kinds (``cache.attention_windows``).

    Returns:
        (1, 1, q, cache_len + q) additive mask in which every row sees the cache; on a sliding-window
        model a row also sees only the keys less than the window behind its position (cache slot i
        holds position i: the cache is full-attention and compacted), which is what AR decoding
        sees. A model mixing full and sliding layers gets ``{layer type: mask}``, the form
        transformers' hybrid models take.
    """
    q = block_mask.shape[-1]
    full = torch.cat([block_mask.new_zeros(1, 1, q, cache_len), block_mask], dim=-1)
    if all(w is None for w in windows.values()):
        return full
    query_pos = position_ids + cache_len
    key_pos = torch.cat([torch.arange(cache_len, device=query_pos.device), query_pos])
    masks = {kind: full if w is None else full.masked_fill(~in_window(query_pos, key_pos, w), torch.finfo(full.dtype).min)
             for kind, w in windows.items()}
    return masks if len(masks) > 1 else next(iter(masks.values()))


@dataclass(frozen=True)
class StepLayout:
    """The device tensors of one decode-step shape, relative to the cache length L.

    Attributes:
        num_real: 1 + m (x_{n-1} and the candidates).
        k: masks per attached group in this step.
        groups: groups attached (0 at the very end of the context).
        mask_ids: (groups * k,) the mask tokens of the block's tail.
        position_ids: (q,) position of each row minus L.
        block_mask: (1, 1, q, q) additive mask of the rows among themselves (they all see the cache).
    """

    num_real: int
    k: int
    groups: int
    mask_ids: torch.Tensor
    position_ids: torch.Tensor
    block_mask: torch.Tensor

    def attention_mask(self, cache_len: int, windows: dict[str, int | None]) -> torch.Tensor | dict[str, torch.Tensor]:
        return with_cache(self.block_mask, self.position_ids, cache_len, windows)

    def draft_rows(self, a: int) -> slice:
        """Rows of the next candidates after a accepted: mask j of G_g proposes position n+g+1+j,
        so from G_g (g = min(a, deepest group)) the masks from offset a-g on (DESIGN §3.5)."""
        if self.groups == 0:
            return slice(0, 0)
        g = min(a, self.groups - 1)
        start = self.num_real + g * self.k
        return slice(start + a - g, start + self.k)


@dataclass(frozen=True)
class TreeLayout:
    """One token-tree step shape (issue #14): ``[x_{n-1}] [mask-tree nodes] [lookup branch] [groups]``.

    Attributes:
        parents: (1+N,) parent row of each block row (-1 for x_{n-1}), on the host.
        depth: (1+N,) depth of each row (x_{n-1}: 0).
        children: per row, its child rows in the order exact sampling tries them.
        mask_nodes: the first N' nodes come from the mask drafts, the rest from prompt lookup.
        draft_index: (N',) flat index of each mask node's token in the drafts (r, R): (depth-1)*R + rank.
        group_rows: anchor row of each mask group (x_{n-1}, then the top-1 chain).
        group_of: (1+N,) per row, the index of its deepest ancestor-or-self group (row 0 has G_0).
        k: masks per group.
        parent_rows, ancestors, score: device tensors for :func:`verify_tree_greedy`.
        mask_ids, position_ids, block_mask: as in :class:`StepLayout`.
    """

    parents: tuple[int, ...]
    depth: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    mask_nodes: int
    draft_index: torch.Tensor
    group_rows: tuple[int, ...]
    group_of: tuple[int, ...]
    k: int
    parent_rows: torch.Tensor
    ancestors: torch.Tensor
    score: torch.Tensor
    mask_ids: torch.Tensor
    position_ids: torch.Tensor
    block_mask: torch.Tensor

    @property
    def num_real(self) -> int:
        return len(self.parents)

    def attention_mask(self, cache_len: int, windows: dict[str, int | None]) -> torch.Tensor | dict[str, torch.Tensor]:
        return with_cache(self.block_mask, self.position_ids, cache_len, windows)

    def path(self, row: int) -> list[int]:
        """Rows from depth 1 down to ``row`` (empty for x_{n-1})."""
        out = []
        while row > 0:
            out.append(row)
            row = self.parents[row]
        return out[::-1]


class SpaceDecoder:
    """SPACE decoding for a HF causal LM with mask tokens (batch size 1).

    Args:
        model: a ``LlamaForCausalLM``-like model whose vocabulary contains the mask token(s) of
            ``mask`` (``space.adapters.load_space`` gives one; a peft model is unwrapped).
        mask: the model's MaskSpec (``space.tokens.mask_spec``).
        config: the step layout (k, groups, prompt lookup). None: the model's recorded layout
            (``model.config.space_decode``, set by ``load_space`` from the adapter's
            ``space_config.json``), else k = the trained k (see ``DecodeConfig.of_model``).

    Raises:
        ValueError: k larger than the model's per-offset mask tokens (mask_diff), a tree rank at or
            above the vocabulary size, or a model with attention layers other than full and
            sliding-window ones (``cache.attention_windows``).
    """

    def __init__(self, model, mask: MaskSpec, config: DecodeConfig | None = None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = config if config is not None else DecodeConfig.of_model(base, mask.mask_num)
        check_mask_num(self.config.mask_num, mask)
        self.model, self.decoder, self.head = model, base.get_decoder(), base.get_output_embeddings()
        self.mask = mask
        self.context = base.config.max_position_embeddings
        self.windows = attention_windows(base.config)  # sliding windows go into the step's 4-D mask
        self.device = self.head.weight.device
        self.mask_ids = mask.ids_for(self.config.mask_num).to(self.device)
        self.suppress = torch.tensor(mask.token_ids, device=self.device)
        self.lookup = PromptLookupCandidateGenerator(
            num_output_tokens=self.config.lookup_tokens, max_matching_ngram_size=self.config.lookup_ngram,
            max_length=self.context) if self.config.lookup_tokens else None
        # the step verifies a token tree when one is configured or a lookup branch joins the drafts;
        # else the chain of top-1 drafts (sampled drafts with the p/q rule when sampling)
        self.tree = None
        if self.config.tree is not None or self.lookup is not None:
            self.tree = self.config.tree or tuple((0,) * d for d in range(1, self.config.mask_num + 1))
        self.draft_ranks = 1 + max(max(p) for p in self.tree) if self.tree else 1  # R: drafts kept per mask
        vocab = self.head.weight.shape[0]
        if self.draft_ranks > vocab:  # a mask has only `vocab` ranked drafts
            raise ValueError(f"token tree: rank {self.draft_ranks - 1} is at or above this model's vocabulary "
                             f"size {vocab} (ranks count from 0)")
        self._layouts: dict[tuple[int, int, int], StepLayout] = {}
        self._tree_layouts: dict[tuple[int, int, int, int], TreeLayout] = {}

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 256, sampling: SamplingConfig = SamplingConfig(),
                 stop_token_ids: Iterable[int] = (),
                 on_tokens: Callable[[list[int]], None] | None = None,
                 draft_override: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None,
                 logits_processor: LogitsProcessor | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ((seq,) or (1, seq)).

        Args:
            sampling: greedy when temperature is 0, else exact speculative sampling (seeded
                generator on the model's device).
            stop_token_ids: generation ends after the first of these.
            on_tokens: streaming callback, called with each step's new tokens; raising
                ``result.StopDecoding(keep)`` keeps the first ``keep`` of them and ends generation.
            draft_override: greedy only, for tests and ablations: called with (tokens generated so
                far, the model's drafts), returns the drafts to verify next. Chain: drafts (m,),
                returns <= k ids. Tree: drafts (r, R) (mask j's top-R tokens, r <= k; (0, R) when
                no group was left), returns (r' <= k, R); the lookup branch is added as usual.
            logits_processor: HF convention, ``(input_ids (1, seq), scores (1, vocab)) -> scores``
                (e.g. a ``LogitsProcessorList``). Applied to each verification row with exactly the
                tokens before the position it scores (in a tree, x_0..x_{n-1} and the node's own
                path), as AR decoding would, so greedy output equals AR with the same processor
                (in fp32; see the module docstring for bf16 / fp16) and sampling stays exact;
                applied to draft rows with their group's context (drafts only need to be drawn from
                the q they report).

        Returns:
            DecodeResult with the new ids and per-step statistics (times in s). Greedy: the new
            ids equal ``ar_generate``'s token for token in fp32; in bf16 / fp16 a near-tie can flip.

        Raises:
            ValueError: empty prompt, batch > 1, or prompt + max_new_tokens over the context.
        """
        ids = check_prompt(input_ids, max_new_tokens, self.context)
        res = DecodeResult(ids.numel(), max_new_tokens, frozenset(stop_token_ids), on_tokens)
        gen = None if sampling.greedy else torch.Generator(device=self.device).manual_seed(sampling.seed)
        cache = full_cache()
        t0 = clock(self.device)
        ids = ids.to(self.device)
        if ids.numel() > 1:  # prefill x_0..x_{n-2}; x_{n-1} enters the first step
            self.decoder(input_ids=ids[None, :-1], **cache_input(cache), use_cache=True)
        prefill_s = clock(self.device) - t0
        last = ids[-1:]
        # prompt + output so far, kept on the host when prompt lookup or a logits processor needs it
        seq = ids.tolist() if self.lookup is not None or logits_processor is not None else None
        if self.tree is not None:
            return self._generate_tree(cache, last, res, prefill_s, sampling, gen, draft_override,
                                       logits_processor, seq)
        cands, q = ids.new_empty(0), None  # q: (m, vocab) draft distributions, sampling
        while True:
            t0 = clock(self.device)
            m = cands.numel()
            last, cands, q, emitted, a = self._step(cache, last, cands, q, sampling, gen, logits_processor, seq)
            if seq is not None:
                seq.extend(emitted)
            if res.emit(emitted, clock(self.device) - t0 + prefill_s, accepted=a, candidates=m):
                return res
            if draft_override is not None and sampling.greedy:
                cands = torch.as_tensor(draft_override(res.new_ids, cands.cpu()), dtype=torch.long)[: self.config.mask_num]
                cands = cands.to(self.device)
            prefill_s = 0.0

    def _generate_tree(self, cache, last, res: DecodeResult, prefill_s: float, sampling: SamplingConfig, gen,
                       draft_override, processor: LogitsProcessor | None, seq: list[int] | None) -> DecodeResult:
        """The decode loop with token-tree steps (see :meth:`_tree_step`)."""
        drafts, found = last.new_empty(0, self.draft_ranks), []
        while True:
            t0 = clock(self.device)
            last, drafts, emitted, a, depth = self._tree_step(cache, last, drafts, found, sampling, gen,
                                                              processor, seq)
            if seq is not None:
                seq.extend(emitted)
            if self.lookup is not None:
                found = self.lookup.get_candidates(torch.tensor([seq]))[0][0, len(seq):].tolist()
            if res.emit(emitted, clock(self.device) - t0 + prefill_s, accepted=a, candidates=depth):
                return res
            if draft_override is not None and sampling.greedy:
                drafts = torch.as_tensor(draft_override(res.new_ids, drafts.cpu()), dtype=torch.long)
                drafts = drafts[: self.config.mask_num, : self.draft_ranks].to(self.device)
            prefill_s = 0.0

    def _tree_step(self, cache, last: torch.Tensor, drafts: torch.Tensor, found: list[int],
                   sampling: SamplingConfig, gen, processor: LogitsProcessor | None, seq: list[int] | None):
        """One forward pass over a token tree (issue #14).

        Args:
            drafts: (r, R) the top-R tokens of the r draft masks from the last step.
            found: prompt-lookup tokens, one more branch of x_{n-1}.

        Returns:
            (bonus (1,), next drafts (r', R), emitted tokens, a, depth of the verified tree).
        """
        L = cache.get_seq_length()  # n - 1; x_{n-1} at position L, a node of depth d at L + d
        room = self.context - L - 1  # deepest node that fits
        found = found[:room]
        lay = self._tree_layout(min(drafts.shape[0], room), len(found), room)
        tokens = drafts.reshape(-1)[lay.draft_index]
        if found:
            tokens = torch.cat([tokens, torch.tensor(found, device=self.device)])
        n1 = lay.num_real
        block = torch.cat([last, tokens, lay.mask_ids])
        with mask_rows(n1):
            hidden = self.decoder(input_ids=block[None], position_ids=(lay.position_ids + L)[None],
                                  attention_mask=lay.attention_mask(L, self.windows), **cache_input(cache),
                                  use_cache=True).last_hidden_state[0]  # (q, hidden)
        logits = self._logits(hidden) if hidden.shape[0] <= 2 * (n1 + lay.k) else None
        target = logits[:n1] if logits is not None else self._logits(hidden[:n1])  # (1+N, vocab)
        host_tokens = tokens.tolist() if processor is not None or not sampling.greedy else None
        if processor is not None:  # row i scores the token after x_0..x_{n-1} and i's path
            target = torch.cat([processor(torch.tensor(seq + [host_tokens[r - 1] for r in lay.path(i)],
                                                       device=self.device)[None], target[i:i + 1])
                                for i in range(n1)])
        if sampling.greedy:
            best, bonus = verify_tree_greedy(target, tokens, lay.parent_rows, lay.ancestors, lay.score)
            best, bonus_id, *host_tokens = torch.cat([best.view(1), bonus.view(1), tokens]).tolist()  # one copy
        else:
            best, bonus = verify_tree_sampling(logits_to_probs(target, sampling), host_tokens, lay.children, gen)
            bonus_id = int(bonus)
        path = lay.path(best)
        a = len(path)
        emitted = [host_tokens[r - 1] for r in path] + [bonus_id]
        compact_cache(cache, L, path)
        bonus = torch.tensor([bonus_id], device=self.device)
        gi = lay.group_of[best]  # draft from the deepest group on the path, shifted (DESIGN §3.5)
        start = n1 + gi * lay.k + a - lay.depth[lay.group_rows[gi]]
        stop = n1 + (gi + 1) * lay.k
        if start >= stop:  # the group's masks all lie behind the accepted path
            return bonus, drafts[:0], emitted, a, max(lay.depth)
        draft_logits = logits[start:stop] if logits is not None else self._logits(hidden[start:stop])
        if processor is not None:  # the group drafts after x_0..x_{n-1} and the path to its anchor
            anchor_path = [host_tokens[r - 1] for r in lay.path(lay.group_rows[gi])]
            ctx = torch.tensor(seq + anchor_path, device=self.device)[None].expand(draft_logits.shape[0], -1)
            draft_logits = processor(ctx, draft_logits)
        return bonus, draft_logits.topk(self.draft_ranks, dim=-1).indices, emitted, a, max(lay.depth)

    def _tree_layout(self, depth: int, num_found: int, room: int) -> TreeLayout:
        """The tree step's layout: the configured tree pruned to ``depth``, then a lookup branch of
        ``num_found`` nodes, groups on x_{n-1} and the top-1 chain; built once per shape and kept on
        the device. ``room``: deepest position offset that fits in the context (groups shrink)."""
        tree = prune(self.tree, depth)
        groups = min(self.config.groups, chain_depth(tree) + 1, room)  # G_g's mask 0 sits at depth g+1
        k = min(self.config.mask_num, room - (groups - 1))
        key = (depth, num_found, groups, k)
        if key in self._tree_layouts:
            return self._tree_layouts[key]
        par = tree_parents(tree) + [0 if i == 0 else len(tree) + i for i in range(num_found)]
        row_of = {p: i + 1 for i, p in enumerate(tree)}
        group_rows = [0] + [row_of[(0,) * d] for d in range(1, groups)]
        lay = build_layout(0, len(par), [r + 1 for r in group_rows], k, parents=par)
        depth_of = lay.position_ids[: len(par)].tolist()
        n1 = len(par)
        group_of = []
        for r in range(n1):  # the deepest ancestor-or-self with a group (x_{n-1} always has G_0)
            anc = r
            while anc not in group_rows:
                anc = par[anc]
            group_of.append(group_rows.index(anc))
        children = [[] for _ in range(n1)]
        for r in range(1, n1):
            children[par[r]].append(r)
        R = self.draft_ranks
        dev = self.device
        ids = self.mask_ids[:k] if self.mask_ids.numel() > 1 else self.mask_ids.expand(k)
        out = TreeLayout(
            parents=tuple(par), depth=tuple(depth_of), children=tuple(map(tuple, children)), mask_nodes=len(tree),
            draft_index=torch.tensor([(len(p) - 1) * R + p[-1] for p in tree], dtype=torch.long, device=dev),
            group_rows=tuple(group_rows), group_of=tuple(group_of), k=k,
            parent_rows=torch.tensor(par[1:], dtype=torch.long, device=dev),
            ancestors=lay.allowed[:n1, :n1].to(dev),
            score=torch.tensor([d * (n1 + 1) + (n1 - r) for r, d in enumerate(depth_of)], device=dev),
            mask_ids=ids.repeat(groups), position_ids=lay.position_ids.to(dev),
            block_mask=to_additive_4d(lay.allowed, self.head.weight.dtype).to(dev))
        self._tree_layouts[key] = out
        return out

    def _step(self, cache, last: torch.Tensor, cands: torch.Tensor, q, sampling: SamplingConfig, gen,
              processor: LogitsProcessor | None = None, seq: list[int] | None = None):
        """One forward pass. Returns (bonus (1,), next candidates (m',), their q, emitted tokens, a).
        ``seq``: x_0..x_{n-1} on the host, needed only by ``processor``."""
        L = cache.get_seq_length()  # n - 1
        cands = cands[: self.context - L - 1]  # candidate c_i sits at position n-1+i < context
        q = None if q is None else q[: cands.numel()]
        m = cands.numel()
        lay = self._layout(m, L)
        block = torch.cat([last, cands, lay.mask_ids])
        with mask_rows(lay.num_real):  # rows num_real: are the mask groups (a frozen-base LoRA acts there)
            hidden = self.decoder(input_ids=block[None], position_ids=(lay.position_ids + L)[None],
                                  attention_mask=lay.attention_mask(L, self.windows), **cache_input(cache),
                                  use_cache=True).last_hidden_state[0]  # (q, hidden)
        # The LM head's cost is mostly one read of its (vocab, hidden) weight, so when few rows
        # would be wasted, run it once on every row (drafts included) rather than twice.
        logits = self._logits(hidden) if hidden.shape[0] <= 2 * (m + 1 + lay.k) else None
        target = logits[: m + 1] if logits is not None else self._logits(hidden[: m + 1])  # (m+1, vocab)
        if processor is not None:  # row i scores the token after x_0..x_{n-1}, c_1..c_i
            context = torch.tensor(seq, device=self.device)
            target = torch.cat([processor(torch.cat([context, cands[:i]])[None], target[i:i + 1])
                                for i in range(m + 1)])
        if sampling.greedy:
            a, bonus = verify_greedy(target, cands)
        else:
            p = logits_to_probs(target, sampling)
            a, bonus = verify_rejection(p, q if q is not None else p[:0], cands, gen)
        a, *tokens = torch.cat([a.view(1), cands, bonus.view(1)]).tolist()  # the step's one host copy
        emitted = tokens[:a] + tokens[-1:]
        crop_cache(cache, L + 1 + a)
        rows = lay.draft_rows(a)
        if rows.stop <= rows.start:  # no group left to draft from: the next step has no candidate
            return bonus.view(1), cands[:0], None, emitted, a
        draft_logits = logits[rows] if logits is not None else self._logits(hidden[rows])  # (<=k, vocab)
        if processor is not None:  # every mask of G_g drafts after x_0..x_{n-1}, c_1..c_g
            g = min(a, lay.groups - 1)
            group_ctx = torch.cat([context, cands[:g]])[None].expand(draft_logits.shape[0], -1)
            draft_logits = processor(group_ctx, draft_logits)
        if sampling.greedy:
            return bonus.view(1), draft_logits.argmax(-1), None, emitted, a
        q_next = logits_to_probs(draft_logits, sampling)
        return bonus.view(1), sample(q_next, gen), q_next, emitted, a

    def _layout(self, m: int, cache_len: int) -> StepLayout:
        """The step's layout, built once per (m, k, groups) and cached on the device. Near the end
        of the context, groups get shorter so no mask row reaches position ``context``."""
        k = max(0, min(self.config.mask_num, self.context - cache_len - 1 - m))  # G_m's last mask: n+m+k-1
        groups = min(self.config.groups, m + 1) if k else 0
        key = (m, k, groups)
        if key not in self._layouts:
            # decode_layout's groups on x_{n-1} and the first candidates; with no group left (the
            # very end of the context) the same call lays out the real rows alone (k is then unused)
            lay = build_layout(0, 1 + m, list(range(1, groups + 1)), max(k, 1))
            ids = self.mask_ids[:k] if self.mask_ids.numel() > 1 else self.mask_ids.expand(k)
            self._layouts[key] = StepLayout(
                1 + m, k, groups, ids.repeat(groups), lay.position_ids.to(self.device),
                to_additive_4d(lay.allowed, self.head.weight.dtype).to(self.device))
        return self._layouts[key]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on selected rows only, mask tokens suppressed: (rows, hidden) -> (rows, vocab)."""
        logits = self.head(hidden).float()
        logits[:, self.suppress] = float("-inf")
        return logits
