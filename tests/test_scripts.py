"""Smoke tests of the benchmark scripts (scripts/*.py) on the CPU at tiny sizes: each runs in this
process through its own ``main`` and writes what its docs promise, so an API change in ``space``
that breaks a script fails here, not on a rented GPU.

``scripts/gpu_check.sh`` is read for its ``gpu_bench.py`` and ``bench_compile.py`` command lines
(and g58b's ``space.eval`` ones, which must pass space-eval's own checks): every one must parse (on a machine without CUDA, ``gpu_bench.py`` stops right after parsing with
its one "needs a CUDA GPU" error), and those of the issue 58 phases (g58a, g58b) and real2 run
here as they are, only shrunk (``--shape tiny``, fewer rows of cache, prompts and tokens,
``--device cpu``). Only the fields and that the numbers are finite are checked, never a timing.
Not covered here: the CUDA-only parts (graph replay, the profiler's kernel times, peak memory,
cuDNN attention itself: only the profiler attributes gpu_bench reads are checked), ``gpu_bench.py
--compile`` (about 45 s of inductor per run on this CPU, even at the tiny shape; ``bench_compile.py``
compiles the tiny trunk once instead) and ``bench_host.py`` (it trains its drafter for about 20 s).
``reproduce_table1.py`` and ``sweep_recipes.py`` have their own tests (test_cli.py, test_sweep.py).
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "adapters" / "smollm2-135m-space"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


def load_script(name: str):
    """scripts/<name>.py as a fresh module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_as_main(name: str, argv: list[str], monkeypatch) -> None:
    """scripts/<name>.py run as ``__main__`` with ``argv`` (for the scripts whose main() reads sys.argv)."""
    path = ROOT / "scripts" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *map(str, argv)])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:  # a script under space.cli.console exits 0 on success
        if e.code not in (0, None):
            raise


def finite_numbers(obj) -> list[float]:
    """Every int or float inside ``obj`` (bools left out), asserting each is finite."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        assert math.isfinite(obj), obj
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj
    return [x for v in values for x in finite_numbers(v)]


def positive_curve(curve: dict, rows: list[int]) -> None:
    assert [str(q) for q in curve] == [str(q) for q in rows]
    assert all(v > 0 for v in finite_numbers(curve))


@pytest.fixture(autouse=True)
def _one_thread_and_sdpa_flags():
    """One thread (2 shared cores), and the process-wide SDPA switches as they were (gpu_bench's
    --cudnn-sdp and choose_sdpa set them)."""
    threads = torch.get_num_threads()
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "math", "cudnn")}
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for name, on in flags.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    """A frozen-base adapter of tiny-random-llama (random LoRA) carrying the shipped adapter's
    tuned layout (dynamic tree + lookup, its step-cost curves): what the shipped adapter makes the
    scripts do, on a model that decodes in milliseconds."""
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=3)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    shipped = json.loads((SHIPPED / "space_config.json").read_text())
    assert shipped["mask_num"] == 3
    path = save_artifact(tmp_path_factory.mktemp("adapter") / "tiny", peft_model, tok, spec, "frozen-base",
                         {"base_model": "tiny-random-llama"})
    config = json.loads((path / "space_config.json").read_text())
    config.update({k: shipped[k] for k in ("decode", "step_cost_setup", "step_costs") if k in shipped})
    (path / "space_config.json").write_text(json.dumps(config, indent=1))
    return path


# ---- scripts/gpu_check.sh's command lines ----


def gpu_check_commands(script: str, sh: Path = GPU_CHECK) -> list[tuple[str, list[str]]]:
    """(phase, argv) of every ``python3 scripts/<script>.py`` line in ``sh`` (gpu_check.sh),
    continuation lines joined, bash arrays (``"${bench[@]}"``) expanded, quotes as
    bash reads them, a redirection or ``&`` and what follows it left out."""
    text = sh.read_text().replace("\\\n", " ")
    arrays = {m[1]: m[2] for m in re.finditer(r"^(\w+)=\((.*)\)\s*$", text, re.M)}
    out, phase = [], None
    for line in text.splitlines():
        if m := re.search(r'\[ "\$phase" = (\w+) \]', line):
            phase = m[1]
        if re.match(r"\w+=\(", line):  # an array's definition, used below
            continue
        for name, body in arrays.items():
            line = line.replace(f'"${{{name}[@]}}"', body)
        if m := re.search(rf"python3 scripts/{script}\.py (.*)", line):
            argv = shlex.split(m[1])
            ends = [i for i, a in enumerate(argv) if a in (">", "&", "2>&1", "}") or a.startswith(">")]
            out.append((phase, argv[:ends[0]] if ends else argv))
    assert out, f"no {script}.py command in {sh.name}"
    return out


def with_flags(argv: list[str], **flags) -> list[str]:
    """``argv`` with each --flag's value replaced (flag_name -> value; None drops the flag and its
    value, True adds a bare flag) and missing ones appended."""
    argv = list(argv)
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if flag in argv:
            i = argv.index(flag)
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            del argv[i:i + 1 + has_value]
        if value is True:
            argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def local_paths(argv: list[str], tmp_path: Path, adapter: Path = SHIPPED) -> list[str]:
    """gpu_check.sh's $ADAPTER and $stash/... paths made local (outputs under tmp_path)."""
    return [str(adapter) if a == "$ADAPTER" else str(tmp_path / Path(a).name) if a.startswith("$stash") else a
            for a in argv]


GPU_BENCH = gpu_check_commands("gpu_bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the parse on a machine without CUDA")
@pytest.mark.parametrize("phase, argv", GPU_BENCH, ids=[f"{p}-{a[0]}-{i}" for i, (p, a) in enumerate(GPU_BENCH)])
def test_gpu_check_gpu_bench_lines_parse(phase, argv, tmp_path, capsys):
    """Every flag gpu_check.sh gives gpu_bench.py exists: the parse gets as far as the CUDA check."""
    with pytest.raises(SystemExit) as exc:
        load_script("gpu_bench").main(local_paths(argv, tmp_path))
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def g58(subcommand: str) -> list[tuple[str, list[str]]]:
    found = [(p, a) for p, a in GPU_BENCH if p in ("g58a", "g58b") and a[0] == subcommand]
    assert found, f"gpu_check.sh's g58 phases run no gpu_bench.py {subcommand}"
    return found


SDP_LINES = [a for _, a in g58("step-cost") if "--sdp" in a]
assert SDP_LINES, "g58a times no step-cost with --sdp (SDPA's math path against its default kernel)"
# with --profile too: how t60b profiled a captured SmolLM2-shaped step (results/gpu60)
STEP_COST = g58("step-cost") + [("profiled", with_flags(SDP_LINES[0], profile=True))]


@pytest.mark.parametrize("phase, argv", STEP_COST)
def test_gpu_bench_step_cost_as_g58a_runs_it(phase, argv, tmp_path):
    """g58a's step-cost (rows, --capture, --sdp, and with --profile) at the tiny shape: the eager and
    the captured curve per cache and SDPA choice (on the CPU StepGraphs runs its buffers through the
    eager trunk), capture seconds, and each curve's step profiles (on the CPU the ops' own times)."""
    profiled = "--profile" in argv
    argv = with_flags(local_paths(argv, tmp_path), shape="tiny", caches=16, repeats=2 if profiled else 1, device="cpu")
    out = load_script("gpu_bench").main(argv)
    rows = [int(r) for r in argv[argv.index("--rows") + 1].split(",")] if "--rows" in argv else None
    written = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
    assert written == json.loads(json.dumps(out))
    assert written["machine"]["device"] == "cpu" and written["shape"] == "tiny"
    sdp = argv[argv.index("--sdp") + 1] if "--sdp" in argv else "default"
    prefixes = {"default": [""], "math": ["math sdp, "], "both": ["", "math sdp, "]}[sdp]
    keys = [p + k for p in prefixes for k in ["16"] + (["captured, 16"] if "--capture" in argv else [])]
    assert sorted(written["curves"]) == sorted(keys)
    for key in keys:
        positive_curve(written["curves"][key], rows or [int(q) for q in written["curves"][key]])
    assert list(written["seconds"]) == [p + "16" for p in prefixes]
    if "--capture" in argv:
        assert list(written["capture_s"]) == [p + "16" for p in prefixes] and min(written["capture_s"].values()) >= 0
    assert ("profiles" in written) == profiled
    if profiled:
        assert sorted(written["profiles"]) == sorted(keys)
        for key in keys:
            assert list(written["profiles"][key]) == list(written["curves"][key])
            for prof in written["profiles"][key].values():
                kernels = prof["kernels"]
                # (which ops: a difference of two CPU runs at the tiny shape is mostly noise here)
                assert "other" in kernels and len(kernels) <= 9 and all(t >= 0 for t in finite_numbers(kernels))
                # the busy time is the named ops' and the rest's
                assert prof["busy_ms"] == pytest.approx(sum(kernels.values()) / 1e3, abs=2e-3)


def check_host_time(written: dict, argv: list[str]) -> None:
    layouts = argv[argv.index("--layouts") + 1].split(",") if "--layouts" in argv else None
    cudnn = argv[argv.index("--cudnn-sdp") + 1] if "--cudnn-sdp" in argv else "load"
    gqa = argv[argv.index("--gqa") + 1] if "--gqa" in argv else "fold"
    suffixes = [c + g for c in {"both": [", cudnn sdp on", ", cudnn sdp off"], "on": [", cudnn sdp on"],
                                "off": [", cudnn sdp off"], "load": [""]}[cudnn]
                for g in {"both": [", gqa fold", ", gqa copy"], "copy": [", gqa copy"], "fold": [""]}[gqa]]
    if layouts:
        assert list(written["layouts"]) == [name + s for name in layouts for s in suffixes]
    assert "cudnn_sdp" in written["sdpa_at_load"]
    for key, entry in written["layouts"].items():
        assert set(entry) == {"median_step_ms", "mean_step_ms", "gpu_busy_ms_per_step", "host_share",
                              "tokens_per_step", "steps", "mean_rows", "tokens_per_s", "warm_s",
                              "attention_kernels"}, key
        finite_numbers(entry)
        assert entry["median_step_ms"] > 0 and entry["mean_step_ms"] > 0 and entry["tokens_per_s"] > 0, key
        assert entry["steps"] > 0 and entry["tokens_per_step"] >= 1 and entry["mean_rows"] >= 1, key
        assert entry["gpu_busy_ms_per_step"] == 0 and entry["host_share"] == 1  # no GPU here
    if layouts and "ar" in layouts:
        assert all(written["layouts"]["ar" + s]["mean_rows"] == 1 for s in suffixes)


@pytest.mark.parametrize("phase, argv", [  # the real SmolLM2's: slow, as every test that loads it
    pytest.param(p, a, marks=[pytest.mark.slow] if "--adapter" in a else [], id=p) for p, a in g58("host-time")])
def test_gpu_bench_host_time_as_g58_runs_it(phase, argv, tmp_path, monkeypatch):
    """g58a's host-time (SmolLM2's shape -> tiny; layouts, --gqa both) and g58b's (the real SmolLM2
    with the shipped adapter, bf16, its shipped layout), with 2 prompts x 4 new tokens."""
    argv = with_flags(local_paths(argv, tmp_path), prompts=2, new_tokens=4, device="cpu")
    if "--adapter" in argv:  # g58b: the real model (bf16 is slow on this CPU: one prompt is timed twice)
        argv = with_flags(argv, prompts=1, new_tokens=3)
    else:
        argv = with_flags(argv, shape="tiny", prompt_len=8)
    bench = load_script("gpu_bench")
    bench.main(argv)
    written = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
    assert written["machine"]["device"] == "cpu" and "partial" not in written
    assert written["new_tokens"] == int(argv[argv.index("--new-tokens") + 1])
    check_host_time(written, argv)
    if "--adapter" in argv:
        return
    # a stage cut at its time cap keeps the layouts it timed: here the third timing stops the run
    real, timed = bench.host_time, []

    def cut(*a, **k):
        if len(timed) == 2:
            raise KeyboardInterrupt
        timed.append(1)
        return real(*a, **k)

    monkeypatch.setattr(bench, "host_time", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(with_flags(argv, out=str(tmp_path / "cut.json")))
    kept = json.loads((tmp_path / "cut.json").read_text())
    assert kept["partial"] is True and kept["machine"]["device"] == "cpu"
    assert list(kept["layouts"]) == list(written["layouts"])[:2]


TRAIN = [(p, a) for p, a in GPU_BENCH if a[0] == "train"]


@pytest.mark.filterwarnings("error:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("checkpointing", [None, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("phase, argv", TRAIN, ids=[a[a.index("--mode") + 1] for _, a in TRAIN])
def test_gpu_bench_train_tiny(phase, argv, checkpointing, tmp_path):
    """phase1's train lines (frozen-base, full) at the tiny shape, with and without activation
    checkpointing (recorded): losses finite, throughput positive."""
    argv = with_flags(local_paths(argv, tmp_path), shape="tiny", batch=1, seq_len=64, steps=3, mask_num=3, spans=2,
                      device="cpu", checkpointing=checkpointing)
    load_script("gpu_bench").main(argv)
    written = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
    assert written["mode"] == argv[argv.index("--mode") + 1] and written["peak_memory_gib"] is None
    assert written["activation_checkpointing"] is bool(checkpointing)
    assert len(written["losses"]) == 3 and all(x > 0 for x in finite_numbers(written["losses"]))
    assert written["median_step_s"] > 0 and written["real_tokens_per_s"] > 0 and written["params"] > 0


def test_gpu_bench_profiler_api_it_reads_on_cuda():
    """gpu_busy_ms reads the profiler's events (device_type, time_range.elapsed_us(), name) only
    on a GPU: the same attributes exist on a CPU profile, so a torch upgrade that renames them
    shows here."""
    from torch.profiler import ProfilerActivity, profile

    assert hasattr(torch.autograd.DeviceType, "CUDA")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    events = list(prof.events())
    assert events
    for e in events:
        assert isinstance(e.name, str) and e.device_type == torch.autograd.DeviceType.CPU
        assert e.time_range.elapsed_us() >= 0
    for name in ("max_memory_allocated", "reset_peak_memory_stats", "synchronize", "get_device_name", "empty_cache"):
        assert callable(getattr(torch.cuda, name)), name
    assert callable(torch.backends.cuda.cudnn_sdp_enabled) and callable(torch.backends.cuda.enable_cudnn_sdp)


# ---- gpu_check.sh g58b's space-eval lines ----


def space_eval_lines(phase: str, sh: Path = GPU_CHECK) -> list[list[str]]:
    """The argv of every ``python3 -m space.eval`` line of ``phase`` in ``sh``, continuation lines
    joined, the phase's own bash arrays (``"${common[@]}"``) and variables (``"$NAME"``) expanded."""
    text = sh.read_text().replace("\\\n", " ")
    found, here, names = [], None, {}
    for line in text.splitlines():
        if m := re.search(r'\[ "\$phase" = (\w+) \]', line):
            here, names = m[1], {}
        if here != phase:
            continue
        if m := re.match(r"\s*(\w+)=\((.*)\)\s*$", line):
            names[m[1]] = shlex.split(m[2])
        elif m := re.match(r"\s*([A-Z_]+)=(\S+)\s*$", line):
            names[m[1]] = [m[2]]
        elif m := re.search(r"python3 -m space\.eval (.*)", line):
            argv = []
            for arg in shlex.split(m[1]):
                ref = re.fullmatch(r"\$\{(\w+)\[@\]\}|\$(\w+)", arg)
                name = ref and (ref[1] or ref[2])
                argv += names[name] if name in names else [arg]
            found.append(argv)
    assert found, f"no space.eval line in {sh.name}'s {phase}"
    return found


G58B_EVAL = space_eval_lines("g58b")


@pytest.mark.parametrize("argv", G58B_EVAL, ids=[a[a.index("--out") + 1].rsplit("/", 1)[-1] for a in G58B_EVAL])
def test_gpu_check_g58b_space_eval_lines_parse(argv, tmp_path):
    """Every g58b space-eval line passes space-eval's own checks (``--device cpu`` here), and its
    ``--datastore`` sets are ones gpu_pack.sh copies into .gpu2/distill/ from data/distill/.
    Catches a misspelt flag, a flag space-eval refuses with another (``--datastore`` without the
    space method, ``--capture`` with ``--compile``), and a set that does not travel."""
    from space.decoding.datastore import set_paths
    from space.eval.__main__ import build_parser, check_args

    local = [str(SHIPPED) if a == "$ADAPTER" else str(tmp_path / "out") if a.startswith("$stash") else a
             for a in with_flags(argv, device="cpu")]
    args = build_parser().parse_args(local)
    check_args(args)
    assert args.dataset == "humaneval" and args.max_new_tokens == 128
    if args.datastore:
        pack = (ROOT / "scripts" / "gpu_pack.sh").read_text()
        for path in set_paths(args.datastore):
            assert path.parent == Path(".gpu2/distill"), path
            assert (ROOT / "data" / "distill" / path.name).is_file(), path.name
            assert f"data/distill/{path.name}" in pack and ".gpu2/distill/" in pack, path.name


def test_gpu_check_g58b_times_the_datastore_on_the_captured_questions():
    """g58b's datastore run decodes the first questions of its captured fp32 run, SPACE alone, so
    their tokens/step and tokens/s compare question for question."""
    by_out = {a[a.index("--out") + 1].rsplit("/", 1)[-1]: a for a in G58B_EVAL}
    store, plain = by_out["eval_humaneval_capture_fp32_datastore"], by_out["eval_humaneval_capture_fp32"]
    assert "--datastore" in store and "--datastore" not in plain
    for flag in ("--capture-len", "--dataset", "--max-new-tokens"):
        assert store[store.index(flag) + 1] == plain[plain.index(flag) + 1], flag
    assert int(store[store.index("--limit") + 1]) <= int(plain[plain.index("--limit") + 1])  # its first questions
    assert store[store.index("--methods") + 1] == "space"


# ---- bench_compile.py (gpu_check.sh real2 / real3) and bench_ops.py ----

BENCH_COMPILE = gpu_check_commands("bench_compile")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the parse on a machine without CUDA")
@pytest.mark.parametrize("phase, argv", BENCH_COMPILE, ids=[p for p, _ in BENCH_COMPILE])
def test_gpu_check_bench_compile_lines_parse(phase, argv, tiny_adapter, tmp_path):
    """Every bench_compile.py line of gpu_check.sh parses and passes the script's own checks: it
    stops only where it first needs CUDA, at ``load_space``'s device check (a CPU build of torch and
    a CUDA build on a machine without a GPU alike)."""
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU is usable here"):
        load_script("bench_compile").main(local_paths(argv, tmp_path, tiny_adapter))


def test_bench_compile_as_real2_runs_it(tiny_adapter, tmp_path):
    """real2's bench_compile line (eager against compiled, AR, PLD and SPACE) on the tiny adapter:
    compile.json's speeds, exactness and compile warm-up, and compile.md."""
    real2 = [a for p, a in gpu_check_commands("bench_compile") if p == "real2"]
    assert real2
    argv = with_flags(local_paths(real2[0], tmp_path, tiny_adapter), device="cpu", threads=1, prompts=1,
                      max_new_tokens=4)
    load_script("bench_compile").main(argv)
    out = Path(argv[argv.index("--out") + 1])
    written = json.loads((out / "compile.json").read_text())
    setups = argv[argv.index("--setups") + 1].split(",")
    methods = argv[argv.index("--methods") + 1].split(",")
    assert sorted(written["tokens_per_s_median"]) == sorted(f"{s}/{m}" for s in setups for m in methods)
    assert all(v > 0 for v in finite_numbers(written["tokens_per_s_median"]))
    assert written["space_equals_ar"] == {s: True for s in setups}
    assert set(written["compiled_over_eager"]) == set(methods) and set(written["space_vs_pld"]) == set(setups)
    assert written["compile_warmup_s"] > 0 and written["graphs"]["warm_up"] >= 1
    assert written["step_cost_ms"] == {}  # --rows ""
    assert written["layout"]["tree"] == "dynamic"  # the adapter's tuned layout
    assert "| compiled |" in (out / "compile.md").read_text()


def test_bench_compile_eager_static_with_curve(tiny_adapter, tmp_path):
    """The eager setups (growing and preallocated cache) with a step-cost curve and the chain layout."""
    out = tmp_path / "static"
    written = load_script("bench_compile").main(
        ["--adapter", str(tiny_adapter), "--threads", "1", "--prompts", "1", "--max-new-tokens", "4", "--rows", "1,2",
         "--setups", "eager,eager-static", "--methods", "ar,space", "--layout", "chain", "--out", str(out)])
    assert json.loads((out / "compile.json").read_text()) == json.loads(json.dumps(written))
    assert written["space_equals_ar"] == {"eager": True, "eager-static": True}
    assert set(written["static_over_dynamic_cache_eager"]) == {"ar", "space"}
    for setup in ("eager", "eager-static"):
        positive_curve(written["step_cost_ms"][setup], [1, 2])
    assert written["compile_warmup_s"] is None and written["layout"]["mask_num"] == 3


def test_bench_ops_cuda_attention_both_dtypes(tiny_adapter, tmp_path, monkeypatch):
    """bench_ops (its adapter fixed to the shipped one; the tiny one here) with transformers' SDPA
    (CUDA's path) in fp32 and bf16: ops per step for AR and the three layouts, their ratios."""
    ops = load_script("bench_ops")
    monkeypatch.setattr(ops, "ADAPTER", tiny_adapter)
    out = tmp_path / "ops.json"
    ops.main(["--prompts", "1", "--max-new-tokens", "4", "--dtype", "float32", "bfloat16", "--attention", "cuda",
              "--threads", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    names = ["AR", "chain", "static tree", "dynamic tree (shipped)"]
    assert list(written["ops_per_step"]) == names and list(written["bf16_over_fp32"]) == names
    for name in names:
        assert set(written["ops_per_step"][name]) == {"float32", "bfloat16"}
        assert all(v > 0 for v in finite_numbers(written["ops_per_step"][name]))
        assert all(v > 0 for v in finite_numbers(written["steps"][name]))
    assert written["over_ar"]["AR"] == {"float32": 1.0, "bfloat16": 1.0}
    assert written["attention"] == "cuda" and set(written["trunk"]) == {"float32", "bfloat16"}


def test_bench_ops_capture_counts_outside_the_graph(tiny_adapter, tmp_path, monkeypatch):
    """bench_ops --capture: PLD joins the methods, and each count leaves the trunk's forward out
    (the tiny trunk dispatches hundreds of ops a step; outside it AR dispatches 8)."""
    ops = load_script("bench_ops")
    monkeypatch.setattr(ops, "ADAPTER", tiny_adapter)
    out = tmp_path / "ops.json"
    ops.main(["--prompts", "1", "--max-new-tokens", "6", "--dtype", "float32", "--capture", "--threads", "1",
              "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["capture"] is True
    assert list(written["ops_per_step"]) == ["AR", "PLD", "chain", "static tree", "dynamic tree (shipped)"]
    assert 0 < written["ops_per_step"]["AR"]["float32"] <= 10  # 8 on torch 2.13
    assert all(0 < v["float32"] < 40 for v in written["ops_per_step"].values()), written["ops_per_step"]
    assert "index_copy_" not in written["by_op"]["AR"]["float32"]  # the trunk's cache writes: paused
    assert written["by_op"]["chain"]["float32"].get("sub_", 0) <= 1  # the crop: one op for every layer


def test_bench_ops_capture_counts_pld_at_space_eval_s_settings(tiny_adapter, tmp_path, monkeypatch):
    """--capture's PLD is space-eval --capture's: no mask group, HF's PLD_TOKENS candidates and
    PLD_NGRAM n-gram (catches the two swapped, which the op bounds above cannot tell)."""
    from space.eval.bench import PLD_NGRAM, PLD_TOKENS

    ops = load_script("bench_ops")
    monkeypatch.setattr(ops, "ADAPTER", tiny_adapter)
    made, real = [], ops.SpaceDecoder

    def recording(model, spec, config=None, **kw):
        made.append(config)
        return real(model, spec, config, **kw)

    monkeypatch.setattr(ops, "SpaceDecoder", recording)
    ops.main(["--prompts", "1", "--max-new-tokens", "6", "--dtype", "float32", "--capture", "--threads", "1",
              "--out", str(tmp_path / "ops.json")])
    pld = [c for c in made if c is not None and c.num_groups == 0]
    assert pld and all((c.lookup_tokens, c.lookup_ngram) == (PLD_TOKENS, PLD_NGRAM) for c in pld), pld


# ---- the CPU benchmarks ----


def test_bench_kernels(tiny_adapter, tmp_path):
    out = tmp_path / "kernels.json"
    load_script("bench_kernels").main(["--adapter", str(tiny_adapter), "--prompts", "1", "--max-new-tokens", "4",
                                       "--threads", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    for key in ("ar_tokens_per_s", "space_tokens_per_s"):
        assert set(written[key]) == {"stock", "fast"} and all(v > 0 for v in finite_numbers(written[key]))
    assert written["ar_same_tokens"] is True and written["ar_fast_over_stock"] > 0


@pytest.mark.parametrize("script, argv, keys", [
    ("bench_step_parts", ["--rows", "16", "--cache", "8", "--rounds", "1"], ("step_ms", "ratio", "kernels")),
    ("bench_packed_kernels", ["--rows", "1,4", "--cache", "8", "--rounds", "1"], ("step_ms", "chosen", "vs_mkl")),
])
def test_step_timing_scripts_on_the_tiny_adapter(script, argv, keys, tiny_adapter, tmp_path, monkeypatch):
    """bench_step_parts and bench_packed_kernels (their adapter fixed to the shipped one; the tiny
    one here, whose fast kernels pack as SmolLM2's do)."""
    module = load_script(script)
    monkeypatch.setattr(module, "ADAPTER", tiny_adapter)
    out = tmp_path / f"{script}.json"
    result = module.main([*argv, "--threads", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    for key in keys:
        assert written[key], key
    assert all(v > 0 for v in finite_numbers(written["step_ms"]))


def test_bench_collator(tmp_path):
    out = tmp_path / "collator.json"
    load_script("bench_collator").main(["--batch", "2", "--length", "64", "--repeats", "1", "--threads", "1",
                                        "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["current_ms"] > 0 and written["rows"] > 0 and written["mask_bytes"] > 0


def test_bench_decode_tiny(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    run_as_main("bench_decode", ["--model", "tiny-random-llama", "--cache", "8", "--repeats", "1", "--gen-tokens", "2",
                                 "--kernels", "stock", "--out", out], monkeypatch)
    written = json.loads(out.read_text())
    assert all(v > 0 for v in finite_numbers(written["latency_vs_query_tokens_ms"]))
    assert written["space_step_ms"] and all(r["needed_rows_ms"] > 0 for r in written["space_step_ms"])
    assert set(written["tokens_per_s"]) == {"ar_loop", "hf_generate", "space_untrained_k5"}
    # DESIGN §6: a result records what makes it (the seed of its random ids, dtype, device, tokens)
    assert (written["seed"], written["dtype"], written["device"], written["gen_tokens"]) == (0, "float32", "cpu", 2)


def test_bench_train_tiny(tmp_path, monkeypatch):
    out = tmp_path / "train.json"
    run_as_main("bench_train", ["--model", "tiny-random-llama", "--seq", "256", "--batch", "1", "--mask-num", "2",
                                "--spans", "2", "--repeats", "1", "--out", out], monkeypatch)
    written = json.loads(out.read_text())
    for mode in ("frozen-base", "full"):
        assert written[mode]["step_s"] > 0 and written[mode]["tokens_per_s"] > 0
    assert written["frozen_base_vs_full"] > 0
    with pytest.raises(SystemExit, match="only 0 of the first 200 LIMA rows fill --seq 32"):  # not max() of nothing
        run_as_main("bench_train", ["--model", "tiny-random-llama", "--seq", "32", "--batch", "1", "--mask-num", "2",
                                    "--out", tmp_path / "short.json"], monkeypatch)
    # some rows fill --seq, fewer than --batch: refused too (timed on fewer rows, tokens/s counted --batch rows)
    with pytest.raises(SystemExit, match=r"only [1-9]\d* of the first 200 LIMA rows fill --seq 256 .* --batch 1000"):
        run_as_main("bench_train", ["--model", "tiny-random-llama", "--seq", "256", "--batch", "1000",
                                    "--mask-num", "2", "--out", tmp_path / "few.json"], monkeypatch)


@pytest.mark.parametrize("flag", ["--prompts", "--max-new-tokens", "--top"])
def test_tune_layout_refuses_a_count_below_one(tmp_path, monkeypatch, capsys, flag):
    """Catches ``--prompts 0`` taking every example of the set (``[-0:]``): a run meant to be short
    decoded all 974 MBPP prompts with every layout."""
    with pytest.raises(SystemExit):
        run_as_main("tune_layout", ["--model", "tiny-random-llama", flag, "0", "--out", tmp_path / "t.json"], monkeypatch)
    assert f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("script, argv, said", [
    # each failed deep inside the run (StatisticsError, a torch RuntimeError, transformers' ValueError after
    # three sections were timed), or wrote nothing after the whole run (an --out under a file)
    ("bench_decode", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    ("bench_decode", ["--cache", "-5"], "argument --cache: must be an integer >= 1, got -5"),
    ("bench_decode", ["--gen-tokens", "0"], "argument --gen-tokens: must be an integer >= 1, got 0"),
    ("bench_decode", ["--out", "{tmp}/afile/bd.json"], "bd.json lies under the file"),
    ("bench_train", ["--out", "{tmp}"], "is a folder; name a file"),
    ("tune_layout", ["--mask-nums", "abc"], "argument --mask-nums: must be a comma list of integers >= 1, got 'abc'"),
    ("tune_layout", ["--lookup-tokens", "2,x"], "--lookup-tokens must be a comma list of integers >= 0, got '2,x'"),
    ("tune_layout", ["--mask-nums", "2,17"], "--mask-nums: mask_num (k) = 17 exceeds the maximum 16"),
])
def test_benchmark_scripts_refuse_bad_arguments_before_the_model_loads(script, argv, said, tmp_path, monkeypatch,
                                                                        capsys):
    import space.loader
    import space.models

    (tmp_path / "afile").write_text("")
    for module, name in ((space.models, "load_model"), (space.loader, "load_space")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit) as exit_info:
        run_as_main(script, ["--model", "tiny-random-llama", *(a.format(tmp=tmp_path) for a in argv)], monkeypatch)
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_tune_layout_tiny(tiny_adapter, tmp_path, monkeypatch):
    out = tmp_path / "tune.json"
    run_as_main("tune_layout", ["--model", "tiny-random-llama", "--adapter", tiny_adapter, "--prompts", "1",
                                "--max-new-tokens", "4", "--mask-nums", "2", "--lookup-tokens", "0,10",
                                "--kernels", "stock", "--out", out], monkeypatch)
    written = json.loads(out.read_text())
    assert written["ar_tokens_per_s"] > 0 and written["ranking"]
    assert all(r["tokens_per_s"] > 0 and "decode" in r for r in written["ranking"])


# ---- the scripts over committed results (read only) ----


def test_compare_planners_on_committed_runs(monkeypatch, capsys):
    runs = sorted((ROOT / "results" / "planner_issue44").glob("*mt-bench5"))
    assert runs
    run_as_main("compare_planners", [*runs, "--adapter", SHIPPED], monkeypatch)
    printed = capsys.readouterr().out
    assert printed.count("tokens/step") >= len(runs) and "tokens per AR-step of modelled cost" in printed


def test_compare_planners_prices_each_run_by_the_curve_it_was_planned_with(capsys):
    """Without --adapter a run's rows are priced by the step-cost curve its run_config.json records
    (this Zen 4's; the adapter's default curve is another machine's). Catches every run priced by
    the adapter's default curve, which put the datastore runs' figures 0.03-0.15 lower."""
    from space.decoding.dynamic import StepCost

    script = load_script("compare_planners")
    run = ROOT / "results" / "datastore" / "turns" / "humaneval40_new_r2"
    recorded = json.loads((run / "run_config.json").read_text())
    script.main([str(run)])
    said = capsys.readouterr().out
    assert script.describe(run, StepCost(tuple(map(tuple, recorded["step_cost"])), recorded["adapter_cost"])) in said
    assert "tokens per AR-step of modelled cost 2.305" in said
    script.main([str(run), "--adapter", str(ROOT / SHIPPED)])
    assert "tokens per AR-step of modelled cost 2.305" not in capsys.readouterr().out


def test_compare_planners_counts_the_questions_the_summary_counts(tmp_path, monkeypatch):
    """A space-eval run can hold skipped records, and a question skipped for one method leaves every
    method's numbers (``space.eval.report.summarize``). The script read every SPACE record's choices
    (a KeyError on a skipped one) and counted questions the summary's PLD figures beside it did not."""
    from space.decoding.dynamic import StepCost
    from space.jsonl import read_jsonl

    run = ROOT / "results" / "planner_issue44" / "new_mt-bench5"
    script = load_script("compare_planners")
    decode = json.loads((ROOT / SHIPPED / "space_config.json").read_text())["decode"]
    cost = StepCost(tuple(map(tuple, decode["step_cost"])), decode.get("adapter_cost", 0.0))
    rows = read_jsonl(run / "samples.jsonl")
    first = next(r["question_id"] for r in rows if r["model_id"] == "space")
    summary = json.loads((run / "summary.json").read_text())
    summary["skipped"] = {"count": 2, "questions": {first: "pld: turn 2's prompt ...", "late": "turn 2 ..."}}
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "summary.json").write_text(json.dumps(summary))
    late = {"question_id": "late", "category": "c", "model_id": "space", "skipped": "turn 2 ..."}
    (copy / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, late]))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "summary.json").write_text(json.dumps(summary))
    (kept / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["question_id"] != first))
    assert script.describe(copy, cost).split(": ", 1)[1] == script.describe(kept, cost).split(": ", 1)[1]
    assert script.describe(copy, cost) != script.describe(run, cost).replace(str(run), str(copy))


def test_compare_planners_counts_only_the_questions_of_the_last_summary(tmp_path):
    """A rerun with a smaller --limit rewrites summary.json over fewer questions while samples.jsonl
    keeps the earlier run's (by design: resumable). Catches counting every record: the SPACE line
    covered other questions than the summary's PLD figures printed beside it."""
    from space.decoding.dynamic import StepCost
    from space.eval.report import summarize
    from space.jsonl import read_jsonl

    run = ROOT / "results" / "planner_issue44" / "new_mt-bench5"
    script = load_script("compare_planners")
    decode = json.loads((ROOT / SHIPPED / "space_config.json").read_text())["decode"]
    cost = StepCost(tuple(map(tuple, decode["step_cost"])), decode.get("adapter_cost", 0.0))
    rows = read_jsonl(run / "samples.jsonl")
    first_two = list(dict.fromkeys(r["question_id"] for r in rows))[:2]
    few = [r for r in rows if r["question_id"] in first_two]
    summary = summarize(few, json.loads((run / "summary.json").read_text())["meta"])
    assert summary["questions"] == first_two
    for name, samples in (("all", rows), ("few", few)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        (tmp_path / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    said = [script.describe(tmp_path / name, cost).split(": ", 1)[1] for name in ("all", "few")]
    assert said[0] == said[1]
    assert said[1] != script.describe(run, cost).split(": ", 1)[1]


def test_compare_drafters_on_committed_ranks(tmp_path):
    ranks = [ROOT / "results" / "sweep" / arm / "ranks.jsonl" for arm in ("k3", "mode_lora")]
    out = tmp_path / "drafters.json"
    load_script("compare_drafters").main([*map(str, ranks), "--sources", "all", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written and all(v >= 0 for v in finite_numbers(written))
    assert json.dumps(written).count('"tokens_per_step"') >= 2


def test_compare_drafters_skips_a_layout_deeper_than_the_drafter_and_a_missing_source(tmp_path):
    """A k = 3 drafter's ranks under a k = 5 layout, and a source the file lacks. Catches replaying
    them anyway: the k = 5 row showed the k = 3 chain's figure under the k = 5 name (a committed
    comparison held one), and a missing source showed 0 tokens/step."""
    ranks = tmp_path / "ranks.jsonl"
    row = {"source": "mbpp", "ranks": [[0, 0, 1], [0, 1, 0], [2, 0, 0], [0, 0, -1]]}
    ranks.write_text(json.dumps(row) + "\n")
    out = tmp_path / "drafters.json"
    table = load_script("compare_drafters").main([str(ranks), "--sources", "mbpp,lima", "--out", str(out)])
    assert json.loads(out.read_text()) == table
    assert table["chain k=5, 6 groups"]["mbpp"][str(ranks)] == {"skipped": "the ranks hold 3 offsets, the layout needs 5"}
    assert table["chain k=3, 4 groups"]["mbpp"][str(ranks)]["tokens_per_step"] > 1
    assert all(v[str(ranks)] == {"skipped": "no sample of source 'lima'"} for v in (t["lima"] for t in table.values()))
    from space.decoding.tree import replay

    with pytest.raises(ValueError, match="the ranks hold 3 offsets; a layout with mask_num 5 needs 5"):
        replay([torch.tensor(row["ranks"])], 5, 6, None)


def test_replay_lookup_by_hand_and_on_a_committed_run(tmp_path):
    """By hand: "1 2" recurs with "3 4 ..." first and "7 8 ..." last; the answer goes on with 7 8 9.
    One branch (PLD's first occurrence) takes 2 steps, two branches 1; how often each source's
    first and later tokens were right is counted by source. On a committed run's AR answers the
    first branch alone replays to PLD's own tokens/step in that run (same answers)."""
    script = load_script("replay_lookup")
    pair = [([1, 2, 3, 4, 1, 2, 7, 8, 1, 2], [7, 8, 9])]
    # step 1 offers 3 4 1 2 7 8 1 2 (wrong); step 2, after 7, offers 8 1 2 7 (8 right, then 1 wrong)
    assert script.replay(pair, 1, 10, 2) == {"steps": 2, "tokens": 3, "tokens_per_step": 1.5,
                                             "right": {"text": {"first": 0.5, "later": 0.0}}}
    # two branches: 3 4 ... wrong, then 7 8 1 2: 7 and 8 right, 1 wrong (the answer's 9)
    assert script.replay(pair, 2, 10, 2) == {"steps": 1, "tokens": 3, "tokens_per_step": 3.0,
                                             "right": {"text": {"first": 0.5, "later": 0.5}}}
    from space.decoding.datastore import Datastore  # what the text lacks, a datastore's answer holds

    fresh, store = [([5, 6, 1, 2, 3], [4, 9, 9])], Datastore([[1, 2, 3, 4, 9, 9, 0]])
    assert script.replay(fresh, 4, 10, 2)["steps"] == 3 and script.replay(fresh, 4, 10, 2, store, 1)["steps"] == 1
    assert script.replay(fresh, 4, 10, 2, store, 1)["right"] == {"datastore": {"first": 1.0, "later": 1.0}}
    run = ROOT / "results" / "humaneval40_zen4_frozen"
    out = tmp_path / "replay.json"
    table = script.main([str(run), "--branches", "1,4", "--out", str(out)])
    one, four = table[str(run)][1]["tokens_per_step"], table[str(run)][4]["tokens_per_step"]
    pld = json.loads((run / "summary.json").read_text())
    assert json.loads(out.read_text())["tokens_per_step"][str(run)]["1"]["tokens_per_step"] == one
    assert abs(one - pld["methods"]["pld"]["tokens_per_step"]) < 0.01 and four > one


def test_replay_lookup_emits_no_token_past_the_answers_end():
    """A step whose continuation holds the whole rest of the answer emits that rest, not one token more
    (the bonus token lies past the answer's end): the over-count inflated tokens/step on every answer a
    lookup finished."""
    from space.decoding.datastore import Datastore

    script = load_script("replay_lookup")
    fresh, store = [([5, 6, 1, 2, 3], [4, 9, 9])], Datastore([[1, 2, 3, 4, 9, 9, 0]])
    assert script.replay(fresh, 4, 10, 2, store, 1)["tokens"] == 3  # the answer's 3, in one step
    assert script.replay([([1, 2, 3, 1, 2], [3])], 1, 10, 2) == {
        "steps": 1, "tokens": 1, "tokens_per_step": 1.0, "right": {"text": {"first": 1.0, "later": None}}}


def test_compare_planners_refuses_a_run_without_a_curve(tmp_path, capsys):
    """A static layout's run records no step-cost curve: without --adapter it is a usage error naming
    the run (not a TypeError traceback on its missing curve)."""
    run = tmp_path / "static_run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"tree": None, "step_cost": None}))
    with pytest.raises(SystemExit) as info:
        load_script("compare_planners").main([str(run)])
    assert info.value.code == 2 and f"{run} records no step-cost curve" in capsys.readouterr().err


def test_plot_mask_accuracy(tmp_path, capsys):
    png = tmp_path / "acc.png"
    load_script("plot_mask_accuracy").main([str(ROOT / "results/sweep/token_targets/log_history.json"), str(png),
                                            "--tokens-per-epoch", "1000"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final accuracy j=0" in capsys.readouterr().out


def test_gpu_bench_takes_the_toolkit_s_dtype_names(tmp_path):
    """--dtype bf16, as space-eval spells it: it failed with an AttributeError traceback."""
    out = tmp_path / "s.json"
    load_script("gpu_bench").main(["step-cost", "--shape", "tiny", "--rows", "1", "--caches", "16", "--repeats", "1",
                                   "--dtype", "bf16", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        load_script("gpu_bench").main(["step-cost", "--dtype", "bf17"])


def test_g58_stage_caps_fit_a_call_and_the_device_time():
    """A call is cut at 600 s (what it had not packed is lost) and a session has 900 s of device
    time, its start included. Catches g58b's caps summing to a whole call (convert 150 + 450) and
    g58a + g58b to 1,010 s."""
    text = GPU_CHECK.read_text()

    def caps(phase):
        body = text.split(f'"$phase" = {phase} ]; then', 1)[1].split("\nel", 1)[0]
        if "join_model" in body:
            lib = (GPU_CHECK.parent / "gpu_lib.sh").read_text()
            body += lib.split("join_model() {", 1)[1].split("\n}", 1)[0]
        return sum(int(n) for n in re.findall(r"\bstage \w+ (\d+) ", body))

    assert caps("g58a") <= 540 and caps("g58b") <= 540
    assert caps("g58a") + caps("g58b") <= 800


def test_bench_ops_count_weighs_each_prompt_by_its_steps_and_skips_one_step_prompts():
    """count() over prompts of 3 steps of 2 ops and 1 step of 4 ops: 10 ops in 4 steps, by op as
    many; a prompt whose first step was its only one (an end of sequence at once) is left out.
    Catches by_op summing each prompt's per-step mean unweighted, and a one-mark prompt reaching
    per_step_by_op (a ValueError ended the run)."""
    ops = load_script("bench_ops")
    x = torch.ones(4)

    def generate(ids, max_new, on_tokens):
        if on_tokens is None:  # the warm-up
            return
        on_tokens()
        for _ in range(ids["steps"]):
            for _ in range(ids["adds"]):
                x.add(1)
            on_tokens()

    per_step, steps, by_op = ops.count(generate, [{"steps": 3, "adds": 2}, {"steps": 1, "adds": 4},
                                                  {"steps": 0, "adds": 0}])
    assert steps == 4 and per_step == pytest.approx(10 / 4)
    assert sum(by_op.values()) == pytest.approx(10)
    with pytest.raises(ValueError, match="every prompt took a single step"):  # was a ZeroDivisionError
        ops.count(generate, [{"steps": 0, "adds": 0}])


def test_gpu_check_g58b_times_spaces_layout_before_ar():
    """g58b's bf16 host-time was cut at its cap after AR's two cuDNN settings, before SPACE's (the
    comparison the stage is for): the shipped layout now comes first."""
    line = next(a for p, a in g58("host-time") if p == "g58b")
    assert line[line.index("--layouts") + 1].split(",")[0] == "shipped"


def test_gpu_bench_step_cost_cut_at_its_cap_keeps_the_curves_it_timed(tmp_path, monkeypatch):
    """A step-cost stage cut at its cap (g58a) kept nothing: each curve is now written as it comes,
    marked partial, as host-time keeps its layouts. Catches dropping that write or its mark."""
    import space.eval.step_cost as step_cost

    real, timed = step_cost.step_cost_curve, []

    def cut(*a, **k):
        if timed:
            raise KeyboardInterrupt
        timed.append(1)
        return real(*a, **k)

    monkeypatch.setattr(step_cost, "step_cost_curve", cut)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        load_script("gpu_bench").main(["step-cost", "--shape", "tiny", "--rows", "1,2", "--caches", "16,24",
                                       "--repeats", "1", "--device", "cpu", "--out", str(out)])
    kept = json.loads(out.read_text())
    assert kept["partial"] is True and list(kept["curves"]) == ["16"] and kept["machine"]["device"] == "cpu"


def test_bench_decode_times_the_same_ids_for_a_seed(tmp_path, monkeypatch):
    """--seed fixes the random token ids the steps are timed on, whatever ran before, and is recorded
    with the run's repeats (catches the seed recorded but never set, and the defaults recorded)."""
    drawn = []
    real = torch.randint

    def randint(*a, **k):
        drawn.append(real(*a, **k))
        return drawn[-1]

    monkeypatch.setattr(torch, "randint", randint)
    firsts = []
    for before in (1, 2):
        torch.manual_seed(before)
        firsts.append(len(drawn))  # the run's first draw: its cache's prefix
        run_as_main("bench_decode", ["--model", "tiny-random-llama", "--cache", "8", "--repeats", "1", "--gen-tokens",
                                     "1", "--kernels", "stock", "--seed", "3", "--out", tmp_path / f"{before}.json"],
                    monkeypatch)
    first, second = (drawn[i] for i in firsts)
    assert first.shape == (8,) and torch.equal(first, second)
    written = json.loads((tmp_path / "2.json").read_text())  # what it was run with, not the defaults
    assert (written["seed"], written["repeats"], written["gen_tokens"], written["cache"]) == (3, 1, 1, 8)


def test_gpu_bench_host_time_refuses_the_gqa_comparison_on_a_compiled_trunk(tmp_path):
    """``--gqa copy`` / ``both`` switch an eager trunk's attention; a compiled trunk keeps
    transformers' own ``sdpa``, so its "fold" timing would be the copy's under another name:
    refused before any model loads."""
    bench = load_script("gpu_bench")
    with pytest.raises(SystemExit, match="drop --compile"):
        bench.main(["host-time", "--shape", "tiny", "--gqa", "both", "--compile", "--device", "cpu",
                    "--out", str(tmp_path / "h.json")])
    assert not (tmp_path / "h.json").exists()


def test_gpu_bench_gqa_copy_runs_transformers_sdpa_and_restores_the_fold():
    """``host-time --gqa copy`` times what ran before the fold: inside ``gqa_path(model, "copy")``
    the model runs transformers' own ``sdpa`` and masks are built at their own width (no
    ``MASK_ALIGN``); on leaving it, also after an error, the model's attention and the alignment are
    back, so the next turn's ``fold`` times the fold. ``fold`` changes nothing. Catches a "copy"
    timing that still ran the fold (or aligned masks), and a fold turn left on ``sdpa``."""
    from space.decoding import backends
    from space.decoding.backends import SDPA_GQA
    from space.decoding.fused import fuse_trunk
    from space.models import tiny_random_llama

    bench = load_script("gpu_bench")
    model, _ = tiny_random_llama()
    fuse_trunk(model)
    align = dict(backends.MASK_ALIGN)
    assert model.config._attn_implementation == SDPA_GQA and align
    with bench.gqa_path(model, "fold"):
        assert model.config._attn_implementation == SDPA_GQA and backends.MASK_ALIGN == align
    with pytest.raises(KeyboardInterrupt), bench.gqa_path(model, "copy"):
        assert model.config._attn_implementation == "sdpa" and backends.MASK_ALIGN == {}
        raise KeyboardInterrupt  # a stage cut at its time cap
    assert model.config._attn_implementation == SDPA_GQA and backends.MASK_ALIGN == align


def test_bench_ops_cuda_attention_counts_under_cudas_path(tiny_adapter, tmp_path, monkeypatch):
    """``bench_ops --attention cuda`` counts every method's generation inside
    ``op_count.cuda_attention`` (the fold, aligned masks) with the one-call norms swapped in; the
    default (``load``) does neither. Catches counts of the CPU's attention recorded as CUDA's."""
    from contextlib import contextmanager

    ops = load_script("bench_ops")
    monkeypatch.setattr(ops, "ADAPTER", tiny_adapter)
    entered = []

    @contextmanager
    def spy():
        entered.append(1)
        yield

    monkeypatch.setattr(ops, "cuda_attention", spy)
    for attention in ("load", "cuda"):
        entered.clear()
        out = tmp_path / f"{attention}.json"
        ops.main(["--prompts", "1", "--max-new-tokens", "4", "--dtype", "float32", "--attention", attention,
                  "--threads", "1", "--out", str(out)])
        written = json.loads(out.read_text())
        methods = len(written["ops_per_step"])
        assert len(entered) == (methods if attention == "cuda" else 0), (attention, len(entered))
        # the load swaps no norm on the CPU; CUDA's trunk swaps every one
        assert (written["trunk"]["float32"]["rms_norms"] > 0) == (attention == "cuda"), written["trunk"]
