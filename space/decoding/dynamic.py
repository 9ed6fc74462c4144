"""Per-step dynamic token trees: spend a step's rows where they are expected to pay (issue 31).

EAGLE-2 (Li et al. 2024, arXiv 2406.16858) grows each step's draft tree from the drafter's own
confidence. A SPACE step feeds three kinds of rows after x_{n-1}: candidate nodes (mask drafts and
prompt-lookup tokens), verified in this step, and mask rows, whose drafts are verified in the next
one. This module prices every row in tokens and keeps it while its expected gain exceeds its cost
on this machine:

* **Cost.** c(q), the time of a q-row step over a 1-row step (:class:`StepCost`, the step-cost
  curve that ``space-tree`` measures and stores with the layout). Tokens per second is a ratio,
  so by Dinkelbach's rule a step maximizes E[tokens] - λ·c(q), with λ the tokens per unit of cost
  achieved so far in this sequence (:class:`AcceptanceStats`). A node is kept while its value is at
  least λ times the marginal cost of a row; the block pays the curve's 1 -> 2-row jump once
  (:meth:`StepCost.multi_row`), and any group the adapter's fixed cost (issue 44).
* **A node's value** is P(its path is right):
  * for mask drafts, the product of the draft probabilities along the path (the probabilities of
    each mask's top-R tokens under its full softmax, EAGLE-2's path value); a top draft's is
    scaled by how much more often that offset's top draft was right than it said
    (:meth:`AcceptanceStats.calibration`), the others shrink so that a mask's row sums to at most 1
    (:func:`calibrated`);
  * for a lookup token at depth d, the running rate at which this sequence's lookup tokens were
    right at depths 1..d (a datastore's continuation in the first place, where the text has none
    of its own: the datastore's rates, :meth:`AcceptanceStats.store_rates`);
  * for a token of another lookup continuation (``DecodeConfig.lookup_branches``: what followed
    the n-gram's other occurrences, the most recent first; then a datastore's), its parent's value
    times the running rate of such tokens at its distance past where the continuation leaves those
    before it (the first token's rate is the continuation's rank's own; a datastore's tokens keep
    rates of their own), the parent's value being the larger one
    where a mask draft made the same path. These are not netted against the node's other children,
    which can then sum above it (netting them cost about 1 % of tokens per step,
    results/lookup_branches).
  A lookup token equal to a mask draft at the same place is one node whose own probability is
  the larger of the two; its mask and lookup children are priced from that merged value.
* **Mask groups.** Groups anchor on x_{n-1} and on the spine, the chain of most likely nodes. After
  the step accepts node u, the next drafts come from u's deepest anchored group G_g, from mask
  offset s = depth(u) - g on (DESIGN §3.5). So mask j of G_g is worth the probability that u ends
  the accepted path with s <= j, times the chance that the next step's draft tree from offset s
  reaches j (running per-offset rates at which the true token is among the top-R drafts; the
  top-1 rate with a sampler head, whose deeper drafts follow the top-1 path), net of the row it
  will need then. Each group takes the length k' <= k that maximizes its net value; the number of
  groups maximizes the total. No group at all (the next step drafts by lookup alone), no mask
  node (only lookup, PLD's step) and a one-row AR step (when the best block does not pay the
  multi-row jump and lookup found nothing in the text itself) are allowed outcomes.
* **Prompt lookup is contained.** Every token of the first lookup continuation (prompt lookup
  decoding's) is a node, as deep as the budget allows, whatever its rate: the step verifies at
  least what prompt lookup decoding would. The other continuations are priced like any node, and
  a datastore's (``space.decoding.datastore``) by its own running rates, the first one too where
  the text has no continuation of its own.
* **Shapes.** Rows are rounded up to a bucket size (:data:`BUCKETS`, capped by the row budget). The
  bucket's free rows take the next-best nodes; only the rest is padding.

Candidates are a deterministic function of the drafts, the lookup tokens and the statistics of
earlier steps, never of this step's verification, so greedy verification and exact multi-candidate
sampling stay exact (``space.decoding.verify``).
"""
from __future__ import annotations

import heapq
import math
import numbers
import operator
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from .tree import anchored_group

# Block sizes a step is rounded up to (then to the row budget): few shapes for caches and graphs,
# fine enough at the small end that a CPU does not pay for many padding rows.
BUCKETS = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)

# c(q) when no curve was measured: one CPU thread with SmolLM2-135M (issue 31's figures: 8 rows
# cost 1.35x one row, 24 rows 1.75x), steeper past that. `space-tree` measures the real curve.
DEFAULT_STEP_COST = ((1, 1.0), (8, 1.35), (24, 1.75), (64, 3.2))

PRIOR_WEIGHT = 2.0  # pseudo-observations behind each running rate's prior
# per step without mask drafts, what the mask rates keep of their evidence (the rest returns to the
# prior): a sequence that dropped its groups tries them again later instead of staying PLD for good
FORGET = 0.9
MASK_PRIOR = 0.5  # prior P(mask offset j's top draft is right | the drafts before it were)
# prior P(a lookup token at depth d is right | the lookup tokens before it were): the first token of
# a recurring n-gram's continuation is a guess, but once it matched, the copied span tends to go on
LOOKUP_PRIOR = (0.3, 0.6)
# the same for another occurrence's continuation, from where it leaves the paths before it: there
# the first occurrence's next token is the likelier one, so it starts from a lower guess
OTHER_PRIOR = (0.2, 0.6)
RATE_PRIOR = (2.0, 8)  # prior λ: 2 tokens per step of 8 rows
# a node's sources (bits): a mask draft, a prompt-lookup token (the text's own), a datastore's token
MASK, LOOKUP, STORE = 1, 2, 4


@dataclass(frozen=True)
class StepCost:
    """The cost of a decode step by its rows, relative to a one-row (AR) step.

    Attributes:
        points: ((rows, cost), ...) measured points, rows ascending from 1, cost in any unit
            (``space-tree`` stores ms); linear between points and past the last.
        adapter: what a step pays once for having any mask row, in the points' unit: the
            frozen-base adapter's fixed cost, which ``space-tree`` measures as 2 rows with and
            without mask rows. 0 when not measured: the 1 -> 2-row jump is then all the multi-row
            path's (a 4-D mask, a many-row kernel), which every block of more than one row pays.

    Raises:
        ValueError: no points, rows not ascending integers from 1, or a cost that is not a finite
            number > 0, or an adapter cost that is not a finite number >= 0.
    """

    points: tuple[tuple[int, float], ...] = DEFAULT_STEP_COST
    adapter: float = 0.0

    def __post_init__(self):
        try:
            pts = tuple((int(q), float(c)) for q, c in self.points)
            ok = all(q == q0 and q >= 1 for (q, _), (q0, _) in zip(pts, self.points))
        except (TypeError, ValueError):
            ok = False
        if not ok or not pts or pts[0][0] != 1 or any(b[0] <= a[0] for a, b in zip(pts, pts[1:])) \
                or not all(math.isfinite(c) and c > 0 for _, c in pts):
            raise ValueError(f"step_cost must be [[rows, cost], ...] with rows ascending from 1 and costs > 0, "
                             f"got {self.points!r}")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_rows", [q for q, _ in pts])
        object.__setattr__(self, "_memo", {})  # c(q) by q: a planner prices the same few row counts all step
        object.__setattr__(self, "_marginal", {})  # c(q + 1) - c(q) by q, likewise
        if isinstance(self.adapter, bool) or not isinstance(self.adapter, numbers.Real) \
                or not math.isfinite(self.adapter) or self.adapter < 0:
            raise ValueError(f"the adapter's step cost must be a finite number >= 0, got {self.adapter!r}")

    def __call__(self, q: int) -> float:
        """c(q) / c(1)."""
        cost = self._memo.get(q)
        if cost is None:
            pts = self.points
            if len(pts) == 1:
                cost = 1.0
            else:
                i = min(max(bisect_left(self._rows, q), 1), len(pts) - 1)
                (q0, c0), (q1, c1) = pts[i - 1], pts[i]
                cost = max(c0 + (c1 - c0) * (q - q0) / (q1 - q0), 1e-9) / pts[0][1]
            self._memo[q] = cost
        return cost

    def marginal(self, q: int) -> float:
        """c(q + 1) - c(q) at q >= 2 rows: what one more row costs (never below 0). The step from 1
        to 2 rows also holds a fixed cost, which :meth:`multi_row` and :meth:`adapter_overhead`
        split."""
        q = max(q, 2)
        step = self._marginal.get(q)
        if step is None:
            step = self._marginal[q] = max(self(q + 1) - self(q), 0.0)
        return step

    def adapter_overhead(self) -> float:
        """What a step pays once for having any mask row (the adapter's fixed cost, :attr:`adapter`,
        relative to one row), at most the 1 -> 2-row jump beyond an ordinary row."""
        return min(self.adapter / self.points[0][1], self._jump())

    def multi_row(self) -> float:
        """What any block of more than one row pays once, mask rows or not (issue 44): the 1 -> 2-row
        jump beyond an ordinary row, less the adapter's part."""
        return self._jump() - self.adapter_overhead()

    def _jump(self) -> float:
        return max(self(2) - self(1) - self.marginal(2), 0.0)


def monotone(cells: list[list[float]], increasing: bool) -> list[float]:
    """Rates hits / trials of ``cells`` ([hits, trials] each), fitted to be monotone in their order
    by pool-adjacent-violators (weighted by trials): neighbours that break the order share one rate."""
    blocks: list[list[float]] = []  # [hits, trials, cells pooled]
    for hits, trials in cells:
        blocks.append([hits, trials, 1])
        while len(blocks) > 1 and ((blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]) if increasing
                                   else (blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1])):
            h, t, n = blocks.pop()
            blocks[-1][0] += h
            blocks[-1][1] += t
            blocks[-1][2] += n
    return [h / t for h, t, n in blocks for _ in range(int(n))]


def bucket(rows: int, budget: int) -> int:
    """The block size a step of ``rows`` rows is padded to: the next bucket, at most ``budget``."""
    i = bisect_left(BUCKETS, rows)
    return min(BUCKETS[i] if i < len(BUCKETS) else rows, max(budget, rows))


class AcceptanceStats:
    """One sequence's running rates that the planner prices rows with (Beta-style priors).

    Args:
        mask_num: k, the mask offsets tracked.
        lookup_tokens: lookup depths tracked.
        cost: the step-cost curve (for λ).
    """

    def __init__(self, mask_num: int, lookup_tokens: int, cost: StepCost):
        self.cost = cost
        self.mask = [[PRIOR_WEIGHT * MASK_PRIOR, PRIOR_WEIGHT] for _ in range(mask_num)]  # [hits, trials], top-1
        self.ranked = [[PRIOR_WEIGHT * MASK_PRIOR, PRIOR_WEIGHT] for _ in range(mask_num)]  # [hits, trials], top-R
        self.said = [[PRIOR_WEIGHT, PRIOR_WEIGHT] for _ in range(mask_num)]  # [hits, sum of top-1 probabilities]
        self.lookup = [[PRIOR_WEIGHT * LOOKUP_PRIOR[min(d, 1)], PRIOR_WEIGHT] for d in range(lookup_tokens)]
        self.other = [[PRIOR_WEIGHT * OTHER_PRIOR[min(d, 1)], PRIOR_WEIGHT] for d in range(lookup_tokens)]
        self.other_first: list[list[float]] = []  # [hits, trials] of each continuation's first token, by rank
        # the same for the datastore's continuations (first tokens by place among all continuations):
        # copied from other texts, they go wrong sooner than the text's own (results/datastore)
        self.store = [[PRIOR_WEIGHT * OTHER_PRIOR[min(d, 1)], PRIOR_WEIGHT] for d in range(lookup_tokens)]
        self.store_first: list[list[float]] = []
        self.tokens, self.spent = PRIOR_WEIGHT * RATE_PRIOR[0], PRIOR_WEIGHT * cost(RATE_PRIOR[1])

    def alphas(self) -> list[float]:
        """P(mask offset j's top draft is right | the draft chain before it was right), j = 0..k-1,
        made non-increasing in j (:func:`monotone`).

        A group drafting after an accepted path starts at offset s = a - g, so offsets below s go
        unobserved while deep accepts last; a later offset is never easier to draft than an
        earlier one, so an earlier offset is credited with at least the later ones' rate rather
        than left at its prior.
        """
        return monotone(self.mask, increasing=False)

    def ranked_alphas(self) -> list[float]:
        """P(the true token at mask offset j is among its top-R drafts | it was at every offset
        before), non-increasing like :meth:`alphas`: how far the next step's draft tree, which
        verifies top-R drafts rather than the top-1 chain, is expected to reach (issue 44)."""
        return monotone(self.ranked, increasing=False)

    def lookup_rates(self) -> list[float]:
        """P(the lookup token at depth d + 1 is right | the ones before it were right), made
        non-decreasing in d (:func:`monotone`): deep depths are seen only after long accepts, and a
        copied span that matched so far is at least as likely to go on."""
        return monotone(self.lookup, increasing=True)

    def other_rates(self, rank: int | None = None) -> list[float]:
        """P(another occurrence's continuation is right at d + 1 tokens past where it leaves the
        branches before it | right so far), non-decreasing in d like :meth:`lookup_rates`; with
        ``rank`` (its place among the other continuations, the most recent first), its first token's
        rate is that rank's own."""
        rates = monotone(self.other, increasing=True)
        if rank is not None and rank < len(self.other_first) and rates:
            hits, trials = self.other_first[rank]
            rates[0] = min(hits / trials, rates[1]) if len(rates) > 1 else hits / trials
        return rates

    def store_rates(self, place: int) -> list[float]:
        """:meth:`other_rates` for a datastore continuation at ``place`` among all the step's
        continuations (0: the text has none of its own), from the datastore's own record: at d + 1
        tokens past where it leaves the continuations before it (from its start at place 0)."""
        rates = monotone(self.store, increasing=True)
        if place < len(self.store_first) and rates:
            hits, trials = self.store_first[place]
            rates[0] = min(hits / trials, rates[1]) if len(rates) > 1 else hits / trials
        return rates

    def calibration(self, j: int) -> float:
        """How much more often mask offset j's top draft was right than its probability said
        (observed hits over the sum of top-1 probabilities; 1 = calibrated). A drafter trained on
        a teacher's top-k is often under-confident; node values are scaled by this."""
        hits, said = self.said[min(j, len(self.said) - 1)]
        return hits / said

    @property
    def rate(self) -> float:
        """λ: tokens emitted per unit of step cost so far (with the prior)."""
        return self.tokens / self.spent

    def observe(self, emitted: list[int], drafts: list[list[int]], top_probs: list[float], draft_offset: int,
                found: list[int], rows: int, others: list[list[int]] = (), stored: int = 0) -> None:
        """Learn from one step.

        Args:
            emitted: the step's tokens, the accepted path then the bonus: the true tokens at
                depths 1..a+1, whether or not their node was in the tree.
            drafts: (r, R) the top-R drafts of each mask the step drafted from, from mask offset
                ``draft_offset`` on, the top-1 first; ``top_probs``: the top-1 drafts' probabilities.
            found: the step's prompt-lookup tokens.
            rows: the block's rows, padding included.
            others: the step's other lookup continuations, as the planner got them (their branch
                points into ``found`` are found here, :func:`_branch_points`).
            stored: how many of ``found`` and ``others`` together, at the end, are the datastore's.
        """
        if not drafts:  # no mask drafted this step: forget a little, towards the prior
            for cells, prior in ((self.mask, MASK_PRIOR), (self.ranked, MASK_PRIOR), (self.said, 1.0)):
                for cell in cells:
                    cell[0] = PRIOR_WEIGHT * prior + FORGET * (cell[0] - PRIOR_WEIGHT * prior)
                    cell[1] = PRIOR_WEIGHT + FORGET * (cell[1] - PRIOR_WEIGHT)
        for i, row in enumerate(drafts[: len(emitted)]):
            j = min(draft_offset + i, len(self.mask) - 1)
            cell, said = self.mask[j], self.said[j]
            cell[1] += 1
            said[1] += top_probs[i]
            if row[0] != emitted[i]:
                break
            cell[0] += 1
            said[0] += 1
        for i, row in enumerate(drafts[: len(emitted)]):
            cell = self.ranked[min(draft_offset + i, len(self.ranked) - 1)]
            cell[1] += 1
            if emitted[i] not in row:
                break
            cell[0] += 1
        first_stored = bool(found) and stored > len(others)  # the text had none of its own
        tried = [(found, 0, 0)] if first_stored else []
        if not first_stored:
            for d, t in enumerate(found[: min(len(emitted), len(self.lookup))]):
                self.lookup[d][1] += 1
                if t != emitted[d]:
                    break
                self.lookup[d][0] += 1
        tried += [(branch, start, rank + 1) for branch, start, rank in _branch_points(found, others)]
        for branch, start, place in tried:
            if branch[:start] != emitted[:start]:  # its shared part was wrong: never tried past it
                continue
            if place > len(others) - stored:
                deep, firsts, at = self.store, self.store_first, place
            else:
                deep, firsts, at = self.other, self.other_first, place - 1  # by rank among the others
            if start < len(emitted) and deep:
                while len(firsts) <= at:
                    firsts.append([PRIOR_WEIGHT * OTHER_PRIOR[0], PRIOR_WEIGHT])
                firsts[at][1] += 1
                firsts[at][0] += branch[start] == emitted[start]
            for d, t in enumerate(branch[start: min(len(emitted), start + len(deep))]):
                deep[d][1] += 1
                if t != emitted[start + d]:
                    break
                deep[d][0] += 1
        self.tokens += len(emitted)
        self.spent += self.cost(rows)


@dataclass(frozen=True)
class StepPlan:
    """One step's block chosen by :func:`plan_step`: ``[x_{n-1}] [nodes] [groups] [padding]``.

    Attributes:
        tokens: (N,) node tokens; nodes come in decreasing value, parents before children.
        parents: (1+N,) parent row of each row (-1 for x_{n-1}).
        group_rows: anchor row of each mask group (row 0 first, then down the spine).
        group_len: masks in each group (1..k).
        rows: the block's rows, padding included (a bucket size).
        values: (N,) each node's value, P(its path is right) as priced.
        sources: (N,) each node's sources: ``MASK`` (a mask draft), ``LOOKUP`` (a prompt-lookup
            token of the text's own), ``STORE`` (a datastore's), or several (the same token at the
            same place), for the provenance records.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    group_rows: tuple[int, ...]
    group_len: tuple[int, ...]
    rows: int
    values: tuple[float, ...]
    sources: tuple[int, ...] = ()

    @property
    def used_rows(self) -> int:
        return len(self.parents) + sum(self.group_len)


def calibrated(probs: list[float], c: float) -> list[float]:
    """One mask's top-R draft probabilities, calibrated: the top draft's scaled by ``c``
    (:meth:`AcceptanceStats.calibration`, counted on top drafts only) and capped at 1, the others
    shrunk in proportion only as far as the row must to sum to at most 1 (never raised)."""
    if not probs:
        return []
    top, rest = min(probs[0] * c, 1.0), sum(probs[1:])
    shrink = min(1.0, (1.0 - top) / rest) if rest > 0 else 1.0
    return [top] + [p * shrink for p in probs[1:]]


def _branch_points(found: list[int], others) -> list[tuple[list[int], int, int]]:
    """(continuation, start, rank) for each of ``others``, the lookup's other continuations: ``start``
    is where it leaves ``found`` and the ones before it (their longest common prefix), so its tokens
    from ``start`` on are nodes of their own; ``rank``, its place in ``others``; one that leaves none
    of them is dropped."""
    out, before = [], [found]
    for rank, branch in enumerate(others):
        start = max(next((i for i, (a, b) in enumerate(zip(branch, p)) if a != b), min(len(branch), len(p)))
                    for p in before)
        if start < len(branch):
            out.append((branch, start, rank))
        before.append(branch)
    return out


def _candidates(draft_ids: list[list[int]], draft_probs: list[list[float]], found: list[int],
                rates: list[float], limit: int, room: int, top1: list[int] | None, match: list[int],
                others: list[tuple[list[int], int, list[float], int]] = (), first_source: int = LOOKUP
                ) -> Iterator[tuple[tuple[int, ...], float, int]]:
    """Up to ``limit`` distinct token paths (path, value, sources) in non-increasing value, each
    after its prefix; generated as they are asked for (a step keeps only its first few).

    A node's value is its parent's times its own conditional probability: a mask draft's, a lookup
    token's running rate ``rates[d]`` at its depth, or the larger of the two for a lookup token
    that is also the mask draft at its place (one node, so its children are priced from that merged
    value). The lookup child comes first: its mask siblings share what it leaves, ``v·(1-r)·p``
    (for a merged child, the other drafts share ``1 - max(p, r)`` in proportion). ``draft_probs``
    rows come sorted in decreasing order. ``top1``: with a sampler head, the rank of each mask's
    top-1 draft in its row; the head drafted offset d+1 given the top-1 draft at d, so only the
    top-1 path has mask children (None: every path does, the drafts of plain masks do not depend on
    each other). ``match``: where the lookup tokens are mask drafts (:func:`_merged_ranks`).

    ``others``: the lookup's other continuations, (tokens, start, rates, source) each
    (:func:`_branch_points`, :meth:`AcceptanceStats.other_rates` of its rank, or a datastore's
    :meth:`AcceptanceStats.store_rates` of its place; ``LOOKUP``, or ``STORE`` for a datastore's).
    Each enters where it leaves the paths before
    it, at ``start``, and goes on token by token, each worth ``rates[d]`` of its parent at d tokens
    past that point; their nodes get no mask children of their own (the masks
    draft after the first continuation and the drafts' own paths), but a path that is both a mask
    draft and another continuation is one node with both kinds of children, priced from its larger
    value. Beside the first continuation and the mask drafts, the other continuations' tokens can
    make siblings sum above their parent (module docstring). ``first_source``: the first
    continuation's source (``STORE`` where the text has none of its own).

    Best-first: a node's children are pushed when its first, most valuable copy pops (a path made
    by two sources is pushed twice), and a popped mask draft pushes its next sibling, so every
    push is worth at most what popped it.
    """
    depth_cap = min(room, len(draft_ids))
    lookup_depth = min(len(found), room, len(rates))
    # the other continuations' nodes: parent path -> [(token, conditional), ...], and their paths
    branch_kids: dict[tuple[int, ...], list[tuple[int, float]]] = {}
    branch_paths: dict[tuple[int, ...], int] = {}  # -> the sources of the continuations through it
    for tokens, start, other_rates, bit in others:
        path = tuple(tokens[:start])
        for d in range(start, min(len(tokens), room, start + len(other_rates))):
            branch_kids.setdefault(path, []).append((tokens[d], other_rates[d - start]))
            path += (tokens[d],)
            branch_paths[path] = branch_paths.get(path, 0) | bit
    heap: list = []
    tick = 0

    def push(value: float, path: tuple[int, ...], ranks: tuple[int, ...] | None, source: int, sibling=None) -> None:
        # ranks: the mask ranks of the path, None off the mask tree; with source 0 (another
        # continuation's copy) its parent's, its own looked up only if it pops first; sibling: for a
        # mask draft, (the value its siblings share, the merged rank the sibling chain skips)
        nonlocal tick
        if value > 0:
            heapq.heappush(heap, (-value, tick, path, ranks, source, sibling))
            tick += 1

    def mask_ranks(path: tuple[int, ...], up: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The mask ranks of ``path`` (``up``: its parent's) if it is a node of the mask tree, else None."""
        d = len(path) - 1
        if up is None or d >= depth_cap or (top1 is not None and up != tuple(top1[:d])) \
                or path[-1] not in draft_ids[d]:
            return None
        return up + (draft_ids[d].index(path[-1]),)

    def next_rank(d: int, r: int, skip: int) -> int | None:
        r += 1 + (r + 1 == skip)
        return r if r < len(draft_ids[d]) else None

    def push_mask_child(shared: float, path, ranks, d: int, r: int | None, skip: int) -> None:
        if r is not None:
            push(shared * draft_probs[d][r], path + (draft_ids[d][r],), ranks + (r,), MASK, (shared, skip))

    def open_node(value: float, path: tuple[int, ...], ranks: tuple[int, ...] | None, on_first: bool) -> None:
        """Push the children of the node at ``path`` (``ranks``: its mask ranks; ``on_first``: on the
        first continuation), worth ``value``."""
        d = len(path)
        lead, skip, share = 0.0, -1, 1.0  # the first continuation's child; the masks' part of the rest
        if on_first and d < lookup_depth:
            if ranks is not None and d < len(match):  # the lookup child is a mask draft too
                skip, p = match[d], draft_probs[d][match[d]]
                lead = max(p, rates[d])
                push(value * lead, path + (found[d],), ranks + (skip,), MASK | first_source)
                share = (1 - lead) / (1 - p) if p < 1 else 0.0
            else:
                lead = rates[d]
                push(value * lead, path + (found[d],), None, first_source)
                share = 1 - lead
        has_masks = ranks is not None and d < depth_cap and (top1 is None or ranks == tuple(top1[:d]))
        for t, c in branch_kids.get(path, ()):
            push(value * c, path + (t,), ranks, 0)
        if has_masks:
            push_mask_child(value * share, path, ranks, d, next_rank(d, -1, skip), skip)

    open_node(1.0, (), (), True)
    seen: set[tuple[int, ...]] = set()  # a row may repeat a token (a test hook's drafts)
    while heap and len(seen) < limit:
        neg, _, path, ranks, source, sibling = heapq.heappop(heap)
        if sibling is not None:
            d = len(path) - 1
            push_mask_child(sibling[0], path[:-1], ranks[:-1], d, next_rank(d, ranks[-1], sibling[1]), sibling[1])
        if path in seen:
            continue
        seen.add(path)
        on_first = bool(source & first_source)  # only the first continuation's copies have its source so far
        if not source:  # another continuation's copy popped first: the path may be a mask draft's too
            ranks = mask_ranks(path, ranks)
            source = branch_paths[path] | (MASK if ranks is not None else 0)
        elif path in branch_paths:
            source |= branch_paths[path]
        yield path, -neg, source
        open_node(-neg, path, ranks, on_first)


class _Kept:
    """A generator's items, produced once, on first demand, and replayed to every later
    iteration (the planner walks the candidates up to three times a step, each a little further)."""

    def __init__(self, items: Iterator):
        self.items, self.done = items, []

    def __iter__(self):
        i = 0
        while True:
            if i == len(self.done):
                item = next(self.items, None)
                if item is None:
                    return
                self.done.append(item)
            yield self.done[i]
            i += 1


def _merged_ranks(draft_ids: list[list[int]], found: list[int], depth: int, top1: list[int] | None) -> list[int]:
    """match[d]: the rank of mask d's draft equal to found[d], while every lookup token so far is a
    draft at its place. With a sampler head (``top1``), the drafts at d + 1 were made given the
    top-1 draft at d, so the match also stops after a lookup token that is another rank."""
    match: list[int] = []
    for d in range(depth):
        if found[d] not in draft_ids[d] or (top1 is not None and d and match[-1] != top1[d - 1]):
            break
        match.append(draft_ids[d].index(found[d]))
    return match


def _lookup_chain(draft_probs: list[list[float]], found: list[int], rates: list[float], depth: int,
                  match: list[int]) -> list[tuple[tuple[int, ...], float, int]]:
    """The first ``depth`` lookup tokens as nodes (path, value, sources), valued as
    :func:`_candidates` values them (``match``: :func:`_merged_ranks`)."""
    out, value = [], 1.0
    for d in range(depth):
        merged = d < len(match)
        p = draft_probs[d][match[d]] if merged else 0.0
        value *= max(p, rates[d])
        out.append((tuple(found[: d + 1]), value, MASK | LOOKUP if merged else LOOKUP))
    return out


def plan_step(draft_ids: list[list[int]], draft_probs: list[list[float]], draft_offset: int, found: list[int],
              stats: AcceptanceStats, budget: int, mask_num: int, max_groups: int, room: int,
              mask_rows_before: int, chained: bool = False, others: list[list[int]] = (), stored: int = 0) -> StepPlan:
    """Choose this step's nodes, mask groups and their lengths (module docstring).

    Prices (issue 44): a node pays its row's marginal cost; the groups pay their rows and, once,
    the adapter's fixed cost (:meth:`StepCost.adapter_overhead`); and the block pays the multi-row
    jump (:meth:`StepCost.multi_row`) once if it has more than one row. A one-row (AR) step is
    chosen only when the best block's net value is below that jump and the text has no lookup
    continuation of its own: every token of its first is in the tree, as prompt lookup would
    verify it (as deep as the budget allows), beside the mask drafts.

    Args:
        draft_ids: (r, R) the top-R draft tokens of the r masks the step drafts from.
        draft_probs: (r, R) their probabilities as the decoder gives them (greedy: the softmax;
            sampling: the processed distribution); each row sums to at most 1. This function
            calibrates them (:func:`calibrated`, on the row's first, top draft) and sorts each row
            by calibrated value.
        draft_offset: mask offset of draft row 0 inside its group.
        found: prompt-lookup tokens for this step (may be empty).
        stats: this sequence's running rates and λ.
        budget: most rows per step, padding included (>= 1).
        mask_num: k, the most masks per group.
        max_groups: most groups (the layout's ``groups``).
        room: deepest depth a row may take (context - cache length - 1): a node of depth d sits
            at depth d, mask j of a group anchored at depth g at depth g + 1 + j.
        mask_rows_before: mask rows of the previous step, to price this step's node rows.
        chained: the drafts come from a sampler head (offset d+1 drafted given offset d's top-1
            draft): only the top-1 path has mask children.
        others: prompt lookup's other continuations (``PromptLookup.continuations`` after the
            first, the most recent occurrence first), candidates priced by
            :meth:`AcceptanceStats.other_rates` of their rank, never forced.
        stored: how many of ``found`` and ``others`` together, at the end, are a datastore's
            (``PromptLookup.continuations``' ``stored``): priced by :meth:`AcceptanceStats.store_rates`
            of their place; ``found`` itself is one when the text has none of its own, then priced
            like any node, not forced.

    Returns:
        StepPlan with ``rows <= max(budget, 1)``.
    """
    lam, cost = stats.rate, stats.cost
    # calibrated drafts, re-sorted: an over-confident top draft may fall below the next one
    ranked = [sorted(zip(calibrated(p, stats.calibration(draft_offset + d)), ids, range(len(ids))), key=lambda t: -t[0])
              for d, (ids, p) in enumerate(zip(draft_ids, draft_probs))]
    top1 = [[r for _, _, r in row].index(0) for row in ranked] if chained else None
    draft_ids = [[t for _, t, _ in row] for row in ranked]
    draft_probs = [[v for v, _, _ in row] for row in ranked]
    own = len(others) + 1 - stored  # continuations before the datastore's
    rates = stats.store_rates(0) if found and own < 1 else stats.lookup_rates()
    match = _merged_ranks(draft_ids, found, min(len(found), room, len(rates), len(draft_ids)), top1)
    branches = [(b, start, stats.store_rates(rank + 1), STORE) if rank + 1 >= own else (b, start, stats.other_rates(rank), LOOKUP)
                for b, start, rank in _branch_points(found, others)]
    cands = _Kept(_candidates(draft_ids, draft_probs, found, rates, max(budget - 1, 0), room, top1, match, branches,
                              LOOKUP if own > 0 else STORE))
    # prompt lookup decoding's chain is always verified; a datastore's, when the text has none of its
    # own, is priced like any node (forced, it cost 1.3-2.2 % of modelled speed, results/datastore)
    depth = min(len(found), room, len(rates), max(budget - 1, 0)) if own > 0 else 0
    forced = _lookup_chain(draft_probs, found, rates, depth, match)

    def nodes(cap: int, fill: int = 0) -> list[tuple[tuple[int, ...], float, int]]:
        """The lookup chain and the candidates that pay for their row, at most ``cap`` nodes in
        all, then ``fill`` more candidates; by value, so parents come before children (values
        never grow down a path)."""
        kept = forced[:cap]
        have = {p for p, _, _ in kept}
        extra = []
        for c in cands:
            if c[0] in have:
                continue
            if not extra and len(kept) < cap and c[1] >= lam * cost.marginal(1 + len(kept) + mask_rows_before):
                kept.append(c)
            elif len(extra) < fill:
                extra.append(c)
            else:
                break
            have.add(c[0])
        return sorted(kept + extra, key=lambda c: (-c[1], len(c[0])))

    def tree(kept) -> tuple[list[int], list[int], list[float]]:
        """(parents, depth, value) of x_{n-1} and the kept nodes."""
        row_of = {(): 0}
        parents, depth, value = [-1], [0], [1.0]
        for p, v, _ in kept:
            row_of[p] = len(parents)
            parents.append(row_of[p[:-1]])
            depth.append(len(p))
            value.append(v)
        return parents, depth, value

    # rows kept for G_0 (but never from the lookup chain); a tight budget is split, else its masks
    # would be fed every step while no row is left to verify their drafts
    reserve = min(mask_num, room, max(budget - 1, 0) // 2) if max_groups else 0
    kept = nodes(max(budget - 1 - reserve, len(forced)))
    parents, depth, value = tree(kept)
    groups, lens, net = _choose_groups(parents, depth, value, stats, lam, mask_num, max_groups, room,
                                       cost.marginal(len(parents) + mask_rows_before), cost.adapter_overhead(),
                                       chained)
    if not groups and reserve:  # no group after all: the reserved rows may verify nodes
        kept = nodes(budget - 1)
        parents, depth, value = tree(kept)
    net += sum(v - lam * cost.marginal(1 + i + mask_rows_before) for i, (_, v, _) in enumerate(kept))
    if not forced and net < lam * cost.multi_row():  # the block does not pay its multi-row jump: an AR step
        kept, groups, lens = [], [], []
    used = 1 + len(kept) + sum(lens)
    while used > budget and lens:  # a budget below 1 + nodes + k: shorten the deepest group
        lens[-1] -= 1
        if not lens[-1]:
            lens.pop()
            groups.pop()
        used -= 1
    rows = bucket(used, budget)
    if rows > used:  # the bucket's free rows take the next-best nodes; the groups keep their anchors
        anchors = [kept[r - 1][0] if r else () for r in groups]
        kept = nodes(len(kept), rows - used)
        row_of = {p: r for r, (p, _, _) in enumerate(kept, 1)} | {(): 0}
        groups = [row_of[p] for p in anchors]
    parents, _, value = tree(kept)
    return StepPlan(tuple(p[-1] for p, _, _ in kept), tuple(parents), tuple(groups), tuple(lens), rows,
                    tuple(value[1:]), tuple(s for _, _, s in kept))


def _choose_groups(parents: list[int], depth: list[int], value: list[float], stats: AcceptanceStats,
                   lam: float, mask_num: int, max_groups: int, room: int, row_cost: float,
                   overhead: float, chained: bool = False) -> tuple[list[int], list[int], float]:
    """Anchor rows and lengths of the mask groups that maximize their net value (module docstring),
    and that value in tokens; any group at all also pays ``overhead``, the adapter's fixed cost per
    step. The next step verifies a tree of each mask's top-R drafts, so its reach is valued by the
    rate at which the true token is among them (:meth:`AcceptanceStats.ranked_alphas`); with a
    sampler head (``chained``) by the top-1 rate, since its deeper drafts follow the top-1 path."""
    n1 = len(parents)
    children_value = [0.0] * n1
    best_child = [0] * n1  # the most likely child of each row (0: none)
    for r in range(1, n1):
        p = parents[r]
        children_value[p] += value[r]
        if not best_child[p] or value[r] > value[best_child[p]]:
            best_child[p] = r
    spine = [0]
    while best_child[spine[-1]]:
        spine.append(best_child[spine[-1]])
    on_spine = set(spine)
    branch = [0] * n1  # depth of each row's deepest spine ancestor-or-self
    for r in range(1, n1):
        branch[r] = depth[r] if r in on_spine else branch[parents[r]]
    end = [max(value[r] - children_value[r], 0.0) for r in range(n1)]  # P(the accepted path ends at r)
    alpha = stats.alphas() if chained else stats.ranked_alphas()
    reach = [[0.0] * mask_num for _ in range(mask_num)]  # reach[s][j]: next step's chain from offset s reaches j
    for s in range(mask_num):
        acc = 1.0
        for j in range(s, mask_num):
            acc *= alpha[j]
            reach[s][j] = acc
    row = lam * row_cost
    # gain[j][s]: what mask j of a group is worth to a path ending at offset s, less its row's cost
    gain = [[max(reach[s][j] - row, 0.0) for s in range(j + 1)] for j in range(mask_num)]
    ends = [(depth[r], branch[r], end[r]) for r in range(n1) if end[r] > 0]  # rows a path may end at
    best = (0.0, [], [])  # no group: nothing gained, nothing paid
    for gn in range(1, min(max_groups, len(spine), room) + 1):
        mass = [[0.0] * mask_num for _ in range(gn)]  # mass[g][s]: P(end at a row drafting from G_g, offset s)
        for d, b, e in ends:
            g, s = anchored_group(d, gn, b)
            if s < mask_num:
                mass[g][s] += e
        total, lens = -lam * overhead, []
        for g in range(gn):
            run, best_run, best_len = 0.0, -math.inf, 1
            for j in range(min(mask_num, room - g)):
                run += sum(map(operator.mul, mass[g], gain[j])) - row
                if run > best_run:
                    best_run, best_len = run, j + 1
            total += best_run
            lens.append(best_len)
        if total > best[0]:
            best = (total, spine[:gn], lens)
    return list(best[1]), list(best[2]), best[0]
