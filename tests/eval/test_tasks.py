"""Task loading (space/eval/tasks.py): question files with ``prompt`` rows, their defaults, and
HumanEval-X files that are missing or damaged; no model runs."""
import gzip
import json
import warnings
from pathlib import Path

import pytest

from space.eval.tasks import EvalTask, load_tasks


def test_question_file_takes_prompt_rows_and_numbers_them_by_line(tmp_path):
    """A .jsonl of ``prompt`` rows (not only MT-Bench ``turns``) is one turn each; a row without an
    id is named by its 0-based line, without a category "default" (ids name samples on resume: they
    must not move); an empty turn is refused with its line."""
    path = tmp_path / "questions.jsonl"
    rows = [{"prompt": "hi"}, {"question_id": 7, "category": "math", "turns": ["a", "b"]}, {"prompt": "bye"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_tasks(str(path)) == [EvalTask("0", "default", ["hi"]), EvalTask("7", "math", ["a", "b"]),
                                     EvalTask("2", "default", ["bye"])]
    assert load_tasks(str(path), limit=1) == [EvalTask("0", "default", ["hi"])]
    path.write_text('{"prompt": "hi"}\n{"turns": ["a", ""]}\n')
    with pytest.raises(ValueError, match="line 2: needs 'turns'"):
        load_tasks(str(path))
    path.write_text('{"prompt": "hi"}\n{"turns": ["a", "  \\n "]}\n')  # blank: accepted, and the model asked nothing
    with pytest.raises(ValueError, match="line 2: needs 'turns' \\(non-empty list of strings, none blank\\)"):
        load_tasks(str(path))
    path.write_text('{"prompt": "hi"}\n{"question_id": null, "prompt": "yo"}\n')  # it became the id 'None'
    with pytest.raises(ValueError, match="line 2: question_id must be text or an integer, got None"):
        load_tasks(str(path))
    path.write_text('{"question_id": "1", "prompt": "hi"}\n{"prompt": "yo"}\n')  # the second is numbered 1 too
    with pytest.raises(ValueError, match="question_id '1' appears 2 times; .*a row without a question_id takes its "
                                         "index, counted from 0"):
        load_tasks(str(path))


def test_humaneval_x_bad_language_missing_and_damaged_files(tmp_path):
    """Each is its own error, the file named: an unknown language, a missing file (not reported as
    damaged), a file that is not gzip (not gzip's OSError)."""
    with pytest.raises(ValueError, match="unknown HumanEval-X language 'cobol'"):
        load_tasks("humaneval-x:cobol", tmp_path)
    with pytest.raises(FileNotFoundError, match="HumanEval-X file not found: .*humaneval_cpp.jsonl.gz"):
        load_tasks("humaneval-x:cpp", tmp_path)
    (tmp_path / "humaneval-x").mkdir()
    (tmp_path / "humaneval-x" / "humaneval_cpp.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="humaneval_cpp.jsonl.gz: damaged file"):
        load_tasks("humaneval-x:cpp", tmp_path)


def _write_rows(root: Path, name: str, rows: list) -> Path:
    """``rows`` as the data file ``load_tasks(name, root)`` reads (HumanEval-X: gzipped JSON lines)."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if name.startswith("humaneval-x"):
        path = root / "humaneval-x" / f"humaneval_{name.split(':')[1]}.jsonl.gz"
        path.parent.mkdir()
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path = root / "mbpp" / "mbpp.jsonl"
        path.parent.mkdir()
        path.write_text(text)
    return path

@pytest.mark.parametrize("name, row, field", [
    ("humaneval-x:cpp", {"task_id": "CPP/0", "test": "int main(){}"}, "prompt"),
    ("humaneval-x:cpp", {"task_id": "CPP/0", "prompt": "int f();"}, "test"),
    # Rust prompts hold the doc comment alone: the signature comes from the declaration
    ("humaneval-x:rust", {"task_id": "Rust/0", "prompt": "/// doc\n", "test": "#[test]\nfn t() {}"}, "declaration"),
    ("mbpp", {"task_id": 1, "code": "x = 1", "test_list": []}, "text"),
    ("mbpp-dev", {"task_id": 15, "text": "t", "code": "x = 1", "test_list": "assert x"}, "test_list"),
])
def test_a_code_row_without_a_field_its_prompt_or_tests_need_is_named(tmp_path, name, row, field):
    """Catches a row read as it is: space-eval stopped with a bare KeyError traceback (or later, in
    the executor, on a test list that is a string), naming neither the file nor the row."""
    good = {"task_id": "CPP/1", "prompt": "int g();", "test": "int main(){}"} if name.startswith("humaneval-x") \
        else {"task_id": 2, "text": "t", "code": "y = 2", "test_list": ["assert y == 2"]}
    if name == "humaneval-x:rust":
        good = {"task_id": "Rust/1", "prompt": "/// doc\n", "declaration": "fn g() -> i32 {\n",
                "test": "#[test]\nfn t() {}"}
    path = _write_rows(tmp_path, name, [good, row])
    with pytest.raises(ValueError, match=rf"{path.name}: line 2: missing or malformed field '{field}'"):
        load_tasks(name, tmp_path)


@pytest.mark.parametrize("name, row", [("humaneval-x:cpp", ["CPP/0", "int f();"]), ("mbpp", "assert f(1) == 2")])
def test_a_code_row_that_is_not_an_object_is_named(tmp_path, name, row):
    """Catches a row that is valid JSON but no object (a list, a string) read as one: space-eval
    stopped with a bare AttributeError traceback, naming neither the file nor the row."""
    good = {"task_id": "CPP/1", "prompt": "int g();", "test": "int main(){}"} if name.startswith("humaneval-x") \
        else {"task_id": 2, "text": "t", "code": "y = 2", "test_list": ["assert y == 2"]}
    path = _write_rows(tmp_path, name, [good, row])
    with pytest.raises(ValueError, match=rf"{path.name}: line 2: not a JSON object"):
        load_tasks(name, tmp_path)


def test_mbpp_dev_is_the_held_out_hundred_and_training_overlap_is_named(tmp_path, monkeypatch):
    """MBPP's prompts are the shipped drafter's training data, all but the dev set's 100: an MBPP
    run on the shipped adapter measured drafts on answers it learned (38 of the first 40).
    ``mbpp-dev`` holds the 100 kept out, and ``trained_questions`` names the questions of a run
    whose prompt is in an adapter's training data, read as training read it (its config's
    datasets, limit and sources; the dev set dropped), in the run's order; a file that cannot be
    read is skipped with a warning; another dataset or no adapter names none."""
    import gzip

    from space.data.dev_set import load_dev_set
    from space.data.sft import to_example
    from space.eval.tasks import trained_questions

    dev = load_tasks("mbpp-dev")
    assert sorted(int(t.question_id) for t in dev) == sorted(load_dev_set()["mbpp_task_ids"])
    shipped = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-space"
    mbpp = load_tasks("mbpp")
    # from outside the checkout: the config's repo-relative training files (data/distill/...) are
    # found from the repo, not the working folder (else no question counted as trained)
    monkeypatch.chdir(tmp_path)
    assert trained_questions(dev, shipped) == []
    assert len(trained_questions(mbpp, shipped)) == 873  # the card's 872 MBPP samples, one prompt asked twice

    def row(task, source):  # a self-distilled row (space-distill's format) of a question's prompt
        return {"prompt": to_example(task.problem).context, "response": "x", "source": source}

    first, dev_task = mbpp[:10], dev[0]
    rows = [row(first[5], "mbpp"), row(first[2], "lima"), row(first[0], "mbpp"), row(dev_task, "mbpp")]
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bad.json").write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()

    def config(**data):
        (adapter / "space_config.json").write_text(json.dumps({"train_config": {"data": data}}))

    config(datasets=f"{tmp_path / 'train.jsonl.gz'},{tmp_path / 'gone.jsonl'}")
    with pytest.warns(UserWarning, match="gone.jsonl not checked"):
        assert trained_questions(first + [dev_task], adapter) == [first[0].question_id, first[2].question_id,
                                                                  first[5].question_id]  # the dev set dropped
    config(datasets=str(tmp_path / "train.jsonl.gz"), sources="mbpp", limit=1)  # training read one row
    assert trained_questions(first, adapter) == [first[5].question_id]
    config(datasets=f" {tmp_path / 'train.jsonl.gz'} ,", sources="lima")  # the lists as training splits them
    assert trained_questions(first, adapter) == [first[2].question_id]
    config(datasets=str(tmp_path / "bad.json"))
    with pytest.warns(UserWarning, match="bad.json not checked"):
        assert trained_questions(first, adapter) == []
    with warnings.catch_warnings():  # no MBPP question: the training data is not read, nor warned about
        warnings.simplefilter("error")
        assert trained_questions(load_tasks("humaneval", limit=5), adapter) == []
    assert trained_questions(first, None) == [] and trained_questions(first, tmp_path) == []
    for recorded in ({"base_model": "m"}, {"train_config": {}}):  # an adapter saved without its training data
        (adapter / "space_config.json").write_text(json.dumps(recorded))
        assert trained_questions(first, adapter) == []


def test_mbpp_dev_reads_task_ids_as_numbers(tmp_path):
    """Catches comparing an MBPP file's ``task_id`` with the dev set's integer ids as it is: a file
    that writes the ids as strings gave an empty ``mbpp-dev``."""
    from space.data.sft import data_root, read_rows

    rows = {r["task_id"]: r for r in read_rows(data_root() / "mbpp" / "mbpp.jsonl")}
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "mbpp.jsonl").write_text(  # 15 is in the dev set, 16 is not
        "".join(json.dumps({**rows[i], "task_id": str(i)}) + "\n" for i in (15, 16)))
    assert [t.question_id for t in load_tasks("mbpp-dev", tmp_path)] == ["15"]


def test_trained_questions_reads_the_training_data_root(tmp_path):
    """Catches reading a registered dataset (``mbpp``) or the dev set from the default data root
    instead of the config's ``data_root``, which training read: here it holds MBPP's first three
    rows and a revised row 15 (a dev-set id, dropped). A data root that is not on this machine
    skips the dev set with a warning instead of stopping the run (the check only advises)."""
    import gzip

    from space.data.sft import data_root, read_rows, to_example
    from space.eval.tasks import trained_questions

    root, adapter = tmp_path / "data", tmp_path / "adapter"
    (root / "mbpp").mkdir(parents=True)
    adapter.mkdir()
    (root / "lima").symlink_to(data_root() / "lima")
    rows = read_rows(data_root() / "mbpp" / "mbpp.jsonl")
    revised = {**rows[14], "text": rows[14]["text"] + " (revised)"}
    assert revised["task_id"] == 15
    (root / "mbpp" / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [revised]))
    tasks = load_tasks("mbpp", root) + load_tasks("mbpp", limit=5)[3:]  # 1, 2, 3, 15 (revised), then 4, 5
    (adapter / "space_config.json").write_text(json.dumps({"train_config": {"data": {
        "datasets": "mbpp", "data_root": str(root)}}}))
    assert trained_questions(tasks, adapter) == ["1", "2", "3"]
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": to_example(tasks[1].problem).context, "response": "x"}) + "\n")
    (adapter / "space_config.json").write_text(json.dumps({"train_config": {"data": {
        "datasets": str(tmp_path / "train.jsonl.gz"), "data_root": str(tmp_path / "elsewhere")}}}))
    with pytest.warns(UserWarning, match="dev set not read"):
        assert trained_questions(tasks, adapter) == ["2"]
    # a hand-edited sources list naming nothing (training refuses one): a warning, not an error
    (adapter / "space_config.json").write_text(json.dumps({"train_config": {"data": {
        "datasets": "mbpp", "data_root": str(root), "sources": " , "}}}))
    with pytest.warns(UserWarning, match="names no source"):
        assert trained_questions(tasks, adapter) == []
