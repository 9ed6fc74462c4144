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
from importlib import import_module
from pathlib import Path

import pytest
import torch

from space.data.sft import load_examples
from space.distill import cli as distill_cli
from space.eval.__main__ import cli as eval_cli
from space.jsonl import append_jsonl, read_jsonl_resumable
from space.layout_cli import cli as layout_cli
from space.models import tiny_random_llama
from space.train.__main__ import cli as train_cli

ROOT = Path(__file__).resolve().parents[1]
# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")

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
    model, tok = tiny_random_llama()  # model folders: a config and a tokenizer, no weights; a damaged config
    for name in ("noweights", "badconfig"):
        tok.save_pretrained(tmp / name)
        model.config.save_pretrained(tmp / name)
    (tmp / "badconfig" / "config.json").write_text('{"model_type": "llama", ')
    (tmp / "emptydir").mkdir()  # a folder that is no model: the tokenizer's load blamed sentencepiece


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
    pytest.param("space-eval", [*EVAL, "--compile", "reduce-overhead"], 2,
                 "compile mode reduce-overhead records CUDA graphs and needs a CUDA GPU; none is usable here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    ("space-eval", [*EVAL, "--compile", "reduce-overhead", "--device", "cpu"], 2,
     "compile mode reduce-overhead records CUDA graphs and needs a CUDA"),
    ("space-eval", [*EVAL, "--device", "banana"], 2, "unknown --device 'banana'"),
    ("space-eval", [*EVAL, "--device", "hpu"], 2, "--device hpu: not supported"),  # torch's ModuleNotFoundError
    ("space-eval", [*EVAL, "--device-map", '{{"": "meta"}}'], 2, "--device meta: not supported"),
    ("space-eval", [*EVAL, "--dtype", "banana"], 2, "unknown dtype 'banana'"),
    ("space-eval", [*EVAL, "--temperature", "-1"], 2, "--temperature must be >= 0, got -1.0"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/adapter_empty"], 2,
     "adapter_empty/space_config.json: not a valid SPACE config (missing mode"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/adapter_torn"], 2, "adapter_torn/space_config.json: not valid JSON"),
    ("space-eval", [*EVAL, "--adapter", "{tmp}/nowhere"], 2, "is not a SPACE adapter"),
    ("space-eval", [*EVAL, "--dataset", "nope"], 2, "unknown dataset 'nope'"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/missing.jsonl"], 2, "not found"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/bad.jsonl"], 2, "bad.jsonl: line 2 is not valid JSON"),
    ("space-eval", [*EVAL, "--limit", "0"], 2, "--limit must be >= 1"),
    ("space-eval", [*EVAL, "--methods", "ar,medusa"], 2, "unknown method(s) ['medusa']"),
    ("space-eval", ["--model", "no/such/model", "--limit", "1", "--out", "{tmp}/out"], 2, "unknown model 'no/such/model'"),
    ("space-eval", ["--model", "{tmp}/noweights", "--limit", "1", "--out", "{tmp}/out"], 2,
     "noweights does not load: Error no file named model.safetensors"),
    ("space-eval", ["--model", "{tmp}/badconfig", "--limit", "1", "--out", "{tmp}/out"], 2, "badconfig does not load"),
    ("space-eval", ["--model", "{tmp}/emptydir", "--limit", "1", "--out", "{tmp}/out"], 2,
     "emptydir holds no config.json: not a HF model folder"),
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
    ("space-train", [*TRAIN, "--sources", " , "], 2, "sources=' , ' names no source"),
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
    # HF options SAR-SFT's own loss or resume would ignore (it trained without smoothing, or from scratch)
    ("space-train", [*TRAIN, "--label_smoothing_factor", "0.1"], 2, "label_smoothing_factor is not supported"),
    # NEFTune noised the frozen real pass (its KV cache and the teacher) of frozen-base training (tiny_smoke's mode)
    ("space-train", [*TRAIN, "--neftune_noise_alpha", "5"], 2, "neftune_noise_alpha with mode frozen-base"),
    ("space-train", [*TRAIN, "--resume_from_checkpoint", "{tmp}"], 2, "not a checkpoint folder"),
    # --debug is taken off before the HfArgumentParser sees it (it would refuse it as an unused argument)
    ("space-train", [*TRAIN, "--mask_num", "0", "--debug"], 2, "mask_num (k) must be an integer >= 1, got 0"),
    # space-layout
    ("space-layout", ["--num-candidates", "5", "-k", "2"], 2, "--num-candidates must lie in 0..k = 0..2, got 5"),
    ("space-layout", ["--mode", "truncate", "-k", "0"], 2, "mask_num (k) must be an integer >= 1, got 0"),
    ("space-layout", ["-k", "2", "--num-groups", "9"], 2, "num-groups must lie in 1..k + 1 = 1..3"),
    ("space-layout", ["-k", "2", "--num-groups", "4"], 2, "--num-groups must lie in 1..k + 1 = 1..3, got 4"),  # k + 2
    ("space-layout", ["-k", "5000"], 2, "mask_num (k) = 5000 exceeds the maximum"),  # asked for terabytes
    # a drawing of n x n cells: a MemoryError traceback; 0 was named by internal names (num_real, cache_len)
    ("space-layout", ["--mode", "train", "--seq-len", "60000"], 2, "--seq-len must lie in 1..512 (a drawing), got 60000"),
    ("space-layout", ["--cache-len", "100000000"], 2, "--cache-len must lie in 0..512 (a drawing)"),
    ("space-layout", ["--mode", "truncate", "--spans", "0"], 2, "--spans must lie in 1..512 (a drawing), got 0"),
    ("space-layout", ["--tree", "[[0],[1]]", "--num-groups", "-3"], 2, "--num-groups must lie in 1..k + 1"),
    ("space-layout", ["--tree", "[[0],[1]]", "--num-groups", "0"], 2, "--num-groups must lie in 1..k + 1"),
    ("space-layout", ["--mode", "train", "--spans", "9"], 2, "group context lengths must lie in 1..6"),
    # flags another mode or layout does not read (they were left unread)
    ("space-layout", ["--mode", "train", "--tree", "[[0]]"], 2, "--tree: only for --mode decode"),
    ("space-layout", ["--mode", "truncate", "--num-groups", "2"], 2, "--num-groups: only for --mode decode"),
    ("space-layout", ["--tree", "[[0],[1]]", "--num-candidates", "1"], 2, "--num-candidates: the chain's"),
    ("space-layout", ["--mode", "truncate", "--spans", "2", "3"], 2, "draws one span start: give one --spans"),
    ("space-layout", ["--spans", "3"], 2, "--spans: only for --mode train or truncate"),
    ("space-layout", ["--seq-len", "8"], 2, "--seq-len: only for --mode train"),
    ("space-layout", ["--mode", "train", "--cache-len", "4"], 2, "--cache-len: only for --mode decode"),
    ("space-layout", ["--tree", "dynamic", "--draft-probs", "[[0.5,0.6]]"], 2,
     "--draft-probs: each mask's probabilities must be its top drafts in decreasing order"),
    ("space-layout", ["--tree", "dynamic", "--draft-probs", "[[0.7,0.6]]"], 2,  # decreasing, but sums to 1.3
     "drafts in decreasing order, summing to at most 1, got '[[0.7,0.6]]'"),
    ("space-layout", ["--tree", "dynamic", "-k", "2", "--draft-probs", "[[0.5],[0.4],[0.3]]"], 2,
     "--draft-probs must be a JSON list of 1..k = 1..2 masks"),
    ("space-layout", ["--tree", "dynamic", "--draft-probs", "0.5,"], 2, "--draft-probs: not JSON"),
    ("space-layout", ["--tree", "dynamic", "--step-cost", "[[2,1]]"], 2, "--step-cost: step_cost must be [[rows, cost]"),
    ("space-layout", ["--tree", "dynamic", "--row-budget", "0"], 2, "--row-budget must be >= 1, got 0"),
    ("space-layout", ["--lookup", "2"], 2, "--lookup: only for --mode decode --tree dynamic"),
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
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(ENTRY) <= set(scripts)
    for name, target in scripts.items():
        module, attr = target.split(":")
        entry = getattr(import_module(module), attr)
        assert entry.__qualname__ == "console.<locals>.entry", name
    with pytest.raises(SystemExit) as exit_info:
        layout_cli(["-k", "2"])
    assert exit_info.value.code == 0


@pytest.mark.parametrize("code", ["EROFS", "ENOSPC", "EFBIG"])  # EFBIG: ulimit -f
def test_a_read_only_or_full_disk_is_a_one_line_error(code, capsys):
    """--out on a read-only file system or a full disk raises a plain OSError (not a
    PermissionError). Catches the wrapper letting it through as a traceback; any other OSError
    still is one (a bug to see whole)."""
    import errno

    from space.cli import console

    def fails(argv):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), "/ro/out")

    with pytest.raises(SystemExit) as exit_info:
        console("space-x", fails)([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("space-x: error: [Errno") and "/ro/out" in err
    assert "Traceback" not in err

    def other(argv):
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError, match="I/O error"):
        console("space-x", other)([])


def test_console_restores_the_sigterm_handler():
    """The wrapper's SIGTERM handler (SystemExit(143)) is for the command's run only: a Python caller
    of an entry point gets its own handler back afterwards."""
    import signal

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(SystemExit):
            layout_cli(["-k", "2"])
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def test_jsonl_keeps_a_file_whose_last_line_ends_in_a_newline_but_is_not_json(tmp_path):
    """An interrupted append leaves a last line without its newline. A file of other text (a user's
    notes named as space-probe's --answers) has one: its line was dropped as torn, the file
    rewritten as an answers cache and the run exited 0. Now it is refused and left as it was."""
    path = tmp_path / "notes.txt"
    for text in ("hi\n", '{"a": 1}\n{"a": \n'):
        path.write_text(text)
        with pytest.raises(ValueError, match="is not valid JSON"):
            read_jsonl_resumable(path)
        assert path.read_text() == text


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


def test_train_resume_refuses_other_data_or_schedule_and_a_checkpoint_without_its_optimizer(tmp_path, capsys):
    """HF restores a checkpoint's optimizer and schedule and skips the batches it saw: a rerun with
    other data went on from a misaligned point and its artifact named the new data; another learning
    rate was ignored. Both are refused now, naming what differs (the data by count and hash). A
    checkpoint without its optimizer state (save_only_model, or copied without it) resumed with a
    fresh Adam and the warm-up again: refused too. The same command still resumes."""
    out = tmp_path / "run"
    args = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(out), "--limit", "4", "--save_steps", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train_cli([*args, "--max_steps", "2"])
    assert exit_info.value.code == 0
    saved = json.loads((out / "checkpoint-2" / "space_settings.json").read_text())
    assert saved["data"]["samples"] == 4 and saved["batch"] > 0
    capsys.readouterr()
    for flags, key in ((["--limit", "3"], "'data'"), (["--learning_rate", "0.5"], "'learning_rate'"),
                       (["--seed", "7"], "'seed'"), (["--mask_loss_weight", "3"], "'mask_loss_weight'")):
        with pytest.raises(SystemExit) as exit_info:
            train_cli([*args, "--max_steps", "4", *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "other SPACE settings or data" in err and key in err, (flags, err)
    (out / "checkpoint-2" / "optimizer.pt").rename(tmp_path / "optimizer.pt")
    with pytest.raises(SystemExit) as exit_info:
        train_cli([*args, "--max_steps", "4"])
    assert exit_info.value.code == 2 and "lacks optimizer.pt" in capsys.readouterr().err
    assert not (out / "checkpoint-4").exists()
    (tmp_path / "optimizer.pt").rename(out / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(SystemExit) as exit_info:
        train_cli([*args, "--max_steps", "4"])
    assert exit_info.value.code == 0 and (out / "checkpoint-4").is_dir()


# ---- space-tree, space-probe, space-chat, space-distill: numbers, devices, trees, files ----

from space.chat import cli as chat_cli  # noqa: E402  (this section's own entry points)
from space.eval.probe import cli as probe_cli  # noqa: E402
from space.eval.tree_search import cli as tree_cli  # noqa: E402

TINY_CHAT = ["--model", "tiny-random-llama", "--adapter", "none", "--kernels", "stock", "--max-new-tokens", "4"]
PROBE = ["--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "4", "-k", "2", "--out", "{tmp}/probe"]
GOOD_ROW = '{"source": "mbpp", "ranks": [[0, 1]]}\n'
RANKS = {  # file name -> content (bytes: written as is)
    "not_utf8.jsonl": b"\xff\xfe" + GOOD_ROW.encode(),
    "not_json.jsonl": GOOD_ROW + "{oops\n",
    "ragged.jsonl": GOOD_ROW + '{"source": "mbpp", "ranks": [[0, 1, 2]]}\n',
    "below.jsonl": '{"source": "mbpp", "ranks": [[0, -2]]}\n',
    "flat.jsonl": '{"source": "mbpp", "ranks": [0, 1]}\n',
    "not_a_row.jsonl": "[1, 2]\n",
    "good.jsonl": GOOD_ROW,
}
TREE_CASES = [
    ("space-tree", ["--ranks", "{tmp}/not_utf8.jsonl"], "not_utf8.jsonl: not a UTF-8 text file"),
    ("space-tree", ["--ranks", "{tmp}/not_json.jsonl"], "not_json.jsonl:2: not JSON"),
    ("space-tree", ["--ranks", "{tmp}/ragged.jsonl"], "ragged.jsonl:2: ranks must be integers >= -1 (-1: no token), 2 per anchor"),
    ("space-tree", ["--ranks", "{tmp}/below.jsonl"], "below.jsonl:1: ranks must be integers >= -1"),
    ("space-tree", ["--ranks", "{tmp}/flat.jsonl"], "flat.jsonl:1: 'ranks' must be a list of per-anchor lists"),
    ("space-tree", ["--ranks", "{tmp}/not_a_row.jsonl"], "not_a_row.jsonl:1: no 'ranks' field"),
    ("space-tree", ["--ranks", "{tmp}/good.jsonl", "--threads", "0"], "--threads must be >= 1, got 0"),
    ("space-tree", ["--ranks", "{tmp}/good.jsonl", "--device", "gpu7"], "unknown --device 'gpu7'"),
    ("space-tree", ["--ranks", "{tmp}/good.jsonl", "--max-rows", "1"], "--max-rows must be >= 2, got 1"),
    ("space-tree", ["--ranks", "{tmp}/good.jsonl", "--kernels", "turbo"], "--kernels must be one of fast, stock"),
    ("space-probe", [*PROBE, "--tree", "[[0],[400]]"], "--tree: rank 400 is not below the vocabulary size 320"),
    ("space-probe", [*PROBE, "--tree", "{tmp}/not_utf8.jsonl"], "not_utf8.jsonl: not UTF-8 text"),
    ("space-probe", [*PROBE, "--threads", "0"], "--threads must be >= 1, got 0"),
    ("space-probe", [*PROBE, "--device", "gpu7"], "unknown --device 'gpu7'"),
    ("space-chat", [*TINY_CHAT, "--temperature", "nan"], "--temperature must be a finite number, got nan"),
    ("space-chat", [*TINY_CHAT, "--temperature", "inf"], "--temperature must be a finite number, got inf"),
    ("space-chat", [*TINY_CHAT, "--temperature", "-1"], "--temperature must be >= 0"),
    ("space-chat", [*TINY_CHAT, "--temperature", "4e38"], "--temperature must be <= 3.40282"),  # after the load
    ("space-chat", [*TINY_CHAT, "--top-p", "nan"], "--top-p must lie in (0, 1], got nan"),
    ("space-chat", [*TINY_CHAT, "--top-p", "0"], "--top-p must lie in (0, 1], got 0.0"),
    ("space-chat", [*TINY_CHAT, "--mask-num", "0"], "--mask-num must be >= 1, got 0"),
    ("space-chat", [*TINY_CHAT, "--lookup-tokens", "-1"], "--lookup-tokens must be >= 0, got -1"),
    ("space-chat", [*TINY_CHAT, "--lookup-branches", "0"], "--lookup-branches must be >= 1, got 0"),
    ("space-chat", [*TINY_CHAT, "--datastore-branches", "0"], "--datastore-branches must be >= 1, got 0"),
    ("space-chat", [*TINY_CHAT, "--datastore-branches", "1"], "--datastore-branches counts the continuations"),
    # read by the dynamic tree with lookup alone: a static layout left it unread and recorded 1
    ("space-chat", [*TINY_CHAT, "--lookup-branches", "2"], "--lookup-branches 2 needs the dynamic tree with prompt lookup"),
    ("space-chat", [*TINY_CHAT, "--threads", "0"], "--threads must be >= 1, got 0"),
    ("space-chat", [*TINY_CHAT, "--device", "gpu7"], "unknown --device 'gpu7'"),
    ("space-chat", [*TINY_CHAT, "--kernels", "turbo"], "--kernels must be one of fast, stock"),
    ("space-chat", [*TINY_CHAT, "--tree", "[[0],[400]]"], "--tree: rank 400 is not below the vocabulary size 320"),
    ("space-chat", [*TINY_CHAT, "--tree", "{tmp}/not_utf8.jsonl"], "not_utf8.jsonl: not UTF-8 text"),
    # accepted before, then every turn failed with a remedy (/reset) that could not help
    ("space-chat", [*TINY_CHAT, "--max-new-tokens", "2048"], "--max-new-tokens 2048 leaves no room for a prompt"),
    ("space-distill", ["--magpie-seed", "-1", "--out", "{tmp}/d.jsonl"], "--magpie-seed must be >= 0, got -1"),
    ("space-distill", ["--magpie-seed", str(2**64), "--out", "{tmp}/d.jsonl"], "--magpie-seed must be < 4294967296"),
]
ENTRY.update({"space-tree": tree_cli, "space-probe": probe_cli, "space-chat": chat_cli})


@pytest.mark.parametrize("command, args, fragment", TREE_CASES)
def test_bad_input_tree_probe_chat(command, args, fragment, tmp_path, capsys):
    for name, content in RANKS.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as exit_info:
        ENTRY[command](["--model", "tiny-random-llama", *[a.format(tmp=tmp_path) for a in args]]
                       if command == "space-tree" else [a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment in err and f"{command}: error: " in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "probe").exists()  # every case fails before the model runs


@pytest.mark.parametrize("command, args", [("space-eval", [*EVAL, "--mask-num", "40"]),
                                           ("space-probe", [*PROBE, "-k", "40"])])
def test_a_mask_num_past_the_maximum_is_refused_before_the_model_loads(command, args, tmp_path, monkeypatch, capsys):
    """space-eval and space-probe refused k = 40 only once load_space had loaded the weights
    (seconds here, minutes for a 7B model); space-chat already refused it while parsing."""
    import space.loader

    monkeypatch.setattr(space.loader, "load_space", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit) as exit_info:
        ENTRY[command]([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "mask_num (k) = 40 exceeds the maximum 16" in err, err


def test_probe_answers_past_the_context_are_refused_before_generating(tmp_path, capsys):
    """HF's generate ran on past the tiny model's 2048-token context (RoPE extrapolates) and the
    probe scored those answers, exit 0; now every prompt is checked before the first batch."""
    import re

    with pytest.raises(SystemExit) as exit_info:
        ENTRY["space-probe"]([a.format(tmp=tmp_path) for a in PROBE] + ["--max-new-tokens", "2040"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert re.search(r"3 prompt\(s\) \(\S+: \d+ tokens\) \+ max_new_tokens 2040 exceed the model's context of "
                     r"2048 tokens", err), err
    assert not (tmp_path / "probe" / "answers.jsonl").exists()


def test_chat_survives_input_that_is_not_utf8(monkeypatch, capsys):
    """A piped line of bytes that are not UTF-8 is answered (with U+FFFD), not a crash."""
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff\nhello\n"), encoding="utf-8"))
    with pytest.raises(SystemExit) as exit_info:
        chat_cli(TINY_CHAT)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.count("tokens/step]") == 2, out


@pytest.mark.parametrize("command", ["space.eval.tree_search", "space.eval.probe", "space.chat", "space.distill"])
def test_help_is_fast_and_shows_each_default_once(command):
    """--help imports neither torch nor transformers (those take seconds), and no "(default: None)"."""
    code = (f"import sys, runpy; sys.argv = ['x', '--help']\ntry: runpy.run_module('{command}', run_name='__main__')\n"
            "except SystemExit: pass\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules, command")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    help_text = " ".join(run.stdout.split())
    assert "(default: None)" not in help_text and help_text.count("(default: cpu)") <= 1
    assert all(h.count("(default") <= 1 for h in help_text.split(" --")), help_text


# ---- space-eval, space-train: numbers (NaN, inf), files that are not UTF-8, Ctrl-C, resume setup ----

NOT_UTF8 = b"\xff\xfe{\"question_id\": \"q\", \"turns\": [\"hi\"]}\n"
EVAL_TRAIN_CASES = [
    ("space-eval", [*EVAL, "--temperature", "nan"], "--temperature must be a finite number, got nan"),
    ("space-eval", [*EVAL, "--temperature", "inf"], "--temperature must be a finite number, got inf"),
    # inf once in float32: SPACE's verification then drew from NaN probabilities (a traceback from torch)
    ("space-eval", [*EVAL, "--temperature", "4e38"], "--temperature must be <= 3.40282"),
    # HF's warper divides the logits unshifted: a traceback from transformers' sampling (SPACE and AR shift first)
    ("space-eval", [*EVAL, "--temperature", "1e-40", "--methods", "ar,pld"],
     "--temperature 1e-40 with pld: transformers divides the float32 logits by it, which overflows below 1e-30"),
    ("space-eval", [*EVAL, "--top-p", "nan"], "--top-p must be a finite number, got nan"),
    ("space-eval", [*EVAL, "--top-p", "0"], "--top-p must lie in (0, 1], got 0.0"),
    ("space-eval", [*EVAL, "--top-p", "1.5"], "--top-p must be <= 1, got 1.5"),
    ("space-eval", [*EVAL, "--top-k", "-1"], "--top-k must be >= 0, got -1"),
    ("space-eval", [*EVAL, "--seed", "-1"], "--seed must be >= 0, got -1"),
    ("space-eval", [*EVAL, "--seed", str(2**64)], "--seed must be <= 4294967295"),
    ("space-eval", [*EVAL, "--lookup-tokens", "-1"], "--lookup-tokens must be >= 0, got -1"),
    ("space-eval", [*EVAL, "--lookup-branches", "0"], "--lookup-branches must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--datastore-branches", "0"], "--datastore-branches must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--datastore-branches", "2"], "--datastore-branches counts the continuations of a --datastore"),
    ("space-eval", [*EVAL, "--tree", "dynamic", "--lookup-tokens", "0", "--lookup-branches", "3"],
     "--lookup-branches 3 needs the dynamic tree with prompt lookup (this layout: tree dynamic, lookup_tokens 0)"),
    ("space-eval", [*EVAL, "--datastore", "x.jsonl", "--methods", "ar,pld"], "--datastore drafts for the space method"),
    ("space-eval", [*EVAL, "--datastore", "no/such/set.jsonl", "--tree", "dynamic", "--lookup-tokens", "4"],
     "datastore set no/such/set.jsonl not found"),
    ("space-eval", [*EVAL, "--datastore", "no/such/set.jsonl", "--tree", "chain"],
     "datastore_branches are branches of the dynamic tree's lookup"),
    ("space-eval", [*EVAL, "--num-groups", "0"], "--num-groups must be >= 1, got 0"),
    ("space-eval", [*EVAL, "--kernels", "turbo"], "unknown --kernels 'turbo'"),
    ("space-eval", [*EVAL, "--device", "gpu7"], "unknown --device 'gpu7'"),
    ("space-eval", [*EVAL, "--dataset", "{tmp}/not_utf8.jsonl"], "not_utf8.jsonl: not UTF-8 text"),
    ("space-eval", [*EVAL, "--tree", "{tmp}/not_utf8.jsonl"], "--tree {tmp}/not_utf8.jsonl: not UTF-8 text"),
    ("space-eval", [*EVAL, "--device-map", "{tmp}/not_utf8.jsonl"], "--device-map {tmp}/not_utf8.jsonl: not UTF-8"),
    ("space-train", [*TRAIN, "--mask_loss_weight", "nan"], "mask_loss_weight must be a finite number, got nan"),
    ("space-train", [*TRAIN, "--mask_loss_weight", "-1"], "mask_loss_weight must be >= 0, got -1.0"),
    ("space-train", [*TRAIN, "--max_train_minutes", "nan"], "max_train_minutes must be a finite number, got nan"),
    ("space-train", [*TRAIN, "--max_train_minutes", "-1"], "max_train_minutes must be >= 0, got -1.0"),
    ("space-train", [*TRAIN, "--mask_prob", "nan"], "mask_prob must lie in [0, 1], got nan"),
    ("space-train", [*TRAIN, "--span_density", "inf"], "span_density must lie in [0, 1], got inf"),
    ("space-train", [*TRAIN, "--lora_dropout", "1"], "lora_dropout must lie in [0, 1), got 1"),
    ("space-train", [*TRAIN, "--lora_dropout", "nan"], "lora_dropout must lie in [0, 1], got nan"),
    ("space-train", [*TRAIN, "--lora_r", "0"], "lora_r must be >= 1, got 0"),
    ("space-train", [*TRAIN, "--lora_alpha", "0"], "lora_alpha must be > 0, got 0"),
    ("space-train", [*TRAIN, "--learning_rate", "nan"], "learning_rate must be a finite number, got nan"),
    ("space-train", [*TRAIN, "--num_train_epochs", "inf"], "num_train_epochs must be a finite number, got inf"),
    ("space-train", ["--config", "{tmp}/not_utf8.yaml"], "not_utf8.yaml: not UTF-8 text"),
    ("space-train", [*TRAIN, "--datasets", "{tmp}/not_utf8.jsonl"], "not_utf8.jsonl: not UTF-8 text"),
]


@pytest.mark.parametrize("command, args, fragment", EVAL_TRAIN_CASES)
def test_bad_input_eval_train(command, args, fragment, tmp_path, capsys):
    (tmp_path / "not_utf8.jsonl").write_bytes(NOT_UTF8)
    (tmp_path / "not_utf8.yaml").write_bytes(b"output_dir: x\nmode: \xff\n")
    with pytest.raises(SystemExit) as exit_info:
        ENTRY[command]([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment.format(tmp=tmp_path) in err and f"{command}: error: " in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "samples.jsonl").exists() and not (tmp_path / "train").exists()


@pytest.mark.parametrize("command, target", [("space-eval", "space.eval.__main__.load_tasks"),
                                             ("space-train", "space.train.run.run_sft")])
def test_ctrl_c_prints_one_line_and_the_resume_hint(command, target, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, interrupted)
    with pytest.raises(SystemExit) as exit_info:
        ENTRY[command]([a.format(tmp=tmp_path) for a in (EVAL if command == "space-eval" else TRAIN)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err == f"{command}: interrupted; run the same command again to resume\n"


def test_eval_resume_refuses_another_thread_count(tmp_path, capsys):
    """Timings made with 1 and 2 threads are not mixed in one folder (nor other device, torch, ...:
    tests/eval/test_resume.py covers every key)."""
    assert _eval(tmp_path) == 0
    before = _lines(tmp_path / "samples.jsonl")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        eval_cli(["--model", "tiny-random-llama", "--limit", "2", "--max-new-tokens", "4", "--methods", "ar,space",
                  "--threads", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "'threads': (1, 2)" in err and err.count("\n") == 1, err
    assert _lines(tmp_path / "samples.jsonl") == before


def test_eval_refuses_an_out_another_run_writes(tmp_path, capsys):
    """Two runs into one --out both wrote every record; the second is refused in one line, naming
    the first's process, before its model loads."""
    from space.eval.resume import hold_samples

    (tmp_path / "out").mkdir()
    with hold_samples(tmp_path / "out" / "samples.jsonl"):
        with pytest.raises(SystemExit) as exit_info:
            eval_cli([a.format(tmp=tmp_path) for a in EVAL])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert f"samples.jsonl is being written by another run (pid {os.getpid()})" in err, err
    assert not (tmp_path / "out" / "samples.jsonl").exists()


def test_eval_resume_says_how_far_it_got(tmp_path, capsys):
    assert _eval(tmp_path) == 0
    capsys.readouterr()
    assert _eval(tmp_path, "--limit", "2") == 0
    assert "resuming: 2 of 4 (question, method) records done" in capsys.readouterr().out


# ---- damaged adapter files (load_space, which space-eval goes through) ----

@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=3)
    return save_artifact(tmp_path_factory.mktemp("adapter") / "a", peft_model, tok, spec, "frozen-base",
                         {"base_model": "tiny-random-llama"})


@pytest.mark.parametrize("name, damage, fragment", [
    ("adapter_model.safetensors", "truncate", "adapter_model.safetensors: not a valid safetensors file"),
    ("adapter_model.safetensors", "garbage", "adapter_model.safetensors: not a valid safetensors file"),
    ("mask_embedding.safetensors", "truncate", "mask_embedding.safetensors: not a valid safetensors file"),
    ("mask_embedding.safetensors", "garbage", "mask_embedding.safetensors: not a valid safetensors file"),
    ("space_config.json", "garbage", "space_config.json: not valid JSON"),
    ("space_config.json", "truncate", "space_config.json: not valid JSON"),
    ("adapter_config.json", "garbage", "adapter_config.json: not valid JSON"),
])
def test_damaged_adapter_file_is_one_line_error(tiny_adapter, tmp_path, capsys, name, damage, fragment):
    import shutil

    adapter = shutil.copytree(tiny_adapter, tmp_path / "adapter")
    data = (adapter / name).read_bytes()
    (adapter / name).write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x89\xff\x00garbage" * 40)
    assert _eval(tmp_path / "out", "--adapter", str(adapter)) == 2
    err = capsys.readouterr().err
    assert fragment in err and "space-eval: error: " in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


# ---- decoding configs (DecodeConfig, SamplingConfig, SpaceDecoder): ranges, NaN, inf, tree ranks ----

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder  # noqa: E402  (this section's API)


NAN, INF = float("nan"), float("inf")
DECODING_CONFIG_CASES = [
    (DecodeConfig, {"mask_num": NAN}, "mask_num (k) must be an integer >= 1, got nan"),
    (DecodeConfig, {"mask_num": INF}, "mask_num (k) must be an integer >= 1, got inf"),
    (DecodeConfig, {"num_groups": NAN}, "num_groups must be an integer, got nan"),
    (DecodeConfig, {"num_groups": INF}, "num_groups must be an integer, got inf"),
    (DecodeConfig, {"num_groups": 2.0}, "num_groups must be an integer, got 2.0"),
    (DecodeConfig, {"mask_num": 3, "num_groups": 5}, "num_groups must lie in 1..4, got 5"),
    (DecodeConfig, {"lookup_tokens": NAN}, "lookup_tokens must be an integer, got nan"),
    (DecodeConfig, {"lookup_tokens": INF}, "lookup_tokens must be an integer, got inf"),
    (DecodeConfig, {"lookup_tokens": -1}, "lookup_tokens must be >= 0, got -1"),
    (DecodeConfig, {"lookup_ngram": NAN}, "lookup_ngram must be an integer, got nan"),
    (DecodeConfig, {"lookup_ngram": 0}, "lookup_ngram must be >= 1, got 0"),
    (DecodeConfig, {"num_groups": True}, "num_groups must be an integer, got True"),  # a bool is no count
    (DecodeConfig, {"mask_num": 3, "num_groups": 0, "tree": "dynamic", "lookup_tokens": 4},
     "num_groups 0 (no mask group) is prompt lookup alone: it needs lookup_tokens > 0 and a static layout"),
    (DecodeConfig, {"tree": "dynamic", "step_cost": ((1, 1.0), (2, 2.0)), "adapter_cost": NAN},
     "adapter_cost must be a finite number, got nan"),
    (DecodeConfig, {"tree": "dynamic", "step_cost": ((1, 1.0), (2, 2.0)), "adapter_cost": -1.0},
     "adapter_cost must be >= 0.0, got -1.0"),
    (SamplingConfig, {"temperature": NAN}, "temperature must be a finite number, got nan"),
    (SamplingConfig, {"temperature": INF}, "temperature must be a finite number, got inf"),
    (SamplingConfig, {"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    (SamplingConfig, {"temperature": 4e38},
     "temperature must be <= 3.403e+38 (float32's largest value: the logits are float32), got 4e+38"),
    (SamplingConfig, {"top_p": NAN}, "top_p must be a finite number, got nan"),
    (SamplingConfig, {"top_p": 0.0}, "top_p must lie in (0, 1], got 0.0"),
    (SamplingConfig, {"top_p": 1.5}, "top_p must lie in (0, 1], got 1.5"),
    (SamplingConfig, {"top_k": NAN}, "top_k must be an integer, got nan"),
    (SamplingConfig, {"top_k": INF}, "top_k must be an integer, got inf"),
    (SamplingConfig, {"top_k": -1}, "top_k must be >= 0, got -1"),
    (SamplingConfig, {"seed": NAN}, "seed must be an integer, got nan"),
    (SamplingConfig, {"seed": -1}, "seed must lie in 0..18446744073709551615, got -1"),
]


@pytest.mark.parametrize("config, values, message", DECODING_CONFIG_CASES)
def test_decoding_config_refuses_bad_numbers(config, values, message):
    with pytest.raises(ValueError) as error:
        config(**values)
    assert str(error.value) == message  # one line, naming the option and the bad value


def test_tree_rank_at_the_vocabulary_size_is_refused(tiny):
    model, _, spec = tiny
    vocab = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError) as error:
        SpaceDecoder(model, spec, DecodeConfig(2, tree=[[0], [vocab], [0, 0]]))
    assert str(error.value) == f"token tree: rank {vocab} is at or above this model's vocabulary size {vocab} (ranks count from 0)"
    assert SpaceDecoder(model, spec, DecodeConfig(2, tree=[[0], [vocab - 1]])).draft_ranks == vocab  # the last rank is fine
    # a dynamic tree has no tree ranks: its draft_ranks was blamed on one
    with pytest.raises(ValueError) as error:
        SpaceDecoder(model, spec, DecodeConfig(2, tree="dynamic", draft_ranks=vocab + 1))
    assert str(error.value) == f"draft_ranks {vocab + 1} exceeds this model's vocabulary size {vocab}"


# ---- run_sft_multi_node.sh: its arguments and environment (checked in a dry run too) ----

LAUNCHER = ROOT / "run_sft_multi_node.sh"
LAUNCH_CONFIG = ["configs/train/tiny_smoke.yaml", "--max_steps", "1", "--output_dir", "{tmp}/train"]
LAUNCHER_CASES = [  # (environment, arguments, the one line on stderr)
    ({}, [], "usage: bash run_sft_multi_node.sh CONFIG [--smoke] [--key value ...]"),
    ({}, ["configs/train/nope.yaml"], "config not found: configs/train/nope.yaml"),
    ({"NNODES": "2", "MASTER_ADDR": "node0"}, LAUNCH_CONFIG, "NNODES=2 needs NODE_RANK (this node's index, 0..1)"),
    ({"NNODES": "2", "NODE_RANK": "1"}, LAUNCH_CONFIG, "NNODES=2 needs MASTER_ADDR"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "node0"}, LAUNCH_CONFIG,
     "NODE_RANK must be an integer in 0..1 (NNODES=2), got '2'"),
    ({"NODE_RANK": "-1"}, LAUNCH_CONFIG, "NODE_RANK must be an integer in 0..0 (NNODES=1), got '-1'"),
    # a leading zero: bash read 010 as octal 8 (let through for NNODES=9, torchrun then read 10)
    ({"NNODES": "9", "NODE_RANK": "010", "MASTER_ADDR": "node0"}, LAUNCH_CONFIG,
     "NODE_RANK must be an integer in 0..8 (NNODES=9), got '010'"),
    ({"MASTER_PORT": "08080"}, LAUNCH_CONFIG, "MASTER_PORT must be a port number in 1..65535, got '08080'"),
    ({"NNODES": "two"}, LAUNCH_CONFIG, "NNODES must be an integer >= 1, got 'two'"),
    ({"NPROC_PER_NODE": "0"}, LAUNCH_CONFIG, "NPROC_PER_NODE must be an integer >= 1, got '0'"),
    ({"NPROC_PER_NODE": "abc"}, LAUNCH_CONFIG, "NPROC_PER_NODE must be an integer >= 1, got 'abc'"),
    ({"NPROC_PER_NODE": "abc"}, [*LAUNCH_CONFIG, "--smoke"], "NPROC_PER_NODE must be an integer >= 1, got 'abc'"),
    ({"MASTER_PORT": "99999"}, LAUNCH_CONFIG, "MASTER_PORT must be a port number in 1..65535, got '99999'"),
    ({"PYTHON": "/no/such/python"}, LAUNCH_CONFIG, "PYTHON=/no/such/python: no such program"),
    ({"SPACE_LAUNCH_DRY_RUN": "yes"}, LAUNCH_CONFIG, "SPACE_LAUNCH_DRY_RUN must be 0 or 1, got 'yes'"),
]


@pytest.mark.parametrize("env, args, message", LAUNCHER_CASES)
def test_bad_launcher_input(env, args, message, tmp_path):
    """Exit 2 with one line before torchrun starts: a multi-node run without its rendezvous would
    otherwise wait out torchrun's 600 s timeout, and no arguments would start a 3-hour training."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "PYTHON")}
    run = subprocess.run(["bash", str(LAUNCHER), *[a.format(tmp=tmp_path) for a in args]], cwd=ROOT,
                         env={**inherited, "SPACE_LAUNCH_DRY_RUN": "1", **env}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
    assert not (tmp_path / "train").exists()
