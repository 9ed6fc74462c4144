"""space-eval end to end on tiny-random-llama, the executors, resume and bad input."""
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

from tests.conftest import full_checkpoint
from space.cpu_kernels import cpu_identity
from space.eval.__main__ import main as eval_main
from space.eval.execute import check, estimate_pass_at_k
from space.eval.report import summarize, to_markdown
from space.eval.tasks import load_tasks

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")


def run(tmp_path, *extra):
    return eval_main(["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "2",
                      "--max-new-tokens", "12", "--mask-num", "3", "--threads", "1", "--out", str(tmp_path), *extra])


def test_end_to_end_all_methods(tmp_path):
    run(tmp_path)
    for name in ("samples.jsonl", "summary.json", "summary.md", "accept_hist.png", "tokens_per_s.png",
                 "tokens_per_step_by_category.png"):
        assert (tmp_path / name).is_file(), name
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().split("\n")[:-1]]
    assert sorted({r["model_id"] for r in rows}) == ["ar", "hf", "pld", "space"] and len(rows) == 8
    s = json.loads((tmp_path / "summary.json").read_text())
    by = {(r["question_id"], r["model_id"]): r for r in rows}  # recompute from the samples, not the summary
    ids = {m: [by[(q, m)]["choices"][0]["token_ids"][0] for q in ("HumanEval/0", "HumanEval/1")] for m in ("ar", "space")}
    assert s["exact_match_rate"] == 1.0 and ids["space"] == ids["ar"] and all(ids["ar"])
    for m in ("ar", "hf", "pld", "space"):
        passed = [by[(q, m)]["choices"][0]["exec"]["passed"] for q in ("HumanEval/0", "HumanEval/1")]
        assert s["pass_at_1"][m] == sum(passed) / 2
    for m in ("ar", "hf", "pld", "space"):  # summary numbers agree with the per-sample file
        mine = [r for r in rows if r["model_id"] == m]
        tokens = sum(sum(c["new_tokens"]) for r in mine for c in r["choices"])
        wall = sum(sum(c["wall_time"]) for r in mine for c in r["choices"])
        assert s["methods"][m]["new_tokens"] == tokens
        assert s["methods"][m]["tokens_per_s"] == pytest.approx(tokens / wall, rel=1e-3)
    steps = sum(sum(c["steps"]) for r in rows if r["model_id"] == "space" for c in r["choices"])
    assert s["methods"]["space"]["tokens_per_step"] == pytest.approx(s["methods"]["space"]["new_tokens"] / steps, rel=1e-3)
    assert s["speedup"]["space_vs_ar"] == pytest.approx(
        s["methods"]["space"]["tokens_per_s"] / s["methods"]["ar"]["tokens_per_s"], rel=1e-2)
    for key in ("model", "adapter", "mask_num", "dtype", "device", "torch", "transformers", "seed",
                "max_new_tokens", "dataset", "limit"):
        assert key in s["meta"]
    assert "| Model | Dataset | Pass@1" in (tmp_path / "summary.md").read_text()
    assert set(s["pass_at_1"]) == {"ar", "hf", "pld", "space"}
    # issue 43: every SPACE step's host time (outside the model) and its planner + layout part
    space = [c for r in rows if r["model_id"] == "space" for c in r["choices"]]
    host = [h for c in space for turn in c["host_ms"] for h in turn]
    assert len(host) == steps and all(h >= 0 for h in host)
    assert all(0 <= p <= h for c in space for ht, pt in zip(c["host_ms"], c["plan_ms"]) for h, p in zip(ht, pt))
    assert s["methods"]["space"]["host_ms_per_step"] == pytest.approx(statistics.median(host), abs=1e-3)
    assert 0 < s["methods"]["space"]["host_share"] < 1 and "host_ms_per_step" not in s["methods"]["ar"]
    assert "Host work per SPACE step" in (tmp_path / "summary.md").read_text()


def test_resume_skips_finished_samples(tmp_path):
    run(tmp_path, "--methods", "ar,space", "--limit", "1")
    first = (tmp_path / "samples.jsonl").read_text()
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"question_id": "torn')  # an interrupted write
    run(tmp_path, "--methods", "ar,space", "--limit", "2")
    lines = (tmp_path / "samples.jsonl").read_text().split("\n")[:-1]
    assert (tmp_path / "samples.jsonl").read_text().startswith(first)
    assert len(lines) == 4 and all(json.loads(line) for line in lines)
    with pytest.raises(ValueError, match=r"other settings.*'max_new_tokens': \(12, 20\)"):
        run(tmp_path, "--methods", "ar,space", "--max-new-tokens", "20")  # would mix 12- and 20-token samples
    assert (tmp_path / "samples.jsonl").read_text().split("\n")[:-1] == lines


def test_a_resume_with_other_flags_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """The settings the command line gives (resume.FLAG_KEYS) and a damaged run record were
    refused only after loading, capturing and timing (minutes for a 7B model); a --dataset file
    named by another path is the same dataset (it was refused as other settings)."""
    import space.loader
    from space.eval.resume import FLAG_KEYS, SAMPLE_KEYS

    assert set(FLAG_KEYS) <= set(SAMPLE_KEYS)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": "a", "turns": ["Say hi."]}) + "\n")
    args = ["--model", "tiny-random-llama", "--dataset", "q.jsonl", "--max-new-tokens", "4", "--mask-num", "2",
            "--methods", "ar", "--threads", "1", "--out", "o"]
    eval_main(args)
    again = [*args[:3], str(tmp_path / "q.jsonl"), *args[4:]]
    assert eval_main(again)["meta"]["dataset"] == str(tmp_path / "q.jsonl")  # resumed: one record, not refused
    assert len((tmp_path / "o" / "samples.jsonl").read_text().splitlines()) == 1
    monkeypatch.setattr(space.loader, "load_space", lambda *a, **k: pytest.fail("loaded the model first"))
    for flag, value, diff in (("--max-new-tokens", "5", r"'max_new_tokens': \(4, 5\)"),
                              ("--methods", "ar,space", r"'methods': \(\['ar'\], \['ar', 'space'\]\)"),
                              ("--dtype", "bfloat16", r"'dtype': \('float32', 'bfloat16'\)"),
                              ("--seed", "3", r"'seed': \(0, 3\)")):
        with pytest.raises(ValueError, match=rf"holds samples made with other settings \(run_config.json\).*{diff}"):
            eval_main([*args, flag, value])
    (tmp_path / "o" / "run_config.json").write_text("{torn")
    with pytest.raises(ValueError, match="run_config.json: damaged run record"):
        eval_main(args)


def test_a_run_whose_every_question_is_skipped_is_an_error_not_a_result(monkeypatch, tmp_path):
    """--max-new-tokens near the context skipped every question (each with its record, listed in
    summary.md), measured nothing and exited 0 like a run that measured. Now it writes the report
    and then fails saying so; a run with one question left to measure still succeeds."""
    monkeypatch.chdir(tmp_path)
    rows = [{"question_id": "short", "turns": ["Hi."]}, {"question_id": "long", "turns": ["word " * 300]}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", "tiny-random-llama", "--dataset", "q.jsonl", "--mask-num", "2", "--methods", "ar,space",
            "--threads", "1"]
    with pytest.raises(ValueError, match=r"all 2 question\(s\) were skipped, so no method was measured.*"
                                         r"--max-new-tokens 2047"):
        eval_main([*args, "--max-new-tokens", "2047", "--out", "all"])
    assert "Skipped 2 question(s)" in (tmp_path / "all" / "summary.md").read_text()
    s = eval_main([*args, "--max-new-tokens", "1900", "--out", "one"])  # "long" (1,500+ tokens) skipped alone
    assert s["skipped"]["count"] == 1 and "long" in s["skipped"]["questions"]


def test_a_rerun_with_a_smaller_limit_reports_only_its_questions(tmp_path):
    """The folder keeps the samples of an earlier, longer run (--limit is no resume key): the
    summary of --limit 1 is over that one question, not over every record in the file."""
    args = ["--model", "tiny-random-llama", "--dataset", "humaneval", "--max-new-tokens", "4", "--mask-num", "2",
            "--methods", "ar", "--threads", "1", "--out", str(tmp_path)]
    assert eval_main([*args, "--limit", "2"])["methods"]["ar"]["samples"] == 2
    summary = eval_main([*args, "--limit", "1"])
    assert summary["methods"]["ar"]["samples"] == 1 and summary["meta"]["num_questions"] == 1
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2  # the records stay


def test_a_resumed_run_packs_for_its_recorded_kernel(tmp_path, monkeypatch):
    """The fast kernels' timed choices (packed kernel, the fewest rows a call is padded to, stock
    F.linear's rows per shape) can go the other way on a resume (a near-tie), and the kernel picks
    the step-cost curve, a resume key: a resumed run packs as its samples were made (one run's
    timings would mix two setups, unsaid), a new run times its own (here the timing is stubbed)."""
    import space.cpu_kernels as kernels

    if not all(kernels.has_kernel(k) for k in kernels.PACKED_KERNELS):
        pytest.skip("needs both packed kernels")
    monkeypatch.setattr(kernels, "choose_packed_kernel", lambda shapes: ("mkl", {}))
    monkeypatch.setattr(kernels, "choose_min_rows", lambda shapes, kernel: (4, {k: {} for k in shapes}))
    monkeypatch.setattr(kernels, "choose_stock_rows", lambda weight, kernel, min_rows: (1, {"timed": "first"}))
    run(tmp_path, "--methods", "ar,space", "--limit", "1")
    first = json.loads((tmp_path / "run_config.json").read_text())
    monkeypatch.setattr(kernels, "choose_packed_kernel", lambda shapes: ("onednn", {}))
    monkeypatch.setattr(kernels, "choose_min_rows", lambda shapes, kernel: (2, {k: {} for k in shapes}))
    monkeypatch.setattr(kernels, "choose_stock_rows", lambda weight, kernel, min_rows: (0, {"timed": "again"}))
    run(tmp_path, "--methods", "ar,space", "--limit", "2")
    resumed = json.loads((tmp_path / "run_config.json").read_text())
    assert resumed["packed_kernel"] == "mkl" and resumed["packed_min_rows"] == 4
    assert resumed["kernel_paths"] == first["kernel_paths"] and {e["stock_rows"] for e in first["kernel_paths"].values()} == {1}
    run(tmp_path / "new", "--methods", "ar,space", "--limit", "1")
    assert json.loads((tmp_path / "new" / "run_config.json").read_text())["packed_kernel"] == "onednn"
    # a merged record of ranks that timed different kernels names both: pinning that string raised
    # "no packed linear kernel 'mkl; onednn'" after the model loaded; the resume times its own
    record = json.loads((tmp_path / "run_config.json").read_text())
    (tmp_path / "run_config.json").write_text(json.dumps({**record, "packed_kernel": "mkl; onednn"}))
    run(tmp_path, "--methods", "ar,space", "--limit", "3")
    assert json.loads((tmp_path / "run_config.json").read_text())["packed_kernel"] == "onednn"


def test_the_recorded_kernel_choices_pinned_on_a_resume_are_checked():
    """``recorded_paths``: a record's timed choices are pinned where they are well formed (0 stock rows
    is a choice: a shape packed from its first row), and timed again where not (a count below 2, which
    ``PackedLinear`` refuses, so a record of 1 stopped the resume; a bool as the fewest packed rows; a
    negative or non-int stock_rows)."""
    from space.eval.__main__ import recorded_paths

    paths = {"576x576": {"stock_rows": 0}, "1536x576": {"stock_rows": 3}}
    assert recorded_paths({"packed_min_rows": 2, "kernel_paths": paths}) == {"min_rows": 2, "paths": paths}
    for min_rows in (1, 0, -2, True, 2.0, "4", None):
        assert recorded_paths({"packed_min_rows": min_rows, "kernel_paths": paths}) == {"paths": paths}, min_rows
    for bad in ({"576x576": {"stock_rows": -1}}, {"576x576": {"stock_rows": True}}, {"576x576": 3}, [paths], None):
        assert recorded_paths({"packed_min_rows": 4, "kernel_paths": bad}) == {"min_rows": 4}, bad


def test_only_a_sampled_run_records_per_turn_seeds(tmp_path):
    """``turn_seeds`` (a resume key) is recorded True only where samples draw (temperature > 0): a
    greedy run draws nothing, so it stays None, as every older run's record reads (OLD_DEFAULTS); True
    there refused every greedy folder made before per-turn seeds."""
    args = ["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "2",
            "--methods", "ar", "--threads", "1"]
    eval_main([*args, "--out", str(tmp_path / "greedy")])
    eval_main([*args, "--temperature", "0.7", "--out", str(tmp_path / "sampled")])
    assert json.loads((tmp_path / "greedy" / "run_config.json").read_text())["turn_seeds"] is None
    assert json.loads((tmp_path / "sampled" / "run_config.json").read_text())["turn_seeds"] is True


def test_a_measured_step_cost_prices_the_dynamic_tree_and_is_kept_on_resume(tmp_path, monkeypatch):
    """--step-cost measure times this machine's steps at load (issue 58: the shipped curves are a
    CPU's, and an H200 priced by one chose 14 rows a step where a flat curve chooses 23): the
    layout the decoder runs carries the measured curve, the record says how it was made, the
    summary says so, and a resumed run keeps the recorded curve (a resume key) instead of
    measuring again. A static layout has no steps to price: refused."""
    import space.eval.step_cost as ts

    calls, real = [], ts.measure_step_cost
    monkeypatch.setattr(ts, "measure_step_cost", lambda *a, **k: calls.append(1) or real(*a, **k))
    flags = ("--methods", "ar,space", "--tree", "dynamic", "--step-cost", "measure")
    run(tmp_path, *flags, "--limit", "1")
    cfg = json.loads((tmp_path / "run_config.json").read_text())
    assert calls == [1] and cfg["step_cost_setup"]["measured"] == "at load" and cfg["step_cost_setup"]["device"] == "cpu"
    assert [q for q, _ in cfg["step_cost"]] == [1, 2, 4, 8, 12, 16, 24, 32] and all(ms > 0 for _, ms in cfg["step_cost"])
    assert "measured at load" in (tmp_path / "summary.md").read_text()
    summary = run(tmp_path, *flags, "--limit", "2")
    assert calls == [1] and summary["meta"]["step_cost"] == cfg["step_cost"] and summary["exact_match_rate"] == 1.0
    with pytest.raises(ValueError, match="layout is static"):
        run(tmp_path / "static", "--methods", "space", "--tree", "chain", "--step-cost", "measure")
    for extra, why in ((("--compile",), "compiled trunk"), (("--shard", "0/2"), "shards")):
        with pytest.raises(ValueError, match=why):
            run(tmp_path / "refused", "--step-cost", "measure", *extra)


def test_auto_step_cost_measures_on_a_gpu_where_no_curve_of_its_device_is_stored(monkeypatch):
    """``--step-cost auto`` (the default): on a GPU whose adapter stores only CPU curves (the shipped
    one) the tree is priced by a curve measured at load; a stored curve of the run's device type,
    kernels and captured steps is kept; the CPU, ``stored``, a shard and a run without ``space``
    never measure. A resumed run keeps how its samples were priced: a stored curve, or the curve it
    measured on the same setup, but a record without samples is measured anew. The model is a stub
    on the meta device, which stands for a GPU here (the measurement is stubbed)."""
    import torch

    import space.eval.__main__ as eval_module
    import space.eval.step_cost as ts
    from space.decoding import DecodeConfig
    from space.eval.shard import Shard

    measured = {"step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.5, "seconds": 1.0}
    lengths = []  # the cached tokens behind each measurement's timed rows
    monkeypatch.setattr(ts, "measure_step_cost",
                        lambda model, max_rows, cache_len=300, graphs=None: lengths.append(cache_len) or measured)
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("meta",))
    gpu, cpu = torch.nn.Linear(1, 1, device="meta"), torch.nn.Linear(1, 1)
    for m in (gpu, cpu):
        m.config = type("Config", (), {"max_position_embeddings": 2048})()
    decode = DecodeConfig(3, 4, tree="dynamic")
    cpu_curve = {"threads": 2, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused"}
    gpu_curve = {"threads": 16, "kernels": "fast", "device": "meta", "capture": False, "trunk": "unfused"}

    def price(setup, model=gpu, *flags, shard=None, methods=("ar", "space"), recorded=None, resuming=False):
        args = eval_module.build_parser().parse_args(list(flags))
        args.kernels = "fast"
        return eval_module.price_here(args, decode, setup, model, None, shard, list(methods), recorded or {}, resuming)

    for setup in (cpu_curve, None, {**gpu_curve, "capture": True}):
        priced, how = price(setup)
        assert priced.step_cost == ((1, 2.0), (32, 3.0)) and priced.adapter_cost == 0.5, setup
        assert how["measured"] == "at load" and how["device"] == "meta"
    assert lengths == [300] * 3
    # within a short captured cache, and short of a sliding window (the timed masks do not slide)
    args = eval_module.build_parser().parse_args(["--capture"])
    args.kernels = "fast"
    eval_module.price_here(args, decode, None, gpu, type("Graphs", (), {"slots": 64})(), None, ["space"], {}, False)
    gpu.config.sliding_window = 100
    price(None)
    del gpu.config.sliding_window
    assert lengths[3:] == [64 - decode.max_rows() - 1, 100 - decode.max_rows() - 1]
    assert price(gpu_curve) == (decode, gpu_curve)
    assert price(cpu_curve, cpu) == (decode, cpu_curve)
    assert price(cpu_curve, gpu, "--step-cost", "stored") == (decode, cpu_curve)
    assert price(cpu_curve, shard=Shard(0, 2)) == (decode, cpu_curve)
    assert price(cpu_curve, gpu, "--compile") == (decode, cpu_curve)  # would time a compiled trunk: minutes
    assert price(cpu_curve, gpu, "--step-cost", "measure", methods=("ar", "pld")) == (decode, cpu_curve)
    priced, how = price(gpu_curve, cpu, "--step-cost", "measure")
    assert how["measured"] == "at load" and how["device"] == "cpu"
    # resuming: a curve measured on this setup is kept; one of another setup, or without samples, is not
    earlier = {"step_cost_setup": {**how, "seconds": 9.0}, "step_cost": [[1, 7.0], [32, 8.0]], "adapter_cost": 0.0}
    assert price(gpu_curve, cpu, "--step-cost", "measure", recorded=earlier, resuming=True)[0].step_cost == \
        ((1, 7.0), (32, 8.0))
    assert price(gpu_curve, cpu, "--step-cost", "measure", recorded=earlier)[0].step_cost == ((1, 2.0), (32, 3.0))
    for flags in (("--step-cost", "measure"), ()):  # refused before timing: the samples' curve would not do
        with pytest.raises(ValueError, match="priced by a curve measured at load on device cpu"):
            price(gpu_curve, gpu, *flags, recorded=earlier, resuming=True)
    # on another CPU that Linux names alike (an AVX2 EPYC and a Zen 4 are both "AMD EPYC"): refused too;
    # a curve measured before the CPU was recorded is taken as this CPU's
    assert how["cpu"] == cpu_identity()
    # another CPU than this one (a fixed name was this machine's own on an AVX2 EPYC: nothing refused)
    other = "AMD EPYC (AVX2)" if cpu_identity() != "AMD EPYC (AVX2)" else "AMD EPYC (AVX-512)"
    elsewhere = {**earlier, "step_cost_setup": {**earlier["step_cost_setup"], "cpu": other}}
    with pytest.raises(ValueError, match=rf"measured at load on device cpu, .*cpu {re.escape(other)}"):
        price(gpu_curve, cpu, "--step-cost", "measure", recorded=elsewhere, resuming=True)
    unnamed = {**earlier, "step_cost_setup": {k: v for k, v in earlier["step_cost_setup"].items() if k != "cpu"}}
    assert price(gpu_curve, cpu, "--step-cost", "measure", recorded=unnamed, resuming=True)[0].step_cost == \
        ((1, 7.0), (32, 8.0))
    # a run priced by a stored curve (or by none) before measuring at load resumes with it under auto
    stored = {"step_cost_setup": cpu_curve, "step_cost": [[1, 54.0], [32, 114.0]]}
    assert price(cpu_curve, recorded=stored, resuming=True) == (decode, cpu_curve)
    with pytest.raises(ValueError, match="priced by the adapter's stored curve"):
        price(cpu_curve, gpu, "--step-cost", "measure", recorded=stored, resuming=True)
    assert price(cpu_curve, recorded={"step_cost_setup": None, "step_cost": None}, resuming=True) == (decode, cpu_curve)
    # under auto, the curve measured at load comes first: before the CPU's stored rule and before a GPU
    # curve the adapter was given since (space-tree --write-adapter keeps its hash)
    assert price(cpu_curve, cpu, recorded=earlier, resuming=True)[0].step_cost == ((1, 7.0), (32, 8.0))
    on_gpu = {**earlier, "step_cost_setup": {**earlier["step_cost_setup"], "device": "meta", "trunk": "unfused"}}
    assert price(gpu_curve, recorded=on_gpu, resuming=True)[0].step_cost == ((1, 7.0), (32, 8.0))


def test_a_run_on_the_adapters_training_questions_warns_and_records_how_many(tmp_path, no_questions_run):
    """MBPP's first questions are the shipped drafter's training data (``tasks.trained_questions``):
    a run on them warns that tokens/step and speedups overstate held-out drafting, naming them, and
    records how many in run_config.json (a rank of a sharded run: of the whole run's questions);
    on ``mbpp-dev`` (held out) it records 0 and does not warn. Catches the check not asked of this
    run's adapter or asked of a rank's share only, its warning inverted or dropped, and the count
    left out of the record. The questions are not run (run_bench stops)."""
    import warnings

    Stop = no_questions_run
    shipped = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-space"
    args = ["--adapter", str(shipped), "--limit", "2", "--max-new-tokens", "4", "--methods", "ar",
            "--threads", "1"]
    with pytest.warns(UserWarning, match=r"2 of 2 questions of --dataset mbpp were in the adapter's training data "
                                         r"\(MBPP 1, 2, \.\.\.\)"), pytest.raises(Stop):
        eval_main([*args, "--dataset", "mbpp", "--out", str(tmp_path / "mbpp")])
    assert json.loads((tmp_path / "mbpp" / "run_config.json").read_text())["trained_questions"] == 2
    # a rank counts the run's questions, not its own share (the merged run's record is one rank's)
    with pytest.warns(UserWarning, match="2 of 2 questions"), pytest.raises(Stop):
        eval_main([*args, "--dataset", "mbpp", "--shard", "0/2", "--out", str(tmp_path / "ranks")])
    assert json.loads((tmp_path / "ranks" / "run_config.rank0.json").read_text())["trained_questions"] == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*in the adapter's training data")
        with pytest.raises(Stop):
            eval_main([*args, "--dataset", "mbpp-dev", "--out", str(tmp_path / "dev")])
    assert json.loads((tmp_path / "dev" / "run_config.json").read_text())["trained_questions"] == 0


def test_a_run_on_the_datastores_questions_warns_and_records_how_many(tmp_path, no_questions_run):
    """The committed datastore sets hold the model's own answers to MBPP's first questions
    (``tasks.datastore_questions``): a run on them with ``--datastore`` warns that tokens/step
    overstate new questions, naming them, and records how many; on ``mbpp-dev`` it records 0 and
    does not warn. A question matches up to whitespace, a set's prompt given as messages or as text.
    Catches the check dropped or inverted, its count left out of the record, and a match on exact
    text or on a later turn."""
    import warnings

    from space.eval.tasks import EvalTask, datastore_questions

    Stop = no_questions_run
    repo = Path(__file__).resolve().parents[2]
    sets = str(repo / "data" / "distill" / "smollm2_lima_mbpp_stdlib.jsonl.gz")  # the committed set with MBPP's
    args = ["--adapter", str(repo / "adapters" / "smollm2-135m-space"), "--limit", "2", "--max-new-tokens", "4",
            "--methods", "space", "--threads", "1", "--datastore", sets]
    with pytest.warns(UserWarning, match=r"2 of 2 questions of --dataset mbpp are answered in the --datastore sets "
                                         r"\(1, 2, \.\.\.\)"), pytest.raises(Stop):
        eval_main([*args, "--dataset", "mbpp", "--out", str(tmp_path / "mbpp")])
    assert json.loads((tmp_path / "mbpp" / "run_config.json").read_text())["datastore_questions"] == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*answered in the --datastore sets")
        with pytest.raises(Stop):
            eval_main([*args, "--dataset", "mbpp-dev", "--out", str(tmp_path / "dev")])
    assert json.loads((tmp_path / "dev" / "run_config.json").read_text())["datastore_questions"] == 0
    own = tmp_path / "set.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "Name  a\ncolour."}, {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": "Another."}], "response": "Blue."},
            {"prompt": "Count to three.", "response": "1 2 3"}]
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = [EvalTask("q1", "writing", ["Name a colour."]), EvalTask("q2", "writing", ["Name a colour!"]),
             EvalTask("q3", "writing", ["Another."]), EvalTask("q4", "math", [" Count to\tthree. "])]
    assert datastore_questions(asked, str(own)) == ["q1", "q4"]
    with own.open("a") as f:  # a malformed prompt answers nothing (it raised a TypeError traceback)
        f.write(json.dumps({"prompt": 7, "response": "x"}) + "\n" + json.dumps({"prompt": None, "response": "y"}) + "\n")
    assert datastore_questions(asked, str(own)) == ["q1", "q4"]
    with pytest.raises(FileNotFoundError, match="not found"):
        datastore_questions(asked, str(tmp_path / "missing.jsonl"))


def test_a_datastore_reaches_the_evaluated_decoder_and_its_record(tmp_path, monkeypatch):
    """``--datastore`` gives SPACE's decoder the sets' answers, one datastore branch a step unless
    ``--datastore-branches`` says more, and the record names both (a decoder built without the
    datastore, or with no branch of it, drafted nothing from it while the record said it did)."""
    import space.eval.bench as bench

    targets = []

    def stop(target, *args, **kwargs):
        targets.append(target)
        raise KeyboardInterrupt  # where the questions would start

    monkeypatch.setattr(bench, "run_bench", stop)
    sets = tmp_path / "set.jsonl"
    sets.write_text(json.dumps({"prompt": "Count.", "response": "one two three four five"}) + "\n")
    for extra, branches in (((), 1), (("--datastore-branches", "3"), 3)):
        out = tmp_path / f"out{branches}"
        with pytest.raises(KeyboardInterrupt):
            run(out, "--methods", "space", "--tree", "dynamic", "--lookup-tokens", "4", "--datastore", str(sets), *extra)
        decoder = targets[-1].decoder
        assert decoder.datastore is not None and decoder.config.datastore_branches == branches
        record = json.loads((out / "run_config.json").read_text())
        assert record["datastore_branches"] == branches and record["datastore_sha256"] == decoder.datastore.identity


def test_a_full_checkpoint_runs_with_its_layout_and_its_training_questions_warn(tmp_path, no_questions_run):
    """A full SAR-SFT checkpoint given as --model is the run's artifact, as an adapter is: the run
    decodes with the layout its space_config.json stores (it ran the default layout) and warns on
    the MBPP questions it was trained on (it never checked). The questions are not run."""
    from space.decoding import DecodeConfig
    from space.eval.tree_search import write_decode

    shipped = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-space"
    trained_on = json.loads((shipped / "space_config.json").read_text())["train_config"]
    ckpt = full_checkpoint(tmp_path / "full", train_config=trained_on)
    write_decode(ckpt, DecodeConfig(2, 2, lookup_tokens=6, tree=[[0], [1], [0, 0]]).to_dict())
    with pytest.warns(UserWarning, match=r"2 of 2 questions of --dataset mbpp were in the checkpoint's training data"), \
            pytest.raises(no_questions_run):
        eval_main(["--model", str(ckpt), "--dataset", "mbpp", "--limit", "2", "--max-new-tokens", "4",
                   "--methods", "ar,space", "--threads", "1", "--out", str(tmp_path / "run")])
    record = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert record["trained_questions"] == 2
    assert (record["mask_num"], record["num_groups"], record["lookup_tokens"], record["tree"]) == \
        (2, 2, 6, [[0], [1], [0, 0]])


def test_the_record_names_the_lookup_branches_a_step_verifies(tmp_path, no_questions_run):
    """``lookup_branches`` (a resume key) is what a step verifies: the layout's in a dynamic tree with
    prompt lookup, else 1, whatever the stored layout holds (a checkpoint's dynamic tree of 3 branches
    run as a chain, or without lookup, recorded 3 and refused resuming a run that decoded alike)."""
    from space.decoding import DecodeConfig
    from space.eval.tree_search import write_decode

    ckpt = full_checkpoint(tmp_path / "full")
    write_decode(ckpt, DecodeConfig(3, tree="dynamic", lookup_tokens=4, lookup_branches=3).to_dict())
    for name, flags, branches in (("stored", (), 3), ("chain", ("--tree", "chain"), 1),
                                  ("no_lookup", ("--lookup-tokens", "0"), 1)):
        with pytest.raises(no_questions_run):
            eval_main(["--model", str(ckpt), "--limit", "1", "--max-new-tokens", "4", "--methods", "space",
                       "--threads", "1", "--out", str(tmp_path / name), *flags])
        assert json.loads((tmp_path / name / "run_config.json").read_text())["lookup_branches"] == branches, name


def test_a_full_checkpoints_dynamic_tree_is_priced_by_its_curve_of_this_setup(tmp_path, no_questions_run):
    """space-eval prices a full checkpoint's stored dynamic tree by the curve the checkpoint
    stores for the run's setup (here 1 thread, stock kernels), not by the last one space-tree
    wrote. Catches the checkpoint's step_costs left unread (the decode entry's own curve)."""
    from space.decoding import DecodeConfig
    from space.eval.tree_search import write_decode

    ckpt = full_checkpoint(tmp_path / "full")
    for threads, curve in ((1, {1: 0.001, 32: 0.002}), (2, {1: 0.003, 32: 0.009})):  # the 2-thread curve last
        write_decode(ckpt, DecodeConfig(2, tree="dynamic").to_dict(), curve, setup={
            "threads": threads, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "fused"})
    with pytest.raises(no_questions_run):
        eval_main(["--model", str(ckpt), "--limit", "1", "--max-new-tokens", "4", "--methods", "ar,space",
                   "--threads", "1", "--kernels", "stock", "--step-cost", "stored", "--out", str(tmp_path / "run")])
    record = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert (record["mask_num"], record["tree"]) == (2, "dynamic")
    assert record["step_cost"] == [[1, 1.0], [32, 2.0]] and record["step_cost_setup"]["threads"] == 1
    # at 3 threads no curve of this setup is stored: the nearest one prices the tree, and the run says so
    threads = torch.get_num_threads()
    with pytest.warns(UserWarning, match=r"step-cost curve was measured with threads 2 \(run: 3\)"), \
            pytest.raises(no_questions_run):
        eval_main(["--model", str(ckpt), "--limit", "1", "--max-new-tokens", "4", "--methods", "ar,space",
                   "--threads", "3", "--kernels", "stock", "--step-cost", "stored", "--out", str(tmp_path / "run3")])
    torch.set_num_threads(threads)


def test_mt_bench_two_turns(tmp_path):
    s = eval_main(["--model", "tiny-random-llama", "--dataset", "mt-bench", "--limit", "2", "--max-new-tokens", "6",
                   "--methods", "ar,space", "--threads", "1", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().split("\n")[:-1]]
    assert all(len(r["choices"][0]["turns"]) == 2 for r in rows)
    assert s["exact_match_rate"] == 1.0 and "writing" in s["categories"]


@pytest.mark.parametrize("dataset", ["humaneval", "humaneval-x:python", "mbpp"])
def test_executor_really_runs_python_tests(dataset):
    for task in load_tasks(dataset, limit=3):
        solution = task.problem.get("canonical_solution") or task.problem.get("code")
        assert check(task.problem, task.language, solution)["passed"]
        assert not check(task.problem, task.language, "")["passed"]


def test_infinite_loop_times_out():
    task = load_tasks("humaneval", limit=1)[0]
    res = check(task.problem, "python", "    while True:\n        pass\n", timeout=2.0)
    assert not res["passed"] and res["result"] == "timed out"


@pytest.mark.parametrize("lang", ["cpp", "js", "java", "rust", "go"])
def test_other_languages_run_or_say_na(lang):
    task = load_tasks(f"humaneval-x:{lang}", limit=1)[0]
    ok, empty = check(task.problem, lang, task.problem["canonical_solution"]), check(task.problem, lang, "")
    if ok["result"].startswith("n/a"):
        assert ok["result"] == "n/a (no toolchain)" and empty["result"] == ok["result"]
    else:
        assert ok["passed"] and not empty["passed"]


@pytest.mark.parametrize("lang,tool", [("cpp", "g++"), ("go", "go"), ("rust", "rustc")])
def test_executor_plumbing_with_and_without_a_toolchain(tmp_path, monkeypatch, lang, tool):
    """Without its toolchain a language says so; with one (here a fake that always fails) the
    executor really calls it and reports the failure. Go has no runner: its HumanEval-X tests need
    github.com/stretchr/testify, which cannot be fetched here, so it says that instead of passing."""
    task = load_tasks(f"humaneval-x:{lang}", limit=1)[0]
    monkeypatch.setenv("PATH", str(tmp_path))  # no toolchain at all
    assert check(task.problem, lang, task.problem["canonical_solution"]) == {"passed": False, "result": "n/a (no toolchain)"}
    fake = tmp_path / tool
    fake.write_text("#!/bin/sh\necho broken toolchain >&2\nexit 3\n")
    fake.chmod(0o755)
    res = check(task.problem, lang, task.problem["canonical_solution"])
    assert not res["passed"]
    assert res["result"] == "n/a (no runner for go)" if lang == "go" else res["result"].startswith(f"failed: {tool} exit 3")


def test_pass_at_k_estimator():
    assert estimate_pass_at_k(10, 0, 1) == 0.0 and estimate_pass_at_k(10, 10, 1) == 1.0
    assert estimate_pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert estimate_pass_at_k(5, 1, 2) == pytest.approx(0.4)
    for n, c, k in ((1, 0, 5), (3, 0, 5), (3, 4, 1), (3, -1, 1)):  # fewer samples than k gave 1.0
        with pytest.raises(ValueError, match="pass@k needs"):
            estimate_pass_at_k(n, c, k)


def test_bad_input_raises_for_python_callers(tmp_path):
    """main() raises (the console entry turns it into one line and exit 2: tests/test_bad_inputs.py)."""
    with pytest.raises(ValueError, match="unknown dataset"):
        eval_main(["--model", "tiny-random-llama", "--dataset", "nope", "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="not found"):
        eval_main(["--model", "tiny-random-llama", "--dataset", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2, "turns": [}\n')
    with pytest.raises(ValueError, match="line 2"):
        eval_main(["--model", "tiny-random-llama", "--dataset", str(bad), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        eval_main(["--model", "tiny-random-llama", "--limit", "0", "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="unknown model"):
        eval_main(["--model", "no/such/model", "--limit", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown method"):
        eval_main(["--model", "tiny-random-llama", "--methods", "ar,medusa", "--out", str(tmp_path)])
    # an --out inside the adapter or model folder: the run's own files changed its fingerprint, and
    # every rerun was refused as another adapter's (also where the default runs/eval/<dataset> lands inside)
    (tmp_path / "adapter").mkdir()
    for flag, out in (("--adapter", tmp_path / "adapter" / "eval"), ("--model", tmp_path / "adapter" / "x" / "eval")):
        with pytest.raises(ValueError, match=f"lies inside {flag}"):
            eval_main([flag, str(tmp_path / "adapter"), "--limit", "1", "--out", str(out)])
    with pytest.raises(ValueError, match="lies inside --adapter"):
        eval_main(["--adapter", ".", "--limit", "1"])


def test_median_question_speedup_resists_an_outlier():
    def rec(q, m, tokens, wall):
        return {"question_id": q, "category": "c", "model_id": m,
                "choices": [{"new_tokens": [tokens], "wall_time": [wall], "steps": [tokens], "accept_lengths": [[]],
                             "token_ids": [[0] * tokens]}]}
    # SPACE is 2x faster on q0 and q1, 10x slower on q2 (a machine hiccup): the total ratio is dragged
    # below 1, the median per-question ratio stays 2
    records = [rec("q0", "ar", 10, 1.0), rec("q0", "space", 10, 0.5), rec("q1", "ar", 10, 1.0),
               rec("q1", "space", 10, 0.5), rec("q2", "ar", 10, 1.0), rec("q2", "space", 10, 10.0)]
    s = summarize(records, {"mask_num": 3})
    assert s["speedup"]["space_vs_ar"] == pytest.approx(30 / 11 / 10, rel=1e-2)
    assert s["median_question_speedup"]["space_vs_ar"] == pytest.approx(2.0)


def test_acceptance_over_steps_with_candidates_and_emitted_histogram():
    """k = 1 with one group: an accepting step leaves no group to draft from, so the next step has
    no candidate. Acceptance counts only the steps that had a candidate; the histogram counts the
    tokens each step emitted (the first step and a step cut by EOS included); lookup steps too."""
    rec = {"question_id": "q0", "category": "c", "model_id": "space",
           "choices": [{"new_tokens": [12], "wall_time": [1.0], "steps": [5], "accept_lengths": [[0, 1, 0, 0, 7]],
                        "candidates": [[0, 1, 0, 1, 10]], "step_tokens": [[1, 2, 1, 1, 7]],
                        "token_ids": [[0] * 12]}]}
    m = summarize([rec], {"mask_num": 1, "num_groups": 1, "lookup_tokens": 10})["methods"]["space"]
    assert m["tokens_per_step_histogram"] == {"1": 3, "2": 1, "7": 1, **{str(n): 0 for n in (3, 4, 5, 6, 8, 9, 10, 11)}}
    assert m["acceptance_per_offset"][:2] == pytest.approx([2 / 3, 1.0], abs=1e-4)  # 3 steps had c_1, 1 had c_2
    assert m["acceptance_per_offset_all_steps"][:2] == pytest.approx([2 / 5, 1 / 5])
    assert m["steps_with_candidates"] == pytest.approx(3 / 5, abs=1e-4)
    assert "layout_cap_tokens_per_step" not in m  # lookup candidates have no cap
    assert summarize([rec], {"mask_num": 1, "num_groups": 1})["methods"]["space"]["layout_cap_tokens_per_step"] == 1.5
    old = {**rec, "choices": [{k: v for k, v in rec["choices"][0].items() if k not in ("candidates", "step_tokens")}]}
    m = summarize([old], {"mask_num": 1})["methods"]["space"]  # records from before candidates were stored
    assert m["acceptance_per_offset"] is None and m["tokens_per_step_histogram"]["8"] == 1


def test_provenance_split_and_acceptance_per_source():
    """Issue 44: the accepted tokens by source (mask drafts, lookup, both) and, per source, the
    acceptance per offset over the steps that offered a candidate of that source at that depth;
    the per-category table puts SPACE's tokens/step beside PLD's on the same prompts."""
    def rec(model, cat, sources=(), offered=(), steps=4, wall=1.0):
        return {"question_id": "q" + cat, "category": cat, "model_id": model,
                "choices": [{"new_tokens": [8], "wall_time": [wall], "steps": [steps],
                             "accept_lengths": [[len(x) for x in sources]], "sources": [list(sources)],
                             "offered": [[list(o) for o in offered]], "token_ids": [[0] * 8]}]}
    space = [rec("space", "a", ["mm", "", "lb", "bbm"], [(2, 0), (1, 0), (0, 3), (3, 2)]),
             rec("space", "b", ["l"], [(0, 1)], steps=8)]
    records = space + [rec("pld", "a", steps=5, wall=2.0), rec("pld", "b", steps=8, wall=1.0)]
    s = summarize(records, {"mask_num": 3, "lookup_tokens": 10})
    m = s["methods"]["space"]
    assert m["accepted_from"] == {"mask": 3, "lookup": 2, "datastore": 0, "both": 3}
    by = m["acceptance_per_offset_by_source"]
    # masks offered depth > 0 in 3 steps: "mm" and "bbm" start with a mask token, "" does not
    assert by["mask"] == pytest.approx([2 / 3, 2 / 2, 1 / 1], abs=1e-4)
    # lookup offered depth > 0 in 3 steps: "lb", "bbm" (its 3rd token is mask only), "l"
    assert by["lookup"] == pytest.approx([3 / 3, 2 / 2, 0 / 1], abs=1e-4)
    assert s["speedup"]["space_vs_pld"] == pytest.approx(1.5)  # 16 tokens in 2 s against 3 s
    cats = s["categories"]
    assert cats["a"]["pld_tokens_per_step"] == pytest.approx(8 / 5) and cats["a"]["space_tokens_per_step"] == 2.0
    assert cats["a"]["speedup_vs_pld"] == pytest.approx(2.0)
    md = to_markdown(s)
    assert "Accepted tokens by source: mask drafts 3 (37.5 %), prompt lookup 2 (25.0 %), both 3 (37.5 %)" in md
    assert "| a | 2.00 | 1.60 |" in md
    old = summarize([{**space[0], "choices": [{k: v for k, v in space[0]["choices"][0].items()
                                               if k not in ("sources", "offered")}]}], {"mask_num": 3})
    assert "accepted_from" not in old["methods"]["space"]  # records from before sources were stored
    # a datastore's tokens: counted apart, and among lookup's in the acceptance per offset
    stored = summarize([rec("space", "a", ["dd", "ld", ""], [(0, 2), (0, 3), (0, 1)])], {"mask_num": 3})
    assert stored["methods"]["space"]["accepted_from"] == {"mask": 0, "lookup": 1, "datastore": 3, "both": 0}
    assert stored["methods"]["space"]["acceptance_per_offset_by_source"]["lookup"] == pytest.approx([2 / 3, 2 / 2, 0 / 1], abs=1e-4)
    assert "prompt lookup 1 (25.0 %), datastore 3 (75.0 %), both 0" in to_markdown(stored)


def _space_record(tokens: int, steps: int) -> dict:
    return {"question_id": "q0", "category": "c", "model_id": "space",
            "choices": [{"new_tokens": [tokens], "wall_time": [1.0], "steps": [steps], "accept_lengths": [[2] * steps],
                         "candidates": [[2] * steps], "step_tokens": [[3] * steps], "token_ids": [[0] * tokens]}]}


def test_summary_prints_the_full_layout_and_a_cap_only_without_lookup():
    """summary.md names tree, lookup tokens, k and groups; the cap follows the tree, and a run
    with prompt lookup (whose candidates no layout bounds) prints none."""
    tree = [[0], [1], [0, 0]]
    meta = {"mask_num": 2, "num_groups": 3, "lookup_tokens": 0, "tree": tree}
    text = to_markdown(summarize([_space_record(30, 10)], meta))
    assert "layout: k = 2, 3 mask group(s), tree [[0],[1],[0,0]], prompt lookup 0 tokens" in text
    assert "Layout cap (k = 2, 3 mask group(s), tree [[0],[1],[0,0]], prompt lookup 0 tokens; every draft " \
           "accepted): 3.00 tokens/step" in text
    text = to_markdown(summarize([_space_record(30, 10)], {**meta, "tree": None, "lookup_tokens": 8}))
    assert "k = 2, 3 mask group(s), chain of top-1 drafts, prompt lookup 8 tokens" in text
    assert "Layout cap" not in text


def test_summary_says_greedy_exactness_is_expected_in_fp32(tmp_path):
    text = to_markdown(summarize([_space_record(30, 10)], {"mask_num": 2}))
    assert "exact (greedy)" in text and "expected 100 % in float32" in text and "near-ties" in text


def test_hf_and_pld_suppress_the_mask_tokens_as_ar_and_space_do(monkeypatch):
    """Issue 44: a baseline that may emit a mask token compares other outputs; HF's own
    ``suppress_tokens`` gets the mask ids, for plain generate and prompt lookup alike."""
    import torch

    from space.decoding import SamplingConfig
    from space.eval.bench import generate
    from space.models import tiny_random_llama
    from space.tokens import add_mask_tokens

    model, tok = tiny_random_llama(seed=0)
    spec = add_mask_tokens(model, tok, mask_num=3)
    seen = []

    def fake_generate(prompt, attention_mask=None, generation_config=None):
        seen.append(generation_config)
        return torch.cat([prompt, torch.tensor([[5, 6]])], dim=1)

    monkeypatch.setattr(model, "generate", fake_generate)
    target = type("T", (), {"model": model, "tokenizer": tok, "mask": spec, "stop_ids": [tok.eos_token_id], "pld": None,
                             "graphs": None})()
    for method in ("hf", "pld"):
        out = generate(method, target, [1, 2, 3], 4, SamplingConfig())
        assert out["ids"] == [5, 6]
    assert [list(c.suppress_tokens) for c in seen] == [list(spec.token_ids)] * 2
    assert seen[1].prompt_lookup_num_tokens == 10


def test_padding_is_given_only_when_every_step_records_it():
    """Row buckets (issue 43): summary.md gives the padding among a step's rows; a resumed run
    that mixes records from before the buckets (which lack it) gives none rather than a wrong share."""
    new, old = _space_record(30, 10), _space_record(30, 10)
    new["choices"][0].update(rows=[[8] * 10], padding=[[2] * 10])
    old["choices"][0].update(rows=[[6] * 10])
    meta = {"mask_num": 2, "num_groups": 2, "tree": None}
    s = summarize([new, {**new, "question_id": "q1"}], meta)
    assert s["methods"]["space"]["rows_per_step"] == 8.0 and s["methods"]["space"]["padding_per_step"] == 2.0
    assert "8.0 rows per step on average (2.0 of them padding)" in to_markdown(s)
    assert "padding_per_step" not in summarize([new, {**old, "question_id": "q1"}], meta)["methods"]["space"]


def test_pass_at_k_when_failures_equal_k():
    """n - c == k still has a k-subset of failures: pass@k < 1 (the shortcut to 1.0 is only for
    n - c < k)."""
    assert estimate_pass_at_k(3, 2, 1) == pytest.approx(2 / 3)
    assert estimate_pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - 1 / C(4, 2)


def test_fenced_reply_is_extracted_before_it_runs():
    """A chat reply's fenced block is the code run, not the whole reply with its prose and fences:
    the canonical solution inside a chatty reply passes (run as it stands, the prose is a syntax
    error), and a bare body stays as it is."""
    from space.eval.execute import extract_code

    task = load_tasks("humaneval", limit=1)[0]
    body = task.problem["canonical_solution"]
    reply = f"Here it is:\n```python\n{body}```\nIt returns the answer."
    assert extract_code(reply) == body and extract_code(body) == body
    assert check(task.problem, "python", reply)["passed"]


def test_compiled_timeout_and_node_assertion_are_failures(tmp_path, monkeypatch):
    """A compiled language's test that runs out of time (here its compiler) is a failure ("timed
    out", never a pass); node's console.assert exits 0 and only prints "Assertion failed": a
    failure too."""
    import shutil

    task = load_tasks("humaneval-x:cpp", limit=1)[0]
    sleep = shutil.which("sleep")  # before PATH holds only the fakes
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "g++").write_text(f"#!/bin/sh\nexec {sleep} 5\n")
    (tmp_path / "g++").chmod(0o755)
    assert check(task.problem, "cpp", task.problem["canonical_solution"], timeout=0.1) == \
        {"passed": False, "result": "timed out"}
    js = load_tasks("humaneval-x:js", limit=1)[0]
    (tmp_path / "node").write_text("#!/bin/sh\necho 'Assertion failed' >&2\nexit 0\n")
    (tmp_path / "node").chmod(0o755)
    res = check(js.problem, "js", js.problem["canonical_solution"])
    assert not res["passed"] and res["result"].startswith("failed: node exit 0")


def test_java_needs_both_javac_and_java(tmp_path, monkeypatch):
    """A language is runnable only when every tool of its toolchain is there: javac without java
    is "n/a (no toolchain)", not a crash when java is called."""
    task = load_tasks("humaneval-x:java", limit=1)[0]
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "javac").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "javac").chmod(0o755)
    res = check(task.problem, "java", task.problem["canonical_solution"])
    assert res == {"passed": False, "result": "n/a (no toolchain)"}


def test_a_resume_keeps_a_curve_measured_at_load_only_for_the_same_trunk_dtype(monkeypatch):
    """A resumed run's curve measured at load prices the rest only on the trunk dtype it was measured
    on: a bf16 trunk's steps cost otherwise than the fp32 one's the samples were priced by, so the
    resume is refused before anything is timed (the dtype left out of that check reused the curve)."""
    import space.eval.__main__ as eval_module
    import space.eval.step_cost as ts
    from space.decoding import DecodeConfig
    from space.eval.step_cost import curve_setup

    monkeypatch.setattr(ts, "measure_step_cost", lambda *a, **k: pytest.fail("measured"))
    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"max_position_embeddings": 2048})()
    decode = DecodeConfig(3, 4, tree="dynamic")
    args = eval_module.build_parser().parse_args(["--step-cost", "measure"])
    args.kernels = "fast"
    how = {**curve_setup(model, "fast", False), "measured": "at load", "seconds": 1.0}
    recorded = {"step_cost_setup": how, "step_cost": [[1, 7.0], [32, 8.0]], "adapter_cost": 0.0}
    priced, kept = eval_module.price_here(args, decode, None, model, None, None, ["space"], recorded, True)
    assert priced.step_cost == ((1, 7.0), (32, 8.0)) and kept == how
    with pytest.raises(ValueError, match=r"measured at load on .*dtype float32"):
        eval_module.price_here(args, decode, None, model.to(torch.bfloat16), None, None, ["space"], recorded, True)


def test_sampling_settings_greedy_decoding_ignores_are_said():
    """--top-p / --top-k with --temperature 0 were ignored without a word (and recorded as resume
    keys); sampling takes them without a warning."""
    import warnings

    import space.eval.__main__ as eval_module

    def checked(*flags):
        eval_module.check_args(eval_module.build_parser().parse_args(["--model", "tiny-random-llama", *flags]), None)

    with pytest.warns(UserWarning, match=r"--top-p 0.5 / --top-k 3 with --temperature 0: greedy decoding ignores them"):
        checked("--top-p", "0.5", "--top-k", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked("--top-p", "0.5", "--top-k", "3", "--temperature", "0.7")
        checked()
