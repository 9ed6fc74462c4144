"""Static token trees for the SPACE step, and how to choose one (issue #14).

A tree is given as paths of ranks, Medusa's format: ``(0,)`` is mask 0's top-1 draft, ``(1,)``
its runner-up (a sibling), ``(0, 2)`` the third-ranked token of mask 1 after the top-1 of mask 0.
A node at depth d (its path has d ranks) proposes the token at offset d-1 after the step's bonus
token, so the tree of a step with k draft masks has depth <= k. Every prefix of a path is a node.
Trees are stored sorted breadth-first, siblings by rank: the decode block lays nodes out in this
order (``space.masking.host_block``, by ``build_layout(parents=...)``'s rules) and exact sampling
tries siblings in it.

Construction (``space-tree``): nodes are added greedily by the measured probability that the
whole path is right, read from the acceptance probe's ranks (``space-probe``'s ``ranks.jsonl``)
or from a per-offset rank table. Which tree (and k, and groups) is fastest is then measured by
:func:`replay`, an exact replay of greedy tree decoding over the probe's teacher-forced ranks.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


Tree = tuple[tuple[int, ...], ...]


def check_tree(paths: Iterable[Sequence[int]], k: int | None = None) -> Tree:
    """Validate a tree and return it sorted breadth-first (by depth, then ranks).

    Raises:
        ValueError: empty, a path that is empty or has a negative / non-integer rank, a duplicate,
            a path whose parent is missing, or a path deeper than ``k``.
    """
    try:
        tree = [tuple(p) for p in paths]
    except TypeError:
        raise ValueError(f"a token tree is a list of paths of ranks such as [[0], [1], [0, 0]], got {paths!r}") from None
    if not tree or not all(p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
                           for p in tree):
        raise ValueError(f"a token tree is a non-empty list of paths of ranks >= 0 such as [[0], [1], [0, 0]], "
                         f"got {paths!r}")
    nodes = set(tree)
    if len(nodes) != len(tree) or any(len(p) > 1 and p[:-1] not in nodes for p in tree):
        raise ValueError("token tree: a duplicate path, or a path whose parent is not in the tree")
    if k is not None and max(map(len, tree)) > k:
        raise ValueError(f"token tree: a path is {max(map(len, tree))} deep, deeper than mask_num k = {k}")
    return tuple(sorted(tree, key=lambda p: (len(p), p)))


def parse_tree(spec: str | None, k: int | None = None) -> Tree | None:
    """A tree from the command line: JSON paths (``'[[0],[1],[0,0]]'``), a JSON file holding them,
    or ``chain`` / None (no tree: the chain of top-1 drafts).

    Raises:
        ValueError: neither JSON nor a file, or an invalid tree (see :func:`check_tree`).
    """
    if spec is None or spec == "chain":
        return None
    text = spec
    if not spec.lstrip().startswith("["):  # inline JSON can be longer than a file name may be
        try:
            text = Path(spec).read_text(encoding="utf-8") if Path(spec).is_file() else spec
        except UnicodeDecodeError as e:
            raise ValueError(f"--tree {spec}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--tree: not 'chain', not JSON and not a file ({e.msg}): {spec!r}") from None
    if not isinstance(paths, list):
        raise ValueError(f"--tree: expected a list of paths of ranks such as [[0], [1], [0, 0]], got {text!r}")
    try:
        return check_tree(paths, k)
    except ValueError as e:
        raise ValueError(f"--tree: {e}") from None


def tree_flag(spec, k: int | None = None) -> Tree | str | None:
    """A ``--tree`` / ``tree=`` value as a ``DecodeConfig.override`` argument: None or ``auto``
    keep the adapter's tuned layout (None), ``chain`` selects the chain, ``dynamic`` the per-step
    dynamic tree (``space.decoding.dynamic``), anything else is a tree (JSON text, a file, or a
    list of paths).

    Raises:
        ValueError: an invalid tree (see :func:`parse_tree`).
    """
    if spec is None or spec == "auto":
        return None
    if spec in ("chain", "dynamic"):
        return spec
    return check_tree(spec, k) if isinstance(spec, (list, tuple)) else parse_tree(spec, k)


def prune(tree: Tree, depth: int) -> Tree:
    """The nodes of ``tree`` at most ``depth`` deep (still a tree: prefixes are shallower)."""
    return tuple(p for p in tree if len(p) <= depth)


def chain_depth(tree: Tree) -> int:
    """Depth of the top-1 chain ``(0,), (0, 0), ...`` inside ``tree``: where mask groups attach."""
    nodes, d = set(tree), 0
    while (0,) * (d + 1) in nodes:
        d += 1
    return d


def group_rows(tree: Tree, groups: int) -> list[int]:
    """Block rows of a static step's ``groups`` mask groups (DESIGN §3.8): G_0 on x_{n-1} (row 0),
    G_d on the top-1 chain's node at depth d (row 1 + its breadth-first index in ``tree``).

    Raises:
        ValueError: ``groups`` outside 0..chain_depth(tree) + 1.
    """
    if not 0 <= groups <= chain_depth(tree) + 1:
        raise ValueError(f"{groups} mask groups need a top-1 chain of depth {groups - 1}; this tree's is {chain_depth(tree)}")
    row_of = {p: i + 1 for i, p in enumerate(tree)}
    return ([0] + [row_of[(0,) * d] for d in range(1, groups)]) if groups else []


# ---- construction -------------------------------------------------------------------------------

def path_probs_from_ranks(ranks: Iterable[torch.Tensor], max_rank: int = 8) -> dict[tuple[int, ...], float]:
    """Measured P(path right): the share of anchors whose true tokens have exactly the path's ranks.

    Args:
        ranks: per sample, (anchors, k) ranks from ``space-probe`` (0 = top-1, -1 = no token).
        max_rank: paths use ranks < max_rank.
    """
    counts: Counter = Counter()
    total = 0
    for r in ranks:
        total += r.shape[0]
        for row in r.tolist():
            for d in range(len(row)):
                if not 0 <= row[d] < max_rank:
                    break
                counts[tuple(row[: d + 1])] += 1
    return {p: c / max(total, 1) for p, c in counts.items()}


def grow_tree(path_probs: dict[tuple[int, ...], float], max_nodes: int, max_depth: int) -> Tree:
    """Greedy tree: repeatedly add the child of the tree (or of the root) with the highest P(path
    right); a path is never more likely than its prefix, so this is the top-``max_nodes`` paths,
    ties broken by depth then ranks. Returns at most ``max_nodes`` nodes, at most ``max_depth`` deep.
    """
    tree: list[tuple[int, ...]] = []
    have: set[tuple[int, ...]] = set()
    candidates = sorted((p for p in path_probs if len(p) <= max_depth), key=lambda p: (-path_probs[p], len(p), p))
    for p in candidates:
        if len(tree) == max_nodes:
            break
        if len(p) == 1 or p[:-1] in have:
            tree.append(p)
            have.add(p)
    return check_tree(tree) if tree else ()


@dataclass(frozen=True)
class ReplayResult:
    """Greedy tree decoding replayed over teacher-forced ranks.

    Attributes:
        tokens: tokens emitted (over all samples).
        steps: decode steps.
        rows: (steps,) block rows of each step (1 + nodes + groups * k).
        accept_lengths: (steps,) drafts accepted per step (bonus not counted), as
            ``DecodeResult.accept_lengths``.
        step_candidates: (steps,) depth of the draft tree verified per step (0 when no group could
            draft; m for a chain), as ``DecodeResult.step_candidates``.
    """

    tokens: int
    steps: int
    rows: list[int]
    accept_lengths: list[int]
    step_candidates: list[int]

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)

    def acceptance(self, j: int = 0) -> float:
        """Share of the steps with a candidate at offset j (depth > j) that accepted it (a > j):
        the acceptance ``space.eval.report`` labels "over steps with a candidate" (DESIGN §6)."""
        had = [a for a, m in zip(self.accept_lengths, self.step_candidates) if m > j]
        return sum(a > j for a in had) / len(had) if had else 0.0


def anchored_group(depth: int, num_groups: int, on_chain: int) -> tuple[int, int]:
    """The group-shift rule (DESIGN §3.5), the one place it is written: groups G_0..G_{num_groups-1}
    anchor on x_{n-1} and down one chain (G_g on the chain's node at depth g: the top-1 chain of a
    static layout, the dynamic tree's spine). After a step accepts a path of ``depth`` nodes whose
    first ``on_chain`` lie on that chain, the next drafts come from the deepest group on the path,
    g = min(on_chain, num_groups - 1), from mask offset ``shift = depth - g`` on (k - shift drafts
    left: none once shift >= k). A layout rule that lives here, beside the trees whose top-1 chain the groups anchor on, so
    ``space.masking`` (which builds the layouts) and the estimators share it without an import
    cycle. Used by the decoder (``StepLayout.draft_rows``), the dynamic
    planner's prices, the static layouts' cap (``DecodeConfig.max_tokens_per_step``) and the
    replay (``tree.replay``).

    Returns:
        (g, shift).

    Raises:
        ValueError: num_groups < 1 (no group to draft from), or on_chain > depth.
    """
    if num_groups < 1 or not 0 <= on_chain <= depth:
        raise ValueError(f"anchored_group needs >= 1 group and 0 <= on_chain <= depth, got {num_groups} groups, "
                         f"on_chain {on_chain}, depth {depth}")
    g = min(on_chain, num_groups - 1)
    return g, depth - g


def replay(ranks: Iterable[torch.Tensor], mask_num: int, num_groups: int, tree: Tree | None) -> ReplayResult:
    """Replay greedy SPACE decoding of the probe's answers with a given layout: the exact accept
    lengths the decoder would get on them (teacher forcing on the target's own greedy answer is
    greedy decoding), without running the model. Lookup branches are not modelled.

    ``ranks[i][j]`` is the rank of answer token i+j+1 among mask j's drafts when a group is anchored
    after answer token i-1 (``space.eval.probe.anchor_ranks``, anchors from the prompt's end). A
    step whose last token is answer token t-1 verifies drafts of tokens t, t+1, ...; a node is right
    when each depth's rank equals the path's. Groups sit on x_{n-1} and the top-1 chain (DESIGN
    §3.5): after accepting depth a, the next drafts come from the deepest group g on the path,
    offsets a-g.. of it (k - (a-g) drafts).

    Args:
        ranks: per sample, (anchors, k') ranks with k' >= mask_num.
        tree: None = the chain of top-1 drafts, k deep.

    Raises:
        ValueError: ranks with fewer than mask_num offsets (a probe of a drafter with a smaller k).
    """
    ranks = list(ranks)
    short = next((r.shape[1] for r in ranks if r.shape[1] < mask_num), None)
    if short is not None:  # sliced to k', such ranks would replay a k' layout under this one's name
        raise ValueError(f"the ranks hold {short} offsets; a layout with mask_num {mask_num} needs {mask_num}")
    tree = tuple((0,) * d for d in range(1, mask_num + 1)) if tree is None else check_tree(tree, mask_num)
    by_depth = [tuple(p for p in tree if len(p) <= d) for d in range(mask_num + 1)]
    tokens = steps = 0
    rows: list[int] = []
    accept_lengths: list[int] = []
    step_candidates: list[int] = []
    for r in ranks:
        r = r[:, :mask_num].tolist()
        n, t = len(r) + 1, 0  # answer tokens with an anchor; t = next answer token to emit
        anchor, offset, avail = None, 0, 0  # current drafts: group anchored at answer token `anchor`
        while t < n:
            nodes = by_depth[min(avail, n - t - 1)]  # no node past the answer's end
            true = r[anchor][offset: offset + avail] if anchor is not None else []
            a, path = 0, ()
            for p in nodes:  # breadth-first: the last right node is a deepest one
                if len(p) > a and list(p) == true[: len(p)]:
                    a, path = len(p), p
            groups = min(num_groups, chain_depth(nodes) + 1)
            g, shift = anchored_group(a, groups, next((i for i, x in enumerate(path) if x), len(path)))
            steps += 1
            tokens += a + 1
            rows.append(1 + len(nodes) + groups * mask_num)
            accept_lengths.append(a)
            step_candidates.append(max(map(len, nodes), default=0))
            anchor, offset, avail = t + g, shift, mask_num - shift
            t += a + 1  # anchor = t + g <= the new t - 1: an answer token with an anchor while t < n
    return ReplayResult(tokens, steps, rows, accept_lengths, step_candidates)
