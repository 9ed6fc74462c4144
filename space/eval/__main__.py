"""``python -m space.eval`` / ``space-eval``: speedup, tokens/step, exactness and pass@k in one run.

Example (the main job, what ``run_eval.sh`` runs)::

    python -m space.eval --model smollm2-135m-instruct --adapter adapters/smollm2-135m-space \\
        --dataset humaneval --limit 10 --methods ar,hf,pld,space --out runs/eval/humaneval

At paper scale (README "Evaluation at paper scale"): ``torchrun --nproc_per_node 8 -m space.eval
... --device cuda`` shards the questions over 8 GPUs (space/eval/shard.py), ``--shard i/n`` does
the same for processes a scheduler starts (then ``--merge OUT``), and ``--device-map auto``
spreads one model too large for a GPU over all of them (space/models.py ``dispatch``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
import transformers

from ..adapters import git_commit, load_space
from ..cli import add_debug_flag, check_device, console
from ..cpu_kernels import KERNEL_CHOICES, apply_kernels
from ..decoding import DEFAULT_MASK_NUM, DecodeConfig, SamplingConfig, SpaceDecoder
from ..decoding.tree import tree_flag
from ..jsonl import write_jsonl
from ..models import DEVICE_MAP_STRATEGIES, SMOLLM2, parse_device_map, parse_dtype
from .bench import METHODS, Target, run_bench
from .report import write_reports
from .shard import Shard, current_shard, join, merge, wait_for_all
from .tasks import DATASETS, load_tasks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="space-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help=f"alias ({SMOLLM2}, tiny-random-llama) or local HF directory; "
                   "default: the adapter's base, else " + SMOLLM2)
    p.add_argument("--adapter", default=None, help="a lora / frozen-base SPACE adapter directory ('none': no adapter)")
    p.add_argument("--dataset", default="humaneval", help=f"one of {', '.join(DATASETS)} or a .jsonl file")
    p.add_argument("--data-root", default=None, help="shared data folder (default ../shared/data or $SPACE_DATA)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default all)")
    p.add_argument("--mask-num", type=int, default=None,
                   help="k drafts per step (default: the adapter's tuned layout, space_config.json 'decode')")
    p.add_argument("--num-groups", type=int, default=None,
                   help="mask groups per step, 1..k+1 (default: the adapter's tuned layout, else k+1)")
    p.add_argument("--lookup-tokens", type=int, default=None,
                   help="space: also try up to N prompt-lookup candidates per step when an n-gram recurs "
                        "(default: the adapter's tuned layout, else 0 = pure SPACE)")
    p.add_argument("--tree", default=None,
                   help="space: 'chain' (verify the top-1 drafts), 'auto' (the adapter's tuned tree), or a token "
                        "tree as JSON paths of ranks, e.g. '[[0],[1],[0,0]]', or a file holding one "
                        "(default: the adapter's tuned layout)")
    p.add_argument("--methods", default="ar,hf,pld,space", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1, help="samples per question (pass@n needs temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (fp32 is fastest on CPU)")
    p.add_argument("--device", default="cpu", help="under torchrun, 'cuda' means each rank's own GPU (LOCAL_RANK)")
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
    p.add_argument("--kernels", choices=KERNEL_CHOICES, default="fast",
                   help="fast: oneDNN-packed linears + GQA attention for every method on an fp32 CPU "
                        "(space/cpu_kernels.py); stock: transformers' own kernels")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/eval/<dataset>); reruns resume")
    add_debug_flag(p)
    return p


def check_args(args: argparse.Namespace, shard: Shard | None = None) -> tuple[list[str], str | dict | None]:
    """Check the arguments that need no model (so a typo fails in a second, not after loading).

    Returns:
        (the methods in order, the parsed ``--device-map`` or None).

    Raises:
        ValueError: unknown or repeated method, a count below its minimum, a bad --tree, num_samples > 1
            when greedy, an unknown dtype or device, a CUDA/MPS device this torch cannot use (in the
            device map too), a bad device map, a device map shared by several torchrun processes
            of one node that have GPUs, or ``--out`` that is a file.
    """
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown method(s) {bad}; choose from {METHODS}")
    if len(set(methods)) != len(methods):  # each (question, method) is one record: twice would duplicate it
        raise ValueError(f"--methods lists a method twice: {args.methods!r}")
    for name, minimum in (("mask_num", 1), ("num_groups", 1), ("max_new_tokens", 1), ("num_samples", 1),
                          ("threads", 1), ("lookup_tokens", 0)):
        value = getattr(args, name)
        if value is not None and value < minimum:  # None: the default (the adapter's, torch's)
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    if args.num_samples > 1 and args.temperature == 0:
        raise ValueError("--num-samples > 1 needs --temperature > 0 (greedy samples are identical)")
    parse_dtype(args.dtype)
    check_device(args.device)
    tree_flag(args.tree, args.mask_num)  # a bad --tree fails here; rechecked against the adapter's k later
    placement = None if args.device_map is None else parse_device_map(args.device_map)
    for device in placement.values() if isinstance(placement, dict) else ():
        check_device(f"cuda:{device}" if isinstance(device, int) else device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if placement is not None and shard is not None and shard.launched and local > 1 and torch.cuda.is_available():
        raise ValueError(f"--device-map with {local} torchrun processes per node: each would spread over the same "
                         "GPUs; start one process per node, or --shard i/n processes with their own "
                         "CUDA_VISIBLE_DEVICES")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; pass a folder")
    return methods, placement


def make_out(out: Path) -> Path:
    """Create the output folder. Raises PermissionError (not writable) or FileExistsError (a file on the path)."""
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise PermissionError(f"--out {out} is not writable")
    return out


def machine(device: str) -> str:
    """The machine record: CPU architecture and cores, plus the GPU's name on CUDA."""
    desc = f"{platform.machine()} {os.cpu_count()} cores"
    if torch.device(device).type == "cuda":
        desc += f", {torch.cuda.get_device_name(torch.device(device))}"
    return desc


def placed_on(model) -> list[str]:
    """The devices a device-mapped model's modules run on, in map order ("cuda:0", "cpu")."""
    return list(dict.fromkeys(f"cuda:{d}" if isinstance(d, int) else str(d) for d in model.hf_device_map.values()))


# settings that shape every sample: a folder's samples are only resumed under the same values.
# Not the code commit: a run may resume under newer code, and meta["commits"] lists every commit.
RESUME_KEYS = ("model", "adapter", "dataset", "methods", "num_samples", "mask_num", "num_groups", "lookup_tokens", "tree",
               "max_new_tokens", "temperature", "top_p", "top_k", "seed", "dtype", "kernels")


def check_resume(out: Path, meta: dict, shard: Shard | None = None) -> None:
    """Record the run's settings in ``out/run_config.json``; refuse to mix in samples made otherwise.

    A rank of a sharded run records them in its own ``run_config.rank{i}.json`` (``meta`` then
    holds its ``shard`` entry) and is checked against its own samples and the merged ones.
    ``meta["commits"]`` becomes the list of every code commit that wrote samples in the file
    resumed (the recorded list, plus the current commit when it is new).

    Raises:
        ValueError: ``out`` holds samples but no record of their settings (run_config.json, or the
            meta of an older summary.json), or settings that differ from ``meta`` in a RESUME_KEYS entry.
    """
    commits = _recorded_commits(out, meta, "samples.jsonl", ("run_config.json", "summary.json"))
    if shard is not None:
        commits = _recorded_commits(out, meta, shard.samples, (shard.config,))
    meta["commits"] = commits + [c for c in meta["commits"] if c not in commits]
    name = shard.config if shard is not None else "run_config.json"
    tmp = out / f"{name}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out / name)


def _recorded_commits(out: Path, meta: dict, samples: str, records: tuple[str, ...]) -> list[str]:
    """The commits that wrote ``out/samples`` ([] when there is none), once its recorded settings
    (the first of ``records`` present) are found equal to ``meta``'s. Raises as check_resume."""
    if not (out / samples).is_file():
        return []
    recorded = next((out / name for name in records if (out / name).is_file()), None)
    if recorded is None:
        raise ValueError(f"{out} holds {samples} but no {records[0]} saying how they were made; "
                         "use another --out, or delete the folder to start over")
    old = json.loads(recorded.read_text())
    old = {"lookup_tokens": 0, "tree": None, **old.get("meta", old)}  # runs from before these options: chain, no lookup
    diff = {k: (old.get(k), meta[k]) for k in RESUME_KEYS if old.get(k) != meta[k]}
    if diff:
        raise ValueError(f"{out} holds samples made with other settings ({recorded.name}); "
                         f"(theirs, now): {diff}. Use another --out, or delete it to start over")
    return old.get("commits") or ([old["commit"]] if old.get("commit") else [])  # older runs kept one


def main(argv: list[str] | None = None) -> dict | None:
    """Run the evaluation, or one rank of it; returns the summary (the console entry ``cli``
    exits 0 instead), or None on a rank that does not merge.

    Raises:
        ValueError, FileNotFoundError, PermissionError: bad arguments, dataset, adapter, device map,
            shard or output folder, or a folder holding samples made otherwise (see check_args,
            load_tasks, check_resume); all raised before any generation. ``--merge``: see merge_run.
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
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    out = make_out(args.out or Path("runs/eval") / args.dataset.replace(":", "-").replace("/", "_"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if shard:
        join(shard)
    device = shard.device(args.device) if shard else args.device
    model, tok, spec = load_space(args.model, args.adapter, args.mask_num or DEFAULT_MASK_NUM, args.dtype, device,
                                  placement)
    kernels = apply_kernels(model, args.kernels)
    # the adapter's tuned layout (space_config.json "decode"), then the flags given on top of it
    decode = DecodeConfig.of_model(model, spec.mask_num).override(
        mask_num=args.mask_num, num_groups=args.num_groups, lookup_tokens=args.lookup_tokens,
        tree=tree_flag(args.tree, args.mask_num))
    decoder = SpaceDecoder(model, spec, decode)
    context = model.config.max_position_embeddings
    if args.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model "
                         f"context of {context} tokens")
    base = args.model or (json.loads((Path(args.adapter) / "space_config.json").read_text())["base_model"]
                          if args.adapter else SMOLLM2)
    devices = placed_on(model) if placement is not None else [device]
    meta = {"model": base, "adapter": args.adapter,
            "dataset": args.dataset, "limit": args.limit, "num_questions": len(tasks), "methods": methods,
            "mask_num": decode.mask_num, "num_groups": decode.groups, "lookup_tokens": decode.lookup_tokens,
            "tree": decode.to_dict()["tree"],
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "num_samples": args.num_samples,
            "seed": args.seed, "dtype": args.dtype, "device": ", ".join(devices), "device_map": args.device_map,
            "ranks": 1, "threads": torch.get_num_threads(), "kernels": kernels, "machine": machine(devices[0]),
            "torch": torch.__version__, "transformers": transformers.__version__, "commits": [git_commit()]}
    if shard:
        meta["shard"] = {"rank": shard.rank, "world_size": shard.world_size,
                         "questions": [t.question_id for t in mine]}
    check_resume(out, meta, shard)
    samples = out / (shard.samples if shard else "samples.jsonl")
    records = run_bench(Target(model, tok, spec, decoder), mine, methods, samples, args.max_new_tokens, sampling,
                        args.num_samples)
    if shard:
        wait_for_all(shard)
        if shard.launched and shard.rank == 0:
            return merge_run(out)
        then = "rank 0 merges" if shard.launched else f"once every rank has run: space-eval --merge {out}"
        print(f"[space-eval] rank {shard.rank} of {shard.world_size} wrote {out}/{shard.samples}; {then}")
        return None
    wanted = {t.question_id for t in tasks}
    records = [r for r in records if r["question_id"] in wanted and r["model_id"] in methods]
    return report(records, meta, out)


def merge_run(out: Path) -> dict:
    """Merge the finished ranks of a sharded run in ``out`` (space/eval/shard.py): writes
    samples.jsonl (ordered as one process writes it), run_config.json, summary.* and plots.

    Returns:
        the summary; its ``meta["ranks"]`` says how many ranks ran.

    Raises:
        FileNotFoundError: no sharded run in ``out``.
        ValueError: a rank that has not run or not finished, or ranks with different settings.
    """
    records, meta = merge(out, RESUME_KEYS)
    write_jsonl(out / "samples.jsonl", records)
    (out / "run_config.json.tmp").write_text(json.dumps(meta, indent=2))
    (out / "run_config.json.tmp").replace(out / "run_config.json")
    return report(records, meta, out)


def report(records: list[dict], meta: dict, out: Path) -> dict:
    """Write and print the summary of ``records``; returns it."""
    summary = write_reports(records, meta, out)
    print((out / "summary.md").read_text())
    print(f"[space-eval] wrote {out}/samples.jsonl, summary.json, summary.md and plots")
    return summary


cli = console("space-eval", main)


if __name__ == "__main__":
    cli()
