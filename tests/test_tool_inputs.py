"""Bad input to the secondary tools (space-tree, space-distill, scripts/*.py): refused with one line and
exit 2 before the model loads or anything is timed, and no run that claims what it did not do (an
empty distilled set reported complete, a sweep table of arms trained with other settings, an unpack
that replaces a user's set)."""
from __future__ import annotations

import importlib.util
import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from space.distill import Distiller, MagpieSettings
from space.models import tiny_tokenizer

from tests.test_distill import StubModel

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def no_model(monkeypatch):
    """Any model load fails the test: the refusal must come first."""
    import space.loader
    import space.models

    def fail(*a, **k):
        pytest.fail("loaded the model before refusing the input")

    monkeypatch.setattr(space.loader, "load_space", fail)
    monkeypatch.setattr(space.models, "load_model", fail)


def prompts_file(tmp_path: Path, questions) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in questions))
    return path


# ---- space-distill ----


def test_distill_an_empty_set_is_never_complete(tmp_path):
    """Catches the manifest marked complete before the "no rows written" refusal: the rerun found the
    set complete, printed "nothing to do" and exited 0 on an empty set."""
    tok = tiny_tokenizer()
    answers = {"A?": " \n ", "B?": "  "}  # blank answers: skipped
    src, out = prompts_file(tmp_path, answers), tmp_path / "set.jsonl"

    def distiller():
        return Distiller(out, "stub", {str(src): None}, 2, 16, 384, None, MagpieSettings())

    with pytest.raises(ValueError, match="no rows written"):
        distiller().run(StubModel(tok, answers), tok)
    assert json.loads((tmp_path / "set.manifest.json").read_text())["complete"] is False
    assert not distiller().complete()
    with pytest.raises(ValueError, match="no rows written"):  # tried again, refused again
        distiller().run(StubModel(tok, answers), tok)
    # a manifest an earlier version marked complete over no row: not complete either
    manifest = json.loads((tmp_path / "set.manifest.json").read_text())
    (tmp_path / "set.manifest.json").write_text(json.dumps({**manifest, "complete": True, "rows": 0}))
    assert not distiller().complete()


def test_distill_refuses_a_limit_below_the_rows_a_set_holds(tmp_path):
    """Catches a resume with a lower limit: nothing was answered, and the manifest recorded the new
    limit over the rows of the old one (3 rows under a limit of 1)."""
    tok = tiny_tokenizer()
    answers = {"A?": "a", "B?": "b", "C?": "c"}
    src, out = prompts_file(tmp_path, answers), tmp_path / "set.jsonl"

    def run(limit):
        return Distiller(out, "stub", {str(src): limit}, 2, 16, 384, None, MagpieSettings()).run(
            StubModel(tok, answers), tok)

    assert run(3)["rows"] == 3
    with pytest.raises(ValueError, match="already holds 3 .* rows, more than .*-limit 1"):
        run(1)
    assert json.loads((tmp_path / "set.manifest.json").read_text())["sources"] == {str(src): 3}
    assert run(None)["rows"] == 3 and run(5)["rows"] == 3  # as many or more: resumed


def test_distill_refuses_a_sources_settings_without_the_source(tmp_path, capsys, monkeypatch):
    """Catches --magpie-seed, --magpie-limit, --no-follow-ups or --lima-limit given while --sources
    leaves their source out: unread, the set came out without what they asked for, exit 0. Given with
    their source they pass on to the run."""
    from space.distill import cli, main

    no_model(monkeypatch)
    for argv, said in ((["--sources", "lima", "--magpie-seed", "3", "--no-follow-ups"],
                        "--magpie-seed, --no-follow-ups given, but --sources lima leaves them unread"),
                       (["--sources", "magpie", "--lima-lim", "10"], "--lima-limit given")):
        with pytest.raises(SystemExit) as info:
            cli([*argv, "--out", str(tmp_path / "s.jsonl")])
        assert info.value.code == 2 and said in capsys.readouterr().err
    ran = []
    summary = {"rows": 0, "new_rows_this_run": 0, "seconds_this_run": 0, "rows_by_source": {},
               "skipped_this_run": {}, "filter_verdicts": {}}
    monkeypatch.setattr("space.distill.distill", lambda out, model, limits, *a: ran.append(limits) or summary)
    main(["--sources", "lima,magpie", "--lima-limit", "5", "--magpie-seed", "3", "--out", str(tmp_path / "s.jsonl")])
    assert ran == [{"lima": 5, "magpie": 1000}]


# ---- scripts/distilled_sets.py ----


def test_unpack_never_replaces_a_set_that_differs(tmp_path):
    """Catches unpack writing over a set of the same name in --out (one resumed since it was packed):
    its rows were lost without a word. The archive's own bytes may be written again."""
    from space.data.set_archive import pack, unpack

    tok = tiny_tokenizer()
    answers = {"A?": "a", "B?": "b", "C?": "c"}
    src, out = prompts_file(tmp_path, answers), tmp_path / "set.jsonl"
    Distiller(out, "stub", {str(src): 2}, 2, 16, 384, None, MagpieSettings()).run(StubModel(tok, answers), tok)
    pack([out], tmp_path / "archive", tok=tok)
    assert unpack(tmp_path / "archive", tmp_path, tok=tok) == [out]  # the same bytes: fine
    Distiller(out, "stub", {str(src): None}, 2, 16, 384, None, MagpieSettings()).run(StubModel(tok, answers), tok)
    grown = out.read_bytes()
    with pytest.raises(FileExistsError, match="set.jsonl exists and differs from the archive's"):
        unpack(tmp_path / "archive", tmp_path, tok=tok)
    assert out.read_bytes() == grown


# ---- space-tree ----


@pytest.mark.parametrize("out, said", [("afile", "tree_search.json lies under the file"),
                                       ("afile/sub", "tree_search.json lies under the file")])
def test_space_tree_refuses_an_unwritable_out_before_the_model_loads(out, said, tmp_path, monkeypatch):
    """Catches --out checked only when tree_search.json was written, after the step-cost curve was timed."""
    from space.eval.tree_search import main

    no_model(monkeypatch)
    (tmp_path / "afile").write_text("")
    ranks = tmp_path / "ranks.jsonl"
    ranks.write_text('{"source": "mbpp", "ranks": [[0, 1]]}\n')
    with pytest.raises(ValueError, match=said):
        main(["--model", "tiny-random-llama", "--ranks", str(ranks), "--out", str(tmp_path / out)])
    with pytest.raises(ValueError, match="no static layout fits in --max-rows 2 rows"):
        main(["--model", "tiny-random-llama", "--ranks", str(ranks), "--max-rows", "2", "--out", str(tmp_path)])


# ---- scripts/sweep_recipes.py ----


def test_sweep_refuses_an_arm_made_with_another_recipe(tmp_path, monkeypatch):
    """Catches a done arm reused after the sweep file changed its minutes or flags: the table showed
    the old arm's numbers under the new minutes and flags, and exited 0."""
    script = load_script("sweep_recipes")
    monkeypatch.setattr(script, "run", lambda cmd: pytest.fail("trained or probed before checking"))
    out = tmp_path / "out"
    shutil.copytree(ROOT / "results" / "sweep" / "base", out / "base")
    train = json.loads((out / "base" / "train.json").read_text())
    made = {"base_config": "configs/train/x.yaml", "minutes": 8, "flags": []}
    (out / "base" / "train.json").write_text(json.dumps({**train, "recipe": made}))
    sweep = tmp_path / "sweep.yaml"
    argv = [str(sweep), "--out", str(out), "--runs", str(tmp_path / "runs")]
    for changed in ("minutes: 30\narms:\n  base: []\n", "minutes: 8\narms:\n  base: [--lora_r, '64']\n"):
        sweep.write_text("base_config: configs/train/x.yaml\n" + changed)
        with pytest.raises(ValueError, match="arm 'base' was made with"):
            script.main(argv)
    sweep.write_text("base_config: configs/train/x.yaml\nminutes: 8\narms:\n  base: []\n")
    rows = script.main(argv)  # the same recipe: the table is rebuilt from the arm as it is
    assert [r["arm"] for r in rows] == ["base"]


# ---- scripts/gpu_bench.py ----


@pytest.mark.parametrize("argv, said", [
    (["step-cost", "--rows", "2,4"], "argument --rows: must include 1"),
    (["step-cost", "--rows", "1,x"], "argument --rows: must be a comma list of integers >= 1"),
    (["step-cost", "--caches", "0"], "argument --caches: must be an integer >= 1, got 0"),
    (["step-cost", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["host-time", "--prompts", "0"], "argument --prompts: must be an integer >= 1, got 0"),
    (["train", "--steps", "2"], "argument --steps: must be >= 3"),
    (["train", "--out", "{tmp}"], "is a folder; name a file"),
])
def test_gpu_bench_refuses_bad_arguments_before_any_model(argv, said, tmp_path, capsys, monkeypatch):
    """Each failed after the work (a KeyError after the first curve, a median of no step after
    training, an --out folder after training) or deep inside it with a traceback."""
    bench = load_script("gpu_bench")
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("built the model first"))
    monkeypatch.setattr(bench, "LlamaForCausalLM", lambda *a, **k: pytest.fail("built the model first"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit) as info:
        bench.main([*argv, "--shape", "tiny", "--device", "cpu"])
    assert info.value.code == 2 and said in capsys.readouterr().err


# ---- scripts/replay_lookup.py ----


def test_replay_lookup_skips_skipped_questions_and_those_past_the_limit(tmp_path):
    """Catches a KeyError traceback on a skipped question's record (it has no choices) and on a
    record past the run's --limit (an earlier run's, kept in samples.jsonl)."""
    from transformers import AutoTokenizer

    from space.models import smollm2_dir

    script = load_script("replay_lookup")
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    run = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "humaneval40_zen4_frozen", run, ignore=shutil.ignore_patterns("*.png"))
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    ar = [r for r in records if r["model_id"] == "ar"]
    gone = ar[0]["question_id"]
    records = [r for r in records if r["question_id"] != gone] + [
        {"question_id": gone, "category": ar[0].get("category"), "model_id": "ar", "skipped": "ar: too long"}]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps({**config, "limit": 20}))
    pairs = script.answers(run, tok, None)
    assert 0 < len(pairs) and len(pairs) == 19  # questions 1..19 of the first 20, question 0 skipped


# ---- the scripts' error path ----


@pytest.mark.parametrize("script, argv, said", [
    ("compare_drafters", ["{tmp}/none.jsonl"], "compare_drafters: error: {tmp}/none.jsonl: no such ranks file"),
    ("compare_planners", ["{tmp}"], "compare_planners: error:"),
    ("distilled_sets", ["unpack", "{tmp}", "--out", "{tmp}/x"], "distilled_sets: error: {tmp} holds no archive.json"),
    ("distilled_sets", ["pack", "{tmp}/s.jsonl", "--out", "{tmp}/x", "--max-mb", "nan"], "--max-mb must be a finite"),
    ("plot_mask_accuracy", ["{tmp}/none.json", "{tmp}/p.png"], "plot_mask_accuracy: error:"),
    ("plot_mask_accuracy", [str(ROOT / "results/sweep/token_targets/log_history.json"), "{tmp}/p.png",
                            "--tokens-before", "5"], "--tokens-before shifts a training-tokens axis"),
    ("sweep_recipes", ["{tmp}/none.yaml"], "sweep_recipes: error:"),
    ("replay_lookup", ["{tmp}", "--branches", "0"], "argument --branches: must be an integer >= 1, got 0"),
    ("replay_lookup", ["{tmp}", "--lookup-ngram", "0"], "argument --lookup-ngram: must be >= 1, got 0"),
    ("replay_lookup", ["{tmp}", "--datastore-branches", "2"], "--datastore-branches counts a datastore's"),
    ("tune_layout", ["--model", "tiny-random-llama", "--top", "2"], "--top counts the --search file's layouts"),
    ("reproduce_table1", ["--checkpoint", "t={ad}", "--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    ("reproduce_table1", ["--checkpoint", "t={ad}", "--limit", "0"], "--limit must be >= 1, got 0"),
    ("reproduce_table1", ["--checkpoint", "t={ad}", "--languages", "pyton"], "--languages: unknown ['pyton']"),
    ("tune_layout", ["--model", "tiny-random-llama", "--search", "{tmp}/bad.json", "--out", "{tmp}/t.json"],
     "--search {tmp}/bad.json: not a space-tree tree_search.json"),
])
def test_scripts_refuse_bad_input_with_one_line_and_exit_2(script, argv, said, tmp_path, capsys, monkeypatch):
    """Catches a traceback and exit 1 for a missing or malformed input, and (reproduce_table1) the
    evaluation's flags refused by space-eval only after every model trained, --max-steps 0 dropped."""
    import subprocess

    no_model(monkeypatch)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a training or evaluation first"))
    (tmp_path / "bad.json").write_text('{"x": 1}')
    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "space_config.json").write_text("{}")
    fill = {"tmp": tmp_path, "ad": adapter}
    monkeypatch.setattr(sys, "argv", [script, *(a.format(**fill) for a in argv)])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(ROOT / "scripts" / f"{script}.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert info.value.code == 2 and said.format(**fill) in err and "Traceback" not in err, err[-2000:]
