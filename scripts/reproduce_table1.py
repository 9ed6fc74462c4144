"""Reproduce the paper's Table 1 (DESIGN §2, §7): SAR-SFT each model, evaluate, write one table.

For every model: train with its config through ``run_sft_multi_node.sh`` (skipped when the
artifact exists and was made by the same training command, ``<out>/<model>/train_command.json``;
a run that trains on removes its evaluations of the earlier artifact; ``--model-path`` points the
config at local base weights), or take a SPACE
model trained elsewhere (``--checkpoint``); then ``space-eval`` on HumanEval-X languages with
methods ar, hf, space, and collect pass@1, tokens/step and speedups into a markdown table with
the paper's columns.

Evaluation at paper scale on one 8-GPU node: models that fit one GPU (7B, 13B) run sharded,
``torchrun --nproc_per_node 8`` over the questions (``--nproc 8``); larger ones (40B, 70B,
``--device-map-models``) run in one process with their layers spread over all GPUs
(``--device-map auto``: memory scale, not speed).

    python scripts/reproduce_table1.py --models smollm2 --max-steps 200 --limit 10      # this CPU
    python scripts/reproduce_table1.py --models llama2-7b --model-path llama2-7b=/models/Llama-2-7b-hf \\
        --checkpoint llama2-13b=/ckpt/llama2-13b-space --languages python,cpp,java,js,go,rust --limit 164 \\
        --device cuda --dtype bfloat16 --nproc 8                                         # 7B/13B, 8 GPUs
    python scripts/reproduce_table1.py --models llama2-70b --model-path llama2-70b=/models/Llama-2-70b-hf \\
        --checkpoint falcon-40b=/ckpt/falcon-40b-space --languages python,cpp,java,js,go,rust --limit 164 \\
        --dtype bfloat16 --device-map auto                                               # 40B/70B, 8 GPUs

``--out`` is resolved against the folder the script is called from, once, so training (which runs
from the repo root) and evaluation write and read the same place.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from space.cli import console
from space.eval.resume import model_files
from space.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name -> training config; model paths for the LLaMA-2 family live in the configs
    "tiny": "configs/train/tiny_smoke.yaml",
    "smollm2": "configs/train/smollm2_frozen_base_cpu.yaml",
    "llama2-7b": "configs/train/llama2_7b_full_zero2.yaml",
    "llama2-7b-lora": "configs/train/llama2_7b_lora.yaml",
    "llama2-70b": "configs/train/llama2_70b_full_zero3.yaml",
}


# evaluated with --device-map (one process, layers over the GPUs) when it is given: too large for one GPU
BIG_MODELS = "llama2-70b,falcon-40b"


def sh(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, **(env or {})})


def named_paths(pairs: list[str], flag: str) -> dict[str, Path]:
    """``["name=DIR", ...]`` -> {name: DIR}. Raises ValueError on an entry without ``=``."""
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"{flag} {bad[0]!r}: expected NAME=DIR")
    return {name: Path(path).resolve() for name, path in (p.split("=", 1) for p in pairs)}


def eval_command(a: argparse.Namespace, name: str) -> list[str]:
    """How ``name`` is evaluated: under --device-map in one process (a model in
    --device-map-models), sharded over --nproc torchrun processes, or in one plain process."""
    if a.device_map and name in a.device_map_models.split(","):
        return [sys.executable, "-m", "space.eval", "--device-map", a.device_map]
    if a.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "-m", "space.eval",
                "--device", a.device]
    return [sys.executable, "-m", "space.eval", "--device", a.device]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None,
                    help=f"comma list of {', '.join(MODELS)} to train (default smollm2, none with --checkpoint)")
    ap.add_argument("--languages", default="python", help="HumanEval-X languages")
    ap.add_argument("--limit", type=int, default=10, help="problems per language (164 = all)")
    ap.add_argument("--max-steps", type=int, default=None, help="cap training steps (small budgets)")
    ap.add_argument("--train-args", default="", help="extra training overrides, e.g. '--datasets mbpp'")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="with --nproc > 1, 'cuda' gives each process its own GPU")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-path", action="append", default=[], metavar="NAME=DIR",
                    help="local base weights for NAME's training (overrides its config's model_name_or_path)")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="evaluate a SPACE model or adapter trained elsewhere as NAME (no training)")
    ap.add_argument("--nproc", type=int, default=1, help="shard each evaluation over N torchrun processes")
    ap.add_argument("--device-map", default=None,
                    help="auto | balanced | JSON: evaluate the --device-map-models in one process over all GPUs")
    ap.add_argument("--device-map-models", default=BIG_MODELS, help="models evaluated with --device-map")
    ap.add_argument("--out", type=lambda s: Path(s).resolve(), default=Path("runs/table1").resolve(),
                    help="output folder (relative to the current folder)")
    a = ap.parse_args(argv)
    # checked before any training: a typo in the last name must not cost the first model's run
    paths, checkpoints = named_paths(a.model_path, "--model-path"), named_paths(a.checkpoint, "--checkpoint")
    names = a.models.split(",") if a.models else [] if checkpoints else ["smollm2"]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    unused = [n for n in paths if n not in names]
    if unused:
        raise ValueError(f"--model-path for {unused}, which --models does not train")
    missing = [str(p) for p in paths.values() if not p.is_dir()]
    missing += [str(p) for p in checkpoints.values() if not (p / "space_config.json").is_file()]
    if missing:
        raise ValueError(f"{missing[0]}: not a directory, or (--checkpoint) not a SPACE model with space_config.json")
    if a.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {a.nproc}")
    # the evaluation's flags, checked before hours of training (space-eval refused them after it, and
    # --max-steps 0 was dropped: the config's whole run)
    for flag, value in (("--limit", a.limit), ("--max-new-tokens", a.max_new_tokens), ("--max-steps", a.max_steps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    from space.eval.tasks import LANGUAGES
    from space.models import parse_dtype

    unknown = [lang for lang in a.languages.split(",") if lang not in LANGUAGES]
    if unknown:
        raise ValueError(f"--languages: unknown {unknown}; choose from {', '.join(LANGUAGES)}")
    parse_dtype(a.dtype)
    finals = {}
    for name in names:
        run_dir = a.out / name
        finals[name] = run_dir / "final"
        extra = ["--output_dir", str(run_dir)] + (["--max_steps", str(a.max_steps)] if a.max_steps is not None else [])
        extra += ["--model_name_or_path", str(paths[name])] if name in paths else []
        train = [MODELS[name], *extra, *a.train_args.split()]
        record = run_dir / "train_command.json"  # what made final/: a rerun with other flags trains again
        done = (finals[name] / "space_config.json").is_file() and record.is_file() and \
            json.loads(record.read_text()) == train
        if not done:  # the launcher trains on (more steps), keeps a finished run, or refuses other SPACE settings
            before = model_files(str(finals[name]))
            sh([str(ROOT / "run_sft_multi_node.sh"), *train])
            write_text_atomic(record, json.dumps(train))
            if model_files(str(finals[name])) != before:  # another artifact: evaluations of the old one are stale
                for stale in sorted(run_dir.glob("eval-*")):
                    print(f"[table1] {name}: retrained, so {stale} (of the previous artifact) is removed", flush=True)
                    shutil.rmtree(stale)
    rows = []
    for name, final in {**finals, **checkpoints}.items():
        mode = json.loads((final / "space_config.json").read_text())["mode"]
        model_args = ["--model", str(final)] if mode == "full" else ["--adapter", str(final)]
        for lang in a.languages.split(","):
            out = a.out / name / f"eval-{lang}"
            sh([*eval_command(a, name), *model_args, "--dataset", f"humaneval-x:{lang}", "--limit", str(a.limit),
                "--methods", "ar,hf,space", "--max-new-tokens", str(a.max_new_tokens), "--dtype", a.dtype,
                "--out", str(out)])
            s = json.loads((out / "summary.json").read_text())
            rows.append((name, mode, lang, s, out))
    lines = ["| Model | mode | HumanEval-X lang | Pass@1 SPACE (AR) | tokens/step | speedup vs AR | speedup vs HF "
             "| exact | XSum speedup | CIP speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: "-" if v is None else v if isinstance(v, str) else f"{100 * v:.1f}"  # noqa: E731
    num = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731  (a run whose every question was skipped has none)
    for name, mode, lang, s, _ in rows:
        p, x = s["pass_at_1"], s["speedup"]
        lines.append(f"| {name} | {mode} | {lang} | {pct(p.get('space'))} ({pct(p.get('ar'))}) | "
                     f"{num(s['methods'].get('space', {}).get('tokens_per_step'))} | {num(x.get('space_vs_ar'))} | "
                     f"{num(x.get('space_vs_hf'))} | {pct(s.get('exact_match_rate'))} % | n/a | n/a |")
    # what each row ran (DESIGN §6: every result names its model, adapter, k, dtype, device, versions, seed,
    # max_new_tokens, dataset and limit), from its own summary.json
    runs = ["", "Runs (each row's summary.json has the rest):"]
    for name, _, lang, s, out in rows:
        m = s["meta"]
        runs.append(f"- {name} {lang}: model {m.get('model')}, adapter {m.get('adapter')}, k {m.get('mask_num')}, "
                    f"{m.get('dtype')} on {m.get('device')}, seed {m.get('seed')}, max_new_tokens "
                    f"{m.get('max_new_tokens')}, dataset {m.get('dataset')}, limit {m.get('limit')}, torch "
                    f"{m.get('torch')}, transformers {m.get('transformers')} ({out / 'summary.json'})")
    table = "\n".join(lines + runs) + "\n\nXSum and CIP are not in ../shared/data: n/a.\n"
    a.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out / "table1.md", table)
    print(table)


if __name__ == "__main__":
    console("reproduce_table1", main)()
