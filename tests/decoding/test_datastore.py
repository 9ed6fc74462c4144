"""Datastore lookup (space.decoding.datastore): what it finds, how it ranks, what it refuses, how
prompt lookup adds it, and SPACE with it decoding AR's tokens while its continuations are accepted."""
import gzip
import json
from collections import Counter

import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.datastore import SCAN, Datastore
from space.decoding.dynamic import LOOKUP, MASK, STORE, AcceptanceStats, StepCost, plan_step
from space.decoding.lookup import PromptLookup
from space.models import tiny_tokenizer
from tests.decoding.test_dynamic import node_paths
from tests.decoding.test_sampling import small_vocab_model  # noqa: F401  (a fixture)


def test_the_longer_shared_context_and_more_occurrences_rank_first():
    """The last 3 tokens (2, 3, 4) follow 1 in one answer (then 5, 6) and 9 and 0 in two others
    (then 7, 8). Catches ranking by count alone, by store order, or ignoring the context."""
    store = Datastore([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [0, 2, 3, 4, 7, 8]])
    assert store.continuations([1, 2, 3, 4], 2, 10) == [[5, 6], [7, 8]]  # 1 + 4 against 1 + 1
    assert store.continuations([9, 2, 3, 4], 2, 10) == [[7, 8], [5, 6]]  # 5 + 1 against 1
    assert store.continuations([7, 2, 3, 4], 2, 10) == [[7, 8], [5, 6]]  # 2 against 1
    assert store.continuations([7, 2, 3, 4], 1, 10) == [[7, 8]]
    assert store.continuations([1, 2, 3, 4], 2, 1) == [[5], [7]]
    assert len(store) == 18


def test_equal_scores_keep_token_order_a_shorter_continuation_first():
    """Three continuations of (1, 2, 3) with one occurrence each and no shared context: ties go in
    token order, a continuation cut by the answer's end before a longer one it starts. Catches ties
    in store order, in reverse, or with the end sorted after every token."""
    store = Datastore([[1, 2, 3, 9, 1], [1, 2, 3, 5, 7], [1, 2, 3, 5]])
    assert store.continuations([8, 1, 2, 3], 3, 10) == [[5], [5, 7], [9, 1]]
    assert store.continuations([8, 1, 2, 3], 1, 10) == [[5]]
    # the same answers in another order, where reverse store order gives [5, 7], [9, 1], [5] (above
    # it gives the token order)
    store = Datastore([[1, 2, 3, 5], [1, 2, 3, 9, 1], [1, 2, 3, 5, 7]])
    assert store.continuations([8, 1, 2, 3], 3, 10) == [[5], [5, 7], [9, 1]]


def test_an_occurrence_at_the_stores_start_has_no_context_before_it():
    """(1, 2, 3) opens the store, then follows 8 in another answer; the text has 1 before its own
    (1, 2, 3). Catches the token "before" the store's first position read from index 0 (the
    n-gram's own first token, 1 here), which scored a context match no text precedes it with."""
    store = Datastore([[1, 2, 3, 9], [8, 1, 2, 3, 7]])
    assert store.continuations([4, 1, 1, 2, 3], 2, 10) == [[7], [9]]  # 1 against 1: token order


def test_only_the_last_scan_occurrences_are_scored():
    """SCAN + 1 occurrences of (1, 2, 3): the first (then 5) is past the SCAN scored, the last SCAN
    in store order (then 6) are. Catches the first SCAN scored instead of the last."""
    store = Datastore([[1, 2, 3, 5]] + [[1, 2, 3, 6]] * SCAN)
    assert store.continuations([1, 2, 3], 2, 1) == [[6]]
    store = Datastore([[1, 2, 3, 6]] * SCAN + [[1, 2, 3, 5]])  # the other way round: both scored
    assert store.continuations([1, 2, 3], 2, 1) == [[6], [5]]


def test_nothing_crosses_an_answer_and_unknown_text_finds_nothing():
    """Catches a continuation that runs into the next answer (separators), an n-gram matched across
    two answers, and a lookup on a text shorter than the n-gram."""
    store = Datastore([[1, 2, 3, 4], [5, 6, 7, 8], [2, 3, 4, 9, 9]])
    assert store.continuations([2, 3, 4], 3, 10) == [[9, 9]]  # the first answer ends after 4
    assert store.continuations([3, 4, 5], 3, 10) == []  # 4 | 5 spans two answers
    assert store.continuations([3, 4], 3, 10) == [] and store.continuations([6, 6, 6], 3, 10) == []
    assert store.continuations([5, 6, 7], 0, 10) == []


def test_a_datastores_identity_names_its_answers_and_where_they_part():
    """``identity`` (a resumed space-eval's ``datastore_sha256``) is the same for the same answers and
    differs for other tokens or the same tokens split into other answers, which continue otherwise.
    Catches an identity of the tokens alone (separators dropped), of the index, or of nothing."""
    one = Datastore([[1, 2, 3, 4, 5], [6, 7, 8, 9]])
    assert one.identity == Datastore([[1, 2, 3, 4, 5], [6, 7, 8, 9]]).identity and len(one.identity) == 64
    split = Datastore([[1, 2, 3, 4, 5, 6], [7, 8, 9]])  # the same tokens, parted elsewhere
    assert one.identity != split.identity  # what follows (4, 5) differs, and so does the identity
    assert one.continuations([3, 4, 5], 1, 2) == [] and split.continuations([3, 4, 5], 1, 2) == [[6]]
    assert one.identity != Datastore([[1, 2, 3, 4, 5], [6, 7, 8, 8]]).identity


def test_bad_datastores_are_refused(tmp_path):
    with pytest.raises(ValueError, match="nothing to look up"):
        Datastore([[1, 2, 3], [], [4]])  # no 3 tokens with one after them
    with pytest.raises(ValueError, match="token ids must be in"):
        Datastore([[1, 2, 3, 1 << 21]])
    with pytest.raises(ValueError, match="token ids must be in"):
        Datastore([[1, 2, -1, 3, 4, 5]])  # not a separator
    with pytest.raises(FileNotFoundError, match="not found"):
        Datastore.from_sets([tmp_path / "none.jsonl"], tiny_tokenizer())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match="not a distilled set"):
        Datastore.from_sets([bad], tiny_tokenizer())


def test_a_set_gives_its_ids_or_its_text_spelled(tmp_path):
    """Catches the text tokenized where the model's own ids are given (another spelling of it), and
    rows of older sets (text only) left out."""
    tok = tiny_tokenizer()
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({"response": "not these", "response_ids": [40, 41, 42, 43, 44]}) + "\n")
    old = tmp_path / "old.jsonl.gz"
    old.write_bytes(gzip.compress((json.dumps({"response": "abcdef"}) + "\n").encode()))
    store = Datastore.from_sets([new, old], tok)
    assert store.continuations([40, 41, 42], 1, 5) == [[43, 44]]
    abc = tok("abcdef", add_special_tokens=False)["input_ids"]
    assert store.continuations(abc[:3], 1, 5) == [abc[3:]]
    # one set mixing both: a text row after an ids row is spelled from its own text
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"response": "zzzzzz", "response_ids": [40, 41, 42, 43, 44]}) + "\n"
                     + json.dumps({"response": "abcdef"}) + "\n")
    assert Datastore.from_sets([mixed], tok).continuations(abc[:3], 1, 5) == [abc[3:]]


def test_prompt_lookup_adds_the_datastores_continuations_after_its_own():
    """Catches datastore continuations placed before the text's own (PLD's is the first), one that
    repeats or starts one already found kept, none offered when the text has none of its own, the
    single continuation (PLD's) changed by a datastore, and the datastore's miscounted."""
    store = Datastore([[7, 8, 9, 1, 2], [7, 8, 9, 5, 6], [3, 3, 3, 4, 4]])
    text = [1, 7, 8, 9, 1, 2, 7, 8, 9]  # the text's own 2-gram (8, 9) recurs: [1, 2, 7, 8, 9]
    lookup = PromptLookup(text, 5, 2, 100, branches=1, datastore=store, datastore_branches=2)
    assert lookup.continuations() == [[1, 2, 7, 8, 9], [5, 6]]  # the datastore's [1, 2] starts the first
    assert lookup.continuations().stored == 1 and lookup.continuations(1, 0).stored == 0
    assert lookup.continuation() == [1, 2, 7, 8, 9] and lookup.continuations(1, 0) == [[1, 2, 7, 8, 9]]
    alone = PromptLookup([6, 3, 3, 3], 5, 2, 100, branches=1, datastore=store, datastore_branches=1)
    assert alone.continuations() == [[3], [4, 4]]  # its own (3, 3) recurs once, cut by the text's end
    none = PromptLookup([0, 7, 8, 9], 5, 2, 100, datastore=store, datastore_branches=2)
    assert none.continuations() == [[1, 2], [5, 6]] and none.continuation() == []
    assert none.continuations().stored == 2 and alone.continuations().stored == 1
    assert PromptLookup([0, 7, 8, 9], 5, 2, 5, datastore=store, datastore_branches=2).continuations() == []  # context full
    # a context of 7 positions, 4 taken: the datastore's end one short of its last (2 tokens, not 3)
    near_end = PromptLookup([0, 7, 8, 9], 5, 2, 7, datastore=Datastore([[7, 8, 9, 1, 2, 3, 4]]), datastore_branches=1)
    assert near_end.continuations() == [[1, 2]]
    with pytest.raises(ValueError, match="datastore_branches"):
        PromptLookup([], 5, 2, 100, datastore=store, datastore_branches=-1)


def test_a_datastore_needs_a_layout_that_reads_it(tiny_varied):
    model, _, spec = tiny_varied
    store = Datastore([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="datastore_branches >= 1"):
        SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", lookup_tokens=4), datastore=store)
    # answers tokenized for another model: an IndexError mid-generation (a device assert on CUDA)
    vocab = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=f"token id {vocab + 5}, outside this model's vocabulary of {vocab}"):
        SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", lookup_tokens=4, datastore_branches=1),
                     datastore=Datastore([[1, 2, 3, vocab + 5]]))
    with pytest.raises(ValueError, match=f"token id {vocab}, outside"):  # the first id past it (off by one)
        SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", lookup_tokens=4, datastore_branches=1),
                     datastore=Datastore([[1, 2, 3, vocab]]))
    with pytest.raises(ValueError, match="need tree='dynamic'"):
        DecodeConfig(2, lookup_tokens=4, datastore_branches=1)  # a static layout
    with pytest.raises(ValueError, match="need tree='dynamic'"):
        DecodeConfig(2, tree="dynamic", datastore_branches=1)  # no lookup


def test_space_with_a_datastore_decodes_ar_and_accepts_from_it(tiny_varied, monkeypatch):
    """A random drafter (its masks rarely right) and a datastore holding the AR answers to the
    prompts (and wrong answers beside them): SPACE's output is AR's token for token for every
    prompt and length, and steps accept deep through the datastore's branches, which a decoder
    without it cannot. Catches a wrong token accepted from a branch, a bonus taken from the wrong
    row, a datastore that is never read, and its continuations not told apart to the planner or in
    the records of where accepted tokens came from."""
    model, _, spec = tiny_varied
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(11, 250, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
               for _ in range(6)]
    truths = [ar_generate(model, p, 48, suppress_ids=spec.token_ids).new_ids for p in prompts]
    noise = [torch.randint(11, 250, (60,), generator=gen).tolist() for _ in range(4)]
    # the answers as the store holds them: each with the prompt's last tokens before it, as the text has them
    store = Datastore([p.tolist()[-3:] + t for p, t in zip(prompts, truths)] + noise)
    cfg = DecodeConfig(2, tree="dynamic", lookup_tokens=6, datastore_branches=2)
    plain = SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", lookup_tokens=6))
    with_store = SpaceDecoder(model, spec, cfg, datastore=store)
    told = []  # what the planner tells plan_step of the datastore's continuations

    def plan_step_told(*args, stored=0, **kwargs):
        told.append(stored)
        return plan_step(*args, stored=stored, **kwargs)

    monkeypatch.setattr("space.decoding.planner.plan_step", plan_step_told)
    steps = plain_steps = 0
    letters = Counter()  # where the accepted tokens came from: the datastore's counted apart
    for p, truth in zip(prompts, truths):
        for n in (1, 17, 48):
            planner = with_store.planner()
            out = with_store.generate(p, n, planner=planner)
            assert out.new_ids == truth[:n], (p.tolist(), n)
        steps += out.num_steps
        assert planner.stats.store[0][1] > 2 and planner.stats.store_first  # it learned which were the datastore's
        plain_out = plain.generate(p, 48)
        plain_steps += plain_out.num_steps
        assert max(out.accept_lengths) >= 4
        letters.update("".join(out.step_sources))
        assert "d" not in "".join(plain_out.step_sources)
    assert steps * 2 < plain_steps, (steps, plain_steps)
    assert max(told) >= 1 and letters["d"] > 20, letters


def test_sampling_with_a_datastore_keeps_ar_sampling_s_distribution(small_vocab_model):
    """Sampling (T = 1) with datastore continuations among the tree's siblings emits t1..t3 with AR
    sampling's exact joint distribution; the datastore's branches were verified (deeper trees than
    without it). Catches a deterministic candidate that biases what a sampled step keeps."""
    from tests.decoding.test_sampling import ALPHA, chi2_pvalue, exact_distribution, sampled

    from space.decoding import SamplingConfig

    model, spec = small_vocab_model
    prompt = [1, 3, 0, 2]
    exact = exact_distribution(model, prompt, SamplingConfig(1.0))
    # several continuations of every 3-gram the samples can end with
    gen = torch.Generator().manual_seed(0)
    store = Datastore([torch.randint(0, 4, (40,), generator=gen).tolist() for _ in range(8)])
    dec = SpaceDecoder(model, spec, DecodeConfig(3, lookup_tokens=3, tree="dynamic", datastore_branches=2),
                       datastore=store)
    counts, outs = sampled(dec, prompt, 1000, temperature=1.0)
    assert max(a for out in outs for a in out.accept_lengths) >= 2
    assert sum(src.count("d") for out in outs for src in out.step_sources) > 50
    assert chi2_pvalue(counts, exact, 1000) > ALPHA


def test_the_datastores_continuations_learn_and_are_priced_by_their_own_rates():
    """Copied from other texts, the datastore's continuations go wrong sooner than the text's own
    (results/datastore): a step teaches their own record, by place among the step's continuations,
    never the text's lookup or other-continuation rates, and the planner prices them by it, the
    first one too (the text has none of its own), which it does not force. Catches the datastore's
    tokens counted, priced, forced or recorded as the text's own."""
    stats = AcceptanceStats(3, 4, StepCost())
    lookup, other, other_first = [list(c) for c in stats.lookup], [list(c) for c in stats.other], []
    # the text has none of its own: the datastore's 5 6 7 is the first continuation, right twice
    stats.observe([5, 6, 9], [], [], 0, [5, 6, 7], 4, others=[], stored=1)
    assert stats.lookup == lookup and stats.other == other and stats.other_first == other_first
    assert [c[1] for c in stats.store_first] == [2.0 + 1] and stats.store_first[0][0] == pytest.approx(0.4 + 1)
    assert [c[1] - 2 for c in stats.store] == [1, 1, 1, 0]  # 5 right (after the first), 6 right, 7 wrong
    # the text's own 5 6 7 is right; the datastore's 8 1, second, leaves it at the root and is wrong
    stats.observe([5, 6, 7, 2], [], [], 0, [5, 6, 7], 4, others=[[8, 1]], stored=1)
    assert [c[1] - 2 for c in stats.lookup] == [1, 1, 1, 0] and stats.other == other
    assert len(stats.store_first) == 2 and stats.store_first[1] == pytest.approx([0.4, 3.0])
    assert [c[1] - 2 for c in stats.store] == [2, 1, 1, 0]
    # the text's own second continuation stays the text's
    stats.observe([8, 1, 2], [], [], 0, [5, 6, 7], 4, others=[[8, 1]], stored=0)
    assert stats.other_first[0] == pytest.approx([1.4, 3.0]) and stats.store_first[1] == pytest.approx([0.4, 3.0])

    # priced: the datastore's record wrong, the text's right; lambda ~ 0, so every node pays
    for cells in (stats.lookup, stats.other):
        for c in cells:
            c[:] = [100.0, 100.0]
    stats.other_first = [[100.0, 100.0]]
    stats.store = [[50.0, 100.0] for _ in range(4)]
    stats.store_first = [[10.0, 100.0], [20.0, 100.0]]
    stats.tokens = 1e-6
    args = dict(budget=64, mask_num=3, max_groups=0, room=100, mask_rows_before=0)
    assert stats.store_rates(1) == pytest.approx([0.2, 0.5, 0.5, 0.5]) and stats.store_rates(0)[0] == pytest.approx(0.1)
    assert stats.store_rates(5) == pytest.approx([0.5] * 4)  # a place never seen: the deep rate
    values = lambda plan: dict(zip(node_paths(plan), plan.values))
    sources = lambda plan: dict(zip(node_paths(plan), plan.sources))
    assert sources(plan_step([], [], 0, [5, 6, 7], stats, others=[[8, 1]], stored=1, **args)) == {
        (5,): LOOKUP, (5, 6): LOOKUP, (5, 6, 7): LOOKUP, (8,): STORE, (8, 1): STORE}
    assert set(sources(plan_step([], [], 0, [8, 1], stats, stored=1, **args)).values()) == {STORE}
    theirs = values(plan_step([], [], 0, [5, 6, 7], stats, others=[[8, 1]], stored=1, **args))
    own = values(plan_step([], [], 0, [5, 6, 7], stats, others=[[8, 1]], stored=0, **args))
    assert theirs[(8,)] == pytest.approx(0.2) and theirs[(8, 1)] == pytest.approx(0.1) and own[(8,)] == pytest.approx(1.0)
    assert theirs[(5, 6, 7)] == own[(5, 6, 7)] == pytest.approx(1.0)
    first = values(plan_step([], [], 0, [8, 1], stats, stored=1, **args))  # the datastore's is the first
    assert first[(8,)] == pytest.approx(0.1) and first[(8, 1)] == pytest.approx(0.05)
    # not forced as prompt lookup decoding's chain is: at a dear row it is left out, the text's own is not
    stats.tokens = 1e6
    assert plan_step([], [], 0, [8, 1], stats, stored=1, **args).tokens == ()
    stats.lookup = [[1.0, 100.0] for _ in range(4)]
    assert plan_step([], [], 0, [8, 1], stats, stored=0, **args).tokens == (8, 1)
    # a mask draft (popped first, worth 0.9 x 0.5) that is the datastore's path too: one node of both
    stats.tokens, stats.lookup = 1e-6, [[50.0, 100.0] for _ in range(4)]
    assert sources(plan_step([[8, 9]], [[0.9, 0.05]], 0, [5, 6, 7], stats, others=[[8, 1]], stored=1,
                             **args))[(8,)] == MASK | STORE
