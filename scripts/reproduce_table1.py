"""Reproduce the paper's Table 1 (DESIGN §2, §7): SAR-SFT each model, evaluate, write one table.

For every model: train with its config through ``run_sft_multi_node.sh`` (skipped when the
artifact exists), then ``space-eval`` on HumanEval-X languages with methods ar, hf, space, and
collect pass@1, tokens/step and speedups into a markdown table with the paper's columns.

    python scripts/reproduce_table1.py --models smollm2 --max-steps 200 --limit 10      # this CPU
    python scripts/reproduce_table1.py --models llama2-7b,llama2-70b --languages python,cpp,java,js,go,rust \\
        --device cuda --dtype bfloat16                                                   # a GPU cluster

``--out`` is resolved against the folder the script is called from, once, so training (which runs
from the repo root) and evaluation write and read the same place.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from space.cli import console

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name -> training config; model paths for the LLaMA-2 family live in the configs
    "tiny": "configs/train/tiny_smoke.yaml",
    "smollm2": "configs/train/smollm2_frozen_base_cpu.yaml",
    "llama2-7b": "configs/train/llama2_7b_full_zero2.yaml",
    "llama2-7b-lora": "configs/train/llama2_7b_lora.yaml",
    "llama2-70b": "configs/train/llama2_70b_full_zero3.yaml",
}


def sh(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, **(env or {})})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--languages", default="python", help="HumanEval-X languages")
    ap.add_argument("--limit", type=int, default=10, help="problems per language (164 = all)")
    ap.add_argument("--max-steps", type=int, default=None, help="cap training steps (small budgets)")
    ap.add_argument("--train-args", default="", help="extra training overrides, e.g. '--datasets mbpp'")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=lambda s: Path(s).resolve(), default=Path("runs/table1").resolve(),
                    help="output folder (relative to the current folder)")
    a = ap.parse_args(argv)
    names = a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:  # before any training: a typo in the last name must not cost the first model's run
        raise ValueError(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    rows = []
    for name in names:
        run_dir = a.out / name
        final = run_dir / "final"
        if not (final / "space_config.json").is_file():
            extra = ["--output_dir", str(run_dir)] + (["--max_steps", str(a.max_steps)] if a.max_steps else [])
            sh([str(ROOT / "run_sft_multi_node.sh"), MODELS[name], *extra, *a.train_args.split()])
        mode = json.loads((final / "space_config.json").read_text())["mode"]
        model_args = ["--model", str(final)] if mode == "full" else ["--adapter", str(final)]
        for lang in a.languages.split(","):
            out = run_dir / f"eval-{lang}"
            sh([sys.executable, "-m", "space.eval", *model_args, "--dataset", f"humaneval-x:{lang}", "--limit",
                str(a.limit), "--methods", "ar,hf,space", "--max-new-tokens", str(a.max_new_tokens),
                "--device", a.device, "--dtype", a.dtype, "--out", str(out)])
            s = json.loads((out / "summary.json").read_text())
            rows.append((name, mode, lang, s))
    lines = ["| Model | mode | HumanEval-X lang | Pass@1 SPACE (AR) | tokens/step | speedup vs AR | speedup vs HF "
             "| exact | XSum speedup | CIP speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, mode, lang, s in rows:
        p = s["pass_at_1"]
        fmt = lambda v: "-" if v is None else v if isinstance(v, str) else f"{100 * v:.1f}"  # noqa: E731
        lines.append(f"| {name} | {mode} | {lang} | {fmt(p.get('space'))} ({fmt(p.get('ar'))}) | "
                     f"{s['methods']['space'].get('tokens_per_step', 0):.2f} | {s['speedup'].get('space_vs_ar', 0):.2f} | "
                     f"{s['speedup'].get('space_vs_hf', 0):.2f} | {fmt(s.get('exact_match_rate'))} % | n/a | n/a |")
    table = "\n".join(lines) + "\n\nXSum and CIP are not in ../shared/data: n/a.\n"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table1.md").write_text(table)
    print(table)


if __name__ == "__main__":
    console("reproduce_table1", main)()
