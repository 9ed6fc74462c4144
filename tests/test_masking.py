"""The layout core against DESIGN §3.1-§3.3, written out by hand, and against the model."""
import pytest
import torch
from transformers import DynamicCache

from space.decoding.cache import cache_input
from space.decoding.tree import anchored_group
from space.masking import (IGNORE_INDEX, build_layout, decode_layout, render, targets,
                           to_additive_4d, train_layout, truncate_layout)

DRAWING = """cache | block
oo    | o......   x     pos 2
oo    | oo.....   c1    pos 3
oo    | ooo....   c2    pos 4
oo    | o..o...   G0m0  pos 3
oo    | o..oo..   G0m1  pos 4
oo    | oo...o.   G1m0  pos 4
oo    | oo...oo   G1m1  pos 5"""


def test_render_matches_docstring_drawing():
    lay = decode_layout(cache_len=2, num_candidates=2, num_groups=2, k=2)
    assert render(lay) == DRAWING
    import space.masking
    assert "\n".join("    " + line for line in DRAWING.splitlines()) in space.masking.__doc__


def reference_decode(n, m, groups, k):
    """DESIGN §3.3 row by row: (name, position, set of visible block rows) with rows named."""
    rows = [("x", n - 1, {0})] + [(f"c{i}", n - 1 + i, set(range(i + 1))) for i in range(1, m + 1)]
    for g in range(groups):
        start = 1 + m + g * k
        for j in range(k):
            rows.append((f"G{g}m{j}", n + g + j, set(range(g + 1)) | set(range(start, start + j + 1))))
    return rows


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 4])
def test_decode_visibility_and_positions(k, n):
    for m in range(k + 1):
        for groups in range(1, m + 2):
            lay = decode_layout(n - 1, m, groups, k)
            ref = reference_decode(n, m, groups, k)
            assert lay.num_rows == len(ref)
            for i, (_, pos, vis) in enumerate(ref):
                assert int(lay.position_ids[i]) == pos
                assert lay.allowed[i, : n - 1].all()  # every row sees the cache
                assert set(lay.allowed[i, n - 1:].nonzero().flatten().tolist()) == vis
            # no real token sees a mask
            assert not lay.allowed[: 1 + m, n - 1 + 1 + m:].any()


def test_first_step_is_x_and_g0():
    lay = decode_layout(cache_len=6, num_candidates=0, num_groups=1, k=3)
    assert lay.position_ids.tolist() == [6, 7, 8, 9]
    assert lay.is_mask.tolist() == [False, True, True, True]


def test_train_layout_targets_follow_skip_one_offset():
    ids = torch.arange(100, 110)  # x_0..x_9
    lay = train_layout(10, [3, 7], k=4)
    tgt = targets(lay, ids)
    # real rows: next token; last real row has none
    assert tgt[:9].tolist() == ids[1:].tolist() and tgt[9] == IGNORE_INDEX
    # group at s=3: mask j at position 3+j, sees x_0..x_2, predicts x_{3+j+1}
    rows = lay.group_rows(0)
    assert lay.position_ids[rows].tolist() == [3, 4, 5, 6]
    assert tgt[rows].tolist() == [104, 105, 106, 107]
    for j, r in enumerate(rows.tolist()):
        assert lay.allowed[r, :10].nonzero().flatten().tolist() == [0, 1, 2]
        assert lay.allowed[r, rows].tolist() == [i <= j for i in range(4)]
    # group at s=7: targets past the end are ignored
    assert tgt[lay.group_rows(1)].tolist() == [108, 109, IGNORE_INDEX, IGNORE_INDEX]
    assert not lay.allowed[:10, 10:].any()
    # prompt tokens excluded from the loss
    assert (targets(lay, ids, first_target=5)[:4] == IGNORE_INDEX).all()


def test_truncate_layout_has_dummy_mask():
    ids = torch.arange(100, 110)
    lay = truncate_layout(4, k=3)
    assert lay.num_rows == 4 + 4
    tgt = targets(lay, ids, drop_offset=3)
    assert tgt.tolist() == [101, 102, 103, 104, 105, 106, 107, IGNORE_INDEX]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="mask_num"):
        build_layout(0, 3, [1], k=0)
    with pytest.raises(ValueError, match="context"):
        build_layout(0, 3, [4], k=2)
    with pytest.raises(ValueError, match="num_groups"):
        decode_layout(3, 1, 3, k=2)


def forward(model, ids, cache=None, lay=None):
    kw = {}
    if lay is not None:
        kw = dict(position_ids=lay.position_ids[None], attention_mask=to_additive_4d(lay.allowed))
    return model(input_ids=ids[None], **cache_input(cache), use_cache=cache is not None, **kw).logits[0]


@pytest.mark.parametrize("k", range(1, 9))
def test_verification_rows_equal_ar_logits(tiny, k):
    model, _, spec = tiny
    gen = torch.Generator().manual_seed(k)
    for n in (1, 5, 17):
        seq = torch.randint(0, 250, (n + k,), generator=gen)
        with torch.no_grad():
            ar = forward(model, seq)  # plain causal forward over prefix + candidates
            cache = DynamicCache(config=model.config)
            if n > 1:
                forward(model, seq[: n - 1], cache)
            lay = decode_layout(n - 1, k, k + 1, k)
            out = forward(model, lay.input_ids(seq[n - 1:], torch.tensor(spec.token_ids)), cache, lay)
        assert (out[: k + 1] - ar[n - 1:]).abs().max() < 1e-5
        # each group G_g equals a separate forward of prefix + c_1..c_g + masks
        for g in range(k + 1):
            with torch.no_grad():
                sep = forward(model, torch.cat([seq[: n + g], torch.full((k,), spec.token_ids[0])]))
            assert (out[lay.group_rows(g)] - sep[n + g:]).abs().max() < 1e-5


def test_to_additive_4d_shape():
    lay = decode_layout(3, 2, 3, 2)
    m = to_additive_4d(lay.allowed)
    assert m.shape == (1, 1, lay.num_rows, 3 + lay.num_rows)
    assert (m == 0).sum() == lay.allowed.sum()


def test_windowed_masks_per_kind_of_layer():
    """A batch's mask with each kind of layer's window applied by position (SAR-SFT's and the
    probe's rule, ``in_window``): unchanged without a window, one mask when every layer slides,
    ``{layer type: mask}`` for a hybrid model; boolean and additive masks alike."""
    from space.masking import windowed

    allowed = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    query_pos = torch.tensor([[4, 5, 6], [2, 3, 9]])
    key_pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 8]])
    assert windowed(allowed, query_pos, key_pos, {"full_attention": None}) is allowed
    seen = windowed(allowed, query_pos, key_pos, {"sliding_attention": 3})
    # row (batch 0, position 5) sees positions 3 and 4; (batch 1, position 9) sees 8 only
    assert seen[0, 0, 1].tolist() == [False, False, False, True, True]
    assert seen[1, 0, 2].tolist() == [False, False, False, False, True]
    assert seen[1, 0, 0].tolist() == [True, True, True, True, True]  # a key ahead of its query: the layout's to hide
    both = windowed(allowed, query_pos, key_pos, {"full_attention": None, "sliding_attention": 3})
    assert both["full_attention"] is allowed and torch.equal(both["sliding_attention"], seen)
    additive = windowed(to_additive_4d(allowed), query_pos, key_pos, {"sliding_attention": 3})
    assert torch.equal(additive, to_additive_4d(seen))


def test_space_layout_dynamic_example(capsys):
    """``space-layout --tree dynamic``: the planner's step from given draft probabilities, drawn."""
    from space.layout_cli import main

    def nodes(text):
        return [line for line in text.splitlines() if line.startswith("c") and ("mask " in line or "lookup " in line)]

    text = main(["--tree", "dynamic", "-k", "3", "--draft-probs", "[[0.8,0.1],[0.6,0.2],[0.3,0.1]]", "--lookup", "2"])
    assert capsys.readouterr().out.rstrip("\n") == text
    # the top draft of mask 0, a child of x beside the lookup child (rate 0.3): 0.8 * (1 - 0.3)
    assert "c1    1      x       mask 0 rank 0    0.560" in text
    assert "c2    2      c1      mask 1 rank 0    0.336" in text  # the path value: 0.56 * 0.6
    assert any(" lookup 1 " in line for line in nodes(text))
    assert "groups: G0 on x (3 masks), G1 on c1 (3 masks)" in text and "G1m2" in text
    assert "(0 pad)" in text and " pad " not in text
    confident = len(nodes(text))
    unsure = main(["--tree", "dynamic", "-k", "3", "--draft-probs", "[[0.05,0.02],[0.04,0.01],[0.01,0.005]]"])
    assert 1 <= len(nodes(unsure)) < confident
    # one draft only: the bucket (6 rows) holds x, its node, G0's 3 masks and one padding row
    padded = main(["--tree", "dynamic", "-k", "3", "--draft-probs", "[[0.9]]", "--num-groups", "1"])
    assert "rows: 1 + 1 node + 3 masks = 5 used, 6 in the block (1 pad)" in padded
    assert padded.splitlines()[-1] == "oo    | .....o   pad   pos 2"  # sees only itself
    # the default example and the static modes still draw
    assert "groups: G0 on x" in main(["--tree", "dynamic"])
    assert main(["--tree", "chain", "-k", "2", "--num-groups", "2"]) == DRAWING


def test_space_layout_tree_groups_stop_at_its_top1_chain():
    """A tree's mask groups sit on x and its top-1 chain only: [[0],[1]] with k = 3 has a chain
    of one node, so 2 groups by default, not k+1 = 4 (which failed: group rows past the tree)."""
    from space.layout_cli import main

    text = main(["--tree", "[[0],[1]]", "-k", "3"])
    assert "G1m2" in text and "G2m0" not in text and "c2" in text


def test_space_layout_draws_a_tree_s_groups_where_the_decoder_puts_them():
    """[[0],[1],[0,0]]: the top-1 chain is c1, c3 (c2 is c1's sibling). Catches groups drawn on
    the first rows of the breadth-first tree (G2 on c2, seeing x and c2) where the decoder's
    static step anchors them on the chain (G2 on c3, seeing x, c1, c3)."""
    from space.decoding import DecodeConfig, SpaceDecoder
    from space.decoding.decoder import Drafts
    from space.layout_cli import main
    from space.models import tiny_random_llama
    from space.tokens import add_mask_tokens

    text = main(["--tree", "[[0],[1],[0,0]]", "-k", "2", "--cache-len", "2"])
    drawn = [(line.split("|")[1].split()[0], int(line.split()[-1])) for line in text.splitlines()[1:]]
    model, tok = tiny_random_llama()
    dec = SpaceDecoder(model, add_mask_tokens(model, tok, mask_num=2), DecodeConfig(mask_num=2, tree=[[0], [1], [0, 0]]))
    lay, _, _ = dec.static_block(2, Drafts(torch.zeros(2, dec.draft_ranks, dtype=torch.long)), [])
    sees = ["".join("o" if v == 0 else "." for v in row) for row in lay.block_mask[0, 0].tolist()]
    assert lay.group_rows == (0, 1, 3)
    assert drawn == [(row, int(pos) + 2) for row, pos in zip(sees, lay.position_ids.tolist())]


def test_space_layout_draws_up_to_its_largest_drawing():
    """``--cache-len``, ``--seq-len`` and ``--spans`` lie in their low..MAX_DRAWN, both ends
    included (the bound is the largest drawing, stated in the error message). Catches an
    off-by-one that refused MAX_DRAWN itself, the largest value the message offers."""
    from space.layout_cli import MAX_DRAWN, main

    text = main(["-k", "1", "--cache-len", str(MAX_DRAWN)])
    assert f"pos {MAX_DRAWN}" in text
    assert main(["--mode", "train", "-k", "1", "--seq-len", str(MAX_DRAWN), "--spans", str(MAX_DRAWN - 1)])
    assert "x0    pos 0" in main(["-k", "1", "--cache-len", "0"])  # the low end: no cached token, the block alone


def test_space_layout_takes_num_candidates_with_the_chain_named():
    """``--tree chain`` is the default layout named: ``--num-candidates`` sizes it as without the flag
    (only a token tree, which sets its own nodes, refuses it)."""
    from space.layout_cli import main

    assert main(["--tree", "chain", "-k", "2", "--num-candidates", "1"]) == main(["-k", "2", "--num-candidates", "1"])


def test_render_labels_padding_and_groups_of_different_lengths():
    lay = build_layout(2, 2, [1, 2], [1, 2], parents=[-1, 0], pad_to=7)
    names = [line.split()[3] for line in render(lay).splitlines()[1:]]
    assert names == ["x", "c1", "G0m0", "G1m0", "G1m1", "pad", "pad"]


def test_train_layout_checks_tensor_span_starts():
    """A tensor of span starts is checked like a list: a start outside 1..seq_len is a ValueError,
    not a wrapped index."""
    from space.masking import train_layout

    for bad in (torch.tensor([0]), torch.tensor([9]), [0]):
        with pytest.raises(ValueError, match="group context"):
            train_layout(5, bad, 2)


def test_anchored_group_is_the_group_shift_rule():
    """DESIGN §3.5 with k+1 groups on the chain: an all-chain path of depth a drafts from G_a,
    offset 0; fewer groups shift; a path that leaves the chain after c nodes drafts from G_c."""
    assert anchored_group(0, 4, 0) == (0, 0)  # nothing accepted: G_0 from its first mask
    assert anchored_group(3, 4, 3) == (3, 0)  # the whole chain: its last group, unshifted
    assert anchored_group(3, 2, 3) == (1, 2)  # 2 groups: G_1, shifted past the 2 drafts accepted beyond it
    assert anchored_group(3, 4, 1) == (1, 2)  # left the chain after 1 node (a rank-1 sibling)
    assert anchored_group(2, 1, 0) == (0, 2)
    for bad in [(2, 0, 0), (1, 3, 2), (1, 3, -1)]:
        with pytest.raises(ValueError, match="anchored_group"):
            anchored_group(*bad)


def test_mask_rows_blocks_nest_and_restore():
    """A nested ``mask_rows`` block restores the outer start on exit: the compiled trunk clears it
    (``mask_rows(None)``) around each layer's graph and re-enters it inside, so a block that reset
    to None would leave every later layer of the step without its mask rows (the frozen-base
    LoRA off there, which a lossless check cannot see)."""
    from space.masking import mask_rows, mask_rows_start

    assert mask_rows_start() is None
    with mask_rows(4):
        with mask_rows(None):
            with mask_rows(2):
                assert mask_rows_start() == 2
            assert mask_rows_start() is None
        assert mask_rows_start() == 4
        with pytest.raises(RuntimeError):
            with mask_rows(1):
                raise RuntimeError
        assert mask_rows_start() == 4
    assert mask_rows_start() is None
