"""Recipe sweep at equal wall-clock, scored on the dev-set probe (issue #13, item 5).

Each arm of the sweep file trains from scratch with ``space-train`` (the base config plus the arm's
flags, ``--max_train_minutes`` from the file), then ``space-probe`` scores it on the dev set, and
``space.decoding.tree.replay`` turns its ranks into exact greedy tokens/step. Arms are comparable
because they had the same minutes on the same machine; nothing else may run meanwhile.

    python scripts/sweep_recipes.py configs/sweep/recipes.yaml --out results/sweep [--arms base,k3]

Per arm, ``<out>/<arm>/`` gets train.json (mode, steps, seconds), log_history.json, and the probe's
probe.json, probe.png and ranks.jsonl: everything the table is built from.

Resumable: an arm whose ``<out>/<arm>/probe.json`` exists is not rerun, an arm whose
``<runs>/<arm>/final`` exists is only probed, and ``space-train`` resumes a half-trained arm from
its last checkpoint (with a fresh budget: note the steps in the table). Writes ``<out>/sweep.json`` and
``<out>/sweep.md`` (one row per arm) after every arm.

Columns: training steps and minutes; dev-set top-1 at offsets 0 / 1 / 2; the chain bound at
k = 3 (1 + sum over j < 3 of P(offsets 0..j all top-1)); both again on the general prompts alone
("-" for probes older than them); replayed tokens/step of a chain with k = 3 and 4 groups, and of
the shipped layout (k = 1, 2 groups, tree [[0],[1],[2]], lookup off). k = 3
is the widest view every arm has, since the k = 3 arm drafts only 3 offsets.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from space.cli import console
from space.decoding.tree import replay
from space.eval.tree_search import load_ranks
from space.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
# the probe's answers for a frozen-base arm: SmolLM2's greedy answers on the dev set, computed once;
# a lora / full arm is a new model, so space-probe generates its own
BASE_ANSWERS = ROOT / "results/probe_stage1/answers.jsonl"
TRAIN_KEYS = ("mode", "global_step", "train_runtime_s")  # copied from the artifact's space_config.json
LAYOUTS = {"chain k=3, 4 groups": (3, 4, None), "shipped (lookup off)": (1, 2, ((0,), (1,), (2,)))}


RECIPE = "recipe.json"  # <runs>/<arm>/: what trained the arm (base config, minutes, flags)


def recipe(cfg: dict, flags: list[str]) -> dict:
    """What makes an arm: the base config, the minutes and the arm's own flags."""
    return {"base_config": str(cfg["base_config"]), "minutes": cfg["minutes"], "flags": [str(f) for f in flags]}


def recorded_recipe(path: Path) -> dict | None:
    """The recipe in ``path`` (``<runs>/<arm>/recipe.json``, or the ``"recipe"`` of ``<out>/<arm>/train.json``),
    None when the file or the key is missing (an arm made before recipes were recorded)."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data.get("recipe") if path.name == "train.json" else data


def check_recipes(arms: dict, cfg: dict, a: argparse.Namespace) -> None:
    """Refuse an arm done (probed in <out>, or trained in <runs>) with another recipe than the sweep file's
    now: it would be reused, and the table would show its numbers under this file's minutes and flags.

    Raises:
        ValueError: the arm, what it was made with and what the file says now.
    """
    unchecked = []
    for name, flags in arms.items():
        want = recipe(cfg, flags or [])
        for path in (a.out / name / "train.json", a.runs / name / RECIPE):
            made = recorded_recipe(path)
            if made is not None and made != want:
                raise ValueError(f"arm {name!r} was made with {made} ({path}), but {a.sweep} now says {want}: "
                                 "rename the arm, or pass another --out and --runs")
        if (a.out / name / "train.json").is_file() and recorded_recipe(a.out / name / "train.json") is None:
            unchecked.append(name)
    if unchecked:
        print(f"[sweep] warning: arms {', '.join(unchecked)} were made before recipes were recorded: their minutes "
              f"and flags are not checked against {a.sweep}", file=sys.stderr, flush=True)


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def train_and_probe(name: str, flags: list[str], cfg: dict, a: argparse.Namespace) -> None:
    """Train arm ``name`` into <runs>/<name>, probe it into <out>/<name> (probe.json, ranks.jsonl)."""
    artifact = a.runs / name / "final"
    if not artifact.is_dir():
        run(["bash", "run_sft_multi_node.sh", cfg["base_config"], "--output_dir", str(a.runs / name),
             "--max_train_minutes", str(cfg["minutes"]), *flags])
        write_text_atomic(a.runs / name / RECIPE, json.dumps(recipe(cfg, flags), indent=1) + "\n")
    # what the table needs from training travels into <out>, so a clone without runs/ can rebuild it
    meta = json.loads((artifact / "space_config.json").read_text())
    (a.out / name).mkdir(parents=True, exist_ok=True)
    made = recorded_recipe(a.runs / name / RECIPE)  # None: trained before recipes were recorded
    write_text_atomic(a.out / name / "train.json", json.dumps({**{k: meta[k] for k in TRAIN_KEYS},
                                                               **({"recipe": made} if made else {})}, indent=1) + "\n")
    write_text_atomic(a.out / name / "log_history.json", (a.runs / name / "log_history.json").read_text())
    answers = ["--answers", str(a.answers)] if meta["mode"] == "frozen-base" and a.answers else []
    # a full-mode artifact is a whole HF checkpoint: the probe loads it as the model
    model = ["--model" if meta["mode"] == "full" else "--adapter", str(artifact)]
    run([sys.executable, "-m", "space.eval.probe", *model, "--out", str(a.out / name), *answers, *a.probe_flags.split()])


def score(name: str, a: argparse.Namespace) -> dict:
    """One row of the table from <out>/<name>/probe.json, ranks.jsonl and train.json."""
    summary = json.loads((a.out / name / "probe.json").read_text())["summary"]
    probe, general = summary["all"], summary.get("general")  # issue 30's targets are read on general text
    meta = json.loads((a.out / name / "train.json").read_text())
    ranks = load_ranks(a.out / name / "ranks.jsonl", None)
    row = {"arm": name, "mode": meta["mode"], "steps": meta["global_step"],
           "train_minutes": round(meta["train_runtime_s"] / 60, 1),
           "top1": [round(x, 3) for x in probe["topk"]["1"][:3]],
           "top5": [round(x, 3) for x in probe["topk"]["5"][:3]],
           "chain_bound_k3": round(1 + sum(probe["chain_all_top1"][:3]), 3),
           "general_top1": [round(x, 3) for x in general["topk"]["1"][:3]] if general else None,
           "general_chain_bound_k3": round(1 + sum(general["chain_all_top1"][:3]), 3) if general else None}
    for layout, (k, groups, tree) in LAYOUTS.items():
        row[layout] = round(replay(ranks, k, groups, tree).tokens_per_step, 3)
    return row


def markdown(rows: list[dict]) -> str:
    head = ("| arm | mode | steps | train min | top-1, offset 0 / 1 / 2 | top-5, offset 0 / 1 / 2 | chain bound k=3 | "
            "general: top-1, offset 0 / 1 / 2 | general: chain bound k=3 | "
            + " | ".join(f"tokens/step, {name}" for name in LAYOUTS) + " |")
    lines = [head, "|" + "---|" * (9 + len(LAYOUTS))]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['mode']} | {r['steps']} | {r['train_minutes']} | "
                     + " / ".join(f"{x:.3f}" for x in r["top1"]) + " | " + " / ".join(f"{x:.3f}" for x in r["top5"])
                     + f" | {r['chain_bound_k3']:.3f} | "
                     + (" / ".join(f"{x:.3f}" for x in r["general_top1"]) if r["general_top1"] else "-")
                     + " | " + (f"{r['general_chain_bound_k3']:.3f}" if r["general_top1"] else "-") + " | "
                     + " | ".join(f"{r[name]:.3f}" for name in LAYOUTS) + " |")
    return "\n".join(lines) + "\n"


def write_table(arms: dict, cfg: dict, a: argparse.Namespace) -> list[dict]:
    """(Re)write <out>/sweep.json and sweep.md from every arm probed so far, in file order."""
    rows = [score(name, a) for name in arms if (a.out / name / "probe.json").is_file()]
    write_text_atomic(a.out / "sweep.json", json.dumps({"sweep": str(a.sweep), "minutes": cfg["minutes"],
                                                       "rows": rows}, indent=1) + "\n")
    write_text_atomic(a.out / "sweep.md", markdown(rows))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, help="sweep YAML: base_config, minutes, arms (name -> space-train flags)")
    p.add_argument("--out", type=Path, default=ROOT / "results/sweep", help="folder for probes and the table")
    p.add_argument("--arms", default=None, help="comma list of arms to run now (default all, in file order)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs/sweep", help="folder for the arms' training runs")
    p.add_argument("--answers", default=str(BASE_ANSWERS),
                   help="greedy answers of the base on the dev set, reused by frozen-base arms ('' = let the probe make them)")
    p.add_argument("--probe-flags", default="", help="extra space-probe flags, e.g. '--limit 10' (smoke runs)")
    a = p.parse_args(argv)
    cfg = yaml.safe_load(a.sweep.read_text())
    arms = cfg["arms"]
    chosen = [s.strip() for s in a.arms.split(",")] if a.arms else list(arms)
    unknown = sorted(set(chosen) - set(arms))
    if unknown:
        p.error(f"unknown arms {unknown}; {a.sweep} has {list(arms)}")
    check_recipes(arms, cfg, a)  # before any training: a done arm of another recipe would be reused
    a.out.mkdir(parents=True, exist_ok=True)
    rows = write_table(arms, cfg, a)
    for name in chosen:
        if not (a.out / name / "probe.json").is_file():
            train_and_probe(name, [str(f) for f in arms[name]], cfg, a)
            rows = write_table(arms, cfg, a)
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    console("sweep_recipes", main)()
