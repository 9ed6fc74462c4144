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
