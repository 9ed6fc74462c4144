"""What space/eval/bench.py records per generation and per question: forward passes counted for
every method, a seed per sample, and the context check over every turn's answer."""
from types import SimpleNamespace

import pytest
import torch

import space.eval.bench as bench
from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder
from space.eval.bench import STEP_KEYS, Target, context_overflow, generate, run_question
from space.eval.tasks import EvalTask, question_sha256
from space.jsonl import write_jsonl
from space.models import tiny_random_llama
from space.tokens import add_mask_tokens


@pytest.fixture(scope="module")
def target():
    model, tok = tiny_random_llama(seed=0)
    spec = add_mask_tokens(model, tok, mask_num=3)
    return SimpleNamespace(model=model, tokenizer=tok, mask=spec, stop_ids=[], graphs=None, pld=None,
                           decoder=SpaceDecoder(model, spec, DecodeConfig(3)))


def test_every_method_records_its_forward_passes(target, monkeypatch):
    """tokens/step divides by the "steps" of a record: AR's are its steps (they were read from the
    accept lengths, which AR has none of), SPACE's its steps, and HF's the forward passes its hook
    counted, not one per new token."""
    ar = generate("ar", target, [5, 6, 7], 6, SamplingConfig())
    assert len(ar["ids"]) == 6 and ar["steps"] == 6
    space = generate("space", target, [5, 6, 7], 6, SamplingConfig())
    assert space["steps"] == len(space["step_tokens"]) >= 1 and sum(space["step_tokens"]) == len(space["ids"])

    def three_forwards(prompt, attention_mask=None, generation_config=None):
        for _ in range(3):
            target.model(input_ids=prompt)
        return torch.cat([prompt, torch.tensor([[5, 6, 7, 8]])], dim=1)

    monkeypatch.setattr(target.model, "generate", three_forwards)
    hf = generate("hf", target, [1, 2, 3], 4, SamplingConfig())
    assert hf["ids"] == [5, 6, 7, 8] and hf["steps"] == 3


@pytest.mark.parametrize("method", ["hf", "pld"])
def test_hf_baselines_ignore_the_models_generation_config(method):
    """transformers fills what a passed generation config leaves unset from the model's own, which
    AR and SPACE never read: a model shipping a repetition penalty or a no-repeat n-gram size
    (Qwen2.5-Instruct ships repetition_penalty 1.05) gave hf and pld other tokens than AR's. Greedy
    hf and pld equal AR under such a config, and the model keeps its config."""
    model, tok = tiny_random_llama(seed=1)
    spec = add_mask_tokens(model, tok, mask_num=3)
    model.eval()
    target = SimpleNamespace(model=model, tokenizer=tok, mask=spec, stop_ids=[], graphs=None, pld=None,
                             decoder=SpaceDecoder(model, spec, DecodeConfig(3)))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ar = generate("ar", target, prompt, 24, SamplingConfig())["ids"]
    assert len(set(ar)) < len(ar)  # AR repeats a token: a penalty on repeats would change it
    model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 3.0, 2
    assert generate(method, target, prompt, 24, SamplingConfig())["ids"] == ar
    assert model.generation_config.repetition_penalty == 3.0


def test_each_sample_of_a_question_has_its_own_seed(monkeypatch):
    """pass@k over n samples needs n draws: sample i runs with seed + i (n copies of one draw made
    pass@n equal pass@1), and each later turn t with seed + i + (t - 1) * n: one seed for every turn
    restarted the same random stream each turn, so a second turn's draws followed the first's (a
    review measured 88 % equal tokens from two alike distributions, 26 % with independent seeds).
    Seeds wrap into the generator's 0..2**64-1."""
    seeds = []

    def fake_generate(method, target, ids, max_new_tokens, cfg):
        seeds.append(cfg.seed)
        return {"ids": [1], "wall_time": 0.1, "steps": 1, **{key: [] for key in STEP_KEYS}}

    monkeypatch.setattr(bench, "generate", fake_generate)
    monkeypatch.setattr(bench, "chat_ids", lambda tok, messages: [1, 2])
    target = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kwargs: "x"), graphs=None,
                             model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100)))
    task = EvalTask("q", "writing", ["one", "two"])
    record = run_question("space", target, task, 4, SamplingConfig(temperature=0.7, seed=5), num_samples=3)
    assert seeds == [5, 8, 6, 9, 7, 10] and [c["index"] for c in record["choices"]] == [0, 1, 2]
    seeds.clear()
    run_question("space", target, task, 4, SamplingConfig(temperature=0.7, seed=2**64 - 1), num_samples=1)
    assert seeds == [2**64 - 1, 0]


def test_context_check_counts_every_earlier_answer(monkeypatch):
    """The last turn's prompt holds every earlier answer, each up to max_new_tokens: a two-turn
    question needs prompt + 2 x max_new_tokens (counting one answer let it overflow mid-run)."""
    monkeypatch.setattr(bench, "chat_ids", lambda tok, messages: [0] * (10 * len(messages)))
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100)),
                             tokenizer=None, graphs=None)
    two = EvalTask("q", "writing", ["one", "two"])
    assert context_overflow(target, two, 40) == \
        "prompt (30 tokens) + 2 x max_new_tokens (40) = 110 exceeds the model context 100"
    assert context_overflow(target, two, 35) is None
    assert context_overflow(target, EvalTask("q", "c", ["one"]), 90) is None  # 10 + 90


def _overflow_target(monkeypatch, answer_chars, context=100, graphs=None):
    """A fake target whose user turns are 10 tokens and whose answers' text tokenizes to
    ``answer_chars(method, seed, generated)`` tokens; ``generate`` refuses an overflowing prompt, as
    the decoders do (``check_prompt``). Returns the target and the (method, seed) of every call."""
    from space.decoding.result import check_prompt

    calls = []
    monkeypatch.setattr(bench, "chat_ids", lambda tok, messages: [0] * sum(
        10 if m["role"] == "user" else len(m["content"]) for m in messages))

    def decoder(method, target, ids, max_new_tokens, cfg):
        check_prompt(ids, max_new_tokens, context)
        calls.append((method, cfg.seed))
        return {"ids": [method, cfg.seed, max_new_tokens], "wall_time": 0.1, "steps": 1,
                **{key: [] for key in STEP_KEYS}}

    monkeypatch.setattr(bench, "generate", decoder)
    decode = lambda ids, **kwargs: "x" * answer_chars(*ids)  # noqa: E731
    target = SimpleNamespace(tokenizer=SimpleNamespace(decode=decode), graphs=graphs,
                             model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)))
    return target, calls


def test_a_later_turn_that_outgrows_the_estimate_is_skipped_not_a_stop(monkeypatch, tmp_path):
    """An answer's text tokenized again can take more tokens than were generated (80 of 3,750
    SmolLM2 answers stored under results/, up to 9 more), so a second turn can overflow the context
    though the estimate let the question in. The decoders then refused the prompt, the run stopped,
    and a resume stopped at the same question again. Now that (question, method) is recorded as
    skipped with why (SPACE's answer here, not AR's), and the run goes on."""
    # 30 generated tokens; SPACE's answer text takes 65 tokens again, AR's 30
    target, _ = _overflow_target(monkeypatch, lambda method, seed, n: 65 if method == "space" else n)
    two, one = EvalTask("q0", "writing", ["a", "b"]), EvalTask("q1", "writing", ["c"])
    assert context_overflow(target, two, 30) is None  # 20 + 2 x 30: let in
    rows = bench.run_bench(target, [two, one], ["ar", "space"], tmp_path / "samples.jsonl", 30, SamplingConfig())
    why = ("space: turn 2's prompt (85 tokens, the earlier answers tokenized again) + max_new_tokens (30) = 115 "
           "exceeds the model context 100")
    assert [(r["question_id"], r["model_id"], r.get("skipped")) for r in rows] == [
        ("q0", "ar", None), ("q0", "space", why), ("q1", "ar", None), ("q1", "space", None)]
    assert len(rows[0]["choices"][0]["turns"]) == 2  # AR's second turn ran: 10 + 30 + 10 + 30 = 80
    assert bench.run_bench(target, [two, one], ["ar", "space"], tmp_path / "samples.jsonl", 30,
                           SamplingConfig()) == rows  # a resume finds every record done



def test_a_resume_refuses_answers_to_another_text_of_a_question(monkeypatch, tmp_path):
    """A question edited between two runs into one --out (a JSONL fixed by hand, another
    --data-root) keeps its id: its old answers were resumed as the new question's, one samples file
    mixing two datasets. Records hold the question's fingerprint; a resume whose question changed is
    refused naming it, whether its text or its tests changed, and one whose questions are the same
    (or whose records predate fingerprints) resumes."""
    target, calls = _overflow_target(monkeypatch, lambda method, seed, n: n)
    samples = tmp_path / "samples.jsonl"
    one, two = EvalTask("q0", "writing", ["a"]), EvalTask("q1", "writing", ["c"])
    rows = bench.run_bench(target, [one, two], ["ar"], samples, 30, SamplingConfig())
    assert all(r["question_sha256"] == question_sha256(t) for r, t in zip(rows, [one, two]))
    edited = [EvalTask("q0", "writing", ["a, edited"]), EvalTask("q0", "python", ["a"], "python", {"test": "new"})]
    for changed in edited:
        with pytest.raises(ValueError, match=r"another text of 1 of this run's questions \(q0\)"):
            bench.run_bench(target, [changed, two], ["ar"], samples, 30, SamplingConfig())
    ran = len(calls)
    assert bench.run_bench(target, [one, two], ["ar"], samples, 30, SamplingConfig()) == rows and len(calls) == ran
    write_jsonl(samples, [{k: v for k, v in r.items() if k != "question_sha256"} for r in rows])  # an older run's
    assert len(bench.run_bench(target, edited[:1] + [two], ["ar"], samples, 30, SamplingConfig())) == 2


def test_a_sample_that_overflows_skips_its_whole_record(monkeypatch):
    """With several samples, one whose second turn overflows after another sample ran whole raises,
    so run_bench writes one skip record and no partial choices; a prompt that fills the context
    exactly (prompt + max_new_tokens == context) runs."""
    # seed 0's answer is 50 tokens again: 10 + 50 + 10 + 30 = 100, exactly the context; seed 1's 51
    target, calls = _overflow_target(monkeypatch, lambda method, seed, n: 50 + seed)
    two = EvalTask("q0", "writing", ["a", "b"])
    with pytest.raises(bench.ContextOverflow, match="turn 2's prompt \\(71 tokens"):
        run_question("space", target, two, 30, SamplingConfig(temperature=0.7, seed=0), num_samples=2)
    assert calls == [("space", 0), ("space", 2), ("space", 1)]  # sample 0's turns, then sample 1's first


def test_a_later_turn_is_checked_against_the_captured_cache(monkeypatch):
    """Over captured steps a turn's prompt must leave a step's rows in the captured cache's slots,
    as the estimate's check does, not the model context alone."""
    graphs = SimpleNamespace(slots=120, max_rows=30)  # room: 90 < the model context 1000
    target, _ = _overflow_target(monkeypatch, lambda method, seed, n: 50, context=1000, graphs=graphs)
    two = EvalTask("q0", "writing", ["a", "b"])
    assert context_overflow(target, two, 30) is None  # 20 + 2 x 30 = 80
    with pytest.raises(bench.ContextOverflow, match="= 100 exceeds the captured cache's 120 slots less a step's 30"):
        run_question("ar", target, two, 30, SamplingConfig(), num_samples=1)


def test_context_over_captured_steps_leaves_room_for_a_steps_rows(monkeypatch):
    """Over captured steps the context is the cache's slots less a step's most rows: a question
    that fits the slots but not that is skipped with why (checked against the slots alone, it ran
    and overflowed the captured cache mid-answer)."""
    monkeypatch.setattr(bench, "chat_ids", lambda tok, messages: [0] * (10 * len(messages)))
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1000)),
                             tokenizer=None, graphs=SimpleNamespace(slots=120, max_rows=20))
    one = EvalTask("q", "c", ["one"])
    assert context_overflow(target, one, 95) == ("prompt (10 tokens) + max_new_tokens (95) = 105 exceeds the captured "
                                                 "cache's 120 slots less a step's 20 rows (--capture-len)")
    assert context_overflow(target, one, 90) is None


def test_stop_ids_are_every_eos_of_the_model_and_tokenizer():
    """A generation config may list several EOS ids (an end-of-turn token beside the tokenizer's
    EOS): AR and SPACE stop at each, as HF generate does (taking one let them run past a reply's end)."""
    def stops(eos, tok_eos=2):
        model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))
        return Target(model, SimpleNamespace(eos_token_id=tok_eos), None, None).stop_ids

    assert stops([7, 2]) == [2, 7] and stops(9) == [2, 9] and stops(None) == [2] and stops(None, None) == []


def test_a_question_during_which_a_graph_compiled_is_timed_again(monkeypatch):
    """``--compile``: a graph built inside a timed question (a shape the warm-up missed, such as
    prompt lookup's 1-row step: a minute on a CPU) would count its build as decoding time; the
    question runs again, warm, and that record is kept. Without a build it runs once."""
    from torch._dynamo.utils import counters

    calls = []

    def fake_run(method, *args):
        calls.append(method)
        if len(calls) == 1:
            counters["stats"]["unique_graphs"] += 1  # a graph built during the first run
        return {"model_id": method, "run": len(calls)}

    monkeypatch.setattr(bench, "run_question", fake_run)
    task = EvalTask("q0", "code", ["def f():"])
    assert bench.warm_question("pld", None, task, 8, SamplingConfig(), 1) == {"model_id": "pld", "run": 2}
    assert bench.warm_question("space", None, task, 8, SamplingConfig(), 1) == {"model_id": "space", "run": 3}
    assert calls == ["pld", "pld", "space"]


def test_a_question_that_keeps_compiling_runs_at_most_warm_tries_times(monkeypatch):
    """A question during whose every run a graph is built (shapes that keep changing) is not rerun
    without end: ``WARM_TRIES`` runs at most, the last one's record kept."""
    from torch._dynamo.utils import counters

    calls = []

    def fake_run(method, *args):
        calls.append(method)
        counters["stats"]["unique_graphs"] += 1  # a graph built during every run
        return {"model_id": method, "run": len(calls)}

    monkeypatch.setattr(bench, "run_question", fake_run)
    task = EvalTask("q0", "code", ["def f():"])
    assert bench.warm_question("space", None, task, 8, SamplingConfig(), 1) == {"model_id": "space", "run": 3}
    assert len(calls) == bench.WARM_TRIES == 3


def test_run_bench_times_each_question_warm(monkeypatch, tmp_path):
    """``run_bench`` records a question through ``warm_question``: a graph built during a timed
    question (``--compile``) gets the question run again and that warm record written, not the one
    that timed the build."""
    from torch._dynamo.utils import counters

    calls = []

    def fake_run(method, target, task, *args):
        calls.append((task.question_id, method))
        if len(calls) == 1:
            counters["stats"]["unique_graphs"] += 1  # the first timed run builds a graph
        return {"question_id": task.question_id, "model_id": method, "run": len(calls)}

    monkeypatch.setattr(bench, "run_question", fake_run)
    monkeypatch.setattr(bench, "generate", lambda *args: {})  # the untimed warm-up
    monkeypatch.setattr(bench, "context_overflow", lambda *args: None)
    monkeypatch.setattr(bench, "chat_ids", lambda tok, messages: [1, 2])
    tasks = [EvalTask("q0", "code", ["one"]), EvalTask("q1", "code", ["two"])]
    rows = bench.run_bench(SimpleNamespace(tokenizer=None), tasks, ["pld"], tmp_path / "samples.jsonl", 4,
                           SamplingConfig())
    assert [(r["question_id"], r["run"]) for r in rows] == [("q0", 2), ("q1", 3)]
    assert calls == [("q0", "pld"), ("q0", "pld"), ("q1", "pld")]


def test_a_samples_file_holding_what_is_no_sample_record_is_refused(target, tmp_path):
    """A record with ``choices: []`` made AR's totals cover other questions than SPACE's (speedups
    off, exit 0); one without ``choices``, a choice without ``new_tokens``, or a JSON that is no
    object failed as a KeyError / TypeError after every question had been decoded. A real
    record, and a skipped one, are read back as they are."""
    from space.eval.bench import read_samples

    task = EvalTask("q1", "c", ["say hi"])
    good = {"question_id": "q1", "category": "c", "model_id": "ar",
            **run_question("ar", target, task, 4, SamplingConfig(), 1)}
    skipped = {"question_id": "q2", "category": "c", "model_id": "ar", "skipped": "too long"}
    path = tmp_path / "samples.jsonl"
    write_jsonl(path, [good, skipped])
    assert read_samples(path) == [good, skipped]
    choice = good["choices"][0]
    for bad, why in [({**good, "choices": []}, "choices missing, empty or not a list of objects"),
                     ({k: v for k, v in good.items() if k != "choices"}, "choices missing"),
                     ({**good, "choices": [{k: v for k, v in choice.items() if k != "new_tokens"}]},
                      "a choice without one entry per turn in each of turns, new_tokens"),
                     ({**good, "choices": [{**choice, "steps": []}]}, "a choice without one entry per turn"),
                     ({k: v for k, v in good.items() if k != "model_id"}, "model_id missing or not text"),
                     ([1, 2], "a JSON list, not an object")]:
        write_jsonl(path, [good, bad])
        with pytest.raises(ValueError, match=rf"samples.jsonl: record 2 is not a space-eval sample record \({why}"):
            read_samples(path)
