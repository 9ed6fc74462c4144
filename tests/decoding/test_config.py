"""DecodeConfig (space/decoding/config.py): a k override that keeps a layout valid, and the
layout's tokens-per-step cap on layouts whose cap DESIGN §3.5 gives."""
import pytest

from space.decoding import DecodeConfig


def test_a_k_override_caps_the_groups_and_prunes_the_tree():
    """``--mask-num`` over an adapter's recorded layout: a smaller k caps num_groups at k+1 and
    prunes the tree to k deep, instead of refusing the recorded layout (num_groups 6 > k+1 = 3)."""
    cfg = DecodeConfig(5, 6, tree=[[0], [1], [0, 0], [0, 0, 0]], lookup_tokens=4)
    small = cfg.override(mask_num=2)
    assert (small.mask_num, small.num_groups, small.tree, small.lookup_tokens) == (2, 3, ((0,), (1,), (0, 0)), 4)
    assert cfg.override(mask_num=2, num_groups=1).num_groups == 1  # an explicit num_groups wins
    assert DecodeConfig(5, 2).override(mask_num=3).num_groups == 2  # under the cap: kept
    assert DecodeConfig(5).override(mask_num=3).groups == 4  # unset: k+1 of the new k


@pytest.mark.parametrize("config, cap", [
    (DecodeConfig(5), 6.0),  # k+1 groups: every step can accept all k drafts
    (DecodeConfig(1, 1), 1.5),  # DESIGN §3.5: every accepting step is followed by one without a candidate
    (DecodeConfig(3, 1), 2.5),  # 1 token, then 3 + 1 after G_0 shifted by 3 left no candidate: (1 + 4) / 2
    (DecodeConfig(2, 3, tree=[[0], [1], [0, 0]]), 3.0),  # the tree's top-1 chain is 2 deep
])
def test_max_tokens_per_step(config, cap):
    """The cap counts the bonus token: all k drafts and the bonus (k+1), not k."""
    assert config.max_tokens_per_step() == pytest.approx(cap)


def test_unknown_decode_settings_are_a_value_error():
    """A recorded layout (``space_config.json``'s "decode") with a misspelt key fails as a ValueError
    naming it, which the commands print as one line; not as a TypeError with a traceback."""
    with pytest.raises(ValueError, match=r"unknown decode settings \['groups'\]"):
        DecodeConfig.from_dict({"mask_num": 3, "groups": 2})
    assert DecodeConfig.from_dict(DecodeConfig(3, 2, tree=[[0], [1]]).to_dict()) == DecodeConfig(3, 2, tree=[[0], [1]])


def test_lookup_branches_above_one_need_the_dynamic_tree_with_lookup():
    """``--lookup-branches`` is read by the dynamic tree with prompt lookup alone. Catches the check
    passing a dynamic tree without lookup (the flag left unread, 1 recorded) or refusing 1 / unset."""
    with pytest.raises(ValueError, match="needs the dynamic tree with prompt lookup"):
        DecodeConfig(2, tree="dynamic").check_lookup_branches(3)
    with pytest.raises(ValueError, match="this layout: tree chain, lookup_tokens 4"):
        DecodeConfig(2, lookup_tokens=4).check_lookup_branches(2)
    DecodeConfig(2, tree="dynamic", lookup_tokens=4).check_lookup_branches(3)
    for given in (None, 1):
        DecodeConfig(2).check_lookup_branches(given)
