"""space_loss against DESIGN §3.2's formula written out by hand: CE(AR rows) + lambda * CE(mask rows)."""
import pytest
import torch
import torch.nn.functional as F

from space.masking import IGNORE_INDEX
from space.train.loss import space_loss

K = 3


@pytest.mark.parametrize("weight", [0.0, 0.3, 2.5])
def test_mask_loss_is_weighted_by_lambda(weight):
    """lambda (``mask_loss_weight``) scales the mask rows' mean CE and nothing else: the loss is
    the AR rows' mean CE plus lambda times the mask rows' mean CE, ignored rows in neither. Every
    other test of the loss runs at a weight the token and teacher losses share, so a lambda that
    was dropped (or applied to the AR term) passed them."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 11, 30, generator=g)
    labels = torch.randint(0, 30, (2, 11), generator=g)
    labels[0, 1] = labels[1, 6] = IGNORE_INDEX  # an ignored AR row and an ignored mask row
    offsets = torch.tensor([-1] * 5 + [0, 1, 2] * 2).repeat(2, 1)
    ar, mask = (labels != IGNORE_INDEX) & (offsets < 0), (labels != IGNORE_INDEX) & (offsets >= 0)
    ar_mean = F.cross_entropy(logits[ar], labels[ar])
    mask_mean = F.cross_entropy(logits[mask], labels[mask])
    loss, _ = space_loss(logits, labels, offsets, weight, K)
    assert torch.allclose(loss, ar_mean + weight * mask_mean)
    assert abs(float(mask_mean) - float(ar_mean)) > 0.05  # lambda on the wrong term would show


def test_per_offset_accuracy_counts_top1_hits_of_scored_mask_rows():
    """Catches a wrong ``mask_acc_{j}`` (the logged predictor of acceptance, DESIGN §3.2): the hits
    of offset j are the scored mask rows of offset j whose argmax is their label, divided by those
    rows; ignored rows and AR rows count in neither. Other tests compare the accuracy of two
    losses computed by the same function, so a wrong hit rule (argmin, or a negated compare) passed."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 11, 30, generator=g)
    offsets = torch.tensor([-1] * 5 + [0, 1, 2] * 2).repeat(2, 1)
    labels = torch.randint(0, 30, (2, 11), generator=g)
    hit_rows = torch.tensor([[0, 5, 6, 9], [1, 8, 9, 10]])  # AR rows 0 and 1, mask rows elsewhere
    for b in range(2):
        labels[b, hit_rows[b]] = logits[b, hit_rows[b]].argmax(-1)
    labels[1, 10] = IGNORE_INDEX  # a scored hit turned into an ignored row
    _, stats = space_loss(logits, labels, offsets, 1.0, K)
    scored = (labels != IGNORE_INDEX) & (offsets >= 0)
    hit = scored & (logits.argmax(-1) == labels)
    expect_hits = [int((hit & (offsets == j)).sum()) for j in range(K)]
    expect_rows = [int((scored & (offsets == j)).sum()) for j in range(K)]
    assert expect_hits == [2, 3, 0] and expect_rows == [4, 4, 3]
    assert stats["mask_hits"].tolist() == expect_hits
    assert stats["mask_offset_rows"].tolist() == expect_rows


def test_teacher_loss_logs_the_token_ce_beside_the_soft_ce():
    """Catches ``mask_token_ce`` logging the optimized (teacher) loss instead of the token
    cross-entropy: with a teacher that is not one-hot the two differ, and only the token CE is
    comparable with a token-target run. (The one-hot teacher test cannot tell them apart.)"""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 11, 30, generator=g)
    labels = torch.randint(0, 30, (2, 11), generator=g)
    offsets = torch.tensor([-1] * 5 + [0, 1, 2] * 2).repeat(2, 1)
    spread = (torch.stack([labels, (labels + 1) % 30], -1), torch.full((2, 11, 2), 0.5))
    _, stats = space_loss(logits, labels, offsets, 1.0, K, teacher=spread)
    mask = offsets >= 0
    token_ce = F.cross_entropy(logits[mask], labels[mask], reduction="sum")
    logp = torch.log_softmax(logits[mask], -1)
    soft = -(0.5 * logp.gather(-1, spread[0][mask]).sum(-1)).sum()
    assert float(stats["mask_token_ce_sum"]) == pytest.approx(float(token_ce), rel=1e-5)
    assert float(stats["mask_loss_sum"]) == pytest.approx(float(soft), rel=1e-5)
    assert abs(float(token_ce) - float(soft)) > 0.5
