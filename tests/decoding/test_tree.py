"""Token-tree verification (issue #14): layout, greedy exactness, KV compaction, exact sampling,
tree construction and the greedy replay."""
import pytest
import torch

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.sampling import logits_to_probs
from space.decoding.tree import check_tree, grow_tree, parse_tree, path_probs_from_ranks, replay
from space.decoding.verify import verify_tree_greedy, verify_tree_sampling
from space.eval.probe import anchor_ranks
from space.layout_cli import main as layout_main
from space.masking import build_layout, tree_parents
from tests.conftest import TRAINED_K, assert_cache_matches_fresh
from tests.decoding.test_sampling import ALPHA, chi2_pvalue
from tests.oracle import oracle_generate


def random_tree(gen: torch.Generator, nodes: int, depth: int):
    """A random tree of ranks: each new node is the next-ranked child of a random node."""
    tree, kids = [], {(): 0}
    while len(tree) < nodes:
        open_ = [p for p in kids if len(p) < depth]
        p = open_[int(torch.randint(len(open_), (1,), generator=gen))]
        child = p + (kids[p],)
        kids[p] += 1
        kids[child] = 0
        tree.append(child)
    return check_tree(tree, depth)


def test_check_and_parse_tree(tmp_path):
    assert check_tree([[0], [0, 0], [1]]) == ((0,), (1,), (0, 0))
    assert parse_tree("chain") is None and parse_tree(None) is None
    (tmp_path / "t.json").write_text("[[0], [0, 0]]")
    assert parse_tree(str(tmp_path / "t.json"), 2) == ((0,), (0, 0))
    for bad, msg in (([[0, 0]], "parent"), ([[0], [0]], "duplicate"), ([[0], [0, 0], [0, 0, 0]], "deeper"),
                     ([[-1]], "ranks"), ([], "non-empty"), ([[True]], "ranks")):
        with pytest.raises(ValueError, match=msg):
            check_tree(bad, 2)
    with pytest.raises(ValueError, match="JSON"):
        parse_tree("nope")
    with pytest.raises(ValueError, match="deeper"):
        DecodeConfig(2, tree=[[0], [0, 0], [0, 0, 0]])
    assert DecodeConfig(3, tree=[[0], [0, 0], [0, 0, 0], [1]]).override(mask_num=2).tree == ((0,), (1,), (0, 0))
    assert DecodeConfig(3, tree=[[0], [1]]).override(tree="chain").tree is None


@pytest.mark.parametrize("m,groups,k", [(0, 1, 1), (3, 4, 3), (4, 2, 5), (2, 1, 2)])
def test_chain_shaped_tree_is_the_decode_layout(m, groups, k):
    chain = check_tree([(0,) * d for d in range(1, m + 1)]) if m else ()
    plain = build_layout(7, 1 + m, list(range(1, groups + 1)), k)
    tree = build_layout(7, 1 + m, list(range(1, groups + 1)), k, parents=tree_parents(chain))
    for name in ("position_ids", "allowed", "is_mask", "mask_offset", "mask_group"):
        assert torch.equal(getattr(plain, name), getattr(tree, name)), name


def test_tree_layout_by_hand():
    # x; c1 = (0,), c2 = (1,) siblings at depth 1; c3 = (0, 0) under c1; groups on x and c1, k = 2
    lay = build_layout(2, 4, [1, 2], 2, parents=tree_parents(check_tree([[0], [1], [0, 0]])))
    assert lay.position_ids.tolist() == [2, 3, 3, 4, 3, 4, 4, 5]
    block = ["o......."[:0] + "".join("o" if v else "." for v in row[2:]) for row in lay.allowed.tolist()]
    assert block == ["o.......", "oo......", "o.o.....", "oo.o....",
                     "o...o...", "o...oo..", "oo....o.", "oo....oo"]
    assert lay.allowed[:, :2].all()
    with pytest.raises(ValueError, match="parents"):
        build_layout(0, 3, [1], 2, parents=[-1, 2, 0])
    text = layout_main(["--tree", "[[0],[1],[0,0]]", "-k", "2", "--num-groups", "2"])
    assert "c2" in text and "G1m1" in text


def test_group_rows_refuse_more_groups_than_the_top1_chain_holds():
    """G_d sits on the top-1 chain's node at depth d: [[0],[1],[0,0]] (chain c1, c3) holds 3
    groups, on x, c1 and c3 (rows 0, 1, 3). Catches a bound one too loose: 4 groups looked up a
    chain node at depth 3 that the tree lacks and failed with a bare KeyError, not the documented
    ValueError naming the chain's depth (the decoder and space-layout clamp the count first;
    other callers of the function rely on the check)."""
    from space.decoding.tree import group_rows

    tree = check_tree([[0], [1], [0, 0]])
    assert group_rows(tree, 3) == [0, 1, 3] and group_rows(tree, 0) == []
    for groups in (4, 5, -1):
        with pytest.raises(ValueError, match=f"{groups} mask groups need a top-1 chain of depth {groups - 1}; "
                                             "this tree's is 2"):
            group_rows(tree, groups)


def test_greedy_tree_walk_equals_the_rule_by_brute_force():
    """The host walk of greedy verification (issue 43) against its rule, checked row by row: a
    row is right when every node on its path is its parent row's argmax; the accepted row is the
    deepest right one, the first in block order among equals. Random trees with small vocabularies,
    so that many nodes are right, siblings tie and a wrong node has right-looking children."""
    rng = torch.Generator().manual_seed(0)
    accepted_deep = 0
    for _ in range(400):
        n = int(torch.randint(1, 24, (1,), generator=rng))
        parents = [-1] + [int(torch.randint(0, r, (1,), generator=rng)) for r in range(1, n + 1)]
        depth = [0] * (n + 1)
        for r in range(1, n + 1):
            depth[r] = depth[parents[r]] + 1
        vocab = int(torch.randint(2, 4, (1,), generator=rng))
        pred = torch.randint(0, vocab, (n + 1,), generator=rng).tolist()
        tokens = torch.randint(0, vocab, (n,), generator=rng).tolist()

        def right(r):
            while r > 0:
                if tokens[r - 1] != pred[parents[r]]:
                    return False
                r = parents[r]
            return True

        ok = [r for r in range(n + 1) if right(r)]
        expect = min(ok, key=lambda r: (-depth[r], r))
        assert verify_tree_greedy(pred, tokens, parents, depth) == expect
        accepted_deep += depth[expect] >= 2
    assert accepted_deep > 50  # the check met deep accepts, not only empty ones


def test_greedy_tree_exact_random_trees(trained):
    """Random trees (1-16 nodes, depth <= k, with and without a lookup branch) x random prompts
    and lengths on a drafter that is usually right: SPACE == AR and non-first siblings win."""
    model, _, spec, language = trained
    gen = torch.Generator().manual_seed(0)
    accepted_depths = []
    for case in range(24):
        k = int(torch.randint(1, TRAINED_K + 1, (1,), generator=gen))
        nodes = int(torch.randint(1, 17, (1,), generator=gen))
        tree = random_tree(gen, nodes, k)
        cfg = DecodeConfig(k, int(torch.randint(1, k + 2, (1,), generator=gen)), tree=tree,
                           lookup_tokens=[0, 4][case % 2])
        prompt = torch.tensor(language.sample(int(torch.randint(2, 30, (1,), generator=gen))))
        max_new = int(torch.randint(1, 60, (1,), generator=gen))
        ar = ar_generate(model, prompt, max_new, suppress_ids=spec.token_ids)
        out = SpaceDecoder(model, spec, cfg).generate(prompt, max_new)
        assert out.new_ids == ar.new_ids, (tree, cfg, prompt.tolist(), max_new)
        accepted_depths += out.accept_lengths
    assert max(accepted_depths) >= 3  # drafts were accepted deep into the trees


def test_oracle_accepts_every_sibling_and_cache_matches_fresh_forward(trained):
    """An oracle puts the true token at a chosen rank of each draft mask, so the accepted path runs
    through non-first siblings; after every step the compacted KV cache equals a fresh forward."""
    model, _, spec, language = trained
    tree = check_tree([[0], [1], [2], [0, 0], [1, 1], [2, 0], [2, 1], [1, 1, 0], [2, 1, 2]])
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 1, tree=tree))
    prompt = torch.tensor(language.sample(12))
    truth = ar_generate(model, prompt, 50, suppress_ids=spec.token_ids).new_ids
    ranks = [[1, 1, 0], [2, 1, 2], [2, 0], [0, 0]]
    # wrong tokens are never in the truth or the prompt, so a draft accepted at a rank other than the
    # oracle's is impossible whatever the language generator's state
    wrong = torch.tensor([t for t in range(11, 256) if t not in truth and t not in prompt.tolist()])

    def override(generated, drafts):
        want = ranks[len(generated) % len(ranks)]
        out = torch.full((3, dec.draft_ranks), 11)
        for j in range(3):
            out[j] = wrong[j * dec.draft_ranks:(j + 1) * dec.draft_ranks]  # distinct per rank and offset
            if len(generated) + j < len(truth) and j < len(want):
                out[j, want[j]] = truth[len(generated) + j]
        return out

    original, seen = dec._step, []

    def checked(cache, last, *args):
        out = original(cache, last, *args)
        seen.append(len(out[3]))
        assert_cache_matches_fresh(model, cache, torch.cat([prompt, torch.tensor(truth)])[:cache.get_seq_length()])
        return out

    dec._step = checked
    assert oracle_generate(dec, prompt, 50, override=override).new_ids == truth
    assert max(seen) == 3 and seen.count(3) >= 5  # full-depth accepts through rank-1 and rank-2 siblings


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_sampling_exact_with_siblings_and_duplicates(temperature, top_p):
    """verify_tree_sampling on a fixed two-level tree with a repeated sibling token: the first
    emitted token follows p0, the second follows the child row's p given the first."""
    gen = torch.Generator().manual_seed(0)
    V = 5
    logits = torch.randn(4, V, generator=gen) * 0.6  # rows: x, c1, c2, c3; several tokens survive top-p
    p = logits_to_probs(logits, SamplingConfig(temperature, top_p=top_p))
    tokens = [2, 0, 2]  # c1 = 2, c2 = 0, c3 = 2 (a duplicate of c1, never accepted twice)
    children = [[1, 2, 3], [], [], []]
    n = 20_000
    first, second = torch.zeros(V), torch.zeros(4, V)
    for _ in range(n):
        row, bonus = verify_tree_sampling(p, tokens, children, gen)
        t1 = tokens[row - 1] if row else int(bonus)
        first[t1] += 1
        if row:
            second[row, int(bonus)] += 1
    assert chi2_pvalue(dict(enumerate(first.tolist())), dict(enumerate(p[0].tolist())), n) > ALPHA
    for row in (1, 2):
        m = int(second[row].sum())
        assert chi2_pvalue(dict(enumerate(second[row].tolist())), dict(enumerate(p[row].tolist())), m) > ALPHA


def test_tree_sampling_walks_into_a_repeated_siblings_children():
    """A lookup branch whose first token is the top mask draft repeats a sibling: the walk accepted
    the first of the two and tried only its children, so the lookup's deeper tokens were never
    verified (4.18 -> 4.01 tokens/step on a chain with lookup). Repeated siblings are one candidate
    now, whose children are all of theirs, scored by the first one's row (the same tokens precede
    both). Here x surely emits 2; c1 (2) has child d1 (3), never right; the repeat c2 (2) has child
    d2 (1), always right under c1's row, then e2 (4) under d2: the walk reaches e2."""
    V = 5
    one = lambda t: [1.0 if i == t else 0.0 for i in range(V)]  # noqa: E731
    # rows: x, c1, c2, d1, d2, e2
    p = torch.tensor([one(2), one(1), one(1), one(0), one(4), one(0)])
    tokens = [2, 2, 3, 1, 4]  # c1, c2, d1 (c1's), d2 (c2's), e2 (d2's)
    children = [[1, 2], [3], [4], [], [5], []]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        row, bonus = verify_tree_sampling(p, tokens, children, gen)
        assert (row, int(bonus)) == (5, 0)


def assert_first_then_after_2(p, tokens, children, paths, first_dist, after_2_dist, n, gen):
    """Over ``n`` sampled verifications of the tree (``paths``: node -> the rows from the root), the
    first emitted token follows ``first_dist`` and, after a 2, the second follows ``after_2_dist``
    (chi-square)."""
    V = p.shape[1]
    first, after_2 = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        row, bonus = verify_tree_sampling(p, tokens, children, gen)
        emitted = [tokens[r - 1] for r in paths[row]] + [int(bonus)]
        first[emitted[0]] += 1
        if emitted[0] == 2:
            after_2[emitted[1]] += 1
    assert chi2_pvalue(dict(enumerate(first.tolist())), dict(enumerate(first_dist.tolist())), n) > ALPHA
    m = int(after_2.sum())
    assert chi2_pvalue(dict(enumerate(after_2.tolist())), dict(enumerate(after_2_dist.tolist())), m) > ALPHA


def test_tree_sampling_exact_when_repeated_siblings_have_children_of_their_own():
    """Repeated siblings c1 and c3 (token 2; same row distribution, as the same tokens precede them)
    with children of their own, d1 (0) under c1 and d3 (1) under c3: the first token follows x's row,
    and after a 2 the second follows c1's row, whichever member's child was accepted."""
    gen = torch.Generator().manual_seed(1)
    V = 4
    x, c = torch.tensor([0.2, 0.3, 0.4, 0.1]), torch.tensor([0.35, 0.25, 0.3, 0.1])
    leaf = torch.full((V,), 1 / V)
    p = torch.stack([x, c, torch.tensor([0.1, 0.6, 0.2, 0.1]), c, leaf, leaf])  # x, c1, c2 (1), c3, d1, d3
    tokens, children = [2, 1, 2, 0, 1], [[1, 2, 3], [4], [], [5], [], []]
    paths = {0: [], 1: [1], 2: [2], 3: [3], 4: [1, 4], 5: [3, 5]}
    n = 20_000
    assert_first_then_after_2(p, tokens, children, paths, x, c, n, gen)


def test_tree_sampling_tries_a_token_once_under_repeated_siblings():
    """Repeated siblings c1 and c2 (token 2) each with a child of token 0, d1 and d2: under the one
    candidate they make, 0 is one candidate too. Catches the children's classes keyed by their own
    parent row instead of its class: 0 was tried twice after a 2, emitted with 2 p(0) (0.6, not 0.3)."""
    gen = torch.Generator().manual_seed(0)
    V = 4
    x, c = torch.tensor([0.2, 0.2, 0.5, 0.1]), torch.tensor([0.3, 0.3, 0.2, 0.2])
    leaf = torch.full((V,), 1 / V)
    p = torch.stack([x, c, c, leaf, leaf])  # x, c1, c2, d1, d2
    tokens, children = [2, 2, 0, 0], [[1, 2], [3], [4], [], []]
    paths = {0: [], 1: [1], 2: [2], 3: [1, 3], 4: [2, 4]}
    n = 6000
    assert_first_then_after_2(p, tokens, children, paths, x, c, n, gen)


def test_tree_sampling_with_three_siblings_and_grandchildren():
    """x's children c1, c2, c3 (distinct tokens), and c2's children d1, d2. Two bugs the one-level
    test above (two distinct siblings, no grandchildren) cannot see: c3 must be tried against the
    mass left after rejecting both c1 and c2 (1 - 0.4 - 0.3), not only the last one (1 - 0.3); and
    after c1 is rejected and c2 accepted, c2's children are tried against c2's own full row, not
    with x's leftover mass carried down (which accepts d1 with 0.3 / 0.6 = 0.5 instead of 0.3)."""
    gen = torch.Generator().manual_seed(0)
    quarter = [0.25, 0.25, 0.25, 0.25]
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1],  # x: c1 = 0, c2 = 1, c3 = 2
                      quarter,                # c1 (a leaf)
                      [0.3, 0.3, 0.2, 0.2],  # c2: d1 = 0, d2 = 1
                      quarter, quarter, quarter])  # c3, d1, d2 (leaves)
    tokens, children = [0, 1, 2, 0, 1], [[1, 2, 3], [], [4, 5], [], [], []]
    paths = {0: [], 1: [1], 2: [2], 3: [3], 4: [2, 4], 5: [2, 5]}
    n, V = 20_000, 4
    first, after_c2 = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        row, bonus = verify_tree_sampling(p, tokens, children, gen)
        emitted = [tokens[r - 1] for r in paths[row]] + [int(bonus)]
        first[emitted[0]] += 1
        if paths[row][:1] == [2]:
            after_c2[emitted[1]] += 1
    assert chi2_pvalue(dict(enumerate(first.tolist())), dict(enumerate(p[0].tolist())), n) > ALPHA
    m = int(after_c2.sum())
    assert m > 3000
    assert chi2_pvalue(dict(enumerate(after_c2.tolist())), dict(enumerate(p[2].tolist())), m) > ALPHA


def path_probs_from_table(table):
    """P(path right) = prod_d table[d][path[d]] for a (k, R) table of rank probabilities per offset
    (ranks independent across offsets): hand-checkable inputs for grow_tree."""
    probs, frontier = {}, {(): 1.0}
    for row in table:
        frontier = {p + (r,): v * pr for p, v in frontier.items() for r, pr in enumerate(row)}
        probs.update(frontier)
    return probs


def test_grow_tree_from_a_table_by_hand():
    # offset 0: ranks 0/1/2 right 0.6/0.2/0.1; offset 1: 0.5/0.3. Path probabilities:
    # (0)=.6 (0,0)=.3 (1)=.2 (0,1)=.18 (1,0)=.1 (2)=.1 (1,1)=.06 (2,0)=.05 (2,1)=.03
    probs = path_probs_from_table([[0.6, 0.2, 0.1], [0.5, 0.3]])
    assert grow_tree(probs, 4, 2) == check_tree([[0], [0, 0], [1], [0, 1]])
    assert grow_tree(probs, 6, 2) == check_tree([[0], [0, 0], [1], [0, 1], [1, 0], [2]])
    assert grow_tree(probs, 3, 1) == ((0,), (1,), (2,))
    measured = path_probs_from_ranks([torch.tensor([[0, 1], [0, 0], [1, -1], [0, 0]])])
    assert measured == {(0,): 0.75, (0, 1): 0.25, (0, 0): 0.5, (1,): 0.25}


def test_grow_tree_breaks_ties_by_depth_then_ranks():
    """Measured path probabilities tie often (they are counts over a few anchors): among equals the
    shallower path comes first, then the lower ranks, as documented. A depth-first tie-break
    ((0, 0) before (1,)), or one by the order paths were first seen, picks another tree."""
    probs = path_probs_from_table([[0.5, 0.25], [0.5, 0.5]])  # (1,), (0, 0), (0, 1) all 0.25, exactly
    assert grow_tree(probs, 2, 2) == ((0,), (1,))
    assert grow_tree(probs, 3, 2) == ((0,), (1,), (0, 0))
    seen = path_probs_from_ranks([torch.tensor([[1, -1], [0, -1]])])  # (1,) is counted first
    assert seen == {(1,): 0.5, (0,): 0.5} and grow_tree(seen, 1, 1) == ((0,),)


def test_path_probs_from_ranks_stop_below_max_rank():
    """A rank >= max_rank (a draft the tree cannot hold) ends the path there: neither it nor a
    deeper node through it is counted."""
    ranks = [torch.tensor([[0, 2], [2, 0], [1, 1]])]
    assert path_probs_from_ranks(ranks, max_rank=2) == {(0,): 1 / 3, (1,): 1 / 3, (1, 1): 1 / 3}


def test_replay_after_a_runner_up_drafts_from_the_root_group():
    """k = 2, groups on x_{n-1} and on the top-1 node (0,). Step 2 accepts the runner-up (1,): the
    path left the top-1 chain at once, so the next drafts are G_0's, shifted by one (its mask 1,
    anchor 1, whose rank is 0 here: accepted). Taking G_1 (anchored on the rejected top-1 node,
    ranks 5 here) as if the path had stayed on the chain accepts nothing at step 3, a bug
    test_replay_predicts_the_decoder lets through."""
    r = torch.full((6, 2), 5)  # rank 5: not in the tree
    r[0] = torch.tensor([1, 0])  # step 2: (1,) right, (0, 0) not
    r[1] = torch.tensor([5, 0])  # G_0 anchored on answer token 1: its mask 1 drafts token 3 at rank 0
    res = replay([r], 2, 2, [[0], [1], [0, 0]])
    assert res.accept_lengths == [0, 1, 1, 0, 0] and res.step_candidates == [0, 2, 1, 1, 0]
    assert res.tokens == 7 and res.rows == [3, 8, 7, 7, 3]


def test_replay_emits_exactly_the_answer():
    """Every draft right (rank 0; -1 past the answer, as the probe writes it): the replay emits
    each answer token once, whatever the answer's length and the layout. A node allowed one
    position too deep near the end accepts the answer's last token as a draft and counts a bonus
    past the answer (7 tokens for a 6-token answer with k = 2)."""
    for k, groups, tree in [(2, 3, None), (3, 2, [[0], [1], [0, 0], [0, 0, 0]])]:
        for anchors in range(1, 12):
            r = torch.zeros(anchors, k, dtype=torch.long)
            for i in range(anchors):
                for j in range(k):
                    if i + j + 1 >= anchors + 1:
                        r[i, j] = -1
            res = replay([r], k, groups, tree)
            assert res.tokens == anchors + 1 == sum(res.accept_lengths) + res.steps, (k, anchors)


@pytest.mark.parametrize("k,groups,tree", [(3, 4, None), (3, 2, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
                                           (2, 1, [[0], [1], [2], [0, 0], [1, 0]])])
def test_replay_predicts_the_decoder(trained, k, groups, tree):
    """The replay over teacher-forced ranks gives exactly the decoder's steps on its own output:
    the same accept length and tree depth at every step but a sample's last, where the decoder
    verifies and counts drafts past max_new_tokens (then cut) and the replay stops at the answer's end."""
    model, _, spec, language = trained
    cfg = DecodeConfig(k, groups, tree=tree)
    steps, accepted, all_ranks = 0, 0, []
    for i in range(4):
        prompt = torch.tensor(language.sample(8 + i))
        out = SpaceDecoder(model, spec, cfg).generate(prompt, 40)
        ranks = anchor_ranks(model, torch.cat([prompt, torch.tensor(out.new_ids)]), len(prompt),
                             spec.ids_for(k), k, suppress_ids=spec.token_ids)
        one = replay([ranks], k, groups, cfg.tree)
        assert one.accept_lengths[:-1] == out.accept_lengths[:-1]
        assert one.step_candidates[:-1] == out.step_candidates[:-1]
        steps, accepted = steps + len(out.step_tokens), accepted + sum(out.accept_lengths)
        all_ranks.append(ranks)
    result = replay(all_ranks, k, groups, cfg.tree)
    assert result.steps == steps and result.tokens == 160
    assert accepted > 40  # drafts were often accepted: the replay was checked on real accepts


@pytest.mark.parametrize("k,groups,lookup", [(3, 2, 0), (4, 5, 3)])
def test_context_end_shrinks_the_tree(tiny, k, groups, lookup):
    """Near the context end the tree is pruned and groups shortened: no row reaches position
    >= context, drafts are accepted through runner-up siblings up to the last position."""
    model, _, spec = tiny
    context = model.config.max_position_embeddings
    prompt = torch.randint(11, 250, (context - 14,), generator=torch.Generator().manual_seed(3))
    truth = ar_generate(model, prompt, 14, suppress_ids=spec.token_ids).new_ids
    tree = check_tree([[0], [1], [1, 0], [1, 0, 0], [0, 0], [0, 0, 0]][: 6 if k >= 3 else 4])
    dec = SpaceDecoder(model, spec, DecodeConfig(k, groups, tree=tree, lookup_tokens=lookup))

    def override(generated, drafts):  # the truth at rank 1, then rank 0: the path (1,), (1, 0), (1, 0, 0)
        out = torch.arange(20, 20 + k * dec.draft_ranks).view(k, dec.draft_ranks)
        for j in range(k):
            if len(generated) + j < len(truth):
                out[j, 1 if j == 0 else 0] = truth[len(generated) + j]
        return out

    positions = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: positions.append(int(kwargs["position_ids"].max()))
        if kwargs.get("position_ids") is not None else None, with_kwargs=True)
    try:
        out = oracle_generate(dec, prompt, 14, override=override)
    finally:
        hook.remove()
    assert out.new_ids == truth and max(positions) == context - 1 and max(out.accept_lengths) == 3


def test_static_block_with_no_room_left(tiny):
    """At the last position of the context (room 0) a static step is x_{n-1} alone: no node, no
    group (the group rows must not name an anchor without a group)."""
    from space.decoding.decoder import Drafts

    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 4))
    lay, tokens, _ = dec.static_block(dec.context - 1, Drafts(torch.zeros(3, 1, dtype=torch.long)), [5, 6])
    assert lay.group_rows == () and lay.group_len == () and lay.rows == 1 and tokens.numel() == 0


def test_replay_refuses_ranks_with_fewer_offsets_than_the_layout_drafts():
    """A probe of a drafter with a smaller k holds fewer offsets per anchor: sliced to them, the
    replay would report a k' layout's accept lengths under this layout's name. It is refused."""
    ranks = [torch.zeros(6, 2, dtype=torch.long)]
    with pytest.raises(ValueError, match="the ranks hold 2 offsets; a layout with mask_num 3 needs 3"):
        replay(ranks, 3, 2, None)
    assert replay(ranks, 2, 2, None).tokens == replay([torch.zeros(6, 3, dtype=torch.long)], 2, 2, None).tokens


def test_a_lookup_branch_that_spells_the_chain_drafts_from_the_deepest_group(tiny):
    """A static chain of 3 with a lookup branch of 3 repeating its first two tokens: when the branch
    is accepted to its end, the groups anchored down the chain saw the same context, so the next
    drafts come from the deepest group (G_2, past its offset 0), as on the chain. Compared by rows,
    the path was off the chain and drafted from G_0 shifted past all its masks: no drafts at all.
    A branch that leaves the chain's tokens drafts from the group where it left."""
    from space.decoding.decoder import Drafts

    model, _, spec = tiny
    dec = SpaceDecoder(model, spec, DecodeConfig(3, 3, lookup_tokens=3))
    lay, tokens, _ = dec.static_block(10, Drafts(torch.tensor([[5], [6], [9]])), [5, 6, 7])
    nodes = tokens.tolist()
    assert lay.parents == (-1, 0, 1, 2, 0, 4, 5) and nodes == [5, 6, 9, 5, 6, 7]  # chain 5 6 9, branch 5 6 7
    assert lay.draft_rows(6, nodes)[:2] == (2, 1)  # the branch's end: G_2, from its mask 1
    assert lay.draft_rows(3, nodes)[:2] == (2, 1)  # the chain's end, the same
    assert lay.draft_rows(5, nodes)[:2] == (2, 0)  # the branch at depth 2: G_2 from its first mask
    assert lay.draft_rows(6, [5, 6, 9, 5, 8, 7])[:2] == (1, 2)  # the branch leaves the chain after one token
    assert lay.draft_rows(6, [5, 6, 9, 4, 6, 7]) is None  # ... at once: G_0 holds nothing past depth 3
    # a custom planner's anchors off any chain (G_1 on a depth-2 row): a depth-1 node spelling that
    # row's token did not see its context, so it drafts from G_0 (shift 1), not from G_1's mask 0
    lay, _ = dec.block_layout((-1, 0, 1, 0), (0, 2), (3, 3), 10)
    assert lay.draft_rows(3, [11, 12, 12])[:2] == (0, 1)


def test_replay_acceptance_counts_only_steps_with_a_candidate_at_the_offset():
    """``ReplayResult.acceptance(j)`` is the share of steps whose tree reached offset j (depth > j)
    that accepted a draft there (a > j): DESIGN §6's "over steps with a candidate", as
    ``space.eval.report`` labels it (``scripts/compare_drafters.py``'s offset0_accept). Catches a
    step with no candidate counted in the denominator (m >= j) and a step that accepted nothing
    counted as accepting offset j (a >= j); a layout no step reached offset j of reads 0.0."""
    from space.decoding.tree import ReplayResult

    res = ReplayResult(tokens=7, steps=4, rows=[1, 8, 8, 5], accept_lengths=[0, 2, 1, 0], step_candidates=[0, 2, 2, 1])
    assert res.acceptance(0) == 2 / 3 and res.acceptance() == 2 / 3
    assert res.acceptance(1) == 1 / 2
    assert res.acceptance(2) == 0.0
    assert res.tokens_per_step == 7 / 4 and ReplayResult(0, 0, [], [], []).tokens_per_step == 0.0
