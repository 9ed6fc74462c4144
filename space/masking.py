"""The mask-token layout: the one place that knows where mask groups go (DESIGN §3.1-§3.3).

Both the SAR-SFT collator (``space.data.collator``) and the auto-correct decoder
(``space.decoding.decoder``) build their inputs here, so training and decoding cannot drift apart.

A layout is a block of query rows appended after ``cache_len`` tokens that every row may see:

* ``num_real`` real rows form an ordinary causal chain: real row ``r`` sits at position
  ``cache_len + r`` and sees the cache and real rows ``0..r``.
* Each mask group is anchored at a context length ``e`` (1 <= e <= num_real): it sees the cache,
  real rows ``0..e-1`` and its own earlier masks. Its mask ``j`` (j = 0..k-1) sits at position
  ``cache_len + e + j`` and is trained to predict real row ``e + j + 1`` (the skip-one offset of
  DESIGN §3.1: the ordinary LM head at row ``e-1`` already predicts row ``e``).
* No real row sees any mask.

Decoding (DESIGN §3.3) is the case ``num_real = 1 + m`` (``x_{n-1}`` and m candidates), cache
``n-1``, groups anchored at ``e = g + 1`` for g = 0..num_groups-1. Training (DESIGN §3.2) is
``cache_len = 0``, ``num_real = seq_len`` and one group per span start ``s`` (``e = s``).

Example: a step with n = 3 (two tokens cached), k = 2 candidates and groups G_0, G_1::

    >>> print(render(decode_layout(cache_len=2, num_candidates=2, num_groups=2, k=2)))
    cache | block
    oo    | o......   x     pos 2
    oo    | oo.....   c1    pos 3
    oo    | ooo....   c2    pos 4
    oo    | o..o...   G0m0  pos 3
    oo    | o..oo..   G0m1  pos 4
    oo    | oo...o.   G1m0  pos 4
    oo    | oo...oo   G1m1  pos 5

Columns left of ``|`` are cached tokens, right of it the block; ``o`` = may attend.

Token trees (DESIGN §3.3 generalized, issue #14): the real rows may form a tree instead of a chain
(``parents``). Real row r then sits at position ``cache_len + depth(r)`` and sees the cache and its
own ancestors; a group anchored at row v (context ``e = v + 1``) sees the path to v and its mask j
sits at ``cache_len + depth(v) + 1 + j``. A chain (``parents[r] = r - 1``) is exactly the layout
above. Example: x, two siblings for the next token, one child of the first, a group on x and on
c1 (``space-layout --tree '[[0], [1], [0, 0]]' -k 2 --num-groups 2``)::

    cache | block
    oo    | o.......   x     pos 2
    oo    | oo......   c1    pos 3    c1 = (0,): mask 0's top-1
    oo    | o.o.....   c2    pos 3    c2 = (1,): mask 0's runner-up, a sibling of c1
    oo    | oo.o....   c3    pos 4    c3 = (0, 0): mask 1's top-1 after c1
    oo    | o...o...   G0m0  pos 3
    oo    | o...oo..   G0m1  pos 4
    oo    | oo....o.   G1m0  pos 4
    oo    | oo....oo   G1m1  pos 5

Dynamic trees (issue 31): ``space-layout --tree dynamic -k 3 --draft-probs '[[0.8,0.1],[0.6,0.2],[0.3,0.1]]'``
prints one step that the per-step planner (``space.decoding.dynamic``) chooses from the drafts'
probabilities, the lookup tokens (``--lookup``) and the step cost: each node with its depth,
parent, kind and value, mask groups of their own lengths (1..k) anchored on x and the most likely
chain, the rows used, and the drawing; rows the step's bucket adds beyond the candidates left are
``pad`` rows, which see only themselves.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


IGNORE_INDEX = -100


@dataclass(frozen=True)
class Layout:
    """One block of query rows and how they see each other.

    Attributes:
        cache_len: tokens before the block (KV cache or, in training, 0); every row sees them.
        num_real: real rows at the start of the block.
        k: masks per group (mask_num); with groups of different lengths, the longest.
        group_ctx: (groups,) context length ``e`` of each mask group, in real rows.
        group_len: (groups,) masks in each group (all ``k`` unless lengths were given).
        position_ids: (q,) position id of each row, q = num_real + sum(group_len) + padding.
        allowed: (q, cache_len + q) bool, True where row i may attend to key j.
        is_mask: (q,) bool, True on mask rows.
        mask_offset: (q,) offset j of a mask row inside its group, -1 on real and padding rows.
        mask_group: (q,) index of a mask row's group, -1 on real and padding rows.
        target_row: (q,) real row each row is trained to predict (row+1 for real rows,
            e+j+1 for masks); may point past the block, callers turn that into IGNORE_INDEX.
        depth: (num_real,) depth of each real row in its tree (a chain: 0, 1, 2, ...).
        ancestors: (num_real, num_real) bool, ancestor-or-self of each real row.
    """

    cache_len: int
    num_real: int
    k: int
    group_ctx: torch.Tensor
    group_len: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    is_mask: torch.Tensor
    mask_offset: torch.Tensor
    mask_group: torch.Tensor
    target_row: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.position_ids.numel()

    def group_rows(self, group: int) -> torch.Tensor:
        """Row indices (group_len[group],) of mask group ``group`` (index into ``group_ctx``)."""
        start = self.num_real + int(self.group_len[:group].sum())
        return torch.arange(start, start + int(self.group_len[group]))

    def input_ids(self, real_ids: torch.Tensor, mask_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (q,) of the block (a layout without padding).

        Args:
            real_ids: (num_real,) ids of the real rows.
            mask_ids: (1,) a single mask id, or (k,) one id per offset (``mask_diff``).
        """
        if real_ids.numel() != self.num_real:
            raise ValueError(f"expected {self.num_real} real ids, got {real_ids.numel()}")
        masks = mask_ids.to(real_ids.device).expand(self.k) if mask_ids.numel() == 1 else mask_ids
        return torch.cat([real_ids, masks[self.mask_offset[self.num_real:].to(masks.device)]])


def build_layout(cache_len: int, num_real: int, group_ctx: list[int] | torch.Tensor, k: int | list[int],
                 parents: list[int] | torch.Tensor | None = None, pad_to: int | None = None,
                 device: torch.device | str | None = None) -> Layout:
    """Build the general layout (see the module docstring) with tensor ops only: no Python loop
    over rows, so thousands of training rows build fast. A decoder's small per-step block is
    built by :func:`host_block` instead, by the same rules (tested equal).

    Args:
        cache_len: tokens already in the cache (visible to every row), >= 0.
        num_real: real rows in the block, >= 1.
        group_ctx: context length e of each mask group, each in 1..num_real; the group is
            anchored at real row e - 1 and sees the path to it.
        k: masks per group, >= 1; or one length >= 1 per group (groups of different lengths,
            the dynamic tree's choice, issue 31).
        parents: (num_real,) parent row of each real row (-1 for row 0, else an earlier row): a
            token tree. None = a chain (``parents[r] = r - 1``), the training and chain-decode case.
            ``target_row`` is only meaningful for chains. A list is validated; a tensor is trusted.
        pad_to: total rows q; rows after the groups are padding that sees only itself (so its
            softmax stays finite) and that no row sees. None: no padding.
        device: where the tensors are built (default: the CPU, or a tensor ``parents``' device).

    Raises:
        ValueError: k < 1, num_real < 1, a group context outside 1..num_real, one length per
            group not given, ``pad_to`` below the rows, or list parents that are not a tree rooted
            at row 0 in topological order.
    """
    lens_given = not isinstance(k, int)
    if (lens_given and any(int(x) < 1 for x in k)) or (not lens_given and k < 1):
        raise ValueError(f"mask_num (k) must be >= 1, got {k}")
    if num_real < 1 or cache_len < 0:
        raise ValueError(f"need num_real >= 1 and cache_len >= 0, got {num_real}, {cache_len}")
    ctx = torch.as_tensor(group_ctx, dtype=torch.long).reshape(-1)
    if ctx.numel() and (int(ctx.min()) < 1 or int(ctx.max()) > num_real):
        raise ValueError(f"group context lengths must lie in 1..{num_real}, got {ctx.tolist()}")
    G = ctx.numel()
    if lens_given and len(k) != G:
        raise ValueError(f"one mask-group length per group: {G} groups, {len(k)} lengths")
    if isinstance(parents, (list, tuple)):
        check_parents(parents, num_real)
    if device is None:
        device = parents.device if isinstance(parents, torch.Tensor) else "cpu"
    lens = (torch.as_tensor(k, dtype=torch.long).reshape(-1) if lens_given
            else torch.full((G,), k, dtype=torch.long)).to(device)
    ctx = ctx.to(device)
    host_lens = [int(x) for x in k] if lens_given else [k] * G  # sizes from the host: no device sync
    M = sum(host_lens)  # mask rows
    used = num_real + M
    q = used if pad_to is None else pad_to
    if q < used:
        raise ValueError(f"pad_to = {pad_to} is below the layout's {used} rows")
    arange = torch.arange(q, device=device)
    real = arange[:num_real]
    grp = torch.repeat_interleave(torch.arange(G, device=device), lens, output_size=M)  # (M,) group index
    j = arange[:M] - (torch.cumsum(lens, 0) - lens)[grp]  # (M,) offset inside the group
    e = ctx[grp]  # (M,) context of each mask row
    pad = q - used
    if parents is None:
        depth, ancestors = real, real[None, :] <= real[:, None]
    else:
        depth, ancestors = tree_ancestors(torch.as_tensor(parents, dtype=torch.long, device=device))

    position_ids = torch.cat([cache_len + depth, cache_len + depth[e - 1] + 1 + j,
                              torch.full((pad,), cache_len, dtype=torch.long, device=device)])
    is_mask = (arange >= num_real) & (arange < used)
    minus = torch.full((num_real,), -1, dtype=torch.long, device=device)
    pad_minus = torch.full((pad,), -1, dtype=torch.long, device=device)
    mask_offset = torch.cat([minus, j, pad_minus])
    mask_group = torch.cat([minus, grp, pad_minus])
    target_row = torch.cat([real + 1, e + j + 1, torch.full((pad,), q, dtype=torch.long, device=device)])

    # Visibility inside the block, (q, q): every row sees the path to its anchor (a real row is
    # its own anchor; a chain's path is every earlier row); a mask row also sees the masks of its
    # own group up to itself; real rows see no mask; padding sees only itself.
    sees_real = torch.zeros(q, q, dtype=torch.bool, device=device)
    sees_real[:num_real, :num_real] = ancestors
    sees_real[num_real:used, :num_real] = ancestors[e - 1]
    same_group = (mask_group[:, None] == mask_group[None, :]) & is_mask[:, None] & is_mask[None, :]
    sees_mask = same_group & (mask_offset[None, :] <= mask_offset[:, None])
    block = sees_real | sees_mask
    block[used:, used:] |= torch.eye(pad, dtype=torch.bool, device=device)
    allowed = torch.cat([torch.ones(q, cache_len, dtype=torch.bool, device=device), block], dim=1)
    return Layout(cache_len, num_real, max(host_lens) if lens_given and G else (k if not lens_given else 1),
                  ctx, lens, position_ids, allowed, is_mask, mask_offset, mask_group, target_row, depth, ancestors)


def host_block(parents: list[int] | tuple[int, ...], group_ctx: list[int] | tuple[int, ...],
               group_len: list[int] | tuple[int, ...], pad_to: int) -> tuple[list[int], list[int], list[int]]:
    """A decode block's layout on the host (cache length 0), by :func:`build_layout`'s rules, in
    one pass over the rows with Python integers: a decoder that plans a new tree every step
    uploads it in one copy instead of launching the ~50 small tensor ops of the general builder
    (issue 43: 0.77 -> 0.15 ms a new block on this CPU, the layout's share of the upload and
    unpacking included; on a GPU no kernel launches). Trusted input: the decoder's own plan
    (parents before children, contexts in 1..len(parents), lengths >= 1).

    Args:
        parents: (num_real,) parent row of each real row (-1 for row 0).
        group_ctx: context length e of each mask group (anchored at real row e - 1).
        group_len: masks in each group.
        pad_to: total rows q (>= the used rows); the rest are padding rows that see only themselves.

    Returns:
        (position ids (q,) from 0, mask offsets (q,) with -1 off mask rows, and per row a bitmask
        of the block rows it may see: bit c of ``sees[r]`` is set when row r may attend to row c;
        :func:`pack_rows` / :func:`unpack_rows` take it to the device).
    """
    n1 = len(parents)
    depth, sees = [0] * n1, [0] * n1
    for r, p in enumerate(parents):  # parents come first: a row sees its parent's path and itself
        depth[r], sees[r] = (depth[p] + 1, sees[p] | 1 << r) if p >= 0 else (0, 1 << r)
    positions, offsets = list(depth), [-1] * n1
    for e, length in zip(group_ctx, group_len):  # mask j sees the path to its anchor and masks 0..j
        seen = sees[e - 1]
        for j in range(length):
            seen |= 1 << len(sees)
            sees.append(seen)
            positions.append(depth[e - 1] + 1 + j)
            offsets.append(j)
    pad = range(len(sees), pad_to)
    return positions + [0] * len(pad), offsets + [-1] * len(pad), sees + [1 << r for r in pad]


WORD = 32  # bits of a row's visibility per uploaded integer (below int64's sign bit)


def pack_rows(sees: list[int], q: int) -> list[int]:
    """Per-row bitmasks (:func:`host_block`) as ``q * ceil(q / 32)`` integers, row-major, lowest
    bits first: a list that goes up in one upload with the rest of a step's plan."""
    words, mask = -(-q // WORD), (1 << WORD) - 1
    return [(bits >> (WORD * w)) & mask for bits in sees for w in range(words)]


def unpack_rows(words: torch.Tensor, q: int) -> torch.Tensor:
    """:func:`pack_rows`'s integers (q * ceil(q / 32),) on any device -> (q, q) bool, True where
    row i may attend to row j (a layout's ``allowed`` without the cache)."""
    shifts = torch.arange(WORD, device=words.device)
    bits = (words.view(q, -1, 1) >> shifts) & 1
    return bits.view(q, -1)[:, :q].bool()


def check_parents(parents, num_real: int) -> None:
    """Raise ValueError unless ``parents`` (host list) is a tree of ``num_real`` rows rooted at row
    0 (-1) in which every other row's parent is an earlier row."""
    if len(parents) != num_real or parents[0] != -1 or any(not 0 <= p < r for r, p in enumerate(parents) if r):
        raise ValueError(f"parents must give row 0 as the root (-1) and an earlier row for every other row, "
                         f"got {list(parents)} for {num_real} rows")


def tree_ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth (n,) of each row of a tree and its ancestor-or-self matrix (n, n), by pointer doubling.

    Each round doubles how far up every row has looked (``jump`` is its 2^t-th ancestor, clamped
    at the root), so ceil(log2(n)) rounds of gathers cover any depth: no loop over rows.

    Args:
        parents: (n,) parent row of each row, -1 for row 0 (the root), on any device.
    """
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    jump = parents.clamp_min(0)  # the root is its own parent
    dist = (parents >= 0).long()  # distance from each row to ``jump``
    # self or parent; elementwise, since ancestors[rows, jump] = True would upload the True (a CUDA sync)
    ancestors = (rows[None, :] == rows[:, None]) | (rows[None, :] == jump[:, None])
    for _ in range(max(n - 1, 1).bit_length()):
        ancestors = ancestors | ancestors[jump]
        dist = dist + dist[jump]
        jump = jump[jump]
    return dist, ancestors


def tree_parents(paths) -> list[int]:
    """Parents of a decode block's real rows for a token tree given as breadth-first paths of ranks
    (``space.decoding.tree``): row 0 is x_{n-1} (-1), row i+1 is path i, whose parent row is its
    prefix's row (0 for depth-1 paths)."""
    row = {tuple(p): i + 1 for i, p in enumerate(paths)}
    return [-1] + [row.get(tuple(p[:-1]), 0) for p in paths]


def decode_layout(cache_len: int, num_candidates: int, num_groups: int, k: int) -> Layout:
    """Inference step of DESIGN §3.3: ``[x_{n-1}] [c_1..c_m] [G_0..G_{num_groups-1}]``.

    Args:
        cache_len: n - 1, the tokens in the KV cache.
        num_candidates: m, candidates in this step (0 on the first step).
        num_groups: groups attached to ``x_{n-1}`` and the first candidates (1..m+1).
        k: masks per group (mask_num).

    Raises:
        ValueError: num_groups outside 1..num_candidates+1, or k < 1.
    """
    if not 1 <= num_groups <= num_candidates + 1:
        raise ValueError(f"num_groups must lie in 1..{num_candidates + 1}, got {num_groups}")
    return build_layout(cache_len, 1 + num_candidates, list(range(1, num_groups + 1)), k)


def train_layout(seq_len: int, span_starts: list[int] | torch.Tensor, k: int) -> Layout:
    """Efficient SAR-SFT layout of DESIGN §3.2: the whole sample, then one group per span start.

    A span start s (1 <= s <= seq_len) anchors a group whose mask j sits at position s+j and
    predicts token s+j+1. The paper's truncate layout is ``train_layout(s, [s], k + 1)`` on the
    sample cut at s, with the last (dummy) mask's target ignored: see :func:`truncate_layout`.

    The result is exactly ``build_layout(0, seq_len, span_starts, k)``, built on the CPU for the
    chain without a tree: the (q, q) mask is an in-place ``tril_`` (real rows) with the mask rows
    (real rows 0..s-1 and their group's triangle) written over it, instead of the general
    builder's several (q, q) passes; the collator calls it per sample at q ~ 2,000.

    Raises:
        ValueError: as :func:`build_layout` (k < 1, seq_len < 1, a span start outside 1..seq_len).
    """
    ctx = torch.as_tensor(span_starts, dtype=torch.long).reshape(-1).cpu()
    if (not isinstance(k, int) or k < 1 or seq_len < 1
            or (ctx.numel() and (int(ctx.min()) < 1 or int(ctx.max()) > seq_len))):
        return build_layout(0, seq_len, span_starts, k)  # per-group lengths, or its ValueError
    n, G = seq_len, ctx.numel()
    M = G * k
    q = n + M
    rows = torch.arange(q)
    real = rows[:n]
    grp = rows[:M] // k  # (M,) group of each mask row
    j = rows[:M] % k  # (M,) offset inside the group
    e = ctx[grp]  # (M,) context of each mask row
    allowed = torch.ones(q, q, dtype=torch.bool).tril_()  # real rows: causal, so no mask is seen
    allowed[n:] = rows[None, :] < e[:, None]  # mask rows: real rows 0..e-1
    tri = torch.tril_indices(k, k)  # and masks 0..j of its own group
    first = n + torch.arange(G)[:, None] * k
    allowed[(first + tri[0]).flatten(), (first + tri[1]).flatten()] = True
    minus = torch.full((n,), -1, dtype=torch.long)
    return Layout(0, n, k, ctx, torch.full((G,), k, dtype=torch.long), torch.cat([real, e + j]), allowed,
                  rows >= n, torch.cat([minus, j]), torch.cat([minus, grp]), torch.cat([real + 1, e + j + 1]),
                  real, allowed[:n, :n].clone())


def truncate_layout(span_start: int, k: int) -> Layout:
    """The paper's truncate layout: ``x_0..x_{s-1}`` followed by k+1 masks in one group.

    The (k+1)-th mask is the dummy the official code needs for the HF label shift; its target
    (row s+k+1) is dropped by :func:`targets` like any target past the kept tokens.
    """
    return train_layout(span_start, [span_start], k + 1)


def targets(layout: Layout, real_ids: torch.Tensor, target_len: int | None = None,
            first_target: int = 0, drop_offset: int | None = None) -> torch.Tensor:
    """Training target of every row (q,), IGNORE_INDEX where there is none.

    Args:
        layout: a training layout (cache_len 0).
        real_ids: (T,) the full sample; T may exceed ``layout.num_real`` (truncate layout).
        target_len: predict only rows < target_len (default T).
        first_target: rows whose target index is < first_target are ignored (prompt tokens).
        drop_offset: mask offset whose target is always ignored (the truncate layout's dummy).
    """
    T = real_ids.numel() if target_len is None else target_len
    tgt = layout.target_row
    keep = (tgt < T) & (tgt >= first_target)
    if drop_offset is not None:
        keep &= layout.mask_offset != drop_offset
    out = torch.full_like(tgt, IGNORE_INDEX)
    out[keep] = real_ids[tgt[keep]]
    return out


def previous_ids(real_ids: torch.Tensor, position_ids: torch.Tensor, cache_len: int = 0) -> torch.Tensor:
    """The token before each mask row's target, the sampler head's second input (issue 34).

    Mask j anchored at e sits at position ``cache_len + e + j`` and predicts real row e+j+1, so the
    token before its target is real row e+j: with true tokens (training, the probe) that row is
    the position minus ``cache_len``. Rows without a target are clamped to the last real row.

    Args:
        real_ids: (..., T) real tokens; position_ids: (..., rows) positions of the mask rows.

    Returns:
        (..., rows) token ids.
    """
    rows = (position_ids - cache_len).clamp(0, real_ids.shape[-1] - 1)
    return real_ids.gather(-1, rows)


def to_additive_4d(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool mask -> (batch, 1, q, kv) additive mask in ``dtype``: 0 allowed, dtype's min elsewhere.

    Args:
        allowed: (q, kv), (batch, q, kv) or (batch, 1, q, kv) bool, True where a row may attend
            (a layout's ``allowed``, or the SAR-SFT collator's ``attention_mask``).

    Raises:
        ValueError: a 4-D mask with more than one head.
    """
    if allowed.dim() == 2:
        allowed = allowed[None]
    if allowed.dim() == 4:
        if allowed.shape[1] != 1:
            raise ValueError(f"expected a (batch, 1, q, kv) mask, got shape {tuple(allowed.shape)}")
        allowed = allowed[:, 0]
    # one pass, in ``dtype`` (a 0-d tensor sets it; the scalar fill is no upload)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), torch.finfo(dtype).min)[:, None]


def in_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(..., q, kv) bool, True where a key lies less than ``window`` positions behind its query.

    This is a sliding-window layer's rule (transformers' ``sliding_window_overlay``: key > query -
    window), applied by position ids, so it holds for a layout's rows in any order. Combine it
    with a layout's ``allowed`` (which rows may see which) for a sliding-window model.

    Args:
        query_pos: (..., q) position id of each query row (a batch: (batch, q)).
        key_pos: (..., kv) position id of each key.
        window: the model's ``sliding_window`` in tokens.
    """
    return query_pos[..., :, None] - key_pos[..., None, :] < window


def windowed(allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
             windows: dict[str, int | None]) -> torch.Tensor | dict[str, torch.Tensor]:
    """A layout's mask for each kind of attention layer of a model: on a sliding layer a row also
    sees only the keys less than the window behind its position (:func:`in_window`), as the
    decoder's steps do (``space.decoding.decoder.with_cache``), so SAR-SFT trains the mask rows on
    what decoding shows them.

    Args:
        allowed: (batch, 1, q, kv) mask, boolean (True: may attend) or additive.
        query_pos: (batch, q) position ids of the rows; key_pos: (batch, kv) of the keys.
        windows: ``{layer type: window in tokens, or None}`` (``space.decoding.cache.attention_windows``).

    Returns:
        ``allowed`` itself when no layer slides; one mask when every layer slides alike (Mistral,
        Phi-3, StarCoder2, which take a 4-D mask as it is); else ``{layer type: mask}``, the form
        transformers' hybrid models (Gemma 2 and 3, Qwen2 with ``use_sliding_window``) take.
    """
    if all(w is None for w in windows.values()):
        return allowed

    def slide(w: int) -> torch.Tensor:
        seen = in_window(query_pos, key_pos, w)[:, None]
        if allowed.dtype == torch.bool:
            return allowed & seen
        return allowed.masked_fill(~seen, torch.finfo(allowed.dtype).min)

    masks = {kind: allowed if w is None else slide(w) for kind, w in windows.items()}
    return masks if len(masks) > 1 else next(iter(masks.values()))


_ROWS = threading.local()  # per thread: a plain attribute read, which torch.compile can trace


@contextmanager
def mask_rows(start: int | torch.Tensor | None) -> Iterator[None]:
    """Declare that the model calls inside this block feed mask rows from row ``start`` on
    (None: no mask row, a plain forward, as outside any block).

    Every layout here puts the mask groups after the real rows, so one integer says which rows
    are masks: rows ``start:`` of the block (``start = layout.num_real`` in a decode step, 0 for
    the frozen-base trainer's mask-only pass). The frozen-base LoRA (DESIGN §3.6) reads it through
    :func:`mask_rows_start` and updates only those rows; outside any such block it updates no
    row, so a plain forward (AR, HF ``generate``) is exactly the base model.

    The value is scoped to the calling thread and restored on exit (blocks may nest). Modules
    read it, never write it: no module keeps per-call state (STYLE.md item 13). A compiled trunk
    (``space.decoding.compiled``) takes it as an argument and re-enters the block inside its graph.

    A captured step (``space.decoding.graphs``) passes a gate instead: a (rows, 1) tensor on the
    device, in the activations' dtype, 1 on mask rows and 0 elsewhere, so that one CUDA graph
    serves every first mask row (an integer would be frozen into it). The LoRA then runs on every
    row and is multiplied by the gate: a real row gets an exact ``+ 0``.

    Raises:
        ValueError: an integer start < 0; a gate that is not (rows, 1).
    """
    if isinstance(start, torch.Tensor):
        if start.dim() != 2 or start.shape[1] != 1:
            raise ValueError(f"a mask-row gate is a (rows, 1) tensor, got shape {tuple(start.shape)}")
    elif start is not None and start < 0:
        raise ValueError(f"mask rows start at a row >= 0, got {start}")
    previous = getattr(_ROWS, "start", None)
    _ROWS.start = start
    try:
        yield
    finally:
        _ROWS.start = previous


def mask_rows_start() -> int | torch.Tensor | None:
    """The first mask row of the current :func:`mask_rows` block (or its gate tensor), None
    outside one."""
    return getattr(_ROWS, "start", None)


def render(layout: Layout) -> str:
    """ASCII drawing of a layout: one line per row (``o`` = may attend), with its position id.
    Rows are named ``x``, ``c1``.. (real), ``G{g}m{j}`` (mask j of group g, groups of any lengths)
    and ``pad`` (padding)."""
    names = ["x"] + [f"c{i}" for i in range(1, layout.num_real)]
    if layout.cache_len == 0:
        names = [f"x{i}" for i in range(layout.num_real)]
    for g, j in zip(layout.mask_group[layout.num_real:].tolist(), layout.mask_offset[layout.num_real:].tolist()):
        names.append(f"G{g}m{j}" if g >= 0 else "pad")  # padding rows have group and offset -1
    width = max(len(n) for n in names)
    c = layout.cache_len
    lines = ["cache | block" if c else "block"]
    for i, name in enumerate(names):
        row = "".join("o" if v else "." for v in layout.allowed[i].tolist())
        head = f"{row[:c]:<5} | " if c else ""
        lines.append(f"{head}{row[c:]}   {name:<{width}}  pos {int(layout.position_ids[i])}")
    return "\n".join(lines)
