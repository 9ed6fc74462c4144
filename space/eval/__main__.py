"""``python -m space.eval`` / ``space-eval``: speedup, tokens/step, exactness and pass@k in one run.

Example (the main job, what ``run_eval.sh`` runs: the default methods, the adapter's tuned layout)::

    python -m space.eval --adapter adapters/smollm2-135m-space --dataset humaneval --limit 5 \\
        --max-new-tokens 128 --device auto --out runs/eval/main_humaneval

At paper scale (docs/evaluation_at_scale.md): ``torchrun --nproc_per_node 8 -m space.eval
... --device cuda`` shards the questions over 8 GPUs (space/eval/shard.py), ``--shard i/n`` does
the same for processes a scheduler starts (then ``--merge OUT``), and ``--device-map auto``
spreads one model too large for a GPU over all of them (space/models.py ``dispatch``).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..cli import (HelpFormatter, add_debug_flag, add_threads_flag, check_device, check_number,
                   check_threads, console, device_flag, set_threads)
from ..choices import ALIASES, COMPILE_MODES, DEVICE_MAP_STRATEGIES, KERNEL_CHOICES, SMOLLM2, STEP_COST_CHOICES
from .bench import HF_MIN_TEMPERATURE, METHODS
from .resume import (adapter_sha256, check_flags_resume, check_resume, hold_samples, merge_run, model_files,
                     read_record, report)
from .shard import Shard, current_shard, join, wait_for_all
from .tasks import DATASETS, datastore_questions, load_tasks, trained_questions

# torch, transformers and the model code are imported inside the functions that need them, so
# that --help answers without loading them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="space-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help=f"alias ({', '.join(ALIASES)}) or local HF "
                   f"directory, e.g. a full SAR-SFT checkpoint, whose tuned layout the run takes (default: the "
                   f"adapter's base model, else {SMOLLM2})")
    p.add_argument("--adapter", default=None, help="a lora / frozen-base SPACE adapter directory ('none': no adapter)")
    p.add_argument("--dataset", default="humaneval", help=f"one of {', '.join(DATASETS)} or a .jsonl file")
    p.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data or $SPACE_DATA)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default all)")
    p.add_argument("--mask-num", type=int, default=None,
                   help="k drafts per step (default: the adapter's or full checkpoint's tuned layout, "
                        "space_config.json 'decode')")
    p.add_argument("--num-groups", type=int, default=None,
                   help="mask groups per step, 1..k+1 (default: the adapter's tuned layout, else k+1)")
    p.add_argument("--lookup-tokens", type=int, default=None,
                   help="space: also try up to N prompt-lookup candidates per step when an n-gram recurs "
                        "(default: the adapter's tuned layout, else 0 = pure SPACE)")
    p.add_argument("--lookup-branches", type=int, default=None,
                   help="space, dynamic tree: most prompt-lookup continuations a step may verify, the first "
                        "occurrence's (PLD's) then the most recent others', each priced like any node "
                        "(default: the adapter's tuned layout, else 1)")
    p.add_argument("--datastore", default=None,
                   help="space, dynamic tree with lookup: comma list of space-distill sets (.jsonl or .jsonl.gz) "
                        "whose answers are a datastore; what followed the text's last 3 tokens there joins prompt "
                        "lookup's continuations (our addition, REST-style; default: none)")
    p.add_argument("--datastore-branches", type=int, default=None,
                   help="space, with --datastore: most datastore continuations a step may verify, each priced "
                        "like any node (default: 1)")
    p.add_argument("--tree", default=None,
                   help="space: 'chain' (verify the top-1 drafts), 'auto' (the adapter's tuned tree), 'dynamic' (a "
                        "tree chosen each step from draft confidence and the step cost), or a token "
                        "tree as JSON paths of ranks, e.g. '[[0],[1],[0,0]]', or a file holding one "
                        "(default: the adapter's tuned layout)")
    p.add_argument("--methods", default="ar,hf,pld,space", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens per answer (each turn)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, >= 0; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this "
                   "probability mass, in (0, 1]; 1 = all")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, >= 0; 0 = all")
    p.add_argument("--num-samples", type=int, default=1, help="samples per question (pass@n needs temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of sample 0's first turn (sample i's turn t "
                   "uses seed + i + (t - 1) x num-samples), the same on every rank")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (fp32 is fastest on CPU; "
                   "greedy SPACE equals AR exactly only in fp32, lower precision can flip near-ties)")
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N or mps; auto = cuda when "
                   "a CUDA GPU is usable, else cpu (the run records the choice); under torchrun, 'cuda' means each "
                   "rank's own GPU (LOCAL_RANK) (default: auto)")
    p.add_argument("--device-map", default=None,
                   help=f"spread the model over devices with accelerate hooks: {'|'.join(DEVICE_MAP_STRATEGIES)} or a "
                        "JSON map {\"module\": device} (file or inline); overrides --device. Memory scale, not speed: "
                        "the layers run one after another")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="evaluate slice I of N (questions I, I+N, ...) into samples.rankI.jsonl in --out, for "
                        "processes a scheduler starts; torchrun / accelerate launch set the ranks themselves")
    p.add_argument("--merge", type=Path, default=None, metavar="OUT",
                   help="merge the finished ranks of a sharded run in OUT into samples.jsonl, summary.* and plots "
                        "(other flags are not used)")
    p.add_argument("--kernels", default=None,
                   help="fast (default): prepacked linears (MKL or oneDNN, whichever is faster here), GQA attention and one-call RMSNorm for every "
                        "method on an fp32 CPU (space/cpu_kernels.py); stock: transformers' own kernels (the "
                        "default with --compile, which packs its own)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="torch.compile the model's trunk for every method, with preallocated KV caches for SPACE and "
                        "AR (space/decoding/compiled.py, issue 43); the first generations of each shape compile. "
                        "reduce-overhead: with CUDA graphs, on a GPU (results/gpu_compiled). frozen: on a CPU, the "
                        "weights folded into the graph for inductor's C++ GEMM, the fastest AR step there; its graphs "
                        "take minutes (results/compile_cpu)")
    p.add_argument("--capture", action="store_true",
                   help="replay each SPACE and AR step's trunk from CUDA graphs captured at load, one per row bucket "
                        "and slot bucket, over one preallocated KV cache (space/decoding/graphs.py, issue 58); pays on a GPU, where an "
                        "eager step is launch-bound. On a CPU the same buffers run eagerly (no gain). pld then runs "
                        "prompt lookup over the same steps (HF's settings, no mask group); hf stays transformers' "
                        "eager generate")
    p.add_argument("--capture-len", type=int, default=None, metavar="N",
                   help="with --capture: KV-cache slots; prompt + new tokens + a step's rows must fit (default: the "
                        "model's context, at most 4096). A step attends over the smallest slot bucket (this halved, "
                        "down to 256) holding its cache and rows")
    p.add_argument("--step-cost", default="auto", choices=STEP_COST_CHOICES,
                   help="what prices the dynamic tree's steps of q rows: stored (the adapter's curve for this run's "
                        "setup, else its layout's own), measure (this machine's steps timed at load, eagerly or "
                        "captured as the run steps: seconds on a GPU, about 10 s for SmolLM2 on 2 CPU threads; "
                        "recorded in run_config.json and kept when the run resumes), auto: measure on a CUDA "
                        "GPU when the adapter stores no curve of that device type and captured steps (the shipped "
                        "ones are CPU curves), not with --compile nor in shards (each rank would measure its own: "
                        "store one with space-tree --write-adapter), else stored")
    add_threads_flag(p)
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/eval/<dataset>); reruns resume")
    add_debug_flag(p)
    return p


def check_args(args: argparse.Namespace, shard: Shard | None = None) -> tuple[list[str], str | dict | None]:
    """Check the arguments that need no model (so a typo fails in a second, not after loading).

    Returns:
        (the methods in order, the parsed ``--device-map`` or None).

    Raises:
        ValueError: unknown or repeated method, a count below its minimum, a temperature, top-p or
            seed out of range (NaN and inf included; a temperature above float32's range, or below
            ``HF_MIN_TEMPERATURE`` for hf and pld), a bad --tree, num_samples > 1 when greedy, an
            unknown dtype, kernels or device (space.cli.check_device), a CUDA/MPS device this torch
            cannot use (in the device map too), a bad device map, a --tree or --device-map file that
            is not UTF-8, a device map shared by several torchrun processes of one node that have
            GPUs, ``--compile reduce-overhead`` without a CUDA device or ``--compile frozen``
            off the CPU (loader.check_compile),
            ``--capture`` with ``--compile`` or ``--device-map``, ``--capture-len`` < 1 or without
            ``--capture``, ``--step-cost measure`` with ``--compile`` or a shard, ``--out`` that is
            a file or lies inside the ``--adapter`` or ``--model`` folder.
    """
    import torch  # lazy: --help stays fast

    from ..decoding.tree import tree_flag
    from ..loader import check_compile
    from ..tokens import check_mask_num
    from ..models import parse_device_map, parse_dtype

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown method(s) {bad}; choose from {METHODS}")
    if len(set(methods)) != len(methods):  # each (question, method) is one record: twice would duplicate it
        raise ValueError(f"--methods lists a method twice: {args.methods!r}")
    check_threads(args.threads)
    for name, minimum in (("mask_num", 1), ("num_groups", 1), ("max_new_tokens", 1), ("num_samples", 1),
                          ("lookup_tokens", 0), ("lookup_branches", 1), ("datastore_branches", 1), ("top_k", 0),
                          ("temperature", 0), ("top_p", 0)):
        check_number(f"--{name.replace('_', '-')}", getattr(args, name), minimum)  # None: the adapter's default
    check_number("--top-p", args.top_p, maximum=1)
    if args.mask_num is not None:
        check_mask_num(args.mask_num)  # past MAX_MASK_NUM it was refused only after the weights loaded
    check_number("--temperature", args.temperature, maximum=torch.finfo(torch.float32).max)  # inf in float32 logits
    if args.top_p == 0:
        raise ValueError("--top-p must lie in (0, 1], got 0.0 (no token would be kept)")
    check_number("--seed", args.seed, 0, 2**32 - 1)
    sampled_by_hf = sorted({"hf", "pld"} & set(methods))
    if 0 < args.temperature < HF_MIN_TEMPERATURE and sampled_by_hf:
        raise ValueError(f"--temperature {args.temperature} with {', '.join(sampled_by_hf)}: transformers divides the "
                         f"float32 logits by it, which overflows below {HF_MIN_TEMPERATURE} (NaN probabilities); use 0 "
                         "for greedy, or a larger temperature")
    if args.temperature == 0 and (args.top_p != 1 or args.top_k):  # said, as training says what it ignores
        warnings.warn(f"--top-p {args.top_p} / --top-k {args.top_k} with --temperature 0: greedy decoding ignores "
                      "them", stacklevel=2)
    if args.num_samples > 1 and args.temperature == 0:
        raise ValueError("--num-samples > 1 needs --temperature > 0 (greedy samples are identical)")
    if args.datastore_branches is not None and not args.datastore:
        raise ValueError("--datastore-branches counts the continuations of a --datastore: give one")
    if args.datastore and "space" not in methods:
        raise ValueError("--datastore drafts for the space method: add space to --methods")
    if args.kernels is None:
        args.kernels = "stock" if args.compile else "fast"
    if args.kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown --kernels {args.kernels!r}; choose one of {KERNEL_CHOICES}")
    if args.capture and (args.compile or args.device_map is not None):
        raise ValueError("--capture records the eager trunk on one device: drop --compile and --device-map")
    if args.capture_len is not None:
        if not args.capture:
            raise ValueError("--capture-len sizes the captured steps' cache: it needs --capture")
        check_number("--capture-len", args.capture_len, 1)
    if args.step_cost == "measure" and args.compile:
        raise ValueError("--step-cost measure times the eager trunk or captured steps: a compiled trunk's curve "
                         "builds its graphs first (minutes); measure it with space-tree --compile --write-adapter")
    if args.step_cost == "measure" and shard is not None:
        raise ValueError("--step-cost measure with shards: each rank would price its questions by its own curve, "
                         "and their samples would not merge; measure once with space-tree --write-adapter")
    if args.compile and args.kernels != "stock":  # the packed weights are opaque tensors, not compiled
        raise ValueError(f"--compile takes --kernels stock (torch.compile packs the linears itself), got "
                         f"--kernels {args.kernels}")
    parse_dtype(args.dtype)
    args.device_requested, args.device = args.device, device_flag(args.device)
    check_compile(args.compile or False, args.device, args.device_map)
    tree_flag(args.tree, args.mask_num)  # a bad --tree fails here; rechecked against the adapter's k later
    try:
        placement = None if args.device_map is None else parse_device_map(args.device_map)
    except UnicodeDecodeError as e:  # a binary file passed by mistake
        raise ValueError(f"--device-map {args.device_map}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for device in placement.values() if isinstance(placement, dict) else ():
        check_device(f"cuda:{device}" if isinstance(device, int) else device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if placement is not None and shard is not None and shard.launched and local > 1 and torch.cuda.is_available():
        raise ValueError(f"--device-map with {local} torchrun processes per node: each would spread over the same "
                         "GPUs; start one process per node, or --shard i/n processes with their own "
                         "CUDA_VISIBLE_DEVICES")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; pass a folder")
    out = args.out or default_out(args.dataset)
    for flag, folder in (("--adapter", args.adapter), ("--model", args.model)):
        # the folder's files are fingerprinted (resume keys): the run's own files would change them every run
        if folder and Path(folder).is_dir() and out.resolve().is_relative_to(Path(folder).resolve()):
            raise ValueError(f"--out {out} lies inside {flag} {folder}, whose files fingerprint the run's "
                             "samples: its own files would change that at every run, and no run would resume; "
                             "pass a folder outside it")
    return methods, placement


def default_out(dataset: str) -> Path:
    """Where a run without ``--out`` writes: ``runs/eval/<dataset>``."""
    return Path("runs/eval") / dataset.replace(":", "-").replace("/", "_")


def make_out(out: Path) -> Path:
    """Create the output folder. Raises PermissionError (not writable) or FileExistsError (a file on the path)."""
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise PermissionError(f"--out {out} is not writable")
    return out


def machine(device: str) -> str:
    """The machine record: CPU architecture, cores, model and vector ISA (the fast kernels' choice and
    every CPU timing depend on them; ``cpu_kernels.cpu_identity``), plus the GPU's name on CUDA, e.g.
    "x86_64 2 cores, AMD EPYC (AVX512)". A resume compares it (``resume.same_machine``)."""
    import torch

    from ..cpu_kernels import cpu_identity

    desc = f"{platform.machine()} {os.cpu_count()} cores, {cpu_identity()}"
    if torch.device(device).type == "cuda":
        desc += f", {torch.cuda.get_device_name(torch.device(device))}"
    return desc


def recorded_run(out: Path, shard: Shard | None) -> dict:
    """The run record of the samples in ``out`` (``run_config.json``, a rank's own under a shard), or
    {}: none yet, or a damaged one (check_resume refuses it)."""
    path = out / (shard.config if shard else "run_config.json")
    try:
        record = read_record(path) if path.is_file() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def recorded_paths(recorded: dict) -> dict:
    """The fast kernels' timed choices a run record holds beside its packed kernel, as
    ``cpu_kernels.apply_kernels`` pins them: ``{"min_rows": n, "paths": {"out x in": {"stock_rows":
    n, ...}}}``, each left out where the record has none or a malformed one (timed again; a fewest
    packed rows below 2, which ``cpu_kernels.PackedLinear`` refuses, is malformed)."""
    min_rows, paths = recorded.get("packed_min_rows"), recorded.get("kernel_paths")
    good = isinstance(paths, dict) and all(isinstance(e, dict) and type(e.get("stock_rows")) is int
                                           and e["stock_rows"] >= 0 for e in paths.values())
    return {**({"min_rows": min_rows} if type(min_rows) is int and min_rows >= 2 else {}),
            **({"paths": paths} if good else {})}


def price_here(args: argparse.Namespace, decode, setup: dict | None, model, graphs, shard: Shard | None,
               methods: list[str], recorded: dict, resuming: bool):
    """The dynamic tree priced by this machine's measured step cost where ``--step-cost`` asks for it
    (``step_cost.price_at_load``: ``measure``; ``auto`` on a CUDA GPU when the stored curve's setup
    differs from the run's, or none is stored), through ``graphs`` when the run captures its
    steps. Only SPACE's dynamic tree is priced: a run without ``space`` measures nothing. A resumed
    run keeps how its samples were priced (the curve is a resume key), checked before anything else
    (the device, a shard, a curve stored since): the curve it measured at load, when its setup is
    this run's (under ``measure`` or ``auto``), or under ``auto`` the stored curve (or none) of a run
    that did not measure. Else ``(decode, setup)`` unchanged.

    Args:
        decode: the run's layout (the adapter's, the flags on top, priced by ``artifact.priced_for_setup``).
        setup: how its curve was measured (``priced_for_setup``'s second value).
        methods: the run's methods.
        recorded: the run record already in ``--out`` (:func:`recorded_run`).
        resuming: whether ``--out`` holds samples this run resumes.

    Returns:
        (the layout, the curve's setup: with ``"measured": "at load"`` and its seconds when measured).

    Raises:
        ValueError: ``--step-cost measure`` for SPACE with a static layout, whose steps no curve prices;
            resumed samples priced otherwise than this run would price (a curve measured on another
            setup, or under ``measure`` a stored one), before anything is timed.
    """
    from .step_cost import curve_setup, price_at_load

    if "space" not in methods or args.step_cost == "stored":
        return decode, setup
    if decode.tree == "dynamic":
        here = curve_setup(model, args.kernels, args.capture)
        # how the samples this run resumes were priced: first, whatever the mode and the stored curves now
        kept = recorded.get("step_cost_setup") if resuming and "step_cost_setup" in recorded else False
        measured_before = isinstance(kept, dict) and bool(kept.get("measured"))
        # a curve measured before the CPU (the GPU) was recorded is taken as this CPU's (GPU's)
        same = ("device", "capture", "trunk", "kernels",
                *(key for key in ("cpu", "gpu", "dtype") if key in here and key in (kept or {})))
        if measured_before and recorded.get("step_cost") and all(kept.get(k) == here[k] for k in same):
            print("[space-eval] the step-cost curve measured when this run started prices its steps")
            return decode.override(step_cost=tuple(map(tuple, recorded["step_cost"])),
                                   adapter_cost=recorded.get("adapter_cost") or 0.0), kept
        if args.step_cost == "auto" and kept is not False and not measured_before:
            return decode, setup  # samples priced by a stored curve (or none), as before measuring at load
        if kept is not False and (measured_before or args.step_cost == "measure"):  # refused now, not after timing
            how = (f"a curve measured at load on {', '.join(f'{k} {kept.get(k)}' for k in same)}"
                   if measured_before else "the adapter's stored curve" if kept else "the default curve")
            raise ValueError(f"the run folder (--out) holds samples whose dynamic tree was priced by {how}; a curve "
                             f"measured now would price the rest otherwise: resume with that setup and --step-cost, "
                             f"or give a new --out")
    return price_at_load(model, decode, setup, args.step_cost, args.kernels, args.capture, graphs,
                         args.compile, shard is not None)


def placed_on(model) -> list[str]:
    """The devices a device-mapped model's modules run on, in map order ("cuda:0", "cpu")."""
    return list(dict.fromkeys(f"cuda:{d}" if isinstance(d, int) else str(d) for d in model.hf_device_map.values()))


def main(argv: list[str] | None = None) -> dict | None:
    """Run the evaluation, or one rank of it; returns the summary (the console entry ``cli``
    exits 0 instead), or None on a rank that does not merge.

    Raises:
        ValueError, FileNotFoundError, PermissionError: bad arguments, dataset, adapter, device map,
            shard or output folder, or a folder holding samples made otherwise (see check_args,
            load_tasks, check_resume), or an ``--out`` another run is writing (its pid named:
            resume.hold_samples); all raised before any generation. ValueError after the report
            when every question was skipped (resume.report). ``--merge``: see resume.merge_run.
    """
    args = build_parser().parse_args(argv)
    if args.merge is not None:
        return merge_run(args.merge)
    if args.adapter is not None and args.adapter.lower() == "none":
        args.adapter = None
    shard = current_shard(args.shard)
    methods, placement = check_args(args, shard)
    tasks = load_tasks(args.dataset, args.data_root, args.limit)
    mine = shard.select(tasks) if shard else tasks
    out = make_out(args.out or default_out(args.dataset))
    with hold_samples(out / (shard.samples if shard else "samples.jsonl")), compile_progress(bool(args.compile)):
        # as the run records them (evaluate's meta), compared before the model loads
        check_flags_resume(out, {"dataset": args.dataset, "methods": methods, "num_samples": args.num_samples,
                                 "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                 "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "dtype": args.dtype},
                           shard)
        return evaluate(args, shard, methods, placement, tasks, mine, out)


@contextmanager
def compile_progress(enabled: bool) -> Iterator[None]:
    """While ``enabled`` (``--compile``), print a line as torch.compile starts and ends each graph:
    one takes minutes at SmolLM2's size on a CPU, and the progress bar stands still meanwhile."""
    if not enabled:
        yield
        return
    from torch._dynamo.callback import callback_handler
    from tqdm import tqdm

    started = {}

    def start(event) -> None:
        started[event.compile_id] = time.perf_counter()
        tqdm.write(f"[space-eval] compiling graph {event.compile_id} (a new shape; may take minutes)")

    def end(event) -> None:
        seconds = time.perf_counter() - started.pop(event.compile_id, time.perf_counter())
        tqdm.write(f"[space-eval] compiled graph {event.compile_id} in {seconds:.0f} s")

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)


def evaluate(args: argparse.Namespace, shard: Shard | None, methods: list[str], placement, tasks: list, mine: list,
             out: Path) -> dict | None:
    """Load the model and run this process's questions ``mine`` of ``tasks`` into ``out`` (main,
    once the arguments are checked and ``out`` is held); returns as main. Raises as main."""
    import torch
    import transformers

    from ..artifact import (SPACE_CONFIG, adapter_decode_config, artifact_folder, compile_setup, git_commit,
                            priced_for_setup)
    from ..cpu_kernels import PACKED_KERNELS, apply_kernels
    from ..decoding import DEFAULT_MASK_NUM, DecodeConfig, SamplingConfig, SpaceDecoder
    from ..loader import load_space
    from ..models import SMOLLM2, model_gpu
    from .bench import PLD_NGRAM, PLD_TOKENS, Target, run_bench
    from .step_cost import trunk_dtype

    # one seed for every rank: sample i of a question is the same whichever rank draws it
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    set_threads(args.threads)
    if shard:
        join(shard)
    device = shard.device(args.device) if shard else args.device
    try:
        # a trunk to compile loads unfused (space.decoding.fused keeps module state a graph must not hold)
        # stored: the run prices its layout after its flags and resume checks (price_here)
        model, tok, spec = load_space(args.model, args.adapter, args.mask_num or DEFAULT_MASK_NUM, args.dtype,
                                      device, placement, compile=args.compile or False, step_cost="stored")
    except UnicodeDecodeError as e:  # a config file of the model or adapter holds other bytes
        raise ValueError(f"--model {args.model} / --adapter {args.adapter}: a config file is not UTF-8 text "
                         f"({e.reason} at byte {e.start})") from None
    # --compile takes stock kernels: nothing to pack under the graph. A resumed run packs as its samples
    # were made: the timed choices could go the other way on a near-tie (one run's timings would mix two
    # setups, and stock and packed rows round apart), and the kernel picks the step-cost curve (a resume key)
    recorded = recorded_run(out, shard)
    # a merged record of ranks that timed different kernels names them all ("mkl; onednn"): timed again
    pinned = recorded.get("packed_kernel") if recorded.get("packed_kernel") in PACKED_KERNELS else None
    kernels = apply_kernels(model, args.kernels, kernel=pinned, **(recorded_paths(recorded) if pinned else {}))
    # timed on this machine (the faster packed kernel, its fewest rows, stock F.linear's rows per shape):
    # recorded, not resume keys (pinned above)
    packed_kernel, kernel_paths = kernels.pop("packed_kernel", None), kernels.pop("stock_rows", None)
    min_rows = kernels.pop("packed_min_rows", None)
    compiled = compile_setup(args.compile)  # True: inductor's default, as older runs recorded
    # the artifact's tuned layout (space_config.json "decode": the adapter's, or a full SAR-SFT checkpoint's
    # given as --model), the flags given on top of it, then a dynamic tree priced by the curve the artifact
    # stores for this run's setup (threads, kernels, compile mode, ...)
    threads = torch.get_num_threads()
    folder = artifact_folder(args.model, args.adapter)
    where = folder / SPACE_CONFIG if folder else None
    adapter_cfg = read_record(where) if where else {}
    tuned = adapter_decode_config(adapter_cfg, where) if where else DecodeConfig.of_model(model, spec.mask_num)
    decode = tuned.with_flags(args)
    datastore = None
    if args.datastore:
        from ..decoding.datastore import Datastore

        datastore = Datastore.from_sets(args.datastore, tok)
        print(f"[space-eval] datastore: {len(datastore):,} tokens of answers from {args.datastore}")
    on = next(model.parameters()).device.type
    decode, setup = priced_for_setup(decode, adapter_cfg, threads, args.kernels, where or "", on, args.capture,
                                     packed_kernel, compiled, gpu=model_gpu(model), dtype=trunk_dtype(model))
    graphs = capture = pld = None
    if args.capture:  # one graph per row and slot bucket (on a GPU), ready before the first question
        from ..decoding.graphs import StepGraphs

        slots = args.capture_len or min(model.config.max_position_embeddings, 4096)
        pld = DecodeConfig(decode.mask_num, 0, lookup_tokens=PLD_TOKENS, lookup_ngram=PLD_NGRAM)
        sizes = {q for c in (decode, pld) for q in SpaceDecoder(model, spec, c, buckets=True).row_sizes}
        graphs = StepGraphs(model, slots, sizes)
        seconds = graphs.capture()
        capture = {"slots": slots, "graphs": graphs.num_graphs, "ready_s": round(seconds, 2)}
        print(f"[space-eval] captured {graphs.num_graphs} step graphs for {len(graphs.sizes)} row buckets and "
              f"{len(graphs.slot_sizes)} slot buckets in {seconds:.1f} s")
    samples = out / (shard.samples if shard else "samples.jsonl")
    decode, setup = price_here(args, decode, setup, model, graphs, shard, methods, recorded, samples.is_file())
    decoder = SpaceDecoder(model, spec, decode, graphs=graphs, datastore=datastore)
    pld = SpaceDecoder(model, spec, pld, graphs=graphs) if graphs is not None else None
    if decode.tree == "dynamic":
        from .step_cost import warn_step_cost_mismatch

        warn_step_cost_mismatch(setup, model, threads, args.kernels, compiled, args.capture, packed_kernel)
    context = model.config.max_position_embeddings
    if args.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model "
                         f"context of {context} tokens")
    base = args.model or (read_record(Path(args.adapter) / "space_config.json")["base_model"]
                          if args.adapter else SMOLLM2)
    devices = placed_on(model) if placement is not None else [device]
    trained = trained_questions(tasks, folder)
    if trained:
        trainee = "adapter" if args.adapter else "checkpoint"
        warnings.warn(f"{len(trained)} of {len(tasks)} questions of --dataset {args.dataset} were in the {trainee}'s "
                      f"training data (MBPP {', '.join(trained[:4])}, ...): its drafts learned their answers, so "
                      "tokens/step and speedups on them overstate held-out drafting; --dataset mbpp-dev holds the "
                      "100 MBPP questions kept out of training", stacklevel=2)
    answered = datastore_questions(tasks, args.datastore) if datastore is not None else []
    if answered:
        warnings.warn(f"{len(answered)} of {len(tasks)} questions of --dataset {args.dataset} are answered in the "
                      f"--datastore sets ({', '.join(answered[:4])}, ...): SPACE copies the model's own earlier answers "
                      "to them, so tokens/step and speedups on them overstate what the datastore drafts for new "
                      "questions" + ("; --dataset mbpp-dev holds the 100 MBPP questions no committed set answers"
                                     if args.dataset == "mbpp" else ""), stacklevel=2)
    meta = {"model": base, "model_files": model_files(base), "adapter": args.adapter,
            "adapter_sha256": adapter_sha256(args.adapter),
            # questions the adapter or checkpoint was trained on (MBPP's, trained_questions)
            "trained_questions": len(trained),
            "dataset": args.dataset, "limit": args.limit, "num_questions": len(tasks), "methods": methods,
            "mask_num": decode.mask_num, "num_groups": decode.groups, "lookup_tokens": decode.lookup_tokens,
            "lookup_ngram": decode.lookup_ngram, "tree": decode.to_dict()["tree"],
            "baselines_suppress_masks": True, "step_cost_setup": setup if decode.tree == "dynamic" else None,  # hf and pld never emit a mask token (issue 44); older runs let them
            # the dynamic tree's own settings (None for static layouts, which do not use them)
            **{key: decode.to_dict()[key] if decode.tree == "dynamic" else None
               for key in ("row_budget", "draft_ranks", "step_cost", "adapter_cost")},
            # prompt lookup's continuations a step may verify: the first alone in a static layout (none
            # without lookup: recorded as 1, which any folder made before the setting resumes with)
            "lookup_branches": decode.lookup_branches if decode.tree == "dynamic" and decode.lookup_tokens else 1,
            # the datastore's answers by the hash of their tokens, and its continuations a step
            "datastore": datastore and {"sets": args.datastore, "tokens": len(datastore)},
            "datastore_sha256": datastore and datastore.identity,
            "datastore_branches": decode.datastore_branches if datastore else 0,
            # questions whose answer the datastore holds (datastore_questions)
            "datastore_questions": len(answered),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "num_samples": args.num_samples,
            "seed": args.seed,
            # each (sample, turn) sampled with a seed of its own (bench.run_question); before, one per sample
            "turn_seeds": True if args.temperature > 0 else None, "dtype": args.dtype, "device": ", ".join(devices),
            "device_flag": getattr(args, "device_requested", args.device), "device_map": args.device_map,
            "ranks": 1, "threads": threads, "kernels": kernels, "packed_kernel": packed_kernel,
            "kernel_paths": kernel_paths, "packed_min_rows": min_rows,
            "compile": compiled, "buckets": decoder.buckets,  # a static layout padded to row buckets
            "capture": capture and capture["slots"], "capture_ready": capture,  # captured steps (issue 58)
            # the slots a captured step attends over (space.decoding.graphs): None before they were bucketed
            "slot_buckets": list(graphs.slot_sizes) if graphs is not None else None,
            "trunk": getattr(model, "space_trunk", None),  # fused groups and attention (space.decoding.fused)
            "sdpa": getattr(model, "space_sdpa", None),  # the attention backend chosen at load (space.decoding.backends)
            "machine": machine(devices[0]),
            "torch": torch.__version__, "transformers": transformers.__version__, "commits": [git_commit()]}
    if shard:
        meta["shard"] = {"rank": shard.rank, "world_size": shard.world_size,
                         "questions": [t.question_id for t in mine]}
    check_resume(out, meta, shard)
    records = run_bench(Target(model, tok, spec, decoder, graphs, pld), mine, methods, samples, args.max_new_tokens, sampling,
                        args.num_samples)
    if shard:
        wait_for_all(shard)
        if shard.launched and shard.rank == 0:
            try:
                return merge_run(out)
            except ValueError as e:  # e.g. a plain run writing samples.jsonl: the ranks' files stay, whole
                raise ValueError(f"{e}; the ranks' own files are kept: merge them later with "
                                 f"space-eval --merge {out}") from None
        then = "rank 0 merges" if shard.launched else f"once every rank has run: space-eval --merge {out}"
        print(f"[space-eval] rank {shard.rank} of {shard.world_size} wrote {out}/{shard.samples}; {then}")
        return None
    wanted = {t.question_id for t in tasks}
    records = [r for r in records if r["question_id"] in wanted and r["model_id"] in methods]
    return report(records, meta, out)


cli = console("space-eval", main, resumes=True)


if __name__ == "__main__":
    cli()
