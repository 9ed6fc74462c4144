"""Acceptance-aware training options (issue 30): chain-weighted mask loss and hidden-state consistency."""
import pytest
import torch

from space.masking import IGNORE_INDEX
from space.train.loss import chain_weights, consistency_loss, space_loss
from space.train.metrics import MetricSums

K = 3


def logged(stats):
    """What the trainer would log for one micro-batch's stats."""
    sums = MetricSums()
    sums.add(stats)
    return sums.reduce()


def batch(seed=0, groups=4, real=5, vocab=50):
    """Logits, labels and offsets of a batch: ``real`` AR rows then ``groups`` groups of K masks."""
    g = torch.Generator().manual_seed(seed)
    rows = real + groups * K
    logits = torch.randn(2, rows, vocab, generator=g, requires_grad=True)
    labels = torch.randint(vocab, (2, rows), generator=g)
    labels[0, -1] = IGNORE_INDEX  # a target past the end of the sample
    offsets = torch.cat([torch.full((real,), -1), torch.arange(K).repeat(groups)]).expand(2, rows)
    return logits, labels, offsets


def test_chain_weights_are_products_over_the_group():
    offsets = torch.tensor([[-1, 0, 1, 2, 0, 1, 2]])
    p = torch.tensor([[0.9, 0.5, 0.4, 0.3, 1.0, 0.2, 0.7]])
    w = chain_weights(p, offsets)
    assert torch.allclose(w, torch.tensor([[0, 1, 0.5, 0.2, 1, 1, 0.2]]))


def test_chain_weighted_loss_equals_plain_loss_when_weights_are_one():
    logits, labels, offsets = batch()
    plain, _ = space_loss(logits, labels, offsets, 1.0, K)
    # a one-hot teacher on the true token: the chain reaches every offset, so every weight is 1
    ones = torch.ones(labels.shape[0], labels.shape[1], 1)
    teacher = (labels.clamp(min=0)[..., None], ones)
    weighted, m = space_loss(logits, labels, offsets, 1.0, K, teacher=teacher, chain_weight=1.0)
    soft, _ = space_loss(logits, labels, offsets, 1.0, K, teacher=teacher)
    assert logged(m)["chain_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(weighted, soft) and torch.allclose(soft, plain)
    off, _ = space_loss(logits, labels, offsets, 1.0, K, chain_weight=0.0)
    assert torch.equal(off, plain)


def test_chain_weights_take_no_gradient():
    """With the model's own probabilities as weights, the gradient is that of the loss with the
    same weights held constant: nothing flows through the weights."""
    logits, labels, offsets = batch(seed=1)
    loss, _ = space_loss(logits, labels, offsets, 1.0, K, chain_weight=1.0)
    (grad,) = torch.autograd.grad(loss, logits)

    valid = (labels != IGNORE_INDEX) & (offsets >= 0)
    p = torch.zeros(labels.shape)
    p[valid] = torch.softmax(logits[valid].detach(), -1).gather(-1, labels[valid][:, None]).squeeze(-1)
    w = chain_weights(p, offsets)[valid]
    ar_rows = (labels != IGNORE_INDEX) & (offsets < 0)
    ce = torch.nn.functional.cross_entropy
    manual = ce(logits[ar_rows], labels[ar_rows]) + (ce(logits[valid], labels[valid], reduction="none") * w).sum() / w.numel()
    (expected,) = torch.autograd.grad(manual, logits)
    assert torch.allclose(loss, manual) and torch.allclose(grad, expected, atol=1e-6)
    assert not torch.allclose(grad, torch.autograd.grad(space_loss(logits, labels, offsets, 1.0, K)[0], logits)[0])


def test_chain_weight_between_zero_and_one_mixes_plain_and_chain_weighted_rows():
    """Catches a wrong mix of ``chain_weight`` alpha: each mask row's CE is weighted by
    ``(1 - alpha) + alpha * chain``. The other loss tests run alpha = 0 (no weighting) or 1, where
    a weight of ``alpha * chain`` (the ``1 - alpha`` term dropped) or ``(1 - alpha) * chain + alpha``
    gives the same loss; at alpha = 0.3 they differ."""
    logits, labels, offsets = batch(seed=3)
    alpha = 0.3
    loss, stats = space_loss(logits, labels, offsets, 1.0, K, chain_weight=alpha)
    valid = (labels != IGNORE_INDEX) & (offsets >= 0)
    p = torch.zeros(labels.shape)
    p[valid] = torch.softmax(logits[valid].detach(), -1).gather(-1, labels[valid][:, None]).squeeze(-1)
    w = chain_weights(p, offsets)[valid]
    assert float(w.max() - w.min()) > 0.5  # the chain weights are far from all ones
    ar_rows = (labels != IGNORE_INDEX) & (offsets < 0)
    ce = torch.nn.functional.cross_entropy
    per_row = ce(logits[valid], labels[valid], reduction="none")
    mixed = (per_row * ((1 - alpha) + alpha * w)).sum()
    manual = ce(logits[ar_rows], labels[ar_rows]) + mixed / w.numel()
    assert torch.allclose(loss, manual)
    assert float(stats["mask_loss_sum"]) == pytest.approx(float(mixed.detach()), rel=1e-5)
    assert float(stats["chain_weight_sum"]) == pytest.approx(float(w.sum()), rel=1e-5)


def test_consistency_loss_is_zero_when_hidden_states_match():
    h = torch.randn(6, 16, requires_grad=True)
    assert consistency_loss(h, h.detach().clone()).item() == 0.0
    other = torch.randn(6, 16)
    loss = consistency_loss(h, other)
    assert loss.item() > 0
    loss.backward()
    assert torch.allclose(h.grad, 2 * (h.detach() - other) / h.numel())


def test_mask_consistency_reads_the_base_at_row_e_plus_j():
    from space.data.collator import SpaceCollator
    from space.train.steps import mask_consistency

    col = SpaceCollator(torch.tensor([999]), K, 0, span_density=1.0)
    g = torch.Generator().manual_seed(2)
    batch = col([{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist(), "prompt_len": 3, "idx": i}
                 for i, n in enumerate((14, 9))])
    T, M = batch["num_real"], batch["input_ids"].shape[1] - batch["num_real"]
    base, masks = torch.randn(2, T, 8, generator=g), torch.randn(2, M, 8, generator=g)
    rows = slice(0, M)
    manual = []
    for b in range(2):
        for m in range(M):
            if batch["labels"][b, T + m] != IGNORE_INDEX and batch["mask_offset"][b, T + m] >= 0:
                manual.append(masks[b, m] - base[b, int(batch["position_ids"][b, T + m])])
    expected = torch.stack(manual).pow(2).mean()
    assert torch.allclose(mask_consistency(masks, base, batch, rows), expected)


def test_acceptance_options_train_end_to_end(tmp_path):
    import json

    from space.config import parse_train_args
    from space.train.run import run_sft

    args = parse_train_args([
        "--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path), "--limit", "2",
        "--max_steps", "2", "--save_steps", "1000", "--logging_steps", "1", "--mask_num", "3",
        "--chain_weight", "0.5", "--consistency_weight", "0.1", "--mask_chunk_rows", "6"])
    run_sft(*args)
    logs = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "mask_loss" in h]
    assert logs and "consistency_loss" in logs[0] and 0 < logs[0]["chain_weight_mean"] <= 1
    for bad, match in ((["--chain_weight", "1.5"], "chain_weight"), (["--consistency_weight", "nan"], "consistency_weight"),
                       (["--consistency_weight", "1", "--mode", "lora"], "consistency_weight needs")):
        with pytest.raises(ValueError, match=match):
            parse_train_args(["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "x"), *bad])


def test_teacher_chain_weights_use_the_teachers_probability_of_the_true_token():
    """With a teacher, the chain weight of mask j is the product of the teacher's probabilities of
    the true tokens at offsets 0..j-1, not of its top-1 probability: the two agree only for a one-hot teacher on the true token, the case above."""
    logits = torch.randn(1, 3, 10, generator=torch.Generator().manual_seed(3))
    labels, offsets = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    ids = torch.tensor([[[5, 1], [2, 6], [7, 8]]])  # true token second, first, absent
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]])
    loss, stats = space_loss(logits, labels, offsets, 1.0, K, teacher=(ids, probs), chain_weight=1.0)
    chain = torch.tensor([1.0, 0.3, 0.3 * 0.6])
    assert float(stats["chain_weight_sum"]) == pytest.approx(float(chain.sum()), abs=1e-6)
    logp = torch.log_softmax(logits[0], -1)
    soft = -(probs[0] * logp.gather(-1, ids[0])).sum(-1)
    assert torch.allclose(loss, (soft * chain).mean())
