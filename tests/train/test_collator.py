"""The SAR-SFT collator against DESIGN §3.1-§3.2, row by row."""
import dataclasses
import random

import pytest
import torch

from space.data.collator import SpaceCollator
from space.masking import IGNORE_INDEX, build_layout, targets, to_additive_4d, train_layout, truncate_layout

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
    allowed = batch["attention_mask"][:, 0]
    assert allowed.dtype == torch.bool and batch["attention_mask"].shape == (len(feats), 1, Q, Q)
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


def reference_batch(col: SpaceCollator, features: list[dict]) -> dict:
    """The collator's batch the slow, obvious way: each sample's layout from the general builder
    (``build_layout``), its rows placed one by one, padding rows seeing only themselves; one
    padding mask column when no sample drew a group."""
    k, rows = col.mask_num, []
    for f in features:
        ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
        p = int(f["prompt_len"])
        spans = col.draw_spans(len(ids), p, int(f.get("idx", 0)))
        mask_ids = col.mask_ids.expand(k) if col.mask_ids.numel() == 1 else col.mask_ids
        if col.layout == "truncate" and spans:
            lay = build_layout(0, spans[0], spans[:1], k + 1)
            tgt = targets(lay, ids, first_target=p, drop_offset=k)
            block = lay.input_ids(ids[: spans[0]], torch.cat([mask_ids, mask_ids[-1:]]))
        else:
            lay = build_layout(0, len(ids), spans, k)
            tgt, block = targets(lay, ids, first_target=p), lay.input_ids(ids, mask_ids)
        rows.append((lay, block, tgt))
    T = max(lay.num_real for lay, _, _ in rows)
    Q = T + max(1, max(lay.num_rows - lay.num_real for lay, _, _ in rows))  # a padding mask column at least
    out = {"input_ids": torch.full((len(rows), Q), col.pad_id), "labels": torch.full((len(rows), Q), IGNORE_INDEX),
           "position_ids": torch.zeros(len(rows), Q, dtype=torch.long),
           "mask_offset": torch.full((len(rows), Q), -1),
           "attention_mask": torch.zeros(len(rows), 1, Q, Q, dtype=torch.bool)}
    for b, (lay, block, tgt) in enumerate(rows):
        slot = [r if r < lay.num_real else T + r - lay.num_real for r in range(lay.num_rows)]
        for r, sr in enumerate(slot):
            out["input_ids"][b, sr], out["labels"][b, sr] = block[r], tgt[r]
            out["position_ids"][b, sr], out["mask_offset"][b, sr] = lay.position_ids[r], lay.mask_offset[r]
            out["attention_mask"][b, 0, sr, slot] = lay.allowed[r]
        for r in sorted(set(range(Q)) - set(slot)):
            out["attention_mask"][b, 0, r, r] = True
    out["num_real"] = T
    return out


def random_case(rng: random.Random, layout: str):
    k = rng.randint(1, 6)
    mask_ids = torch.tensor([MASK]) if rng.random() < 0.5 else MASK + torch.arange(k)  # mask_diff: one per offset
    col = SpaceCollator(mask_ids, k, PAD, mask_prob=rng.choice([1.0, 0.5, 0.0]), spans_per_sample=rng.randint(1, 4),
                        layout=layout, seed=rng.randint(0, 99), epoch=rng.randint(0, 3),
                        span_density=rng.choice([0.0, 0.0, 0.3, 1.0]) if layout == "efficient" else 0.0)
    feats = []
    for i in range(rng.randint(1, 4)):
        n = rng.randint(1, 40)  # some too short for a span, so padding of every kind
        ids = [rng.randint(1, 500) for _ in range(n)]
        feats.append({"input_ids": ids if rng.random() < 0.5 else torch.tensor(ids), "idx": rng.randint(0, 10**6),
                      "prompt_len": rng.randint(0, n)})
    return col, feats


@pytest.mark.parametrize("layout", ["efficient", "truncate"])
def test_batch_equals_reference(layout):
    """Random batches (sizes, lengths, prompts, k, spans, mask_prob, dense groups, mask_diff): the
    collator's batch is exactly the one-row-at-a-time reference, boolean mask included."""
    rng = random.Random(layout)
    seen = {"padded": 0, "no_span": 0, "groups": 0}
    for _ in range(60):
        col, feats = random_case(rng, layout)
        got, want = col(feats), reference_batch(col, feats)
        assert got["attention_mask"].dtype == torch.bool
        assert set(want) <= set(got) and got["num_short"] >= 0
        for key, value in want.items():
            assert (torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value), key
        real = got["num_real"]
        seen["padded"] += any(len(f["input_ids"]) < real for f in feats)
        seen["no_span"] += bool((got["mask_offset"] == -1).all(1).any())
        seen["groups"] += bool((got["mask_offset"] >= 0).any())
    assert all(seen.values()), seen  # the random cases covered padding, span-less samples and groups


def test_reference_catches_a_wrong_mask():
    """The comparison above fails on any one wrong entry of the mask: a mask row that also sees
    the real row it predicts, a real row that sees a mask, a padding row that sees row 0."""
    col = SpaceCollator(torch.tensor([MASK]), 3, PAD, spans_per_sample=2, seed=3)
    feats = features([14, 9])
    got, want = col(feats), reference_batch(col, feats)
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    T, r = got["num_real"], int((got["mask_offset"][0] == 0).nonzero()[0])
    s = int(got["position_ids"][0, r])
    for b, row, column in ((0, r, s), (0, s, r), (1, 12, 0)):
        wrong = got["attention_mask"].clone()
        wrong[b, 0, row, column] ^= True
        assert not torch.equal(wrong, want["attention_mask"])
    assert not want["attention_mask"][0, 0, r, s] and want["attention_mask"][0, 0, r, s - 1]


def test_train_layouts_equal_general_builder():
    """train_layout / truncate_layout (the collator's fast chain builders) give exactly
    build_layout's Layout, every field."""
    rng = random.Random(0)
    for _ in range(60):
        n, k = rng.randint(1, 30), rng.randint(1, 6)
        spans = [rng.randint(1, n) for _ in range(rng.randint(0, 5))]  # any order, repeats allowed
        s = rng.randint(1, n)
        for fast, slow in ((train_layout(n, spans, k), build_layout(0, n, spans, k)),
                           (train_layout(n, torch.tensor(spans, dtype=torch.long), k), build_layout(0, n, spans, k)),
                           (truncate_layout(s, k), build_layout(0, s, [s], k + 1))):
            for f in dataclasses.fields(fast):
                a, b = getattr(fast, f.name), getattr(slow, f.name)
                if isinstance(a, torch.Tensor):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
                else:
                    assert a == b, f.name
    for bad in ((0, 3, [1], 0), (0, 3, [4], 2), (0, 3, [0], 2), (0, 0, [], 2)):
        with pytest.raises(ValueError) as slow_error:
            build_layout(*bad)
        with pytest.raises(ValueError) as fast_error:
            train_layout(*bad[1:])
        assert str(fast_error.value) == str(slow_error.value)


def test_additive_mask_from_the_collator_mask():
    """to_additive_4d takes the collator's (B, 1, Q, Q) bool as is: 0 where allowed, dtype min elsewhere."""
    batch = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=2)(features([12, 7]))
    allowed = batch["attention_mask"]
    for dtype in (torch.float32, torch.bfloat16):
        add = to_additive_4d(allowed, dtype)
        assert add.dtype == dtype and add.shape == allowed.shape
        assert torch.equal(add == 0, allowed) and (add[~allowed] == torch.finfo(dtype).min).all()
        assert torch.equal(add, to_additive_4d(allowed[:, 0], dtype))
    with pytest.raises(ValueError, match="batch, 1, q, kv"):
        to_additive_4d(allowed.expand(-1, 2, -1, -1))


def test_bool_mask_runs_like_the_additive_one(tiny):
    """The model (SDPA) reads the collator's bool mask as the additive mask it replaced."""
    model, _, spec = tiny
    col = SpaceCollator(spec.ids_for(3), 3, PAD, spans_per_sample=2, seed=5)
    batch = col([{"input_ids": list(range(10, 10 + n)), "prompt_len": 2, "idx": i} for i, n in enumerate([16, 9])])
    kw = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    with torch.no_grad():
        got = model(**kw, attention_mask=batch["attention_mask"]).logits
        want = model(**kw, attention_mask=to_additive_4d(batch["attention_mask"])).logits
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["efficient", "truncate"])
def test_mask_diff_rows_carry_their_offsets_id(layout):
    """With one mask token per offset (``mask_diff``), mask j's input id is mask_ids[j] (the
    truncate layout's dummy mask k repeats the last one). The reference batch builds its ids with
    the same ``Layout.input_ids``, so it cannot catch a wrong id per offset; this reads them."""
    k = 3
    ids = MASK + torch.arange(k)
    batch = SpaceCollator(ids, k, PAD, spans_per_sample=3, layout=layout, seed=2)(features([20, 14]))
    rows = batch["mask_offset"] >= 0
    offsets = batch["mask_offset"][rows]
    assert rows.any() and int(offsets.max()) == k - (layout == "efficient")
    assert torch.equal(batch["input_ids"][rows], ids[offsets.clamp(max=k - 1)])


def test_spans_depend_on_the_sample_index():
    """Spans are drawn from (seed, epoch, sample idx): two samples of the same length and prompt
    but different idx get different spans (a seed without idx gives every such sample the same)."""
    col = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=2, seed=7)
    same = [{"input_ids": list(range(100, 140)), "prompt_len": 3, "idx": i} for i in range(4)]
    batch = col(same)
    drawn = [spans_of(batch, b, 2) for b in range(4)]
    assert len({tuple(s) for s in drawn}) > 1, drawn
    assert col.draw_spans(40, 3, 2) == drawn[2]  # and the idx, not the place in the batch, decides
    assert spans_of(col([same[2], same[0]]), 0, 2) == drawn[2]


def test_a_large_seed_draws_spans():
    """HF accepts any seed numpy takes (below 2**32); the mixed span seed must stay in the
    generator's range. Catches a seed of 20240101 (a date) overflowing at the first batch, after
    the model had loaded."""
    for seed in (20240101, 2**32 - 1):
        col = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=2, seed=seed)
        assert len(col.draw_spans(40, 3, 5)) == 2


def test_every_anchor_is_used_when_spans_per_sample_covers_them():
    """A sample with A eligible anchors (s in max(prompt, 1)..len-2) gets min(spans_per_sample, A)
    groups: one anchor (len = prompt + 2) gives one group, not none."""
    col = SpaceCollator(torch.tensor([MASK]), 2, PAD, spans_per_sample=4, seed=0)
    for n, want in ((5, [3]), (6, [3, 4]), (7, [3, 4, 5]), (20, None)):
        spans = col.draw_spans(n, 3, 0)
        assert (spans == want) if want else (len(spans) == 4)
    batch = col(features([5], prompt_len=3))
    assert spans_of(batch, 0, 2) == [3] and batch["num_short"] == 0


def test_num_short_counts_only_samples_too_short_for_a_span():
    """``num_short`` (logged as short_samples) counts samples with no room for a span; one that
    only lost the mask_prob draw is not short."""
    long = features([30, 30, 4], prompt_len=3)  # the third has no anchor (4 - 2 < 3)
    assert SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=0.0)(long)["num_short"] == 1
    assert SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=1.0)(long)["num_short"] == 1


def test_truncate_span_is_one_uniform_draw_whatever_spans_per_sample():
    """Catches the truncate layout drawing ``spans_per_sample`` spans and keeping the first (the
    smallest, since spans are sorted): its one span per sample was then the minimum of several
    draws, so the masks trained mostly on early response positions. With the default
    ``spans_per_sample`` (4) the span must still be one uniform draw over [prompt_len, length-2]."""
    col = SpaceCollator(torch.tensor([MASK]), 3, PAD, layout="truncate", seed=3)
    assert col.spans_per_sample == 4
    lo, hi = 5, 48  # length 50, prompt 5
    draws = [col.draw_spans(50, 5, idx) for idx in range(600)]
    assert all(len(d) == 1 and lo <= d[0] <= hi for d in draws)
    starts = torch.tensor([d[0] for d in draws], dtype=torch.float64)
    # uniform: mean (lo+hi)/2 = 26.5, sd of the mean ~0.5; the minimum of 4 draws has mean ~13.6
    assert abs(float(starts.mean()) - (lo + hi) / 2) < 2.5
    assert float((starts > (lo + hi) / 2).double().mean()) > 0.4
    batch = col(features([50], prompt_len=5))
    assert len(spans_of(batch, 0, 3)) == 1


def test_a_sample_with_exactly_one_anchor_is_not_short():
    """Catches an off-by-one in ``num_short``: a sample of prompt_len + 2 tokens has exactly one
    anchor (s = prompt_len, mask 0's target the last token), so losing the mask_prob draw does not
    make it short; one token less does."""
    feats = features([5, 4], prompt_len=3)  # 5 tokens: anchor s = 3; 4 tokens: none
    assert SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=1.0).draw_spans(5, 3, 0) == [3]
    assert SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=0.0)(feats)["num_short"] == 1
    assert SpaceCollator(torch.tensor([MASK]), 3, PAD, mask_prob=0.0)(feats[:1])["num_short"] == 0
