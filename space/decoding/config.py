"""``DecodeConfig``: the one source of SPACE decode defaults (STYLE.md item 15).

A trained adapter carries its tuned layout in ``space_config.json`` under ``"decode"``;
``space.loader.load_space`` records it on the model (``model.config.space_decode``) and
``SpaceDecoder(model, mask)`` reads it from there, so the Python API, ``space-eval`` and
``run_eval.sh`` all decode an adapter with its own layout unless a flag overrides it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields, replace

from ..tokens import check_mask_num
from .dynamic import StepCost
from .tree import Tree, anchored_group, chain_depth, check_tree, prune, tree_flag

DEFAULT_MASK_NUM = 5  # the paper's k (DESIGN §2); the only place a default k is written


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    """Raise a one-line ValueError naming ``name`` unless ``value`` is an integer (not a bool, not
    a float such as 2.0, NaN or inf) in ``minimum..maximum`` (None: no upper bound)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):  # numpy / torch integers too
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"be >= {minimum}" if maximum is None else f"lie in {minimum}..{maximum}"
        raise ValueError(f"{name} must {bound}, got {value}")


def check_real(name: str, value, minimum: float, maximum: float = math.inf, min_open: bool = False) -> None:
    """Raise a one-line ValueError naming ``name`` unless ``value`` is a finite number in
    [minimum, maximum] (``(minimum, maximum]`` with ``min_open``). NaN fails every comparison, so it
    is refused explicitly rather than slipping through a ``<`` check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (min_open and value == minimum) or value > maximum:
        if maximum == math.inf:
            bound = f"be {'>' if min_open else '>='} {minimum}"
        else:
            bound = f"lie in {'(' if min_open else '['}{minimum}, {maximum}]"
        raise ValueError(f"{name} must {bound}, got {value}")


@dataclass(frozen=True)
class DecodeConfig:
    """How a SPACE step is laid out (DESIGN §3.3-§3.5).

    Attributes:
        mask_num: k, masks per group = most mask drafts verified per step (1..MAX_MASK_NUM).
        num_groups: mask groups attached per step, 1..k+1; None = k+1 (the paper's layout).
            Fewer groups make a step cheaper on a CPU; see :meth:`max_tokens_per_step` for the cap.
            0 with ``lookup_tokens`` and a static layout: no mask group, prompt lookup alone (PLD
            run by this decoder's step, the baseline a captured run compares with, issue 58); the
            tree then has no drafts to verify.
        lookup_tokens: 0 = pure SPACE; else up to this many prompt-lookup candidates per step,
            verified as one more branch of the step's token tree (added to the mask drafts).
        lookup_ngram: longest n-gram matched by prompt lookup (>= 1).
        tree: None = verify the chain of top-1 drafts; a static token tree of mask-draft ranks, at
            most k deep (``space.decoding.tree``; groups attach to x_{n-1} and the top-1 chain;
            lists are accepted and stored as the breadth-first sorted tuple); or ``"dynamic"``: a
            tree, groups and group lengths chosen every step from the drafts' probabilities and
            the step cost (``space.decoding.dynamic``, issue 31).
        row_budget: dynamic tree: most rows per step, padding included (>= 1).
        draft_ranks: dynamic tree: top-R drafts per mask it may use (>= 1).
        step_cost: dynamic tree: the step-cost curve ``((rows, cost), ...)``, rows ascending from
            1 (``space-tree`` measures it in ms); None = ``dynamic.DEFAULT_STEP_COST``.
        adapter_cost: dynamic tree: what a step pays once for having mask rows (the frozen-base
            adapter's fixed cost), in the curve's unit; ``space-tree --dynamic`` measures it as 2
            rows with and without mask rows. 0 = not measured (``dynamic.StepCost.adapter``).
        lookup_branches: dynamic tree: most prompt-lookup continuations a step may verify (>= 1):
            the first occurrence's (prompt lookup decoding's, always in the tree), then the most
            recent other occurrences' of the same n-gram, each priced like any node (our addition,
            ``space.decoding.lookup``); a static layout verifies the first alone.
        datastore_branches: dynamic tree with prompt lookup: most continuations a step takes from
            a datastore of the model's own answers, when the decoder has one (``SpaceDecoder``'s
            ``datastore``, ``space.decoding.datastore``; our addition, REST-style), each priced
            like any node by the datastore's own running rates, the best one first where the text
            has none of its own (then priced too, not always verified as prompt lookup's is); 0 = none.

    Raises:
        ValueError: any field out of range or not an integer (NaN, inf and 2.0 included), at
            construction. A tree rank beyond the vocabulary is refused where the vocabulary is
            known, by ``SpaceDecoder``.
    """

    mask_num: int = DEFAULT_MASK_NUM
    num_groups: int | None = None
    lookup_tokens: int = 0
    lookup_ngram: int = 2
    tree: Tree | str | None = None
    row_budget: int = 32
    draft_ranks: int = 4
    step_cost: tuple[tuple[int, float], ...] | None = None
    adapter_cost: float = 0.0
    lookup_branches: int = 1
    datastore_branches: int = 0

    def __post_init__(self):
        check_mask_num(self.mask_num)
        if isinstance(self.tree, str):
            if self.tree != "dynamic":
                raise ValueError(f"tree must be a list of paths of ranks or 'dynamic', got {self.tree!r}")
        elif self.tree is not None:
            object.__setattr__(self, "tree", check_tree(self.tree, self.mask_num))
        check_int("row_budget", self.row_budget, 1)
        check_int("draft_ranks", self.draft_ranks, 1)
        if self.step_cost is not None:
            object.__setattr__(self, "step_cost", StepCost(self.step_cost).points)
        check_real("adapter_cost", self.adapter_cost, 0.0)
        if self.adapter_cost and self.step_cost is None:  # the default curve has no unit to measure it in
            raise ValueError("adapter_cost is in the step-cost curve's unit: give step_cost with it")
        if self.num_groups is not None:  # G_0..G_k; none only for prompt lookup alone
            lookup_alone = bool(self.lookup_tokens) and self.tree != "dynamic"
            if self.num_groups == 0 and not lookup_alone:
                raise ValueError("num_groups 0 (no mask group) is prompt lookup alone: it needs lookup_tokens > 0 "
                                 "and a static layout")
            check_int("num_groups", self.num_groups, 0 if lookup_alone else 1, self.mask_num + 1)
        check_int("lookup_tokens", self.lookup_tokens, 0)
        check_int("lookup_ngram", self.lookup_ngram, 1)
        check_int("lookup_branches", self.lookup_branches, 1)
        check_int("datastore_branches", self.datastore_branches, 0)
        if self.datastore_branches and (self.tree != "dynamic" or not self.lookup_tokens):
            raise ValueError("datastore_branches are branches of the dynamic tree's lookup: they need tree='dynamic' "
                             "and lookup_tokens > 0")

    @property
    def groups(self) -> int:
        """Mask groups attached per step (num_groups, or k+1 when unset)."""
        return self.mask_num + 1 if self.num_groups is None else self.num_groups

    def max_rows(self) -> int:
        """The most rows one step's block has, padding excluded: the dynamic tree's ``row_budget``,
        else x_{n-1}, the tree (the chain of k top-1 drafts when unset), the lookup branch and the
        groups' k masks each."""
        if self.tree == "dynamic":
            return self.row_budget
        drafts = (len(self.tree) if self.tree else self.mask_num) if self.groups else 0  # no group drafts nothing
        return 1 + drafts + self.lookup_tokens + self.groups * self.mask_num

    def as_dynamic(self) -> DecodeConfig:
        """This layout as the dynamic tree its step-cost curve prices (a static layout carries the
        curve for a ``tree="dynamic"`` override); ``num_groups`` unset, since prompt lookup alone
        (0 groups) is a static layout only."""
        return replace(self, tree="dynamic", num_groups=None)

    def override(self, **values) -> DecodeConfig:
        """A copy with the given fields replaced; None values keep the current field.

        When only ``mask_num`` changes, ``num_groups`` is capped at k+1 and the tree pruned to k
        deep, so a k override never inherits a layout that does not fit it. ``tree="chain"``
        selects the chain (no tree).
        """
        values = {k: v for k, v in values.items() if v is not None}
        if values.get("tree") == "chain":
            values["tree"] = None
        if "mask_num" in values and "num_groups" not in values and self.num_groups is not None:
            values["num_groups"] = min(self.num_groups, values["mask_num"] + 1)
        if "mask_num" in values and "tree" not in values and self.tree not in (None, "dynamic"):
            values["tree"] = prune(self.tree, values["mask_num"]) or None
        return replace(self, **values)

    def with_flags(self, args) -> DecodeConfig:
        """This layout under the layout flags ``space-eval`` and ``space-chat`` share (``--mask-num``,
        ``--num-groups``, ``--lookup-tokens``, ``--lookup-branches``, ``--tree``, ``--datastore`` and
        ``--datastore-branches``; a flag not given keeps the field, :meth:`override`). A datastore
        without ``--datastore-branches`` verifies one continuation.

        Raises:
            ValueError: a malformed ``--tree`` (``tree_flag``), or ``--lookup-branches`` above 1
                where one continuation is verified (:meth:`check_lookup_branches`).
        """
        decode = self.override(mask_num=args.mask_num, num_groups=args.num_groups, lookup_tokens=args.lookup_tokens,
                               lookup_branches=args.lookup_branches, tree=tree_flag(args.tree, args.mask_num),
                               datastore_branches=(args.datastore_branches or 1) if args.datastore else None)
        decode.check_lookup_branches(args.lookup_branches)
        return decode

    def check_lookup_branches(self, given: int | None) -> None:
        """Raises ValueError when ``--lookup-branches`` was ``given`` above 1 for a layout that verifies
        one lookup continuation at most (a static tree or chain, or no prompt lookup): the flag was
        left unread, and the run recorded 1."""
        if given is not None and given > 1 and not (self.tree == "dynamic" and self.lookup_tokens):
            raise ValueError(f"--lookup-branches {given} needs the dynamic tree with prompt lookup (this layout: tree "
                             f"{'chain' if self.tree is None else self.tree}, lookup_tokens {self.lookup_tokens}); "
                             "a static layout verifies one continuation")

    def to_dict(self) -> dict:
        """JSON-ready (the tree as lists of ranks)."""
        d = asdict(self)
        d["tree"] = self.tree if self.tree in (None, "dynamic") else [list(p) for p in self.tree]
        d["step_cost"] = None if self.step_cost is None else [list(p) for p in self.step_cost]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DecodeConfig:
        """Raises ValueError on unknown keys or out-of-range values."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown decode settings {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def of_model(cls, model, trained_mask_num: int = 0) -> DecodeConfig:
        """The model's recorded decode layout (``config.space_decode``), else k = the trained k or
        DEFAULT_MASK_NUM."""
        recorded = getattr(getattr(model, "config", None), "space_decode", None)
        if recorded:
            return cls.from_dict(recorded)
        return cls(mask_num=trained_mask_num or DEFAULT_MASK_NUM)

    def max_tokens_per_step(self) -> float:
        """The layout's cap on tokens/step: the mean emitted when every mask draft is accepted.

        With fewer than k+1 groups, a step that accepts a > g drafts must draft from G_g shifted,
        which leaves k - (a - g) candidates; with k = 1 and one group, every accepting step is
        followed by a step with no candidate, so the cap is 1.5 (DESIGN §3.5). With a tree, the
        all-right path is its top-1 chain (at most its depth). Lookup candidates are not counted
        (they are not bounded by the layout). The dynamic tree: k + 1, its bound when every step
        attaches a full group where the accepted path ends.
        """
        k, g_max = self.mask_num, self.groups - 1
        if self.tree == "dynamic":
            return float(k + 1)
        if not self.groups:  # prompt lookup alone: no mask draft
            return 1.0
        depth = k if self.tree is None else chain_depth(self.tree)
        m, seen, emitted = 0, {}, []
        while m not in seen:  # a deterministic walk over the candidate count m: find its cycle
            seen[m] = len(emitted)
            a = min(m, depth)
            emitted.append(a + 1)
            m = k - anchored_group(a, g_max + 1, a)[1]  # all a accepted: the path is the top-1 chain
        cycle = emitted[seen[m]:]
        return sum(cycle) / len(cycle)
