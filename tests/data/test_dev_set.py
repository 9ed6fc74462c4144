"""The drafter dev set: recorded, reproducible, kept out of self-distillation (issue 13)."""
import pytest

from space.data.dev_set import build_dev_set, dev_keys, dev_prompts, load_dev_set
from space.distill import collect_prompts


def test_recorded_dev_set_is_the_seeded_draw():
    recorded = load_dev_set()
    general = {k: recorded.pop(k) for k in ("general_seed", "general_prompts")}  # drawn by SmolLM2, stored verbatim
    assert recorded == build_dev_set()
    assert len(recorded["mbpp_task_ids"]) == 100 and len(recorded["lima_rows"]) == 30
    assert len(set(general["general_prompts"])) == 50
    prompts = dev_prompts()
    assert [p["source"] for p in prompts] == ["mbpp"] * 100 + ["lima"] * 30 + ["general"] * 50
    assert len({p["key"] for p in prompts}) == 180 and all(len(p["prompt"]) == 1 for p in prompts)


def test_self_distillation_skips_the_dev_set():
    from space.data.dev_set import held_out_key

    keys = dev_keys()
    train = collect_prompts({"mbpp": None, "lima": None})
    assert not keys & {held_out_key(p["prompt"]) for p in train}
    assert not {p["id"] for p in dev_prompts()} & {p["id"] for p in train}
    assert sum(p["source"] == "mbpp" for p in train) >= 974 - 100 - 5  # everything else is kept
    with_dev = collect_prompts({"mbpp": None}, exclude_dev=False)
    assert len(with_dev) - sum(p["source"] == "mbpp" for p in train) == 100


def test_training_holds_the_dev_set_out():
    from space.data.sft import load_examples
    from space.train.run import drop_dev_set

    examples = load_examples("mbpp") + load_examples("lima")
    kept, dropped = drop_dev_set(examples, None)
    assert dropped == 130 and len(kept) == len(examples) - 130


def test_training_says_when_no_dev_set_can_be_held_out(tmp_path):
    """Without the shared MBPP/LIMA files the dev set was silently not held out: a JSONL holding its
    prompts trained on them, and the probe's numbers were no longer held out."""
    from space.data.sft import Example
    from space.train.run import drop_dev_set

    examples = [Example([{"role": "user", "content": "hi"}], "answer")]
    with pytest.warns(UserWarning, match="dev set cannot be held out"):
        kept, dropped = drop_dev_set(examples, tmp_path / "no data here")
    assert kept == examples and dropped == 0


def test_copies_of_a_dev_prompt_with_other_spacing_or_a_system_turn_are_held_out():
    """Catches holding the dev set out by exact match only: a training file with a dev prompt plus
    a trailing newline, other spacing or a system turn trained on it, and the probe's numbers on
    that prompt were no longer held out."""
    from space.data.sft import Example
    from space.train.run import drop_dev_set

    [dev] = [p for p in dev_prompts() if p["id"] == "lima/2"]
    text = dev["prompt"][0]["content"]
    copies = [[{"role": "user", "content": text}], [{"role": "user", "content": text + "\n"}],
              [{"role": "user", "content": "  " + text.replace(" ", "  ")}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]]
    other = [{"role": "user", "content": text + " Also, why?"}]
    kept, dropped = drop_dev_set([Example(c, "answer") for c in [*copies, other]], None)
    assert dropped == 4 and [ex.context for ex in kept] == [other]


def test_prompt_key_covers_every_message():
    """Catches a key of the last message only: two follow-ups with the same text after other
    conversations would be deduplicated into one."""
    from space.data.dev_set import prompt_key

    a = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "More?"}]
    b = [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "More?"}]
    assert prompt_key(a) != prompt_key(b) and prompt_key(a) == prompt_key([dict(m) for m in a])
