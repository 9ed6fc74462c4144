"""Every entry point answers --help; the shell wrapper and the Table-1 script run on the tiny model."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["space.eval", "space.train", "space.distill", "space.layout_cli", "space.eval.probe"])
def test_module_help(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-500:]


def test_shell_wrappers_help():
    for script in ("run_eval.sh", "run_sft_multi_node.sh"):
        out = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "bash" in out.stdout


def test_run_eval_sh_on_another_model(tmp_path):
    """The shipped adapter is for SmolLM2: run_eval.sh leaves it out for another --model. It runs
    the python of setup.sh's VENV when one is given (it ran .venv's, or set up again)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho ran >> {tmp_path / "used"}\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    out = subprocess.run(["bash", "run_eval.sh", "--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "4",
                          "--methods", "ar,space", "--threads", "1", "--out", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "VENV": str(venv)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["adapter"] is None
    assert (tmp_path / "used").is_file()


def test_run_eval_sh_keeps_the_adapter_for_its_base_spelt_another_way(tmp_path):
    """run_eval.sh compared --model with the adapter's base_model as text: its base given as
    ``./m/`` (or the alias's cache folder) ran without the adapter, said only by a warning; a
    space_config.json that is not JSON printed a Python traceback before space-eval's one-line
    error. A python that prints the arguments it would hand space-eval stands in for the run."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -m ]; then echo "$@"; exit 0; fi\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (tmp_path / "m").mkdir()
    for name, config in (("adapter", json.dumps({"base_model": str(tmp_path / "m")})), ("broken", "{not json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "space_config.json").write_text(config)

    def passed(model: str, adapter: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "run_eval.sh"), "--model", model], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "VENV": str(venv), "ADAPTER": adapter,
                                                           "PYTHONPATH": str(ROOT)})

    for model in ("./m/", "m", str(tmp_path / "m")):
        out = passed(model, str(tmp_path / "adapter"))
        assert out.returncode == 0 and f"--adapter {tmp_path / 'adapter'}" in out.stdout, (model, out.stdout, out.stderr)
    assert "--adapter" not in passed("tiny-random-llama", str(tmp_path / "adapter")).stdout
    broken = passed("tiny-random-llama", str(tmp_path / "broken"))
    assert "--adapter" in broken.stdout and "Traceback" not in broken.stderr, broken.stderr


def test_run_eval_sh_reads_paths_from_where_it_runs_and_refuses_a_wrong_adapter(tmp_path):
    """Catches the script's cd into the repo: a relative --dataset or --out was read from the repo,
    not from where the user ran it; and a mistyped ADAPTER was dropped without a word (the run went
    on without an adapter and exited 0)."""
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    common = ["bash", str(ROOT / "run_eval.sh"), "--model", "tiny-random-llama", "--limit", "1",
              "--max-new-tokens", "4", "--methods", "ar", "--threads", "1", "--dataset", "q.jsonl", "--out", "o"]
    out = subprocess.run(common, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "o" / "summary.json").is_file()
    bad = subprocess.run(common, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ADAPTER": "adapters/typo"})
    assert bad.returncode == 2 and "ADAPTER=adapters/typo is not a SPACE adapter" in bad.stderr


def test_run_eval_sh_keeps_each_datasets_run_in_its_own_folder(tmp_path):
    """Every run_eval.sh wrote to runs/eval/main: after the README's first command, its own example
    ``--dataset mt-bench`` stopped there ("holds samples made with other settings"). The default folder
    is now named for the dataset, the model and whether an adapter runs."""
    for name in ("q", "r"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": f"Say {name}."}) + "\n")
    common = ["bash", str(ROOT / "run_eval.sh"), "--model", "tiny-random-llama", "--limit", "1",
              "--max-new-tokens", "4", "--methods", "ar", "--threads", "1"]
    for name in ("q", "r"):
        out = subprocess.run([*common, "--dataset", f"{name}.jsonl"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "runs" / "eval").iterdir()) == [
        "main_q_tiny-random-llama_no_adapter", "main_r_tiny-random-llama_no_adapter"]
    # an adapter of the user's own is named (it was "_no_adapter", the folder of a run without one)
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=3)
    save_artifact(tmp_path / "mine", peft_model, tok, spec, "frozen-base", {"base_model": "tiny-random-llama"})
    out = subprocess.run([*common, "--dataset", "q.jsonl", "--adapter", "mine"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "runs" / "eval" / "main_q_tiny-random-llama_mine" / "summary.json").is_file()
    # ... or through ADAPTER= (for its own base model; the tiny one here)
    out = subprocess.run([*common, "--dataset", "r.jsonl"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ADAPTER": "mine"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "runs" / "eval" / "main_r_tiny-random-llama_mine" / "summary.json").is_file()


def test_reproduce_table1_tiny(tmp_path):
    # from another folder with a relative --out: training (run from the repo root) and evaluation
    # must both use tmp_path/table
    out = subprocess.run([sys.executable, str(ROOT / "scripts/reproduce_table1.py"), "--models", "tiny", "--limit", "1",
                          "--max-steps", "2", "--max-new-tokens", "8", "--out", "table"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "table" / "table1.md").read_text()
    assert "| tiny | frozen-base | python |" in table and "100.0 %" in table
    # what the row ran, which the table alone did not say (DESIGN §6)
    assert re.search(r"- tiny python: model \S+, adapter \S+, k \d, float32 on cpu, seed 0, max_new_tokens 8, "
                     r"dataset humaneval-x:python, limit 1, torch \S+, transformers \S+", table), table
    # a rerun with more steps trains on: the 2-step artifact was tabled again, silently
    argv = out.args
    again = subprocess.run([*argv[:argv.index("--max-steps") + 1], "3", *argv[argv.index("--max-steps") + 2:]],
                           cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    final = tmp_path / "table" / "tiny" / "final"
    assert json.loads((final / "space_config.json").read_text())["global_step"] == 3
    assert "--max_steps" in json.loads((final.parent / "train_command.json").read_text())


def test_eval_help_loads_no_torch_and_shows_each_default_once():
    code = ("import sys; from space.eval.__main__ import build_parser; text = build_parser().format_help()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint(text)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-1000:]
    text = " ".join(out.stdout.split())
    assert "(default: None)" not in text and all(h.count("(default") <= 1 for h in text.split(" --"))


def test_train_help_lists_space_options_first(capsys):
    from space.train.__main__ import main as train_main

    with pytest.raises(SystemExit):
        train_main(["--help"])
    text = capsys.readouterr().out
    assert text.index("--config CONFIG") < text.index("SPACE: model") < text.index("SPACE: mask tokens") \
        < text.index("HF TrainingArguments")
    assert "YAML file setting any of the keys" in text and "(default: None)" not in " ".join(text.split())
    # Python 3.13's argparse writes the metavar once: "--lora_r, --lora-r LORA_R"
    assert re.search(r"--lora_r( LORA_R)?, --lora-r LORA_R\n +lora / frozen-base: LoRA rank", text), text


def test_output_file_checks_a_results_path_and_makes_nothing(tmp_path):
    """``space.cli.output_file`` (the benchmark scripts' --out) refuses a folder, a path under a file
    and an unwritable folder while parsing, and makes no folder: one made while parsing stayed
    behind after --help or a later bad flag."""
    import argparse

    from space.cli import output_file

    (tmp_path / "afile").write_text("")
    assert output_file(str(tmp_path / "new" / "deeper" / "r.json")) == tmp_path / "new" / "deeper" / "r.json"
    assert not (tmp_path / "new").exists()
    for path, said in ((tmp_path, "is a folder; name a file"), (tmp_path / "afile" / "r.json", "lies under the file")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            output_file(str(path))
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        with pytest.raises(argparse.ArgumentTypeError, match="is not writable"):
            output_file(str(tmp_path / "locked" / "sub" / "r.json"))


def test_given_flags_names_what_the_command_line_gave_not_the_defaults():
    """``space.cli.given_flags``: a flag given at its default value counts, an abbreviated one counts
    under its own name, a store_true counts, a flag left out does not (a check on the parsed values
    alone cannot tell a default from a flag given)."""
    import argparse

    from space.cli import given_flags

    p = argparse.ArgumentParser()
    p.add_argument("--magpie-seed", type=int, default=0)
    p.add_argument("--lima-limit", type=int, default=400)
    p.add_argument("--no-follow-ups", action="store_true")
    assert given_flags(p, []) == set()
    assert given_flags(p, ["--magpie-seed", "0"]) == {"magpie_seed"}
    assert given_flags(p, ["--lima-l", "5", "--no-follow-ups"]) == {"lima_limit", "no_follow_ups"}
