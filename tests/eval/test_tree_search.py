"""space-tree: layout search from probe ranks and a step-cost curve (issue #14)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from space.cpu_kernels import PACKED_KERNELS, cpu_identity, packed_kernel
from space.decoding.config import DecodeConfig
from space.decoding.dynamic import StepCost
from space.decoding.tree import replay
from space.eval import probe
from space.eval.resume import adapter_sha256
from space.eval.step_cost import step_cost_points
from space.eval.tree_search import _key, cli, estimate, load_ranks, main, search, write_decode

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")

SHIPPED = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-space"


def test_one_interpolation_of_the_curve():
    """The replay's estimate and the dynamic planner price rows with the same StepCost (issue 46)."""
    curve = {1: 2.0, 4: 5.0, 8: 6.0}
    cost = StepCost(tuple(sorted(curve.items())))
    assert cost(1) == 1.0 and cost(2) == 1.5 and cost(6) == 2.75
    assert cost(12) == 3.5  # beyond the last point: the last slope
    ranks = [torch.zeros(12, 2, dtype=torch.long)]  # every draft right: the chain accepts k each step
    res = replay(ranks, 2, 3, None)
    assert estimate(ranks, DecodeConfig(2, 3), curve)["est_speedup"] == pytest.approx(
        res.tokens / sum(cost(q) for q in res.rows), rel=1e-3)
    assert max(res.rows) == 1 + 2 + 3 * 2  # full steps priced at cost(9), past the 8-row point


def test_buckets_price_the_padded_rows():
    """With ``buckets`` (a compiled run pads static layouts, issue 43) every step is priced at its
    row bucket, up to the layout's own bucketed size: a full chain step of 9 rows at 12, the first
    step of 3 rows at 4. Without it, at its own rows."""
    curve = {1: 1.0, 32: 32.0}  # one cost unit per row
    ranks = [torch.zeros(12, 2, dtype=torch.long)]
    res = replay(ranks, 2, 3, None)
    assert sorted(set(res.rows)) == [3, 9]
    padded = [{3: 4, 9: 12}[q] for q in res.rows]
    assert estimate(ranks, DecodeConfig(2, 3), curve, buckets=True)["est_speedup"] == pytest.approx(
        res.tokens / sum(padded), rel=1e-3)
    assert estimate(ranks, DecodeConfig(2, 3), curve)["est_speedup"] == pytest.approx(
        res.tokens / sum(res.rows), rel=1e-3)
    assert DecodeConfig(2, 3).max_rows() == 9 and DecodeConfig(2, 3, lookup_tokens=4).max_rows() == 13


def test_search_prefers_trees_when_runner_ups_are_right_and_rows_are_cheap():
    # mask 0's top-1 right half the time, its runner-up the other half: a sibling doubles acceptance
    ranks = [torch.tensor([[j % 2, 0] for j in range(40)]) for _ in range(6)]
    cheap = search(ranks, {1: 1.0, 64: 1.0}, 2, 64)
    best = cheap[0]["decode"]
    assert best["tree"] is not None and [1] in best["tree"]
    chain = next(r for r in cheap if r["decode"]["tree"] is None and r["decode"]["mask_num"] == best["mask_num"]
                 and r["decode"]["num_groups"] == best["num_groups"])
    assert cheap[0]["tokens_per_step"] > chain["tokens_per_step"] and cheap[0]["est_speedup"] > chain["est_speedup"]
    costly = search(ranks, {1: 1.0, 2: 10.0, 64: 100.0}, 2, 64)  # every extra row costs a forward: AR-like wins
    assert costly[0]["rows_per_step"] < cheap[0]["rows_per_step"]
    assert all(r["rows_per_step"] <= 64 for r in cheap)


def test_cli_on_probe_ranks_and_bad_input(tmp_path, capsys):
    # --device auto, as space-eval takes it (both tools refused it): the CPU here
    probe.main(["--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "12", "-k", "2", "--device", "auto",
                "--out", str(tmp_path / "probe")])
    out = main(["--model", "tiny-random-llama", "--ranks", str(tmp_path / "probe" / "ranks.jsonl"),
                "--max-mask-num", "2", "--max-rows", "12", "--cache-len", "16", "--out", str(tmp_path / "tree")])
    saved = json.loads((tmp_path / "tree" / "tree_search.json").read_text())
    assert saved["best"] == out["best"] and set(saved["step_cost_ms"]) == {"1", "2", "4", "8", "12"}
    assert saved["dtype"] == "float32"
    bf16 = main(["--model", "tiny-random-llama", "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--dtype",
                 "bfloat16", "--device", "auto", "--max-mask-num", "2", "--max-rows", "4", "--cache-len", "16", "--out", str(tmp_path / "bf16")])
    assert bf16["dtype"] == "bfloat16"  # the curve a bf16 space-eval run is priced by
    assert all(r["decode"]["mask_num"] <= 2 for r in saved["layouts"])
    for args, msg in ((["--ranks", str(tmp_path / "nope.jsonl")], "no such ranks file"),
                      (["--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--write-adapter"], "needs --adapter")):
        with pytest.raises(SystemExit) as info:
            cli(["--model", "tiny-random-llama", *args])
        assert info.value.code == 2 and msg in capsys.readouterr().err


def test_cli_compile_measures_the_compiled_trunk_over_a_static_cache(tmp_path, monkeypatch, capsys):
    """Issue 58: space-tree --compile frozen times the steps on the frozen trunk over a static cache,
    as space-eval --compile runs them (without it the curve was an eager one priced for a compiled
    run), prices static layouts at their buckets and records the mode; with --capture or the fast
    kernels it is refused, as space-eval refuses them."""
    import space.eval.step_cost as step_cost
    import space.eval.tree_search as tree_search
    from space.decoding.compiled import is_compiled

    probe.main(["--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "12", "-k", "2",
                "--out", str(tmp_path / "probe")])
    args = ["--model", "tiny-random-llama", "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--max-mask-num", "2",
            "--max-rows", "4", "--cache-len", "8", "--threads", "1", "--out", str(tmp_path / "tree")]
    timed = []
    real = step_cost.time_steps

    def spy(model, shapes, cache_len=300, repeats=15, static=False, graphs=None):
        timed.append((is_compiled(model), static))
        return real(model, shapes, cache_len, 2, static, graphs)

    monkeypatch.setattr(step_cost, "time_steps", spy)
    searched = []
    real_search = tree_search.search

    def search_spy(ranks, curve, max_mask_num, max_rows, current=None, buckets=False):
        searched.append(buckets)
        return real_search(ranks, curve, max_mask_num, max_rows, current, buckets)

    monkeypatch.setattr(tree_search, "search", search_spy)
    out = main([*args, "--compile", "frozen", "--dynamic"])
    assert timed == [(True, True), (True, True)]  # the curve, then the adapter cost
    assert searched == [True]  # the layouts priced at their buckets, as the report says
    assert out["compile"] == "frozen" and out["buckets"] is True and set(out["step_cost_ms"]) == {1, 2, 4}
    # the setup --write-adapter stores the curve under (write_decode): the mode in it, else an eager stock curve
    assert out["step_cost_setup"]["compile"] == "frozen" and out["step_cost_setup"]["kernels"] == "stock"
    for extra, msg in ((["--capture"], "drop --capture"), (["--kernels", "fast"], "--kernels fast")):
        with pytest.raises(ValueError, match=msg):
            main([*args, "--compile", "frozen", *extra])


def test_cli_capture_times_one_slot_bucket(tmp_path, monkeypatch):
    """space-tree --capture times every row count after the same cache, so its steps all land in the
    top slot bucket: it captures that one only (at --cache-len 2048 it captured four, three never
    replayed: about 4x the capture time and graph memory). The CPU runs the captured steps eagerly."""
    import space.decoding.graphs as graphs_module

    made = []
    real = graphs_module.StepGraphs.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self.slot_sizes)

    monkeypatch.setattr(graphs_module.StepGraphs, "__init__", spy)
    probe.main(["--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "12", "-k", "2",
                "--out", str(tmp_path / "probe")])
    main(["--model", "tiny-random-llama", "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--max-mask-num", "2",
          "--max-rows", "4", "--cache-len", "1020", "--threads", "1", "--capture", "--out", str(tmp_path / "tree")])
    assert [list(sizes) for sizes in made] == [[1024]]


def test_write_decode_keeps_other_keys(tmp_path):
    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "decode": {"mask_num": 1}}))
    write_decode(tmp_path, {"mask_num": 3, "num_groups": 2, "tree": [[0], [1]]})
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert cfg == {"mode": "frozen-base", "decode": {"mask_num": 3, "num_groups": 2, "tree": [[0], [1]]}}
    # with the measured curve (seconds): stored as step_cost [[rows, ms], ...], a valid DecodeConfig
    write_decode(tmp_path, DecodeConfig(3, 2, tree=[[0], [1]]).to_dict(), {8: 0.0031234, 1: 0.002})
    decode = json.loads((tmp_path / "space_config.json").read_text())["decode"]
    assert decode["step_cost"] == [[1, 2.0], [8, 3.123]] and decode["tree"] == [[0], [1]]
    assert DecodeConfig.from_dict(decode).step_cost == ((1, 2.0), (8, 3.123))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="no 'ranks'"):
        load_ranks(bad)


def test_step_cost_setup_is_stored_with_a_dynamic_curve_and_checked(tmp_path):
    """Issue 44: the threads and kernels a stored curve was measured with travel with it (a static
    layout's too: it prices a tree="dynamic" override, and without its setup no run was warned of
    another setup's curve), leave the adapter's hash alone, and space-eval's check names what
    differs from the run; a layout stored without a curve drops the setup."""
    from space.eval.resume import adapter_sha256
    from space.eval.step_cost import step_cost_mismatch

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base"}))
    before = adapter_sha256(tmp_path)
    setup = {"threads": 1, "kernels": "fast", "trunk": "fused"}
    dynamic = DecodeConfig(3, 4, tree="dynamic").to_dict()
    write_decode(tmp_path, dynamic, {1: 0.002, 8: 0.003}, setup=setup)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert cfg["step_cost_setup"] == setup and DecodeConfig.from_dict(cfg["decode"]).tree == "dynamic"
    assert adapter_sha256(tmp_path) == before  # tuning metadata, like "decode": not the drafter
    static = {**setup, "threads": 2}
    write_decode(tmp_path, {**DecodeConfig(3, 2, tree=[[0], [1]]).to_dict(), "adapter_cost": 1.5}, {1: 0.002},
                 setup=static)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert cfg["step_cost_setup"] == static and [(e["threads"], e["step_cost"], e["adapter_cost"]) for e in
                                                 cfg["step_costs"]] == [(1, [[1, 2.0], [8, 3.0]], 0.0), (2, [[1, 2.0]], 1.5)]
    write_decode(tmp_path, DecodeConfig(3, 2, tree=[[0], [1]]).to_dict(), setup=static)  # no curve
    assert "step_cost_setup" not in json.loads((tmp_path / "space_config.json").read_text())
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically, nothing left beside it
    assert step_cost_mismatch(setup, 1, "fast") is None and step_cost_mismatch(None, 2, "stock") is None
    msg = step_cost_mismatch(setup, 2, "fast")
    assert "threads 1 (run: 2)" in msg and "kernels" not in msg
    assert "kernels fast (run: stock)" in step_cost_mismatch(setup, 1, "stock")
    assert "compile False (run: True)" in step_cost_mismatch(setup, 1, "fast", compiled=True)  # eager curve
    # a curve recorded before the fused trunk (no "trunk") prices a fused run's rows too high
    assert "trunk unfused (run: fused)" in step_cost_mismatch({"threads": 1, "kernels": "fast"}, 1, "fast")
    assert step_cost_mismatch({"threads": 1, "kernels": "fast"}, 1, "fast", trunk="unfused") is None
    # issue 58: a CPU's curve (every curve recorded before it) prices a GPU's or a captured run's rows wrong
    assert "device cpu (run: cuda)" in step_cost_mismatch(setup, 1, "fast", device="cuda")
    assert "capture False (run: True)" in step_cost_mismatch(setup, 1, "fast", capture=True)
    assert step_cost_mismatch({**setup, "device": "cuda", "capture": True}, 1, "fast", device="cuda", capture=True) is None


def test_curves_are_stored_and_chosen_per_device_and_capture(tmp_path):
    """Issue 58: a GPU's captured curve is stored beside the CPU's eager one for the same threads and
    kernels (it replaced it before), and each run is priced by its own device's and capture's; an
    entry written before (no device, no capture) is a CPU's eager one."""
    from space.artifact import adapter_decode_config, priced_for_setup

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    dynamic = DecodeConfig(3, 4, tree="dynamic").to_dict()
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.5}, {1: 0.050, 16: 0.100}, setup={"threads": 8, "kernels": "fast"})
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.0}, {1: 0.004, 16: 0.005},
                 setup={"threads": 8, "kernels": "fast", "device": "cuda", "capture": True})
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.2}, {1: 0.020, 16: 0.030},
                 setup={"threads": 8, "kernels": "fast", "device": "cuda", "capture": False})
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert [(e.get("device"), e.get("capture")) for e in cfg["step_costs"]] == [(None, None), ("cuda", False), ("cuda", True)]
    cpu = adapter_decode_config(cfg, threads=8, kernels="fast")
    assert cpu.step_cost == ((1, 50.0), (16, 100.0)) and cpu.adapter_cost == 0.5
    assert adapter_decode_config(cfg, threads=8, kernels="fast", device="cuda").step_cost == ((1, 20.0), (16, 30.0))
    captured, setup = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 8, "fast", device="cuda", capture=True)
    assert captured.step_cost == ((1, 4.0), (16, 5.0)) and captured.adapter_cost == 0.0
    assert setup["device"] == "cuda" and setup["capture"] is True
    # a GPU's curve serves any host threads; a CPU run at threads without a curve takes its device's
    # nearest, not the decode entry's own (the last written: here the GPU's eager one)
    assert adapter_decode_config(cfg, threads=16, kernels="fast", device="cuda").step_cost == ((1, 20.0), (16, 30.0))
    assert cfg["decode"]["step_cost"] == [[1, 20.0], [16, 30.0]]
    nearest, setup = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 4, "fast")
    assert nearest.step_cost == cpu.step_cost and setup["threads"] == 8  # space-eval warns: threads 8 (run: 4)


def test_curves_are_stored_and_chosen_per_compile_mode(tmp_path):
    """Issue 58: under --compile frozen a 1-row step costs relatively less than eagerly, so a frozen
    trunk's curve is stored beside the eager one of the same threads and kernels, each run is
    priced by its own mode's (load_space too), and a mode without a curve of its own falls back to
    the decode entry's, which space-eval's check names."""
    from space.artifact import adapter_decode_config, compile_setup, priced_for_setup, stored_step_costs
    from space.eval.step_cost import step_cost_mismatch

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    dynamic = DecodeConfig(3, 4, tree="dynamic").to_dict()
    eager = {"threads": 2, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "unfused"}
    write_decode(tmp_path, {**dynamic, "adapter_cost": 5.0}, {1: 0.050, 16: 0.080}, setup=eager)
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.0}, {1: 0.024, 16: 0.041},
                 setup={**eager, "compile": "frozen"})
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert [e.get("compile") for e in cfg["step_costs"]] == [None, "frozen"]  # two entries, eager first
    frozen, setup = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", compile="frozen")
    assert frozen.step_cost == ((1, 24.0), (16, 41.0)) and frozen.adapter_cost == 0.0
    assert setup["compile"] == "frozen" and step_cost_mismatch(setup, 2, "stock", "frozen", "unfused") is None
    plain, setup = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock")
    assert plain.step_cost == ((1, 50.0), (16, 80.0)) and "compile" not in setup
    assert "compile False (run: frozen)" in step_cost_mismatch(setup, 2, "stock", "frozen", "unfused")
    assert adapter_decode_config(cfg, threads=2, kernels="stock", compile="frozen").step_cost == frozen.step_cost
    # inductor's default mode has no curve here: the decode entry's own (the last written), named by the check
    stored = DecodeConfig.from_dict(cfg["decode"])
    other, setup = priced_for_setup(stored, cfg, 2, "stock", compile=compile_setup("default"))
    assert other.step_cost == frozen.step_cost and "compile frozen (run: True)" in step_cost_mismatch(
        setup, 2, "stock", True, "unfused")
    # "default" and True name one mode: no warning between them
    assert step_cost_mismatch({**eager, "compile": "default"}, 2, "stock", True, "unfused") is None
    assert compile_setup("default") is True and compile_setup(None) is False and compile_setup("frozen") == "frozen"
    with pytest.raises(ValueError, match="compile"):
        stored_step_costs({"step_costs": [{**cfg["step_costs"][0], "compile": 1}]})
    # load_space prices its tuned layout by its compile mode's curve (nothing compiles before a call)
    adapter = tmp_path / "adapter"
    shutil.copytree(SHIPPED, adapter)
    decode = json.loads((adapter / "space_config.json").read_text())["decode"]
    here = {**eager, "threads": torch.get_num_threads(), "cpu": cpu_identity()}  # this CPU's: chosen over the shipped ones
    write_decode(adapter, decode, {1: 0.024, 32: 0.050}, setup={**here, "compile": "frozen"})
    write_decode(adapter, decode, {1: 0.050, 32: 0.090}, setup=here)
    from space.loader import load_space

    model, _, _ = load_space(adapter=str(adapter), compile="frozen")
    assert model.config.space_decode["step_cost"] == [[1, 24.0], [32, 50.0]]


def test_default_compile_mode_is_one_setup_however_named(tmp_path):
    """``--compile`` alone is inductor's default mode, named "default" (the flag's value, which
    ``load_space(compile=...)`` receives as given) or True (``space-tree`` stores it so, as runs did
    before the modes were recorded): one setup. A curve stored under either name prices a run
    given the other and comes back as True, a later curve of that mode replaces it instead of
    standing beside it, the check names no difference, and a malformed curve of the mode is named
    with it. Catches the run's mode or a stored entry's compared unnormalized: the run then fell
    back to the decode entry's curve (here the eager one, written last)."""
    from space.artifact import priced_for_setup
    from space.eval.step_cost import step_cost_mismatch

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    dynamic = DecodeConfig(3, 4, tree="dynamic").to_dict()
    eager = {"threads": 2, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "unfused"}
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.0}, {1: 0.030, 16: 0.045},
                 setup={**eager, "compile": "default"})
    write_decode(tmp_path, {**dynamic, "adapter_cost": 5.0}, {1: 0.050, 16: 0.080}, setup=eager)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert cfg["decode"]["step_cost"] == [[1, 50.0], [16, 80.0]]  # the eager curve, written last
    for run in (True, "default"):
        layout, setup = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", compile=run)
        assert layout.step_cost == ((1, 30.0), (16, 45.0)) and setup["compile"] is True, run
        assert step_cost_mismatch(setup, 2, "stock", run, "unfused") is None
    assert step_cost_mismatch({**eager, "compile": True}, 2, "stock", "default", "unfused") is None
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.0}, {1: 0.020, 16: 0.035}, setup={**eager, "compile": True})
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert len(cfg["step_costs"]) == 2  # the eager curve and the default mode's, replaced
    layout, _ = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", compile="default")
    assert layout.step_cost == ((1, 20.0), (16, 35.0))
    cfg["step_costs"][1]["step_cost"] = [[1, -1.0]]  # the compiled entry (sorted after the eager one)
    with pytest.raises(ValueError, match="bad step_costs entry for 2 threads, stock kernels, cpu, compile True:"):
        priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", "x", compile="default")


def test_curves_name_their_packed_kernel(tmp_path):
    """Issue 58: a CPU curve measured on oneDNN's packed kernel (a 16-row step 1.88x a 1-row one)
    prices rows wrong on MKL's (1.65x): the curve keeps the kernel it was measured with, the run
    is priced with it in hand, and space-eval's check names the difference. A curve or a run that
    names no kernel (stock kernels, a GPU, a curve written before) is not compared."""
    from space.artifact import priced_for_setup, stored_step_costs
    from space.eval.step_cost import step_cost_mismatch

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    setup = {"threads": 2, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused",
             "packed_kernel": "onednn"}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.050, 16: 0.094}, setup=setup)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert cfg["step_costs"][0]["packed_kernel"] == "onednn"
    _, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast")
    assert priced == setup
    assert "packed_kernel onednn (run: mkl)" in step_cost_mismatch(priced, 2, "fast", packed_kernel="mkl")
    assert step_cost_mismatch(priced, 2, "fast", packed_kernel="onednn") is None
    assert step_cost_mismatch(priced, 2, "fast") is None  # the run names none
    assert step_cost_mismatch({k: v for k, v in setup.items() if k != "packed_kernel"}, 2, "fast",
                              packed_kernel="mkl") is None  # the curve names none
    with pytest.raises(ValueError, match="packed_kernel"):
        stored_step_costs({"step_costs": [{**cfg["step_costs"][0], "packed_kernel": 1}]})
    # the kernel follows the CPU: MKL's curve (another machine's) is kept beside oneDNN's, and each
    # run is priced by its own kernel's curve, whichever was written last
    mkl = {**setup, "packed_kernel": "mkl"}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.040, 16: 0.066}, setup=mkl)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["packed_kernel"] for e in cfg["step_costs"]) == ["mkl", "onednn"]
    for kernel, curve in (("onednn", ((1, 50.0), (16, 94.0))), ("mkl", ((1, 40.0), (16, 66.0)))):
        layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast", packed_kernel=kernel)
        assert layout.step_cost == curve and priced["packed_kernel"] == kernel
    layout, _ = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast", packed_kernel="other")
    assert layout.step_cost in (((1, 50.0), (16, 94.0)), ((1, 40.0), (16, 66.0)))  # none of its own: one of them
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.030, 16: 0.060}, setup=mkl)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert [e["step_cost"][0][1] for e in cfg["step_costs"]] == [30.0, 50.0]  # the same setup's curve replaced


def test_curves_name_their_cpu(tmp_path, monkeypatch):
    """Two CPUs of one packed kernel step differently: the dynamic tree priced by an AVX2 EPYC's
    oneDNN curve decoded 1.10x slower on a Zen 4 EPYC than by its own
    (results/humaneval20_zen4_curve), and Linux names both "AMD EPYC". A curve keeps the CPU it
    was timed on (``cpu_identity``: model and vector ISA), a write on another CPU keeps it beside
    the first, a run is priced by its own CPU's curve, and space-eval's check names another CPU's
    (an entry that names none is not compared)."""
    from space.artifact import priced_for_setup, stored_step_costs
    from space.eval.step_cost import curve_setup, step_cost_mismatch
    from space.models import tiny_random_llama

    assert curve_setup(tiny_random_llama(seed=0)[0], "fast", False)["cpu"] == cpu_identity()
    assert cpu_identity().endswith(f"({torch.backends.cpu.get_cpu_capability()})")
    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    base = {"threads": 2, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused",
            "packed_kernel": "onednn"}
    avx2, zen4 = {**base, "cpu": "AMD EPYC (AVX2)"}, {**base, "cpu": "AMD EPYC (AVX512)"}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.097, 16: 0.183}, setup=avx2)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.041, 16: 0.065}, setup=zen4)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["cpu"] for e in cfg["step_costs"]) == ["AMD EPYC (AVX2)", "AMD EPYC (AVX512)"]  # side by side
    for setup, curve in ((avx2, ((1, 97.0), (16, 183.0))), (zen4, ((1, 41.0), (16, 65.0)))):
        for _ in range(2):  # whichever of the two comes first in the file
            layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast",
                                              packed_kernel="onednn", cpu=setup["cpu"])
            assert layout.step_cost == curve and priced == setup
            assert step_cost_mismatch(priced, 2, "fast", packed_kernel="onednn", cpu=setup["cpu"]) is None
            cfg["step_costs"].reverse()
    layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast", packed_kernel="onednn",
                                      cpu="Intel Xeon (AVX512)")  # none of its own: another CPU's, and said so
    assert layout.step_cost in (((1, 97.0), (16, 183.0)), ((1, 41.0), (16, 65.0))) and priced["threads"] == 2
    assert f"cpu {priced['cpu']} (run: Intel Xeon (AVX512))" in step_cost_mismatch(
        priced, 2, "fast", packed_kernel="onednn", cpu="Intel Xeon (AVX512)")
    assert step_cost_mismatch(base, 2, "fast", packed_kernel="onednn", cpu="Intel Xeon (AVX512)") is None
    assert step_cost_mismatch(avx2, 2, "fast", device="cuda") is not None  # a GPU run: the device differs
    assert "cpu" not in (step_cost_mismatch({**avx2, "device": "cuda"}, 2, "fast", device="cuda") or "")
    # no cpu given: this machine's (faked as the Zen 4, the curve after the AVX2 one in the file), for the
    # choice and for the check; none compared off a CPU, and a GPU's curve names none
    monkeypatch.setattr("space.cpu_kernels.cpu_identity", lambda: zen4["cpu"])
    layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "fast", packed_kernel="onednn")
    assert layout.step_cost == ((1, 41.0), (16, 65.0)) and priced == zen4
    assert step_cost_mismatch(zen4, 2, "fast", packed_kernel="onednn") is None
    assert "cpu AMD EPYC (AVX2) (run: AMD EPYC (AVX512))" in step_cost_mismatch(avx2, 2, "fast", packed_kernel="onednn")
    assert "cpu" not in (step_cost_mismatch({**avx2, "device": "cuda"}, 2, "fast", device="cuda") or "")
    assert "cpu" not in curve_setup(torch.nn.Linear(1, 1, device="meta"), "fast", False)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.040, 16: 0.060}, setup=zen4)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["step_cost"][0][1] for e in cfg["step_costs"]) == [40.0, 97.0]  # its own CPU's replaced
    with pytest.raises(ValueError, match="cpu"):
        stored_step_costs({"step_costs": [{**cfg["step_costs"][0], "cpu": 1}]})


def test_curves_name_their_gpu(tmp_path, monkeypatch):
    """A GPU's eager step is launch-bound, so its curve follows the GPU (and its host): a CUDA
    curve keeps the GPU it was timed on (``models.gpu_identity``), a write on another GPU keeps it
    beside the first, a run is priced by its own GPU's curve, and the check names another GPU's (an
    entry that names none, written before the GPU was recorded, is not compared). Fails with the GPU
    left out of ``setup_key``, of the choice, of the check or of ``write_decode``'s keys."""
    from space.artifact import priced_for_setup, stored_step_costs
    from space.eval.step_cost import step_cost_mismatch

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    base = {"threads": 2, "kernels": "stock", "device": "cuda", "capture": True, "trunk": "fused"}
    h100, a10 = {**base, "gpu": "NVIDIA H100 80GB HBM3"}, {**base, "gpu": "NVIDIA A10"}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.004, 16: 0.005}, setup=h100)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.006, 16: 0.011}, setup=a10)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["gpu"] for e in cfg["step_costs"]) == [a10["gpu"], h100["gpu"]]  # side by side
    for setup, curve in ((h100, ((1, 4.0), (16, 5.0))), (a10, ((1, 6.0), (16, 11.0)))):
        for _ in range(2):  # whichever of the two comes first in the file
            layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", device="cuda",
                                              capture=True, gpu=setup["gpu"])
            assert layout.step_cost == curve and priced == setup
            assert step_cost_mismatch(priced, 2, "stock", device="cuda", capture=True, gpu=setup["gpu"]) is None
            cfg["step_costs"].reverse()
    assert "gpu NVIDIA A10 (run: NVIDIA H100 80GB HBM3)" in step_cost_mismatch(
        a10, 2, "stock", device="cuda", capture=True, gpu=h100["gpu"])
    assert step_cost_mismatch(base, 2, "stock", device="cuda", capture=True, gpu=h100["gpu"]) is None
    # no gpu given: this machine's (faked as the A10)
    monkeypatch.setattr("space.models.gpu_identity", lambda: a10["gpu"])
    # whichever comes first (write_decode put the A10's first: one order let "this machine's" go unread)
    for _ in range(2):
        layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", device="cuda", capture=True)
        assert layout.step_cost == ((1, 6.0), (16, 11.0)) and priced == a10
        cfg["step_costs"].reverse()
    assert "gpu NVIDIA H100" in step_cost_mismatch(h100, 2, "stock", device="cuda", capture=True)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.003, 16: 0.004}, setup=h100)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["step_cost"][0][1] for e in cfg["step_costs"]) == [3.0, 6.0]  # its own GPU's replaced
    with pytest.raises(ValueError, match="gpu"):
        stored_step_costs({"step_costs": [{**cfg["step_costs"][0], "gpu": 1}]})


def test_a_model_on_a_second_kind_of_gpu_is_priced_by_its_own_gpus_curve(tmp_path, monkeypatch):
    """On a host with two kinds of GPU, a model on the second (an A10 beside a current H100) is priced
    and checked by the A10's curve (``models.model_gpu``): the stored curve was chosen, and the check
    compared, by the current device's name. Fails with ``model_gpu`` reading the current GPU, or
    with ``warn_step_cost_mismatch`` or ``adapter_decode_config`` left without the model's GPU."""
    import types
    import warnings

    from space.artifact import adapter_decode_config
    from space.eval.step_cost import curve_setup, warn_step_cost_mismatch
    from space.models import model_gpu

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A10"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: names[0 if device is None else torch.device(device).index or 0])
    param = types.SimpleNamespace(device=torch.device("cuda", 1), dtype=torch.float32)
    on_a10 = types.SimpleNamespace(parameters=lambda: iter([param]))
    assert model_gpu(on_a10) == names[1] and curve_setup(on_a10, "stock", True)["gpu"] == names[1]
    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    base = {"threads": 2, "kernels": "stock", "device": "cuda", "capture": False, "trunk": "unfused"}
    h100, a10 = {**base, "gpu": names[0]}, {**base, "gpu": names[1]}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.004, 16: 0.005}, setup=h100)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.006, 16: 0.011}, setup=a10)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    decode = adapter_decode_config(cfg, tmp_path / "space_config.json", 2, "stock", "cuda", gpu=model_gpu(on_a10))
    assert decode.step_cost == ((1, 6.0), (16, 11.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_step_cost_mismatch(a10, on_a10, 2, "stock")  # its own GPU's curve: no warning
    with pytest.warns(UserWarning, match=r"gpu NVIDIA H100 80GB HBM3 \(run: NVIDIA A10\)"):
        warn_step_cost_mismatch(h100, on_a10, 2, "stock")


def test_curves_name_their_dtype(tmp_path):
    """A bf16 trunk's steps cost otherwise than fp32's (SmolLM2 on a Zen 4: 32 rows 2.07x one row
    in bf16, 2.6x in fp32), and a bf16 run was priced by the fp32 curve without a word: a curve
    records its trunk's dtype (one naming none was fp32's), the two are kept side by side, a run
    is priced by its own dtype's, and the check names another's. Fails with the dtype left out of
    ``setup_key``, the choice, the check, ``curve_setup`` or ``write_decode``'s keys."""
    from space.artifact import priced_for_setup, stored_step_costs
    from space.eval.step_cost import curve_setup, step_cost_mismatch
    from space.models import tiny_random_llama

    model = tiny_random_llama(seed=0)[0]
    assert curve_setup(model, "stock", False)["dtype"] == "float32"
    assert curve_setup(model.to(torch.bfloat16), "stock", False)["dtype"] == "bfloat16"
    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    old = {"threads": 2, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "fused",
           "cpu": cpu_identity()}  # written before the dtype was recorded: fp32's
    bf16 = {**old, "dtype": "bfloat16"}
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.040, 32: 0.104}, setup=old)
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.065, 32: 0.135}, setup=bf16)
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e.get("dtype", "-") for e in cfg["step_costs"]) == ["-", "bfloat16"]  # side by side
    for dtype, curve, setup in (("float32", ((1, 40.0), (32, 104.0)), old), ("bfloat16", ((1, 65.0), (32, 135.0)), bf16)):
        for _ in range(2):  # whichever comes first in the file
            layout, priced = priced_for_setup(DecodeConfig(3, tree="dynamic"), cfg, 2, "stock", dtype=dtype)
            assert layout.step_cost == curve and priced == setup
            assert step_cost_mismatch(priced, 2, "stock", trunk="fused", cpu=setup["cpu"], dtype=dtype) is None
            cfg["step_costs"].reverse()
    assert "dtype float32 (run: bfloat16)" in step_cost_mismatch(old, 2, "stock", trunk="fused", dtype="bfloat16")
    assert step_cost_mismatch(old, 2, "stock", trunk="fused") is None  # no dtype given: not compared
    write_decode(tmp_path, DecodeConfig(3, 4, tree="dynamic").to_dict(), {1: 0.039, 32: 0.100},
                 setup={**old, "dtype": "float32"})  # fp32 re-timed: replaces the entry that named none
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert sorted(e["step_cost"][0][1] for e in cfg["step_costs"]) == [39.0, 65.0]
    with pytest.raises(ValueError, match="dtype"):
        stored_step_costs({"step_costs": [{**cfg["step_costs"][0], "dtype": 16}]})


def test_load_ranks_by_source(tmp_path):
    path = tmp_path / "ranks.jsonl"
    path.write_text('{"source": "mbpp", "ranks": [[0, 1]]}\n{"source": "lima", "ranks": [[2, 3]]}\n'
                    '{"source": "lima", "ranks": []}\n')
    assert [r.tolist() for r in load_ranks(path)] == [[[0, 1]], [[2, 3]]]
    assert [r.tolist() for r in load_ranks(path, "lima")] == [[[2, 3]]]


def test_search_keeps_the_adapters_lookup_and_estimates_its_current_layout():
    """Issue: --write-adapter dropped lookup_tokens 10 -> 0 and wrote a layout slower than the current one."""
    ranks = [torch.tensor([[j % 3, 0] for j in range(40)]) for _ in range(6)]
    current = DecodeConfig(2, 2, lookup_tokens=10, tree=[[0], [1], [0, 0], [0, 1]])
    found = search(ranks, {1: 1.0, 2: 1.5, 64: 30.0}, 2, 64, current)
    assert {(r["decode"]["lookup_tokens"], r["decode"]["lookup_ngram"]) for r in found} == {(10, 2)}
    mine = [r for r in found if r.get("current")]
    assert len(mine) == 1 and mine[0]["decode"] == current.to_dict()
    assert found[0]["est_speedup"] >= mine[0]["est_speedup"]


def test_write_adapter_keeps_lookup_and_refuses_another_adapters_ranks(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(SHIPPED, adapter)
    # a static current layout (the shipped one is the dynamic tree since issue 31, which the replay
    # cannot estimate: test_write_adapter_dynamic_then_static_over_it covers that case)
    cfg = json.loads((adapter / "space_config.json").read_text())
    cfg["decode"].update(mask_num=2, num_groups=2, tree=[[0], [1], [0, 0], [0, 1]])
    (adapter / "space_config.json").write_text(json.dumps(cfg, indent=2))
    before = cfg["decode"]
    ranks = tmp_path / "ranks.jsonl"
    meta = {"model": "smollm2-135m-instruct", "adapter": str(adapter), "adapter_sha256": adapter_sha256(adapter)}
    rows = [{"id": i, "source": "mbpp", "ranks": [[j % 2, 0, 1] for j in range(30)]} for i in range(4)]
    ranks.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": meta}, *rows]))
    args = ["--adapter", str(adapter), "--ranks", str(ranks), "--max-mask-num", "3", "--max-rows", "12",
            "--cache-len", "16", "--threads", "1", "--out", str(tmp_path / "tree")]
    report = main([*args, "--write-adapter"])
    after = json.loads((adapter / "space_config.json").read_text())["decode"]
    assert (after["lookup_tokens"], after["lookup_ngram"]) == (before["lookup_tokens"], before["lookup_ngram"]) == (10, 2)
    assert report["current"] is not None and report["best"]["est_speedup"] >= report["current"]["est_speedup"]
    # the layout written carries this machine's step-cost curve (ms), which a dynamic tree would price rows with
    curve = [[q, ms] for q, ms in report["step_cost_ms"].items()]
    assert [q for q, _ in curve] == [1, 2, 4, 8, 12] and after["step_cost"] == curve == step_cost_points(
        {q: ms / 1e3 for q, ms in curve})
    kept = report["best"] is report["current"]
    layout = DecodeConfig.from_dict(before).to_dict() if kept else report["best"]["decode"]
    assert {**after, "adapter_cost": None} == {**layout, "step_cost": curve, "adapter_cost": None}
    # the adapter cost is measured with the curve: the one stored was that of the setup the adapter was
    # priced with at load (the shipped 2-thread fast kernels' 7.468 ms), a pair no setup measured
    assert after["adapter_cost"] != layout["adapter_cost"] and after["adapter_cost"] >= 0
    written = json.loads((adapter / "space_config.json").read_text())
    entry = next(e for e in written["step_costs"] if e.get("threads") == 1 and e["kernels"] == "fast"
                 and e["step_cost"] == curve)
    assert entry["adapter_cost"] == after["adapter_cost"] and written["step_cost_setup"]["threads"] == 1
    other = dict(meta, adapter="adapters/other", adapter_sha256="0" * 64)
    ranks.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": other}, *rows]))
    with pytest.raises(SystemExit) as info:
        cli(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "adapters/other" in err and str(adapter) in err and "Traceback" not in err


def test_search_leaves_out_a_current_dynamic_tree():
    """The replay cannot play the dynamic tree: search() skips it as the current layout (no crash)
    and keeps its lookup, row budget and draft ranks on the static layouts; estimate() refuses it."""
    ranks = [torch.tensor([[j % 3, 0] for j in range(40)]) for _ in range(6)]
    current = DecodeConfig(2, lookup_tokens=10, tree="dynamic", row_budget=12, draft_ranks=3,
                           step_cost=[[1, 1.0], [8, 2.0]])
    found = search(ranks, {1: 1.0, 2: 1.5, 64: 30.0}, 2, 64, current)
    assert found and not any(r.get("current") for r in found)
    assert {(r["decode"]["lookup_tokens"], r["decode"]["row_budget"], r["decode"]["draft_ranks"]) for r in found} \
        == {(10, 12, 3)}
    assert all(r["decode"]["tree"] != "dynamic" for r in found)
    assert _key(current.to_dict()) == (2, 3, "dynamic", 10, 2)
    with pytest.raises(ValueError, match="cannot estimate the dynamic tree"):
        estimate(ranks, current, {1: 1.0, 64: 2.0})


def test_search_leaves_out_a_current_layout_of_prompt_lookup_alone():
    """A stored layout without a mask group (prompt lookup alone, which load_space decodes) crashed
    space-tree in the replay ("anchored_group needs >= 1 group"): left out as the dynamic tree is."""
    ranks = [torch.tensor([[j % 3, 0] for j in range(40)]) for _ in range(6)]
    current = DecodeConfig(2, 0, lookup_tokens=10)
    found = search(ranks, {1: 1.0, 2: 1.5, 64: 30.0}, 2, 64, current)
    assert found and not any(r.get("current") for r in found)
    assert {r["decode"]["lookup_tokens"] for r in found} == {10}


def test_one_stored_curve_per_threads_and_kernels(tmp_path):
    """Issue 44: space-tree --write-adapter keeps one curve per (threads, kernels); a later curve
    replaces only its own setup's; the adapter's hash ignores them; and a dynamic tree loads the
    curve of the run's own setup, else the "decode" entry's."""
    from space.artifact import adapter_decode_config, priced_for_setup, stored_step_costs
    from space.eval.resume import adapter_sha256

    (tmp_path / "space_config.json").write_text(json.dumps({"mode": "frozen-base", "mask_num": 3}))
    before = adapter_sha256(tmp_path)
    dynamic = DecodeConfig(3, 4, tree="dynamic").to_dict()
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.5}, {1: 0.001, 8: 0.004}, setup={"threads": 1, "kernels": "fast"})
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.7}, {1: 0.002, 8: 0.003}, setup={"threads": 2, "kernels": "fast"})
    write_decode(tmp_path, {**dynamic, "adapter_cost": 0.9}, {1: 0.003, 8: 0.005}, setup={"threads": 2, "kernels": "fast"})
    cfg = json.loads((tmp_path / "space_config.json").read_text())
    assert [(e["threads"], e["kernels"], e["adapter_cost"]) for e in cfg["step_costs"]] == [(1, "fast", 0.5), (2, "fast", 0.9)]
    assert len(stored_step_costs(cfg)) == 2
    assert adapter_sha256(tmp_path) == before
    one = adapter_decode_config(cfg, threads=1, kernels="fast")
    assert one.step_cost == ((1, 1.0), (8, 4.0)) and one.adapter_cost == 0.5
    two = adapter_decode_config(cfg, threads=2, kernels="fast")
    assert two.step_cost == ((1, 3.0), (8, 5.0)) and two.adapter_cost == 0.9
    # no curve for this setup: the "decode" entry's own (the last written), as before issue 44
    assert adapter_decode_config(cfg, threads=4, kernels="fast").step_cost == two.step_cost
    cfg["decode"] = {**cfg["decode"], "tree": [[0], [1]]}  # a static layout prices no rows by a curve
    assert adapter_decode_config(cfg).step_cost == two.step_cost  # the entry's own, unpriced
    # but carries this setup's, which a --tree dynamic override in space-chat or space.hf.generate
    # takes (they priced it by the entry's own, where space-eval took this setup's)
    static = adapter_decode_config(cfg, threads=1, kernels="fast")
    assert static.tree == ((0,), (1,)) and (static.step_cost, static.adapter_cost) == (one.step_cost, 0.5)
    assert static.override(tree="dynamic") == one.override(tree="dynamic", lookup_tokens=static.lookup_tokens)
    static = adapter_decode_config(cfg, threads=2, kernels="fast")  # carries the 2-thread curve
    # --tree dynamic over the static stored layout: priced after the flag, with the setup it names
    priced, setup = priced_for_setup(static.override(tree="dynamic"), cfg, 1, "fast")
    assert priced.step_cost == one.step_cost
    assert setup == {"threads": 1, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "unfused"}
    unpriced, setup = priced_for_setup(static.override(tree="dynamic"), cfg, 1, "stock")
    assert unpriced.step_cost == two.step_cost and setup == {"threads": 2, "kernels": "fast"}  # warns in space-eval
    cfg["step_costs"][0]["step_cost"] = [[1, -1.0]]
    with pytest.raises(ValueError, match="x/space_config.json: bad step_costs entry for 1 threads"):
        priced_for_setup(priced, cfg, 1, "fast", "x/space_config.json")
    for bad in (None, 3, [{"threads": "2", "kernels": "fast", "step_cost": []}], [{"threads": 1}]):
        with pytest.raises(ValueError, match="bad step_costs"):
            priced_for_setup(priced, {**cfg, "step_costs": bad}, 1, "fast")
        (tmp_path / "space_config.json").write_text(json.dumps({**cfg, "step_costs": bad}))
        with pytest.raises(ValueError, match="bad step_costs"):  # space-tree refuses to extend it
            write_decode(tmp_path, dynamic, {1: 0.001}, setup={"threads": 1, "kernels": "fast"})


def test_eval_prices_rows_by_the_curve_of_its_threads(tmp_path, recwarn):
    """space-eval on the shipped adapter with curves stored for 1 and 2 threads and the fast kernels:
    the run at 1 thread decodes with (and records) the 1-thread curve, and does not warn about a
    mismatch (load_space itself loads with the stock kernels, so the eval must choose the curve).
    The curves are stored for each packed kernel (the run times its own) and this CPU, over the
    shipped ones."""
    from space.eval.__main__ import main as eval_main

    adapter = tmp_path / "adapter"
    shutil.copytree(SHIPPED, adapter)
    decode = json.loads((adapter / "space_config.json").read_text())["decode"]
    for kernel in PACKED_KERNELS if packed_kernel() else (None,):
        for threads, curve in ((1, {1: 0.05, 32: 0.15}), (2, {1: 0.04, 32: 0.09})):
            setup = {"threads": threads, "kernels": "fast", "trunk": "fused", "cpu": cpu_identity(),
                     **({"packed_kernel": kernel} if kernel else {})}
            write_decode(adapter, {**decode, "adapter_cost": 5.0 * threads}, curve, setup=setup)
    eval_main(["--adapter", str(adapter), "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "8",
               "--methods", "space", "--threads", "1", "--out", str(tmp_path / "run")])
    meta = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert meta["step_cost"] == [[1, 50.0], [32, 150.0]] and meta["adapter_cost"] == 5.0
    kernel = meta["packed_kernel"]  # the run's timed choice, recorded beside the settings
    assert meta["step_cost_setup"] == {"threads": 1, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused",
                                       "cpu": cpu_identity(), **({"packed_kernel": kernel} if kernel else {})}
    assert not [w for w in recwarn if "step-cost curve" in str(w.message)]


def test_eval_compile_prices_rows_by_its_modes_curve_and_records_it(tmp_path, monkeypatch, recwarn):
    """space-eval --compile (the flag alone: inductor's default mode, "default") decodes with the
    curve stored for that mode (space-tree --compile stores it under True), not the eager curve
    of the same threads and kernels, and records the mode as True, as runs recorded it before the
    modes (a resume key). Catches the run's compile mode left out of the curve's choice, and
    "default" recorded as given. The questions are not run (run_bench stops): nothing compiles."""
    import space.eval.bench as bench
    from space.eval.__main__ import main as eval_main

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    adapter = tmp_path / "adapter"
    shutil.copytree(SHIPPED, adapter)
    decode = json.loads((adapter / "space_config.json").read_text())["decode"]
    assert decode["tree"] == "dynamic"
    eager = {"threads": 1, "kernels": "stock", "device": "cpu", "capture": False, "trunk": "unfused"}
    write_decode(adapter, {**decode, "adapter_cost": 0.0}, {1: 0.03, 32: 0.06}, setup={**eager, "compile": True})
    write_decode(adapter, {**decode, "adapter_cost": 5.0}, {1: 0.05, 32: 0.15}, setup=eager)  # written last
    monkeypatch.setattr(bench, "run_bench", stop)
    with pytest.raises(Stop):
        eval_main(["--adapter", str(adapter), "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "8",
                   "--methods", "space", "--threads", "1", "--compile", "--out", str(tmp_path / "run")])
    meta = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert meta["compile"] is True
    assert meta["step_cost"] == [[1, 30.0], [32, 60.0]] and meta["adapter_cost"] == 0.0
    assert meta["step_cost_setup"] == {**eager, "compile": True}
    assert not [w for w in recwarn if "step-cost curve" in str(w.message)]


def test_write_adapter_dynamic_then_static_over_it(tmp_path, capsys):
    """--dynamic --write-adapter stores the dynamic tree with the curve; a later plain --write-adapter
    run over that adapter skips the dynamic current layout and stores the best static one."""
    adapter = tmp_path / "adapter"
    shutil.copytree(SHIPPED, adapter)
    ranks = tmp_path / "ranks.jsonl"
    meta = {"model": "smollm2-135m-instruct", "adapter": str(adapter), "adapter_sha256": adapter_sha256(adapter)}
    rows = [{"id": i, "source": "mbpp", "ranks": [[j % 2, 0, 1] for j in range(30)]} for i in range(4)]
    ranks.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": meta}, *rows]))
    args = ["--adapter", str(adapter), "--ranks", str(ranks), "--max-mask-num", "2", "--max-rows", "12",
            "--cache-len", "16", "--threads", "1", "--out", str(tmp_path / "tree"), "--write-adapter"]
    report = main([*args, "--dynamic"])
    after = json.loads((adapter / "space_config.json").read_text())["decode"]
    curve = [[q, ms] for q, ms in report["step_cost_ms"].items()]
    # the adapter's trained k (3) capped by --max-mask-num, its lookup settings, row budget = --max-rows
    assert after == {"mask_num": 2, "num_groups": 3, "lookup_tokens": 10, "lookup_ngram": 2, "lookup_branches": 4,
                     "datastore_branches": 0, "tree": "dynamic",
                     "row_budget": 12, "draft_ranks": 4, "step_cost": curve,
                     "adapter_cost": after["adapter_cost"]} == report["dynamic"]
    assert after["adapter_cost"] >= 0  # 2 rows with a mask row minus without, measured (issue 44)
    assert DecodeConfig.from_dict(after).tree == "dynamic"
    assert "dynamic tree" in capsys.readouterr().out
    # issue 58: the curve of captured steps (here their buffers, run eagerly) is stored beside the eager one
    main([*args, "--dynamic", "--capture"])
    cfg = json.loads((adapter / "space_config.json").read_text())
    # each names the kernel its packed linears ran, timed on this CPU (None, no key: this torch has no
    # packed kernel) and this CPU; the shipped curves of other CPUs stay beside them, and so do those
    # written before curves named a CPU (the shipped MKL ones, which an Intel CPU's kernel choice matches)
    kernel = cfg["step_cost_setup"].get("packed_kernel")
    assert kernel in (PACKED_KERNELS if packed_kernel() else (None,))
    mine = [e for e in cfg["step_costs"] if e["threads"] == 1 and e["kernels"] == "fast"
            and e.get("packed_kernel") == kernel and e.get("cpu") == cpu_identity()]
    assert [(e["device"], e["capture"]) for e in mine] == [("cpu", False), ("cpu", True)]
    assert mine[1]["adapter_cost"] >= 0  # the gated graph against the plain one
    assert "[space-tree] captured 0 step graphs" in capsys.readouterr().out
    report = main(args)
    assert report["current"] is None and report["dynamic"] is None
    after = json.loads((adapter / "space_config.json").read_text())["decode"]
    assert after["tree"] != "dynamic" and after == {**report["best"]["decode"], "step_cost": after["step_cost"],
                                                    "adapter_cost": after["adapter_cost"]}
    assert (after["lookup_tokens"], after["row_budget"]) == (10, 12)  # kept from the dynamic layout
    assert "replaces the current dynamic tree" in capsys.readouterr().out


def test_step_costs_are_timed_on_the_decoders_cache(tiny, monkeypatch):
    """``time_steps`` prices a step on the cache the eager decoder holds, a ``SlabCache`` (one write
    of the block per layer), not a ``DynamicCache``, whose every step concatenates the whole cache in
    every layer and costs what no decode step pays."""
    import space.decoding.cache as cache_module
    from space.eval.step_cost import time_steps

    made = []

    class Counted(cache_module.SlabCache):
        def update(self, *args, **kwargs):
            made.append(self)
            return super().update(*args, **kwargs)

    monkeypatch.setattr(cache_module, "SlabCache", Counted)
    model, _, _ = tiny
    timed = time_steps(model, [(1, False), (4, False)], cache_len=20, repeats=1)
    assert set(timed) == {(1, False), (4, False)} and all(t > 0 for t in timed.values())
    assert made and all(c is made[0] for c in made)  # every forward wrote the one slab cache


def test_static_step_costs_pass_the_decoders_mask(tiny, sdpa_calls):
    """Over a static cache, ``time_steps`` times each step with the 4-D mask a decoder passes there
    (``decoder.mask_slots``): on an attention that reads the mask's width (``SDPA_GQA``), the
    cached tokens and the rows only, 1 row too, as ``ar_generate``'s step; on stock ``sdpa``,
    every slot of the cache."""
    from space.eval.step_cost import time_steps
    from tests.conftest import sdpa_gqa_copy

    model, _, _ = tiny
    gqa, seen = sdpa_gqa_copy(model), sdpa_calls
    for m, narrow in [(gqa, True), (model, False)]:
        seen.clear()
        time_steps(m, [(1, False), (4, True)], cache_len=20, repeats=1, static=True)
        steps = seen[m.config.num_hidden_layers:]  # past the 20-row prefill
        # 1 and 4 rows after 20 cached, in a cache of 25 slots (one past the widest block)
        assert {w for _, _, w in steps} == ({21, 24} if narrow else {25})
        assert all(keys == width for _, keys, width in steps)


def test_search_tries_every_group_count_up_to_the_row_limit():
    """Every k gets 1..k+1 groups (k+1, the default, was left out by a range one short), and a
    layout of exactly --max-rows rows is tried (the limit is inclusive)."""
    ranks = [torch.zeros(20, 2, dtype=torch.long) for _ in range(4)]
    chains = {_key(r["decode"])[:2] for r in search(ranks, {1: 1.0, 64: 2.0}, 2, 64) if r["decode"]["tree"] is None}
    assert chains == {(1, 1), (1, 2), (2, 1), (2, 2), (2, 3)}
    found = search(ranks, {1: 1.0, 64: 2.0}, 2, 9)
    assert DecodeConfig(2, 3).max_rows() == 9 and (2, 3, None) in {_key(r["decode"])[:3] for r in found}
    assert max(DecodeConfig.from_dict(r["decode"]).max_rows() for r in found) == 9


def test_search_estimates_on_the_samples_it_did_not_grow_trees_on():
    """Trees are grown on the even samples and every layout replayed on the odd ones: here every
    draft of the odd samples is wrong, so each chain emits one token a step (replayed on all the
    samples, the perfect even ones made it look better than it is)."""
    right, wrong = torch.zeros(20, 2, dtype=torch.long), torch.full((20, 2), 60, dtype=torch.long)
    found = search([right, wrong, right, wrong], {1: 1.0, 64: 2.0}, 2, 64)
    chains = [r for r in found if r["decode"]["tree"] is None]
    assert len(chains) == 5 and all(r["tokens_per_step"] == 1.0 for r in chains)


def test_step_cost_points_are_never_zero():
    """A stored cost must be > 0 (DecodeConfig refuses 0): a step under 0.5 us rounds up to 0.001 ms."""
    assert step_cost_points({4: 0.0031234, 1: 2e-7}) == [[1, 0.001], [4, 3.123]]
    assert DecodeConfig(3, tree="dynamic", step_cost=step_cost_points({1: 2e-7, 4: 0.003})).step_cost[0] == (1, 0.001)


def test_a_gpu_curve_is_not_refused_for_the_hosts_threads():
    """A GPU's steps barely depend on the host's threads: a GPU curve prices a GPU run at any
    thread count, while a CPU curve at other threads is named."""
    from space.eval.step_cost import step_cost_mismatch

    gpu = {"threads": 8, "kernels": "fast", "device": "cuda", "capture": True, "trunk": "fused"}
    assert step_cost_mismatch(gpu, 2, "fast", device="cuda", capture=True) is None
    assert "threads 8 (run: 2)" in step_cost_mismatch({**gpu, "device": "cpu", "capture": False}, 2, "fast")


def test_ranks_of_another_base_model_are_refused(tmp_path, capsys):
    """No adapter on either side, the ranks of another base model: not this model's drafts.
    A file without a meta line (an older space-probe) passes with a warning."""
    from space.eval.tree_search import check_ranks_source

    path = tmp_path / "ranks.jsonl"
    meta = {"model": "smollm2-135m-instruct", "adapter": None, "adapter_sha256": None}
    with pytest.raises(ValueError, match="ranks of base model 'smollm2-135m-instruct', not of 'tiny-random-llama'"):
        check_ranks_source(meta, path, "tiny-random-llama", None)
    check_ranks_source({**meta, "model": "tiny-random-llama"}, path, "tiny-random-llama", None)
    check_ranks_source(None, path, "tiny-random-llama", None)
    assert "does not record which adapter produced it" in capsys.readouterr().err


def test_write_decode_leaves_the_config_whole_when_the_write_fails(tmp_path, monkeypatch):
    """space_config.json is replaced atomically: a write cut short (disk full, Ctrl-C) leaves the
    old file, not a torn one that no longer loads the adapter, and no temporary file beside it (a
    file left in the adapter's folder changes its fingerprint, and its ranks files were refused)."""
    import space.jsonl
    from space.eval.resume import adapter_sha256

    config = tmp_path / "space_config.json"
    config.write_text(json.dumps({"mode": "frozen-base", "decode": {"mask_num": 1}}))
    before, fingerprint = config.read_text(), adapter_sha256(tmp_path)

    def full(fd):
        raise OSError("No space left on device")

    monkeypatch.setattr(space.jsonl.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_decode(tmp_path, DecodeConfig(3, 2).to_dict(), {1: 0.002})
    monkeypatch.undo()
    assert config.read_text() == before and adapter_sha256(tmp_path) == fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space_config.json"]


def test_a_curve_measured_over_captured_steps_is_timed_at_their_row_buckets(tiny):
    """``--step-cost measure`` under ``--capture`` times the captured steps, which hold only their row
    buckets (a power-of-two ladder here): the curve is timed at the buckets up to the most rows,
    never at a count no graph holds (12 rows failed as "not a bucket size", and the run with it).
    The CPU runs the captured steps eagerly."""
    from space.decoding.graphs import StepGraphs
    from space.eval.step_cost import measure_step_cost

    model, _, _ = tiny
    graphs = StepGraphs(model, 64, [1, 2, 4, 8, 16])
    measured = measure_step_cost(model, 16, cache_len=20, repeats=1, graphs=graphs)
    assert [rows for rows, _ in measured["step_cost"]] == [1, 2, 4, 8, 16]
    assert all(ms > 0 for _, ms in measured["step_cost"]) and measured["adapter_cost"] >= 0


def test_write_adapter_stores_a_full_checkpoints_layout(tmp_path, capsys):
    """A full SAR-SFT checkpoint given as --model is an artifact too: ``--write-adapter`` stores
    the best layout and its curve in the checkpoint's space_config.json (it refused: "needs
    --adapter"), the report's current layout is the checkpoint's, and ``load_space`` then decodes
    with it; the checkpoint's fingerprint for a resume (``model_files``) ignores the layout, as an
    adapter's hash does, and still counts any other change of the file. A plain model without
    --adapter is still refused."""
    from space.decoding import SpaceDecoder
    from space.eval.resume import model_files
    from space.loader import load_space
    from tests.conftest import full_checkpoint

    ckpt = full_checkpoint(tmp_path / "full")
    probe.main(["--model", str(ckpt), "--limit", "1", "--max-new-tokens", "12", "--out", str(tmp_path / "probe")])
    before = model_files(str(ckpt), layout=False)
    report = main(["--model", str(ckpt), "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--max-mask-num", "3",
                   "--max-rows", "12", "--cache-len", "16", "--threads", "1", "--out", str(tmp_path / "tree"),
                   "--write-adapter"])
    assert report["current"] is not None and report["current"]["decode"]["mask_num"] == 3
    stored = json.loads((ckpt / "space_config.json").read_text())["decode"]
    curve = [[q, ms] for q, ms in report["step_cost_ms"].items()]
    assert stored == {**report["best"]["decode"], "step_cost": curve, "adapter_cost": stored["adapter_cost"]}
    assert f"{ckpt / 'space_config.json'}" in capsys.readouterr().out
    loaded, _, spec = load_space(model=str(ckpt))
    assert SpaceDecoder(loaded, spec).config == DecodeConfig.from_dict(stored)
    assert model_files(str(ckpt), layout=False) == before  # the layout is no part of the model its ranks measured
    again = ["--model", str(ckpt), "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--max-mask-num", "3",
             "--max-rows", "12", "--cache-len", "16", "--threads", "1", "--out", str(tmp_path / "tree"),
             "--write-adapter"]
    assert main([*again, "--dynamic"])["dynamic"]["tree"] == "dynamic"  # its ranks still the checkpoint's
    full_checkpoint(ckpt, seed=1)  # retrained in place: the same path, other weights
    with pytest.raises(ValueError, match="has changed since .*run space-probe on it again"):
        main(again)
    with pytest.raises(SystemExit) as info:
        cli(["--model", "tiny-random-llama", "--ranks", str(tmp_path / "probe" / "ranks.jsonl"), "--write-adapter"])
    assert info.value.code == 2 and "needs --adapter, or a full SAR-SFT checkpoint" in capsys.readouterr().err


def test_auto_measures_a_trunk_of_another_dtype_than_its_stored_curve(monkeypatch):
    """``auto`` on a GPU takes a stored curve of the run's setup, dtype included: a bf16 trunk priced by
    an fp32 curve of the same device is measured at load (the dtype left out of that check kept the
    fp32 curve). The meta device stands for the GPU, the measurement is stubbed."""
    import space.eval.step_cost as ts

    monkeypatch.setattr(ts, "AUTO_MEASURED", ("meta",))
    monkeypatch.setattr(ts, "measure_step_cost", lambda model, max_rows, cache_len=300, graphs=None: {
        "step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.5, "seconds": 1.0})
    model = torch.nn.Linear(1, 1, device="meta", dtype=torch.bfloat16)
    model.config = type("Config", (), {"max_position_embeddings": 2048})()
    stored = {"threads": torch.get_num_threads(), "kernels": "stock", "device": "meta", "capture": False,
              "trunk": "unfused"}
    decode = DecodeConfig(3, 4, tree="dynamic")
    assert ts.price_at_load(model, decode, {**stored, "dtype": "bfloat16"}, "auto", "stock")[0] == decode
    priced, how = ts.price_at_load(model, decode, {**stored, "dtype": "float32"}, "auto", "stock")
    assert priced.step_cost == ((1, 2.0), (32, 3.0)) and how["measured"] == "at load" and how["dtype"] == "bfloat16"


def test_ranks_recorded_before_the_models_files_are_taken_as_its(tmp_path):
    """Ranks of a model folder written before space-probe recorded the folder's files (no
    ``model_files`` in their meta) are checked by the model's name alone, as before: comparing the
    missing fingerprint refused every such file. Recorded files that differ are still refused."""
    from space.eval.resume import model_files
    from space.eval.tree_search import check_ranks_source
    from tests.conftest import full_checkpoint

    ckpt = str(full_checkpoint(tmp_path / "full"))
    older = {"model": ckpt, "adapter": None, "adapter_sha256": None, "mask_num": 3}
    check_ranks_source(older, tmp_path / "ranks.jsonl", ckpt, None)
    check_ranks_source({**older, "model_files": model_files(ckpt, layout=False)}, tmp_path / "ranks.jsonl", ckpt, None)
    with pytest.raises(ValueError, match="has changed since"):
        check_ranks_source({**older, "model_files": "0" * 64}, tmp_path / "ranks.jsonl", ckpt, None)
