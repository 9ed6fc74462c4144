"""The SAR-SFT collator against DESIGN §3.1-§3.2, row by row."""
import pytest
import torch

from space.data.collator import SpaceCollator
from space.masking import IGNORE_INDEX

MASK, PAD = 999, 0


def features(lengths, prompt_len=3):
    return [{"input_ids": list(range(100 * (i + 1), 100 * (i + 1) + n)), "prompt_len": prompt_len, "idx": i}
            for i, n in enumerate(lengths)]


def spans_of(batch, b, k):
    """Span start of each mask group in sample b, read back from positions (mask 0 sits at s)."""
    off, pos = batch["mask_offset"][b], batch["position_ids"][b]
    return [int(pos[r]) for r in range(off.numel()) if off[r] == 0]


@pytest.mark.parametrize("layout", ["efficient", "truncate"])
def test_rows_follow_design(layout):
    k = 3
    col = SpaceCollator(torch.tensor([MASK]), k, PAD, spans_per_sample=3, layout=layout, seed=1)
    feats = features([12, 9, 20])
    batch = col(feats)
    T, Q = batch["num_real"], batch["input_ids"].shape[1]
    allowed = batch["attention_mask"][:, 0] == 0
    for b, f in enumerate(feats):
        x = torch.tensor(f["input_ids"])
        spans = spans_of(batch, b, k)
        assert spans and all(f["prompt_len"] <= s <= len(x) - 2 for s in spans)
        n_real = spans[0] if layout == "truncate" else len(x)
        # real rows: causal, next-token labels after the prompt, no mask visible
        for r in range(n_real):
            assert batch["position_ids"][b, r] == r
            assert allowed[b, r].nonzero().flatten().tolist() == list(range(r + 1))
            want = int(x[r + 1]) if r + 1 < len(x) and r + 1 >= f["prompt_len"] else IGNORE_INDEX
            if layout == "truncate" and r + 1 >= n_real:
                want = int(x[r + 1])  # predicts x_s, the token the cut removed
            assert batch["labels"][b, r] == want
        mask_rows = [r for r in range(T, Q) if batch["mask_offset"][b, r] >= 0]
        groups = {}
        for r in mask_rows:
            j = int(batch["mask_offset"][b, r])
            if j == 0:
                groups[r] = r
            start = max(g for g in groups if g <= r)
            s = int(batch["position_ids"][b, start])
            assert batch["input_ids"][b, r] == MASK and batch["position_ids"][b, r] == s + j
            visible = allowed[b, r].nonzero().flatten().tolist()
            assert visible == list(range(s)) + list(range(start, r + 1))
            want = int(x[s + j + 1]) if s + j + 1 < len(x) else IGNORE_INDEX
            if layout == "truncate" and j == k:
                want = IGNORE_INDEX  # the dummy mask
            assert batch["labels"][b, r] == want
        assert len(mask_rows) == len(spans) * (k + (layout == "truncate"))
    # padding rows see only themselves and carry no target
    pad_rows = (batch["input_ids"] == PAD) & (batch["labels"] == IGNORE_INDEX)
    for b, r in pad_rows.nonzero().tolist():
        assert allowed[b, r].nonzero().flatten().tolist() == [r]


def test_spans_fresh_per_epoch_and_repeatable():
    col = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=2, seed=7)
    feats = features([40, 40, 40])
    first = [spans_of(col(feats), b, 2) for b in range(3)]
    again = [spans_of(col(feats), b, 2) for b in range(3)]
    col.epoch = 1
    second = [spans_of(col(feats), b, 2) for b in range(3)]
    assert first == again and first != second
    other_seed = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=2, seed=8)
    assert [spans_of(other_seed(feats), b, 2) for b in range(3)] != first


def test_short_samples_kept_for_ar_and_counted():
    col = SpaceCollator(torch.tensor([MASK]), 3, PAD)
    batch = col(features([4, 12], prompt_len=3))  # 4 tokens, prompt 3: no room for a span
    assert batch["num_short"] == 1
    assert (batch["mask_offset"][0] == -1).all() and (batch["labels"][0, :3] != IGNORE_INDEX).sum() == 1


def test_mask_prob_zero_gives_ar_only():
    col = SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=0.0)
    assert (col(features([30, 30]))["mask_offset"] == -1).all()


def test_bad_collator_arguments():
    with pytest.raises(ValueError, match="mask_num"):
        SpaceCollator(torch.tensor([MASK]), 0, PAD)
    with pytest.raises(ValueError, match="layout"):
        SpaceCollator(torch.tensor([MASK]), 2, PAD, layout="other")
