"""Metrics are sums and counts on the device, reduced once per log step (issue 59, finding 10;
STYLE item 20)."""
import pytest
import torch

from space.config import SpaceSettings
from space.train import metrics as metrics_module
from space.train.loss import space_loss
from space.train.metrics import MetricSums
from tests.syncs import SyncCounter

K = 3


def batch(seed, rows=12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, rows, 40, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, rows), generator=g)
    offsets = torch.tensor([-1, -1, -1, 0, 1, 2, 0, 1, 2, 0, 1, 2][:rows]).repeat(2, 1)
    return logits, labels, offsets


def test_loss_and_accumulator_read_nothing_back():
    """Each micro-batch made about 2k+3 ``.item()`` host syncs for its metrics before."""
    sums = MetricSums()
    inputs = [batch(seed) for seed in range(3)]
    with SyncCounter(holders=[inputs]) as syncs:  # the batches live on the device
        for logits, labels, offsets in inputs:
            loss, stats = space_loss(logits, labels, offsets, 1.0, K, chain_weight=0.5)
            sums.add(stats, short_samples=0, batches=1)
    assert syncs.kinds["read"] == 0, syncs.where
    assert sums.reduce()["mask_loss"] > 0  # the one read, at the log step


def test_reduce_is_one_all_reduce_of_sums_over_ranks(monkeypatch):
    """Two ranks with different row counts: accuracy is Σhits/Σrows over both, not a mean of ratios;
    one collective carries every metric."""
    calls = []
    other = MetricSums()  # the other rank's micro-batches
    _, other_stats = space_loss(*batch(7, rows=6), 1.0, K)
    other.add(other_stats, short_samples=1, batches=1)

    def all_reduce(flat):
        calls.append(flat.numel())
        keys = sorted(other.device)
        flat += torch.cat([other.device[k].reshape(-1) for k in keys]
                          + [torch.tensor([other.host[k] for k in sorted(other.host)])])

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    mine = MetricSums()
    stats = [space_loss(*batch(seed), 1.0, K)[1] for seed in (1, 2)]
    for s in stats:
        mine.add(s, short_samples=0, batches=1)
    got = mine.reduce()
    assert len(calls) == 1
    everything = [*stats, other_stats]
    for j in range(K):
        hits = sum(float(s["mask_hits"][j]) for s in everything)
        rows = sum(float(s["mask_offset_rows"][j]) for s in everything)
        assert got[f"mask_acc_{j}"] == round(hits / rows, 4)
    mask = sum(float(s["mask_loss_sum"]) for s in everything) / sum(float(s["mask_rows"]) for s in everything)
    assert got["mask_loss"] == round(mask, 4) and got["short_samples"] == round(1 / 3, 4)
    assert mine.reduce() == {}  # a new interval starts empty


def test_logged_names_are_the_ones_curves_and_tests_read():
    _, stats = space_loss(*batch(0), 1.0, K, teacher=None, chain_weight=0.3)
    sums = MetricSums()
    sums.add(stats)
    assert set(sums.reduce()) == {"ar_loss", "mask_loss", "chain_weight_mean", *(f"mask_acc_{j}" for j in range(K))}
    assert set(metrics_module.RATIOS) >= {"ar_loss", "mask_loss", "mask_token_ce", "consistency_loss"}
    assert SpaceSettings().mask_num >= 1


@pytest.mark.parametrize("mode", ["full", "frozen-base"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, mode):
    """Two micro-batches with different row counts, accumulated, give the gradient of the one batch
    holding both: each micro-batch's loss is its share of the step's mean (num_items_in_batch), not
    a mean of the micro-batches' means."""
    from transformers import TrainingArguments

    from space.adapter_layers import prepare_model
    from space.data.collator import SpaceCollator
    from space.models import tiny_random_llama
    from space.train.trainer import SpaceTrainer

    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    model, spec = prepare_model(model, tok, mode, K)
    collator = SpaceCollator(spec.ids_for(K), K, tok.pad_token_id, spans_per_sample=3)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 250, (n,), generator=g).tolist(), "prompt_len": 4, "idx": i}
            for i, n in enumerate((40, 12, 25))]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_accumulation_steps=2)
    trainer = SpaceTrainer(model=model, args=args, space=SpaceSettings(mode=mode, mask_num=K))
    micro, counts = trainer.get_batch_samples(iter([collator(rows[:1]), collator(rows[1:])]), 2, torch.device("cpu"))
    model.zero_grad()
    for b in micro:
        trainer.training_step(model, b, counts)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    trainer.compute_loss(model, collator(rows)).backward()
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, msg=name, atol=1e-6, rtol=1e-4)


def test_two_ranks_share_the_step_mean(tmp_path, monkeypatch):
    """Two ranks, each its own micro-batch of a different size: their losses, scaled for DDP's
    average over ranks (times the ranks, divided by the step's count over both ranks), average to
    the gradient of the one batch holding both. (A rank's own mean, or the missing factor, fails.)"""
    from transformers import TrainingArguments

    from space.adapter_layers import prepare_model
    from space.data.collator import SpaceCollator
    from space.models import tiny_random_llama
    from space.train.steps import scored_rows
    from space.train.trainer import SpaceTrainer

    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    model, spec = prepare_model(model, tok, "full", K)
    collator = SpaceCollator(spec.ids_for(K), K, tok.pad_token_id, spans_per_sample=3)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 250, (n,), generator=g).tolist(), "prompt_len": 4, "idx": i}
            for i, n in enumerate((40, 12, 25))]
    ranks = [collator(rows[:1]), collator(rows[1:])]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = SpaceTrainer(model=model, args=args, space=SpaceSettings(mode="full", mask_num=K))
    both = scored_rows(ranks[0]) + scored_rows(ranks[1])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda counts: counts.copy_(both))
    monkeypatch.setattr(type(trainer.accelerator.state), "num_processes", property(lambda self: 2), raising=False)
    assert trainer.accelerator.num_processes == 2
    grads = []
    for batch in ranks:  # each rank's gradient, as DDP computes it before averaging
        _, counts = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
        assert torch.equal(counts, both)
        model.zero_grad()
        trainer.compute_loss(model, batch, num_items_in_batch=counts).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    monkeypatch.undo()
    model.zero_grad()
    trainer.compute_loss(model, collator(rows)).backward()
    for name in grads[0]:
        torch.testing.assert_close((grads[0][name] + grads[1][name]) / 2, model.get_parameter(name).grad, msg=name,
                                   atol=1e-6, rtol=1e-4)


def test_an_interval_without_mask_rows_logs_no_mask_ratios():
    """A log interval whose samples were all too short for a span has no scored mask row: the mask
    ratios are left out of the log (a 0/0 would crash the run at its log step). Catches a ratio
    taken without checking its count."""
    logits, labels, _ = batch(3)
    sums = MetricSums()
    _, stats = space_loss(logits, labels, torch.full((2, 12), -1), 1.0, K, chain_weight=0.5)
    sums.add(stats, short_samples=2, batches=1)
    got = sums.reduce()
    assert got["ar_loss"] > 0 and got["short_samples"] == 2.0
    assert not any(k.startswith("mask_") or k.startswith("chain_") for k in got), got
