"""Dense supervision, chunked mask rows and teacher targets (issue 13; DESIGN §3.2, §3.6)."""
import dataclasses
import json

import pytest
import torch
from transformers import TrainingArguments

from space.adapter_layers import prepare_model
from space.config import parse_train_args
from space.data.collator import SpaceCollator
from space.masking import IGNORE_INDEX, targets, train_layout
from space.models import load_model
from space.train.loss import space_loss, teacher_targets
from space.train.run import run_sft
from space.config import SpaceSettings
from space.train.metrics import MetricSums
from space.train.steps import real_pass
from space.train.trainer import SpaceTrainer

MASK, PAD, K = 999, 0, 3


def features(lengths, prompt_len=4):
    return [{"input_ids": list(range(10 * (i + 1), 10 * (i + 1) + n)), "prompt_len": prompt_len, "idx": i}
            for i, n in enumerate(lengths)]


def test_dense_collator_rows_match_layout_core():
    """span_density 1: a group at every answer position, each sample's rows exactly train_layout's."""
    col = SpaceCollator(torch.tensor([MASK]), K, PAD, span_density=1.0)
    feats = features([15, 9, 22])
    batch = col(feats)
    T = batch["num_real"]
    for b, f in enumerate(feats):
        ids = torch.tensor(f["input_ids"])
        spans = list(range(f["prompt_len"], len(ids) - 1))  # every s with a target x_{s+1}
        lay = train_layout(len(ids), spans, K)
        slot = torch.cat([torch.arange(len(ids)), T + torch.arange(len(spans) * K)])
        assert torch.equal(batch["input_ids"][b, slot], lay.input_ids(ids, torch.tensor([MASK])))
        assert torch.equal(batch["position_ids"][b, slot], lay.position_ids)
        assert torch.equal(batch["labels"][b, slot], targets(lay, ids, first_target=f["prompt_len"]))
        allowed = batch["attention_mask"][b, 0]
        assert torch.equal(allowed[slot[:, None], slot[None, :]], lay.allowed)
        assert (batch["mask_offset"][b, T + len(spans) * K:] == -1).all()  # the rest is padding


def test_span_density_counts_and_checks():
    col = SpaceCollator(torch.tensor([MASK]), K, PAD, span_density=0.25, spans_per_sample=1)
    batch = col(features([44]))  # 44 tokens, prompt 4: anchors 4..42, 39 of them -> ceil(9.75) = 10
    assert int((batch["mask_offset"][0] == 0).sum()) == 10
    with pytest.raises(ValueError, match="span_density"):
        SpaceCollator(torch.tensor([MASK]), K, PAD, span_density=1.5)
    with pytest.raises(ValueError, match="efficient"):
        SpaceCollator(torch.tensor([MASK]), K, PAD, span_density=0.5, layout="truncate")


def logged(stats):
    """What the trainer would log for one micro-batch's stats."""
    sums = MetricSums()
    sums.add(stats)
    return sums.reduce()


def test_teacher_loss_equals_token_ce_for_one_hot_teacher():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 50, generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :2] = IGNORE_INDEX
    offsets = torch.tensor([[-1, -1, 0, 1, 2, 0, 1, 2, -1], [0, 1, 2, 0, 1, 2, 0, 1, 2]])
    token, tm = space_loss(logits, labels, offsets, 0.7, 3)
    one_hot = (labels.clamp(min=0)[..., None], torch.ones(2, 9, 1))
    teacher, m = space_loss(logits, labels, offsets, 0.7, 3, teacher=one_hot)
    tm, m = logged(tm), logged(m)
    assert torch.allclose(token, teacher) and m["mask_loss"] == pytest.approx(tm["mask_loss"])
    assert m["mask_token_ce"] == pytest.approx(tm["mask_loss"]) and m["mask_acc_0"] == tm["mask_acc_0"]
    spread = (torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 1) % 50], -1), torch.full((2, 9, 2), 0.5))
    assert not torch.allclose(space_loss(logits, labels, offsets, 0.7, 3, teacher=spread)[0], token)


@pytest.fixture(scope="module")
def frozen():
    model, tok = load_model("tiny-random-llama")
    model, spec = prepare_model(model, tok, "frozen-base", K)
    torch.manual_seed(0)
    for name, p in model.named_parameters():  # a non-zero LoRA update and distinct mask rows
        if "lora_B" in name or "mask_rows" in name:
            torch.nn.init.normal_(p, std=0.5)
    col = SpaceCollator(spec.ids_for(K), K, tok.pad_token_id, span_density=1.0)
    g = torch.Generator().manual_seed(1)
    batch = col([{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist(), "prompt_len": 5, "idx": i}
                 for i, n in enumerate((30, 21))])
    return model, spec, batch


def test_teacher_rows_are_the_base_at_row_e_plus_j(frozen):
    """Mask j anchored at e learns the frozen base's top-K at real row e+j (not e+j+1, not e)."""
    model, spec, batch = frozen
    T = batch["num_real"]
    _, hidden = real_pass(model, batch)
    head = model.get_base_model().get_output_embeddings()
    ids, probs = teacher_targets(head, hidden, batch, topk=4, suppress_ids=spec.token_ids)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=batch["input_ids"][:, :T]).logits  # (batch, T, vocab), plain causal
    base[..., list(spec.token_ids)] = float("-inf")
    checked = 0
    for b, m in ((batch["labels"][:, T:] != IGNORE_INDEX) & (batch["mask_offset"][:, T:] >= 0)).nonzero().tolist():
        row = int(batch["position_ids"][b, T + m])  # e + j
        top = base[b, row].topk(4)
        assert torch.equal(ids[b, m], top.indices)
        assert torch.allclose(probs[b, m], torch.softmax(top.values, -1), atol=1e-5)
        checked += 1
    assert checked > 40


def test_teacher_never_proposes_a_suppressed_token():
    """Catches ``teacher_targets`` ignoring ``suppress_ids`` (the mask tokens): a base whose head
    favours a mask token would teach the mask rows to draft it, a token decoding never emits. The
    teacher is then the top-K of the other tokens, renormalized over those K. The frozen-base
    tests above never see it: a fresh mask token's logit is never in the base's top K."""
    col = SpaceCollator(torch.tensor([MASK]), K, PAD, span_density=1.0)
    batch = col(features([12, 9]))
    T = batch["num_real"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, T, 8, generator=g)
    head = torch.nn.Linear(8, 20)
    with torch.no_grad():
        head.weight.copy_(torch.randn(20, 8, generator=g))
        head.bias.zero_()
        head.bias[[7, 3]] = torch.tensor([100.0, 50.0])  # the two suppressed tokens top every row
    scored = (batch["labels"][:, T:] != IGNORE_INDEX) & (batch["mask_offset"][:, T:] >= 0)
    assert int(scored.sum()) > 10
    plain, _ = teacher_targets(head, hidden, batch, topk=4)
    assert (plain[scored][:, :2] == torch.tensor([7, 3])).all()  # the control: they would be taught
    ids, probs = teacher_targets(head, hidden, batch, topk=4, suppress_ids=(7, 3))
    assert not torch.isin(ids[scored], torch.tensor([7, 3])).any()
    torch.testing.assert_close(probs[scored].sum(-1), torch.ones(int(scored.sum())))
    with torch.no_grad():
        b, m = scored.nonzero(as_tuple=True)
        logits = head(hidden[b, batch["position_ids"][:, T:][b, m]])
        logits[:, [7, 3]] = float("-inf")
    assert torch.equal(ids[scored], logits.topk(4).indices)


@pytest.mark.parametrize("k", [1, 3])
def test_teacher_refuses_the_truncate_layout_by_name(k):
    """Catches an off-by-one in ``teacher_targets``' check that every mask row's real row e+j lies
    in the sample: the truncate layout cuts the sample at s, so even mask 0 (row s) has no teacher
    row. With k = 1 that row is exactly T: a ``> T`` check let it through to an IndexError."""
    col = SpaceCollator(torch.tensor([MASK]), k, PAD, layout="truncate")
    batch = col(features([12, 9]))
    hidden = torch.zeros(2, batch["num_real"], 8)
    with pytest.raises(ValueError, match="efficient layout"):
        teacher_targets(torch.nn.Linear(8, 20), hidden, batch, topk=2)


@pytest.mark.parametrize("arch, overrides", [("Granite", dict(logits_scaling=8.0)), ("Cohere", dict(logit_scale=0.0625))])
def test_teacher_rows_are_the_models_own_distribution_where_it_scales_its_logits(arch, overrides):
    """The teacher was softmax(lm_head(h)), skipping what the causal-LM forward does after the head
    (Granite divides by logits_scaling, Cohere scales, Gemma 2+ soft-caps), which the decoders apply:
    a Granite teacher 8x sharper than the model, which frozen mask rows cannot match. It is now the
    model's own logits' top-K (``steps.causal_lm_head``)."""
    import transformers

    from space.models import tiny_tokenizer
    from space.train.steps import causal_lm_head

    config = getattr(transformers, f"{arch}Config")(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.2, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    tok = tiny_tokenizer()
    model, spec = prepare_model(model, tok, "frozen-base", K)
    col = SpaceCollator(spec.ids_for(K), K, tok.pad_token_id, span_density=1.0)
    g = torch.Generator().manual_seed(1)
    batch = col([{"input_ids": torch.randint(11, 250, (24,), generator=g).tolist(), "prompt_len": 5, "idx": 0}])
    T = batch["num_real"]
    _, hidden = real_pass(model, batch)
    ids, probs = teacher_targets(causal_lm_head(model), hidden, batch, topk=4, suppress_ids=spec.token_ids)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=batch["input_ids"][:, :T]).logits  # the forward's own scaling included
    base[..., list(spec.token_ids)] = float("-inf")
    for b, m in ((batch["labels"][:, T:] != IGNORE_INDEX) & (batch["mask_offset"][:, T:] >= 0)).nonzero().tolist():
        top = base[b, int(batch["position_ids"][b, T + m])].topk(4)
        assert torch.equal(ids[b, m], top.indices)
        assert torch.allclose(probs[b, m], torch.softmax(top.values, -1), atol=1e-5), (b, m)


@pytest.mark.parametrize("target,chain,consistency", [("token", 0, 0), ("teacher", 0, 0), ("teacher", 0.5, 1.0),
                                                      ("token", 1.0, 0.3)])
def test_chunked_loss_and_gradients_equal_unchunked(frozen, tmp_path, target, chain, consistency):
    model, spec, batch = frozen
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    space = SpaceSettings(mask_num=K, mask_target=target, teacher_topk=5, suppress_ids=spec.token_ids,
                          chain_weight=chain, consistency_weight=consistency)
    trainer = SpaceTrainer(model=model, args=args, space=space)
    model.train()
    results = []
    for chunk_rows in (0, 7):  # 7 rows -> chunks of 2 groups (6 rows): 72 mask columns in 12 chunks
        trainer.space = dataclasses.replace(space, mask_chunk_rows=chunk_rows)
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads, trainer.metrics.reduce()))
    (loss0, g0, m0), (loss1, g1, m1) = results
    assert m0.keys() == m1.keys() and all(m0[k] == pytest.approx(m1[k], abs=2e-4) for k in m0)
    assert torch.allclose(loss0, loss1, atol=1e-5)
    assert all(torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4) for n in g0)
    assert any(g.abs().sum() > 0 for g in g0.values())


def test_teacher_and_dense_train_end_to_end(tmp_path):
    args = parse_train_args([
        "--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path), "--limit", "2",
        "--max_steps", "2", "--save_steps", "1000", "--logging_steps", "1", "--mask_num", "3",
        "--mask_target", "teacher", "--teacher_topk", "8", "--span_density", "0.5", "--mask_chunk_rows", "12"])
    run_sft(*args)
    logs = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "mask_loss" in h]
    assert logs and "mask_token_ce" in logs[0] and "mask_acc_0" in logs[0]
    bad = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "x"), "--mask_target", "teacher"]
    with pytest.raises(ValueError, match="teacher needs mode frozen-base"):
        parse_train_args([*bad, "--mode", "lora"])
    args = parse_train_args(bad)
    args[0].mode = "lora"  # a Python caller that builds its own arguments gets the same check
    with pytest.raises(ValueError, match="teacher needs mode frozen-base"):
        run_sft(*args)
