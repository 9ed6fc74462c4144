"""Bad and edge inputs of every command (issue 17): a one-line error and exit 2, never a traceback,
exit 0 on bad input, or lost or mixed records.

The table runs each case through the console entry point itself (``space.eval.__main__:cli`` and
the others, which ``[project.scripts]`` points at: see ``test_console_scripts_are_wrapped``),
in-process. A subprocess per case would cost a torch + transformers + peft import each (about 8
CPU-seconds here), minutes for the table; ``test_space_eval_exits_0`` and ``tests/test_cli.py``
run the installed scripts as real subprocesses.
"""
import json
import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest
import torch

from space.data.sft import load_examples
from space.distill import cli as distill_cli
from space.eval.__main__ import cli as eval_cli
from space.jsonl import append_jsonl, read_jsonl_resumable
from space.masking import cli as layout_cli
from space.train.__main__ import cli as train_cli

ROOT = Path(__file__).resolve().parents[1]
ENTRY = {"space-eval": eval_cli, "space-train": train_cli, "space-layout": layout_cli, "space-distill": distill_cli}
EVAL = ["--model", "tiny-random-llama", "--out", "{tmp}/out"]
TRAIN = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", "{tmp}/train", "--max_steps", "1"]
ROOT_USER = os.geteuid() == 0  # root writes anywhere: the permission case cannot fail for it


def _files(tmp: Path) -> None:
    """The bad inputs the table refers to as {tmp}/<name>."""
    (tmp / "empty.jsonl").write_text("")
    (tmp / "blank.jsonl").write_text("\n   \n\n")
    (tmp / "dup.jsonl").write_text('{"question_id": "q1", "turns": ["a"]}\n{"question_id": "q1", "turns": ["b"]}\n')
    (tmp / "bad.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": [}\n')
    (tmp / "rows.jsonl").write_text('{"question": "no known format", "answer": "x"}\n')
    (tmp / "a_file").write_text("not a folder")
    (tmp / "broken.yaml").write_text("mode: [frozen-base\noutput_dir: x\n")
    (tmp / "list.yaml").write_text("- mode\n")
    for name, text in (("adapter_empty", "{}"), ("adapter_torn", '{"mode": "frozen-b')):
        (tmp / name).mkdir()
        (tmp / name / "space_config.json").write_text(text)
    (tmp / "readonly").mkdir()
    (tmp / "readonly").chmod(0o500)


CASES = [  # (command, args, exit code, fragment of stderr)
    # space-eval: silently wrong values
    ("space-eval", [*EVAL, "--mask-num", "0"], 2, "--mask-num must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--methods", "ar,ar,space"], 2, "lists a method twice"),
    ("space-eval", [*EVAL, "--num-samples", "0"], 2, "--num-samples must be >= 1"),
    ("space-eval", [*EVAL, "--threads", "0"], 2, "--threads must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--threads", "-1"], 2, "--threads must be >= 1, got -1"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/empty.jsonl"], 2, "empty.jsonl: the file is empty"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/blank.jsonl"], 2, "blank.jsonl: the file is empty"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/dup.jsonl"], 2, "dup.jsonl: question_id 'q1' appears 2 times"),
    # space-eval: one-line errors
    ("space-eval", [*EVAL, "--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--max-new-tokens", "-5"], 2, "--max-new-tokens must be >= 1, got -5"),
    ("space-eval", [*EVAL, "--max-new-tokens", "5000", "--limit", "1"], 2,
     "--max-new-tokens 5000 leaves no room for a prompt in the model context of 2048"),
    ("space-eval", ["--model", "tiny-random-llama", "--out", "{tmp}/a_file"], 2, "a_file is a file"),
    ("space-eval", ["--model", "tiny-random-llama", "--out", "{tmp}/a_file/sub"], 2, "Not a directory"),
    pytest.param("space-eval", ["--model", "tiny-random-llama", "--out", "{tmp}/readonly/sub"], 2, "Permission denied",
                 marks=pytest.mark.skipif(ROOT_USER, reason="root may write anywhere")),
    pytest.param("space-eval", [*EVAL, "--device", "cuda"], 2, "no CUDA GPU is usable here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    ("space-eval", [*EVAL, "--device", "banana"], 2, "unknown --device 'banana'"),
    ("space-eval", [*EVAL, "--dtype", "banana"], 2, "unknown dtype 'banana'"),
    ("space-eval", [*EVAL, "--temperature", "-1"], 2, "need temperature >= 0"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/adapter_empty"], 2,
     "adapter_empty/space_config.json: not a valid SPACE config (missing mode"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/adapter_torn"], 2, "adapter_torn/space_config.json: not a valid SPACE config"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/nowhere"], 2, "is not a SPACE adapter"),
    ("space-eval", [*EVAL, "--dataset", "nope"], 2, "unknown dataset 'nope'"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/missing.jsonl"], 2, "not found"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/bad.jsonl"], 2, "bad.jsonl: line 2 is not valid JSON"),
    ("space-eval", [*EVAL, "--limit", "0"], 2, "--limit must be >= 1"),
    ("space-eval", [*EVAL, "--methods", "ar,medusa"], 2, "unknown method(s) ['medusa']"),
    ("space-eval", ["--model", "no/such/model", "--limit", "1", "--out", "{tmp}/out"], 2, "unknown model 'no/such/model'"),
    ("space-eval", [*EVAL, "--max-new-tokens", "abc"], 2, "invalid int value: 'abc'"),  # argparse's own
    ("space-eval", [*EVAL, "--mask-num", "0", "--debug"], 2, "Traceback"),
    # space-train
    ("space-train", [*TRAIN, "--datasets", "{tmp}/missing.jsonl"], 2, "unknown dataset"),
    ("space-train", [*TRAIN, "--datasets", "{tmp}/bad.jsonl"], 2, "bad.jsonl: line 2 is not valid JSON"),
    ("space-train", [*TRAIN, "--datasets", "{tmp}/rows.jsonl"], 2, "rows.jsonl: row 0: unknown row format"),
    ("space-train", [*TRAIN, "--datasets", "{tmp}/empty.jsonl"], 2, "empty.jsonl: the file is empty"),
    ("space-train", [*TRAIN, "--mask_num", "0"], 2, "mask_num (k) must be an integer >= 1, got 0"),
    ("space-train", [*TRAIN, "--mode", "banana"], 2, "unknown mode 'banana'"),
    ("space-train", [*TRAIN, "--layout", "banana"], 2, "unknown layout 'banana'"),
    ("space-train", [*TRAIN, "--limit", "0"], 2, "limit must be >= 1"),
    ("space-train", [*TRAIN, "--span_density", "1.5"], 2, "span_density must lie in [0, 1], got 1.5"),
    ("space-train", [*TRAIN, "--mask_target", "banana"], 2, "unknown mask_target 'banana'"),
    ("space-train", [*TRAIN, "--mask_target", "teacher", "--mode", "full"], 2, "mask_target teacher needs mode frozen-base"),
    ("space-train", [*TRAIN, "--teacher_topk", "0"], 2, "teacher_topk must be >= 1"),
    ("space-train", [*TRAIN, "--init_adapter", "no/such/adapter"], 2, "init_adapter: no/such/adapter is not a SPACE adapter"),
    ("space-train", [*TRAIN, "--init_adapter", "adapters/smollm2-135m-space", "--mode", "full"], 2, "init_adapter needs mode lora or frozen-base"),
    ("space-train", [*TRAIN, "--mask_chunk_rows", "-1"], 2, "mask_chunk_rows must be >= 0"),
    ("space-train", ["--config", "{tmp}/broken.yaml"], 2, "broken.yaml: not valid YAML"),
    ("space-train", ["--config", "{tmp}/list.yaml"], 2, "list.yaml: expected a mapping"),
    ("space-train", ["--config", "{tmp}/missing.yaml"], 2, "No such file"),
    ("space-train", [*TRAIN, "--output_dir", "{tmp}/a_file"], 2, "a_file is a file"),
    ("space-train", [*TRAIN, "--no_such_flag", "1"], 2, "not used by the HfArgumentParser"),
    # space-layout
    ("space-layout", ["--num-candidates", "5", "-k", "2"], 2, "--num-candidates must lie in 0..k = 0..2, got 5"),
    ("space-layout", ["--mode", "truncate", "-k", "0"], 2, "--mask-num (k) must be >= 1, got 0"),
    ("space-layout", ["-k", "2", "--num-groups", "9"], 2, "num_groups must lie in 1..3"),
    ("space-layout", ["--mode", "train", "--spans", "9"], 2, "group context lengths must lie in 1..6"),
    # space-distill (arguments are checked before the model and the prompts load)
    ("space-distill", ["--batch-size", "0", "--out", "{tmp}/d.jsonl"], 2, "--batch-size must be >= 1, got 0"),
    ("space-distill", ["--max-new-tokens", "0", "--out", "{tmp}/d.jsonl"], 2, "--max-new-tokens must be >= 1"),
    ("space-distill", ["--lima-limit", "-1", "--out", "{tmp}/d.jsonl"], 2, "--lima-limit must be >= 0"),
    ("space-distill", ["--out", "{tmp}"], 2, "is a folder"),
    ("space-distill", ["--sources", "nope", "--out", "{tmp}/d.jsonl"], 2, "unknown ['nope']"),
]


@pytest.mark.parametrize("command, args, code, fragment", CASES)
def test_bad_input(command, args, code, fragment, tmp_path, capsys):
    _files(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        ENTRY[command]([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert fragment in err, err
    if "--debug" not in args:
        assert "Traceback" not in err and f"{command}: error: " in err, err
    assert not (tmp_path / "out" / "samples.jsonl").exists()


def test_console_scripts_are_wrapped():
    """Every [project.scripts] entry is a space.cli.console wrapper, whose success exits 0."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(ENTRY) <= set(scripts)
    for name, target in scripts.items():
        module, attr = target.split(":")
        entry = getattr(import_module(module), attr)
        assert entry.__qualname__ == "console.<locals>.entry", name
    with pytest.raises(SystemExit) as exit_info:
        layout_cli(["-k", "2"])
    assert exit_info.value.code == 0


def test_space_eval_exits_0(tmp_path):
    """The installed script, as CI would call it: exit 0 after a good run (it used to exit 1)."""
    out = subprocess.run([str(Path(sys.executable).parent / "space-eval"), "--model", "tiny-random-llama",
                          "--limit", "1", "--max-new-tokens", "4", "--methods", "ar,space", "--threads", "1",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "{'meta'" not in out.stderr and (tmp_path / "summary.json").is_file()


# ---- resume: data-mixing cases ----

def _eval(out: Path, *extra: str, dataset: str = "humaneval") -> int:
    """space-eval on the tiny model through its console entry; returns the exit code."""
    with pytest.raises(SystemExit) as exit_info:
        eval_cli(["--model", "tiny-random-llama", "--dataset", dataset, "--limit", "1", "--max-new-tokens", "4",
                  "--methods", "ar,space", "--threads", "1", "--out", str(out), *extra])
    return exit_info.value.code


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("first, second, key", [
    (["--temperature", "0.7", "--num-samples", "1"], ["--temperature", "0.7", "--num-samples", "2"], "'num_samples': (1, 2)"),
    ([], ["--methods", "ar"], "'methods': (['ar', 'space'], ['ar'])"),
    (["--temperature", "0.7"], ["--temperature", "0.7", "--top-p", "0.5"], "'top_p': (1.0, 0.5)"),
])
def test_resume_refuses_other_settings(tmp_path, capsys, first, second, key):
    assert _eval(tmp_path, *first) == 0
    before = _lines(tmp_path / "samples.jsonl")
    capsys.readouterr()
    assert _eval(tmp_path, *second, "--limit", "2") == 2
    assert key in capsys.readouterr().err
    assert _lines(tmp_path / "samples.jsonl") == before


def test_resume_refuses_samples_without_run_config(tmp_path, capsys):
    assert _eval(tmp_path) == 0
    (tmp_path / "run_config.json").unlink()
    (tmp_path / "summary.json").unlink()  # an older run's meta would also do
    before = _lines(tmp_path / "samples.jsonl")
    capsys.readouterr()
    assert _eval(tmp_path, "--limit", "2") == 2
    assert "holds samples.jsonl but no run_config.json" in capsys.readouterr().err
    assert _lines(tmp_path / "samples.jsonl") == before


def test_resume_keeps_every_commit(tmp_path):
    """A commit change alone does not block resume; run_config.json and the summary list both."""
    assert _eval(tmp_path) == 0
    cfg = json.loads((tmp_path / "run_config.json").read_text())
    now = cfg["commits"]
    cfg["commits"] = ["0123abc"]  # as if an older commit wrote the first samples
    (tmp_path / "run_config.json").write_text(json.dumps(cfg))
    assert _eval(tmp_path, "--limit", "2") == 0
    assert json.loads((tmp_path / "run_config.json").read_text())["commits"] == ["0123abc", *now]
    assert json.loads((tmp_path / "summary.json").read_text())["meta"]["commits"] == ["0123abc", *now]
    assert "0123abc" in (tmp_path / "summary.md").read_text()
    assert len(_lines(tmp_path / "samples.jsonl")) == 4


def test_duplicate_ids_write_nothing(tmp_path):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"question_id": "q1", "turns": ["a"]}\n{"question_id": "q2", "turns": ["b"]}\n'
                   '{"question_id": "q1", "turns": ["c"]}\n')
    assert _eval(tmp_path / "out", dataset=str(dup)) == 2
    assert not (tmp_path / "out" / "samples.jsonl").exists()


def test_too_long_prompt_is_skipped_for_every_method(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": "long", "turns": ["x" * 3000]}) + "\n"  # 3000 tokens > 2048
                    + json.dumps({"question_id": "short", "turns": ["hi"]}) + "\n")
    assert _eval(tmp_path / "out", "--limit", "2", dataset=str(data)) == 0
    rows = [json.loads(line) for line in _lines(tmp_path / "out" / "samples.jsonl")]
    skipped = {(r["question_id"], r["model_id"]) for r in rows if "skipped" in r}
    assert skipped == {("long", "ar"), ("long", "space")}
    assert "prompt (30" in rows[0]["skipped"] and "exceeds the model context 2048" in rows[0]["skipped"]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["skipped"]["count"] == 1 and "long" in s["skipped"]["questions"]
    assert s["methods"]["ar"]["samples"] == s["methods"]["space"]["samples"] == 1
    assert "Skipped 1 question(s)" in (tmp_path / "out" / "summary.md").read_text()


# ---- JSONL line separators ----

SEPARATORS = "a\u2028b\u2029c\x85d"


def test_jsonl_keeps_records_with_unicode_line_separators(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, [{"text": SEPARATORS}, {"text": "plain"}])
    text = path.read_text(encoding="utf-8")
    assert "\u2028" in text  # written raw (ensure_ascii=False)...
    assert read_jsonl_resumable(path) == [{"text": SEPARATORS}, {"text": "plain"}]  # ...and read whole
    assert path.read_text(encoding="utf-8") == text  # nothing rewritten or dropped
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": SEPARATORS, "response": SEPARATORS},
                                                     ensure_ascii=False) + "\n", encoding="utf-8")
    [ex] = load_examples(str(tmp_path / "train.jsonl"))
    assert ex.response == SEPARATORS and ex.context[0]["content"] == SEPARATORS


def test_jsonl_refuses_a_damaged_middle_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n{"a": 4')  # line 2 damaged, line 4 torn
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_jsonl_resumable(path)
    path.write_text('{"a": 1}\n\n{"a": 3}\n{"a": 4')
    assert read_jsonl_resumable(path) == [{"a": 1}, {"a": 3}]
    assert path.read_text() == '{"a": 1}\n{"a": 3}\n'


def test_eval_resume_keeps_a_record_with_line_separators(tmp_path):
    assert _eval(tmp_path) == 0
    rows = [json.loads(line) for line in _lines(tmp_path / "samples.jsonl")]
    rows[0]["choices"][0]["turns"][0] += SEPARATORS
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                            encoding="utf-8")
    assert _eval(tmp_path) == 0
    again = [json.loads(line) for line in _lines(tmp_path / "samples.jsonl")]
    assert again == rows


# ---- training resume ----

def test_train_resume_refuses_another_mask_num(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", out, "--limit", "4", "--save_steps", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train_cli([*args, "--max_steps", "2", "--mask_num", "3"])
    assert exit_info.value.code == 0
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "space_settings.json").read_text())
    assert saved["mask_num"] == 3 and saved["mode"] == "frozen-base"
    assert (tmp_path / "run" / "checkpoint-2" / "mask_embedding.safetensors").is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_cli([*args, "--max_steps", "4", "--mask_num", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "other SPACE settings" in err and "'mask_num': (3, 2)" in err
    assert not (tmp_path / "run" / "checkpoint-4").exists()
