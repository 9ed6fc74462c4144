"""Records -> summary.json, summary.md (paper Table 1 columns) and plots; never runs a model.

Definitions (DESIGN §6): tokens/s = new tokens / wall time summed over all turns; speedup = a
method's tokens/s over the baseline's on the same prompts (also reported as the median of the
per-question ratios, which one slow outlier cannot move); tokens/step (MAT) = new tokens / target
forward passes that emit tokens, first step and bonus token counted, for every method (HF's
forward passes are counted by a hook, not assumed; AR's and HF's prefill emits the first token,
while SPACE's prefill of the prompt's first n-1 tokens emits none and is not counted: about one
forward a turn, 1 % of a 256-token answer at 2.9 tokens/step, in SPACE's favour); acceptance of offset j = share of the SPACE steps that had a
candidate at offset j (m > j) that accepted it (a > j), with the share over all steps beside it,
labelled; the histogram counts the tokens each step actually emitted (EOS and max_new_tokens cut
the last step); exactness = share of samples whose greedy SPACE ids equal the AR ids in every
turn (``exact_turn_rate``: the share of turns, beside it): 100 % is
expected in float32; in bfloat16/float16 the differently shaped SPACE forward can flip a near-tie
of the argmax, so a lower rate there is reported as measured, never hidden.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from ..decoding.config import DEFAULT_MASK_NUM, DecodeConfig
from ..jsonl import save_figure_atomic, write_text_atomic
from .execute import estimate_pass_at_k


def _method_stats(rows: list[dict]) -> dict:
    tokens = sum(n for r in rows for c in r["choices"] for n in c["new_tokens"])
    wall = sum(t for r in rows for c in r["choices"] for t in c["wall_time"])
    steps = [s for r in rows for c in r["choices"] for s in c["steps"]]
    stats = {"samples": len(rows), "new_tokens": tokens, "wall_time_s": round(wall, 3),
             "tokens_per_s": round(tokens / wall, 3) if wall else 0.0}
    if steps and None not in steps:
        stats["forward_passes"] = sum(steps)
        stats["tokens_per_step"] = round(tokens / max(sum(steps), 1), 3)
    rows_fed = [q for r in rows for c in r["choices"] for turn in c.get("rows") or [] for q in turn]
    if rows_fed:  # SPACE records since issue 31: the block rows of every step, padding included
        stats["rows_per_step"] = round(sum(rows_fed) / len(rows_fed), 2)
        # records since issue 43's row buckets say how many of a step's rows were padding; with
        # older records among them (a resumed run) the share is not known, so none is given
        padding = [p for r in rows for c in r["choices"] for turn in c.get("padding") or [] for p in turn]
        if any(padding) and len(padding) == len(rows_fed):
            stats["padding_per_step"] = round(sum(padding) / len(padding), 2)
    host = [h for r in rows for c in r["choices"] for turn in c.get("host_ms") or [] for h in turn]
    if host:  # SPACE records since issue 43: each step's time outside the model (planner, layout, verify, cache)
        plan = [p for r in rows for c in r["choices"] for turn in c.get("plan_ms") or [] for p in turn]
        stats["host_ms_per_step"] = round(statistics.median(host), 3)
        stats["plan_ms_per_step"] = round(statistics.median(plan), 3) if plan else None
        timed = sum(t for r in rows for c in r["choices"] if c.get("host_ms") for t in c["wall_time"])
        stats["host_share"] = round(sum(host) / 1e3 / timed, 4) if timed else None  # over records that have it
    return stats


def _acceptance(rows: list[dict], k: int) -> dict:
    """Tokens-per-step histogram and per-offset acceptance of SPACE records, k = most candidates.

    Records from before per-step candidates were stored give only the all-steps figures
    (acceptance over steps with candidates is then None).
    """
    steps = []  # (accepted a, candidates m or None, tokens emitted)
    for r in rows:
        for c in r["choices"]:
            for i, accepted in enumerate(c["accept_lengths"]):
                cands = c.get("candidates", [None] * len(c["accept_lengths"]))[i] or [None] * len(accepted)
                emitted = c.get("step_tokens", [[]])[i] if c.get("step_tokens") else [a + 1 for a in accepted]
                steps += zip(accepted, cands, emitted)
    hist = Counter(e for _, _, e in steps)
    known = [(a, m) for a, m, _ in steps if m is not None]
    with_cands = []
    for j in range(k):
        had = [a for a, m in known if m > j]
        with_cands.append(round(sum(a > j for a in had) / len(had), 4) if had else None)
    top = max([k + 1, *hist])  # a lookup step may emit more than the recorded k allows
    return {"tokens_per_step_histogram": {str(n): hist.get(n, 0) for n in range(1, top + 1)},
            "acceptance_per_offset": with_cands if known else None,
            "acceptance_per_offset_all_steps": [round(sum(a > j for a, _, _ in steps) / len(steps), 4)
                                                if steps else 0.0 for j in range(k)],
            "steps_with_candidates": round(sum(m > 0 for _, m in known) / len(known), 4) if known else None}


def _sources(rows: list[dict]) -> dict | None:
    """Where SPACE's accepted tokens came from (issue 44), from the per-step records: how many came
    from the mask drafts, from prompt lookup, from a datastore (``space.decoding.datastore``; 0
    without one), or from the masks and a lookup (the same token offered by both), and per source
    (the datastore's counted as lookup) the acceptance per offset j: over the steps whose deepest
    candidate from that source is deeper than j, how often the first j+1 accepted tokens were all
    offered by it. None for records written before the sources were stored."""
    steps = [(src, off) for r in rows for c in r["choices"]
             for turn_src, turn_off in zip(c.get("sources") or [], c.get("offered") or []) for src, off in zip(turn_src, turn_off)]
    if not steps:
        return None
    counts = Counter(ch for src, _ in steps for ch in src)
    out = {"accepted_from": {"mask": counts["m"], "lookup": counts["l"], "datastore": counts["d"], "both": counts["b"]},
           "acceptance_per_offset_by_source": {}}
    for name, letters, i in (("mask", "mb", 0), ("lookup", "lbd", 1)):
        rates = []
        for j in range(max((o[i] for _, o in steps), default=0)):
            had = [src for src, o in steps if o[i] > j]
            rates.append(round(sum(len(src) > j and all(ch in letters for ch in src[: j + 1]) for src in had) / len(had), 4))
        out["acceptance_per_offset_by_source"][name] = rates
    return out


def _pass_at(rows: list[dict], k: int = 1):
    """pass@k over the samples whose tests ran: one without a toolchain when it was made ("n/a",
    stored with it) is no failure, and counted it pulled a resumed run's rate down where the
    toolchain came later (:func:`_not_run` counts them); "n/a ..." when none ran, None without
    execution results."""
    results = [[c["exec"] for c in r["choices"] if "exec" in c] for r in rows]
    results = [res for res in results if res]
    if not results:
        return None
    ran = [[x for x in res if not x["result"].startswith("n/a")] for res in results]
    if not any(ran):
        return results[0][0]["result"]
    per_q = [estimate_pass_at_k(len(res), sum(x["passed"] for x in res), k) for res in ran if len(res) >= k]
    return round(sum(per_q) / len(per_q), 4) if per_q else None


def _not_run(rows: list[dict]) -> int:
    """Samples whose tests did not run ("n/a"), beside samples whose tests did."""
    results = [c["exec"]["result"] for r in rows for c in r["choices"] if "exec" in c]
    na = sum(x.startswith("n/a") for x in results)
    return na if na < len(results) else 0


def summarize(records: list[dict], meta: dict) -> dict:
    """summary.json content from the per-sample records and the run metadata.

    Skipped questions (records with a ``skipped`` reason, see ``bench.run_bench``) count in no
    method's numbers; ``summary["skipped"]`` says how many and why: ``{"count", "questions": {id: reason}}``.
    ``summary["questions"]``: the ids of the questions counted, in the records' order (a folder's
    samples.jsonl can hold more: an earlier run's with a larger ``--limit``).
    """
    skipped = {r["question_id"]: r["skipped"] for r in records if "skipped" in r}
    # a question skipped for one method only (a later turn that outgrew the context on its answers:
    # bench.run_question) leaves the others' records too, or the methods' numbers cover other questions
    records = [r for r in records if r["question_id"] not in skipped]
    by_method = defaultdict(list)
    for r in records:
        by_method[r["model_id"]].append(r)
    methods = {m: _method_stats(rows) for m, rows in by_method.items()}
    summary = {"meta": meta, "methods": methods, "speedup": {}, "median_question_speedup": {}, "pass_at_1": {},
               "questions": list(dict.fromkeys(r["question_id"] for r in records))}
    if skipped:
        summary["skipped"] = {"count": len(skipped), "questions": skipped}
    per_q = {m: {r["question_id"]: _method_stats([r])["tokens_per_s"] for r in rows} for m, rows in by_method.items()}
    for base in ("ar", "hf", "pld"):
        for m in methods:
            if m != base and base in methods and methods[base]["tokens_per_s"]:
                key = f"{m}_vs_{base}"
                summary["speedup"][key] = round(methods[m]["tokens_per_s"] / methods[base]["tokens_per_s"], 3)
                ratios = [tps / per_q[base][q] for q, tps in per_q[m].items() if per_q[base].get(q)]
                summary["median_question_speedup"][key] = round(statistics.median(ratios), 3) if ratios else None
    for m, rows in by_method.items():
        summary["pass_at_1"][m] = _pass_at(rows, 1)
        if not_run := _not_run(rows):  # left out of pass@k, and said so
            summary.setdefault("tests_not_run", {})[m] = not_run
        n = max(len(r["choices"]) for r in rows)
        if n > 1:
            summary.setdefault(f"pass_at_{n}", {})[m] = _pass_at(rows, n)
    if "space" in by_method:
        # a step verifies up to k mask drafts, or up to lookup_tokens prompt-lookup candidates
        k = max(meta.get("mask_num", DEFAULT_MASK_NUM), meta.get("lookup_tokens") or 0)
        methods["space"].update(_acceptance(by_method["space"], k))
        sources = _sources(by_method["space"])
        if sources is not None:
            methods["space"].update(sources)
        if meta.get("mask_num") and not meta.get("lookup_tokens") and meta.get("tree") != "dynamic":
            # lookup candidates have no cap, and the dynamic tree's only bound is k + 1
            layout = DecodeConfig(meta["mask_num"], meta.get("num_groups"), tree=meta.get("tree"))
            methods["space"]["layout_cap_tokens_per_step"] = round(layout.max_tokens_per_step(), 3)
        if "ar" in by_method and meta.get("temperature", 0) == 0:
            ar = {r["question_id"]: r for r in by_method["ar"]}
            samples = [(c_s["token_ids"], c_a["token_ids"]) for r in by_method["space"] if r["question_id"] in ar
                       for c_s, c_a in zip(r["choices"], ar[r["question_id"]]["choices"])]
            turns = [(t_s, t_a) for s, a in samples for t_s, t_a in zip(s, a)]
            # DESIGN §6: a sample is exact when every turn is (a second turn's prompt holds the first answer)
            summary["exact_match_rate"] = round(sum(s == a for s, a in samples) / len(samples), 4) if samples else None
            summary["exact_turn_rate"] = round(sum(s == a for s, a in turns) / len(turns), 4) if turns else None
        cats = defaultdict(list)
        for r in by_method["space"]:
            cats[r["category"]].append(r)
        summary["categories"] = {}
        for cat, rows in sorted(cats.items()):
            entry = {"space_tokens_per_step": _method_stats(rows).get("tokens_per_step")}
            ids = {r["question_id"] for r in rows}
            for base in ("ar", "hf", "pld"):
                if base in by_method:
                    b = _method_stats([r for r in by_method[base] if r["question_id"] in ids])
                    entry[f"speedup_vs_{base}"] = round(_method_stats(rows)["tokens_per_s"] / b["tokens_per_s"], 3) if b["tokens_per_s"] else None
                    if base == "pld":  # tokens/step on the same prompts: the planner's target (issue 44)
                        entry["pld_tokens_per_step"] = b.get("tokens_per_step")
            summary["categories"][cat] = entry
    return summary


def _fmt(x, pct=False):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def priced_by(meta: dict) -> str:
    """What priced a dynamic tree's steps, as the layout text's tail: a curve measured when the run
    started (space-eval --step-cost), or the stored curve of another device type than the run's."""
    setup, device = meta.get("step_cost_setup"), str(meta.get("device") or "cpu").split(":")[0]
    if not isinstance(setup, dict):
        return ""
    if setup.get("measured"):
        return f", steps priced by this machine's step cost, measured at load in {setup.get('seconds')} s"
    if setup.get("device", "cpu") != device:
        return f", steps priced by a {setup.get('device', 'cpu')} step-cost curve"
    return ""


def layout_text(meta: dict, rows_per_step: float | None = None, padding_per_step: float | None = None) -> str:
    """The decoding layout of a run's meta in words: k, groups, tree (chain, static tree, or dynamic),
    lookup tokens and continuations (a datastore's too), and the mean rows per step (with the padding among
    them) when given."""
    tree = meta.get("tree")
    rows = f", {rows_per_step:.1f} rows per step on average" if rows_per_step else ""
    if rows and padding_per_step:
        rows += f" ({padding_per_step:.1f} of them padding)"
    if tree == "dynamic":
        store = meta.get("datastore")
        return (f"dynamic tree (k <= {meta.get('mask_num')}, <= {meta.get('num_groups')} mask group(s), "
                f"<= {meta.get('row_budget')} rows{rows}{priced_by(meta)}), prompt lookup "
                f"{meta.get('lookup_tokens') or 0} tokens, {meta.get('lookup_branches') or 1} continuation(s)"
                + (f", {meta.get('datastore_branches')} more from a datastore of {store['tokens']:,} tokens"
                   if store else ""))
    shape = f"tree {json.dumps(tree, separators=(',', ':'))}" if tree else "chain of top-1 drafts"
    groups = meta.get("num_groups")
    return (f"k = {meta.get('mask_num')}, {groups if groups is not None else '?'} mask group(s), {shape}, "
            f"prompt lookup {meta.get('lookup_tokens') or 0} tokens{rows}")


def to_markdown(s: dict) -> str:
    """Paper Table 1 columns first, then one row per method and per category."""
    m, meta, sp, p1 = s["methods"], s["meta"], s["speedup"], s["pass_at_1"]
    model = meta.get("model", "?") + (f" + {Path(meta['adapter']).name}" if meta.get("adapter") else "")
    device_map = meta.get("device_map") or ""
    placement = (f", device map {'(inline JSON)' if device_map.lstrip().startswith('{') else device_map}"
                 if device_map else "")
    if meta.get("ranks", 1) > 1:
        placement += f", {meta['ranks']} ranks (each question's methods in one process)"
    if meta.get("capture"):  # issue 58: every method but hf replays CUDA graphs (the buffers eagerly on a CPU)
        placement += (f", captured steps over a cache of {meta['capture']} slots (AR, SPACE, and PLD by the SPACE decoder "
                      "with no mask group; hf eager)")
    lines = [f"# SPACE evaluation: {meta.get('dataset')} ({meta.get('num_questions')} questions)", "",
             f"layout: {layout_text(meta, m.get('space', {}).get('rows_per_step'), m.get('space', {}).get('padding_per_step'))}; max_new_tokens = {meta.get('max_new_tokens')}, limit = {meta.get('limit')}, seed = {meta.get('seed')}, temperature = {meta.get('temperature')}, dtype = {meta.get('dtype')}, "
             f"device = {meta.get('device')} ({meta.get('machine')}){placement}, torch {meta.get('torch')}, "
             f"transformers {meta.get('transformers')}", "",
             "| Model | Dataset | Pass@1 SPACE (AR) | tokens/step | speedup vs AR | speedup vs HF | PLD speedup vs HF | exact (greedy) |",
             "|---|---|---|---|---|---|---|---|",
             f"| {model} | {meta.get('dataset')} | {_fmt(p1.get('space'), True)} ({_fmt(p1.get('ar'), True)}) | "
             f"{_fmt(m.get('space', {}).get('tokens_per_step'))} | {_fmt(sp.get('space_vs_ar'))} | "
             f"{_fmt(sp.get('space_vs_hf'))} | {_fmt(sp.get('pld_vs_hf'))} | {_fmt(s.get('exact_match_rate'), True)} % |",
             "", "exact (greedy) = share of samples whose SPACE tokens equal AR's in every turn; expected 100 % in float32 (bfloat16"
             " and float16 can flip near-ties: the rate is reported as measured)",
             "", "| method | new tokens | time (s) | tokens/s | tokens/step | speedup vs AR | speedup vs HF | speedup vs PLD | pass@1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, st in m.items():
        lines.append(f"| {name} | {st['new_tokens']} | {st['wall_time_s']:.1f} | {st['tokens_per_s']:.2f} | "
                     f"{_fmt(st.get('tokens_per_step'))} | {_fmt(1.0 if name == 'ar' else sp.get(f'{name}_vs_ar'))} | "
                     f"{_fmt(1.0 if name == 'hf' else sp.get(f'{name}_vs_hf'))} | "
                     f"{_fmt(1.0 if name == 'pld' else sp.get(f'{name}_vs_pld'))} | {_fmt(p1.get(name), True)} |")
    if s.get("tests_not_run"):
        lines += ["", "pass@1 over the samples whose tests ran; not run (\"n/a\": no toolchain, or no test runner for "
                  "the language, as Go's, when made): "
                  + ", ".join(f"{k} {v}" for k, v in s["tests_not_run"].items())]
    med = s.get("median_question_speedup", {})
    if med:
        lines += ["", "Median per-question speedup: " + ", ".join(f"{k.replace('_vs_', ' vs ')} {v:.2f}"
                                                              for k, v in med.items() if v is not None)]
    if "space" in m:
        sm = m["space"]
        lines += ["", "Tokens emitted per step (histogram): " + ", ".join(
            f"{n}: {c}" for n, c in sm["tokens_per_step_histogram"].items())]
        if sm.get("acceptance_per_offset") is not None:
            lines.append("Acceptance per offset j, over steps with a candidate at j: " + ", ".join(
                _fmt(a) for a in sm["acceptance_per_offset"])
                + f" ({_fmt(sm['steps_with_candidates'], True)} % of steps had a candidate)")
        lines.append("Acceptance per offset j, over all steps: " + ", ".join(
            _fmt(a) for a in sm["acceptance_per_offset_all_steps"]))
        if sm.get("host_ms_per_step") is not None:
            # a GPU runs behind the host: the step's one read waits for its queued work, so on CUDA
            # (and most under --capture, where the forward call only enqueues a graph) this is not host work
            where = ("Time per SPACE step outside the model's forward and LM head calls (on CUDA it includes "
                     "waiting for the GPU's queued work)" if str(meta.get("device", "")).startswith("cuda")
                     else "Host work per SPACE step (outside the model's forward and LM head)")
            lines.append(f"{where}: median "
                         f"{sm['host_ms_per_step']:.3f} ms, of which planner + layout {_fmt(sm.get('plan_ms_per_step'))} ms; "
                         f"{_fmt(sm.get('host_share'), True)} % of SPACE's wall time")
        if sm.get("accepted_from"):
            src, total = sm["accepted_from"], sum(sm["accepted_from"].values())
            lines.append("Accepted tokens by source: " + ", ".join(
                f"{name} {n} ({_fmt(n / total if total else None, True)} %)" for name, n in
                (("mask drafts", src["mask"]), ("prompt lookup", src["lookup"]),
                 *((("datastore", src["datastore"]),) if src.get("datastore") else ()), ("both", src["both"]))))
            for name, rates in sm["acceptance_per_offset_by_source"].items():
                lines.append(f"Acceptance per offset j of {name} candidates, over steps with one at j: "
                             + (", ".join(_fmt(a) for a in rates) or "none offered"))
        if "layout_cap_tokens_per_step" in sm:  # none with prompt lookup: its candidates are unbounded
            lines.append(f"Layout cap ({layout_text(meta)}; every draft accepted): "
                         f"{sm['layout_cap_tokens_per_step']:.2f} tokens/step")
    if len(s.get("categories", {})) > 1:
        lines += ["", "| category | tokens/step | PLD tokens/step | speedup vs AR | speedup vs HF | speedup vs PLD |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c} | {_fmt(e['space_tokens_per_step'])} | {_fmt(e.get('pld_tokens_per_step'))} | "
                  f"{_fmt(e.get('speedup_vs_ar'))} | {_fmt(e.get('speedup_vs_hf'))} | {_fmt(e.get('speedup_vs_pld'))} |"
                  for c, e in s["categories"].items()]
    lines += _provenance(s)
    return "\n".join(lines) + "\n"


def _provenance(s: dict) -> list[str]:
    """Skipped questions and the code commits that wrote the samples."""
    lines = []
    if s.get("skipped"):
        lines += ["", f"Skipped {s['skipped']['count']} question(s), in no method's numbers:"]
        lines += [f"- {q}: {why}" for q, why in s["skipped"]["questions"].items()]
    if s["meta"].get("commits"):
        lines += ["", "Samples written by commit(s): " + ", ".join(s["meta"]["commits"])]
    return lines


def plot(s: dict, out_dir: Path) -> list[Path]:
    """PNG plots: tokens/step histogram, tokens/s per method, tokens/step per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    m = s["methods"]
    if "space" in m:
        hist = m["space"]["tokens_per_step_histogram"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(list(hist), list(hist.values()), color="#4c72b0")
        ax.set(xlabel="tokens emitted per step", ylabel="steps", title="SPACE tokens emitted per step")
        paths.append(_save(fig, out_dir / "accept_hist.png"))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(list(m), [st["tokens_per_s"] for st in m.values()], color="#55a868")
    ax.set(ylabel="tokens/s", title=f"Decoding speed ({s['meta'].get('device')})")
    paths.append(_save(fig, out_dir / "tokens_per_s.png"))
    cats = s.get("categories", {})
    if cats:
        fig, ax = plt.subplots(figsize=(max(5, len(cats) * 0.9), 3.2))
        ax.bar(list(cats), [e["space_tokens_per_step"] or 0 for e in cats.values()], color="#c44e52")
        ax.set(ylabel="tokens/step", title="SPACE tokens per step by category")
        ax.tick_params(axis="x", rotation=30)
        paths.append(_save(fig, out_dir / "tokens_per_step_by_category.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    save_figure_atomic(fig, path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_reports(records: list[dict], meta: dict, out_dir: Path) -> dict:
    """Write summary.json, summary.md and the plots into ``out_dir``; returns the summary."""
    s = summarize(records, meta)
    write_text_atomic(out_dir / "summary.json", json.dumps(s, indent=2))
    write_text_atomic(out_dir / "summary.md", to_markdown(s))
    plot(s, out_dir)
    return s
