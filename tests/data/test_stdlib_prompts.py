"""Stdlib coding prompts (issue 13, DESIGN §5): thousands, deterministic, no evaluation leak."""
import re

import pytest

from space.data.stdlib_prompts import eval_entry_points, stdlib_prompts
from space.distill import collect_prompts


@pytest.fixture(scope="module")
def prompts():
    return stdlib_prompts()


def test_thousands_of_prompts_in_a_deterministic_order(prompts):
    assert len(prompts) > 1000
    again = stdlib_prompts.__wrapped__()  # a fresh build, not the cached one
    assert [p.name for p in again] == [p.name for p in prompts] and again == prompts
    assert len({p.name for p in prompts}) == len(prompts)


def test_no_humaneval_or_mbpp_entry_point_leaks(prompts):
    banned, texts = eval_entry_points()
    assert {"has_close_elements", "similar_elements"} <= banned  # HumanEval/0 and MBPP task 2
    for p in prompts:
        defined = re.findall(r"def (\w+)\(", p.prompt)
        assert defined and p.name.rsplit(".", 1)[1] == defined[0] and defined[0] not in banned
        assert not any(t in " ".join(p.prompt.lower().split()) for t in texts)


def test_prompts_are_public_documented_functions(prompts):
    for p in prompts:
        name = p.name.rsplit(".", 1)[1]
        assert not name.startswith("_") and '"""' in p.prompt and "```python" in p.prompt
    modules = {p.name.split(".")[0] for p in prompts}
    assert not modules & {"antigravity", "this", "turtle", "tkinter", "idlelib", "test"}


def test_distill_sources_include_stdlib(prompts):
    got = collect_prompts({"stdlib": 5, "mbpp": 3})
    assert [p["source"] for p in got] == ["stdlib"] * 5 + ["mbpp"] * 3
    assert got[0]["id"] == f"stdlib/{prompts[0].name}" and got[0]["prompt"][0]["content"] == prompts[0].prompt


def test_a_docstring_holding_a_task_text_is_dropped(tmp_path, monkeypatch):
    """Catches dropping the task-text check: a function under another name whose docstring
    states an MBPP task must not become a prompt (the real stdlib has none, so plant one)."""
    from space.data import stdlib_prompts as mod

    _, texts = eval_entry_points()
    body = '    """{}\n\n    More words so that the docstring is long enough to keep."""\n    return 1\n'
    (tmp_path / "planted.py").write_text("def leaky(x):\n" + body.format(texts[0]) +
                                         "def clean(x):\n" + body.format("Return the value unchanged, always."))
    monkeypatch.setattr(mod, "stdlib_root", lambda: tmp_path)
    assert [p.name for p in mod.stdlib_prompts.__wrapped__()] == ["planted.clean"]
