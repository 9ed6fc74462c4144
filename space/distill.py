"""Self-distillation (DESIGN §5): the target model's own greedy responses to training prompts.

Training the masks on what the model itself would say raises acceptance. Prompts come from MBPP
(code), LIMA (general), the Python standard library's documented functions (code,
``space.data.stdlib_prompts``) and the model itself (``magpie``: general user turns it writes,
with a follow-up turn after its first answer, ``space.data.magpie``); never from HumanEval or
MT-Bench, which are evaluation sets, and never from the drafter dev set
(``configs/data/dev_set.json``, see ``space.data.dev_set``), which the acceptance probe measures on.

``space-distill --out data/distill/smollm2.jsonl.gz --sources magpie,lima,mbpp,stdlib --magpie-limit 2000``

Sources are answered in the order given. Each has a limit (``--mbpp-limit``, ``--lima-limit``,
``--stdlib-limit``: prompts taken after the dev set and duplicates are skipped; ``--magpie-limit``:
first-turn prompts kept by the filters). Answers come from batched HF ``generate`` (left padding,
greedy; :func:`greedy_batches`, shared with the probe). On these 2-core CPUs a batch of 16 answers
costs about 0.1 s a token per batch, about 5x less a sample than the batch-1 SPACE decoder
(whose greedy output is the same AR output), so batching wins here.

Files, all written whole after every batch and atomically, so an interrupted run resumes where it
stopped (a ``.gz`` output is what a repository commits):

* ``OUT`` (``.jsonl`` or ``.jsonl.gz``): one row per answer, ``id``, ``key``, ``source``,
  ``prompt`` (messages), ``response``, ``response_ids`` (the generated token ids, cut before EOS:
  training uses them rather than the text tokenized again, ``space.data.sft.tokenize``),
  ``new_tokens``, ``finished`` and, on a finished answer, ``stop_id`` (the end id the model
  generated: Llama-3-Instruct ends a turn with ``<|eot_id|>``, not its tokenizer's EOS, and training
  appends this one);
* ``<OUT stem>.magpie.jsonl[.gz]``: every sampled user turn, kept or not, so the filters can be
  replayed and nothing is sampled twice;
* ``<OUT stem>.manifest.json``: settings, sources, counts, filter verdicts, skips, commit and
  versions. A resumed run must have the same settings (model, token limits, Magpie sampling), or
  it is refused: answers made with other settings are never mixed into one set.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

# torch, transformers, datasets and the modules that import them load inside the functions that
# need them, so that --help answers at once
from .choices import SMOLLM2
from .cli import add_debug_flag, add_threads_flag, console, given_flags, set_threads
from .data.prompts import chat_ids
from .jsonl import append_jsonl, held, read_jsonl, read_jsonl_resumable, write_jsonl, write_text_atomic

SOURCES = ("mbpp", "lima", "stdlib", "magpie")
SEED_LIMIT = 2**32  # seeds are 0..2**32-1: the batch seeds derived from them stay in torch's int64


def source_prompts(name: str, data_root=None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of every prompt of a source: a registered dataset, ``stdlib`` or a file."""
    from .data.sft import load_examples
    from .data.stdlib_prompts import stdlib_prompts

    if name == "stdlib":
        return [(f"stdlib/{p.name}", [{"role": "user", "content": p.prompt}]) for p in stdlib_prompts(data_root)]
    return [(f"{name}/{i}", ex.context) for i, ex in enumerate(load_examples(name, data_root))]


def collect_prompts(sources: dict[str, int | None], data_root=None, exclude_dev: bool = True) -> list[dict]:
    """Deduplicated single-turn prompts: {"id", "source", "prompt" (messages), "key"}.

    Args:
        sources: source name -> how many prompts to take (None: all); ``magpie`` is skipped here
            (its prompts need the model, :func:`distill` makes them).
        exclude_dev: skip the drafter dev set's prompts (always, for training data).
    """
    from .data.dev_set import dev_keys, held_out_key, prompt_key

    dev = dev_keys(data_root) if exclude_dev else set()
    seen = set()
    out = []
    for name, limit in sources.items():
        if name == "magpie":
            continue
        taken = 0
        for pid, context in source_prompts(name, data_root):
            if limit is not None and taken >= limit:
                break
            if len(context) != 1:  # multi-turn rows carry human answers: skip them
                continue
            key = prompt_key(context)
            if key not in seen and held_out_key(context) not in dev:
                seen.add(key)
                out.append({"id": pid, "source": name, "prompt": context, "key": key})
                taken += 1
    return out


def greedy_batches(model, tok, prompts: list[dict], batch_size: int = 16, max_new_tokens: int = 256,
                   suppress_ids: tuple[int, ...] = (),
                   desc: str = "generate") -> Iterator[list[tuple[dict, list[int], int | None]]]:
    """Greedy answers of ``model`` with batched HF ``generate`` (left padding, attention mask).

    Args:
        prompts: rows with ``ids`` (prompt token ids); batched shortest first (less padding).
        suppress_ids: token ids never generated (a SPACE model's mask tokens).

    Yields:
        per batch, (prompt row, new token ids cut before the first end id, that end id: None when
        none was reached, an answer cut at ``max_new_tokens``).
        The end ids are the tokenizer's and the model's (``space.models.stop_ids``), as space-eval
        stops; the model's other generation settings are left out (``space.models.plain_generate``):
        the answers are its greedy AR output, the decoders' own.

    Raises:
        ValueError: a prompt whose ids and max_new_tokens exceed the model's
            max_position_embeddings (checked for every prompt before the first batch).
    """
    import torch

    from .models import plain_generate, stop_ids

    context = getattr(model.config, "max_position_embeddings", None)
    over = [p for p in prompts if context is not None and len(p["ids"]) + max_new_tokens > context]
    if over:  # HF's generate ran on past the context (RoPE extrapolates): answers no decoder gives
        raise ValueError(f"{len(over)} prompt(s) ({over[0]['id']}: {len(over[0]['ids'])} tokens) + max_new_tokens "
                         f"{max_new_tokens} exceed the model's context of {context} tokens: lower max_new_tokens "
                         "(or the prompts' length)")
    stops = stop_ids(model, tok)
    side, tok.padding_side = tok.padding_side, "left"
    try:
        todo = sorted(prompts, key=lambda p: len(p["ids"]))
        for start in tqdm(range(0, len(todo), batch_size), desc=desc, unit="batch"):
            batch = todo[start:start + batch_size]
            enc = tok.pad({"input_ids": [p["ids"] for p in batch]}, return_tensors="pt").to(model.device)
            with torch.inference_mode():
                gen = plain_generate(model, enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                     pad_token_id=tok.pad_token_id, suppress_tokens=list(suppress_ids) or None)
            rows = gen[:, enc["input_ids"].shape[1]:].tolist()
            ends = [next((i for i, t in enumerate(row) if t in stops), None) for row in rows]
            yield [(p, row if end is None else row[:end], None if end is None else row[end])
                   for p, row, end in zip(batch, rows, ends)]
    finally:
        tok.padding_side = side


@dataclass
class MagpieSettings:
    """How user turns are sampled (``space.data.magpie``); part of a distilled set's identity.

    Attributes:
        seed: sampling seed; batch b of first turns is seeded ``seed * 1_000_003 + b``.
        temperature, top_p: sampling of the user's text.
        max_new_tokens: token limit of one user turn (longer ones are dropped as unfinished).
        batch_size: user turns sampled per ``generate`` call (changes what a seed draws).
        follow_ups: also sample a second user turn after each kept first turn's answer.
    """

    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 128
    batch_size: int = 32
    follow_ups: bool = True


def sibling(out: Path, tag: str, ext: str | None = None) -> Path:
    """``data/x.jsonl.gz`` + ``magpie`` -> ``data/x.magpie.jsonl.gz`` (``ext`` replaces the extension)."""
    name = out.name
    suffix = next((e for e in (".jsonl.gz", ".jsonl") if name.endswith(e)), "")
    return out.with_name(f"{name[: len(name) - len(suffix)]}.{tag}{suffix if ext is None else ext}")


class Distiller:
    """One self-distillation run over ``out`` and its sibling files (module docstring)."""

    def __init__(self, out: Path, model_name: str, sources: dict[str, int | None], batch_size: int,
                 max_new_tokens: int, max_prompt_tokens: int, data_root, magpie: MagpieSettings,
                 dtype: str = "float32", device: str = "cpu"):
        self.out, self.sources, self.batch_size, self.data_root, self.magpie = out, sources, batch_size, data_root, magpie
        # the dtype is part of a set's identity (bf16 greedy answers part from fp32 ones at near-ties);
        # the devices are recorded beside it, not checked: the answers' distribution is the model's on any
        # device (a magpie seed draws other user turns on a GPU's generator)
        self.settings = {"model": model_name, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                         "magpie": asdict(magpie) if "magpie" in sources else None, "dtype": dtype}
        self.turns_file, self.manifest_file = sibling(out, "magpie"), sibling(out, "manifest", ".json")
        old = self._check_resume()
        self.old_manifest = old
        # every run's, a resumed set's too: a manifest from before the list names one device, one from
        # before --device was made on a CPU
        earlier = old.get("devices") or ([old["device"]] if "device" in old else ["cpu"] if old else [])
        self.devices = sorted({*earlier, device})
        # likewise every run's answer batch size: a batch's padding moves fp32 greedy answers at near-ties
        # as a device does, so a set resumed at another size says it did (a manifest from before the
        # list names the last run's)
        sizes = old.get("answer_batch_sizes") or ([old["answer_batch_size"]] if "answer_batch_size" in old else [])
        self.batch_sizes = sorted({*sizes, batch_size})
        out.parent.mkdir(parents=True, exist_ok=True)
        self.rows = read_jsonl(out) if out.suffix == ".gz" else read_jsonl_resumable(out)
        self.turns = read_jsonl(self.turns_file) if self.turns_file.is_file() else []
        # what sampled the set's Magpie turns, kept by a rerun without them (an unpacked set, or one
        # whose .magpie file is gone): erased, a later magpie run would sample again from batch 0 under
        # the ids its rows already hold
        self.turns_sampled = (dict(Counter(f"turn {t['turn']}" for t in self.turns)) if self.turns
                              else dict(old.get("magpie_turns_sampled") or {}))
        self.done = {row["key"] for row in self.rows}
        # a lower limit cannot unmake rows: the manifest would record the new limit over more rows than it allows
        held_rows = Counter(row["source"] for row in self.rows)
        over = [(name, limit, held_rows[name]) for name, limit in sources.items()
                if limit is not None and held_rows[name] > limit]
        if over:
            name, limit, n = over[0]
            raise ValueError(f"{out} already holds {n} {name} rows, more than --{name}-limit {limit}: a lower limit "
                             "cannot drop them; pass the set's own limit or another --out")
        self.skipped: Counter = Counter()
        # a rerun without magpie keeps what sampled the turns already in the set, and their verdicts
        # (erased, a later magpie resume was refused as made with other settings)
        if self.settings["magpie"] is None:
            self.settings["magpie"] = old.get("settings", {}).get("magpie")
        self.filters: dict[str, dict] = dict(old.get("filter_verdicts") or {})
        self.new_rows, self.start = 0, time.monotonic()
        if "magpie" in sources and self.turns_sampled and not self.turns and not self.complete():
            # a set unpacked from an archive: sampling again from batch 0 would draw other turns under
            # the ids its rows already hold
            raise ValueError(f"{out} records sampled Magpie turns but {self.turns_file.name} is missing: it resumes "
                             "only with them (an archived set is for training; finish a set before packing it)")

    def complete(self) -> bool:
        """The set was finished with these sources and limits, every row its manifest counts in
        place: a rerun has nothing to do (a set restored from ``space.data.set_archive`` comes
        without its ``.magpie`` turns, which a rerun would otherwise sample again)."""
        old = self.old_manifest
        # an empty set is never complete (a manifest written so before the run refused it): tried again
        return (bool(old.get("complete")) and old.get("sources") == self.sources and bool(self.rows)
                and old.get("rows") == len(self.rows))

    def _check_resume(self) -> dict:
        """Refuse to resume a set made with other settings (they would mix two distributions), or
        rows without the manifest that records them; returns the old manifest ({} when new)."""
        from .models import model_identity

        if not self.manifest_file.is_file():
            if any(f.is_file() and f.stat().st_size for f in (self.out, self.turns_file)):
                raise ValueError(f"{self.out} (or its .magpie file) holds rows but has no manifest {self.manifest_file.name}, "
                                 "so the settings that made them are unknown: delete it or pass another --out")
            return {}
        manifest = json.loads(self.manifest_file.read_text(encoding="utf-8"))
        recorded = manifest.get("file", self.out.name)
        # x.jsonl and x.jsonl.gz share x.manifest.json: the other one's manifest is refused; a set copied or
        # renamed with its manifest (which names the old file) is the same set, and resumes
        if recorded != self.out.name and sibling(self.out.with_name(recorded), "manifest", ".json") == self.manifest_file:
            raise ValueError(f"{self.manifest_file} records the set {recorded}, not {self.out.name}: the two "
                             "share a manifest (and the .magpie turns); pass an --out of another stem")
        old = manifest.get("settings", {})

        def same(key: str) -> bool:
            if key == "model":  # an alias and its own folder are one model
                return model_identity(str(old.get(key))) == model_identity(str(self.settings.get(key)))
            if key == "dtype":  # sets made before --dtype are fp32
                return old.get(key, "float32") == self.settings[key]
            return old.get(key) == self.settings.get(key) or (key == "magpie" and self.settings[key] is None)

        differ = sorted(k for k in self.settings.keys() | old.keys() if not same(k))
        if differ:
            raise ValueError(f"{self.out} was made with other settings ({', '.join(f'{k}: {old.get(k)!r} -> {self.settings.get(k)!r}' for k in differ)}); "
                             "resume with the same settings, or pass another --out")
        return manifest

    def run(self, model, tok) -> dict:
        static = collect_prompts(self.sources, self.data_root)  # before any answer: a bad dataset fails at once
        self.model, self.tok = model, tok
        # before any answer: greedy_batches checks each batch, but a set of several sources stopped part way
        context, longest = getattr(model.config, "max_position_embeddings", None), sum(
            self.settings[k] for k in ("max_prompt_tokens", "max_new_tokens"))
        if context is not None and longest > context:
            raise ValueError(f"--max-prompt-tokens {self.settings['max_prompt_tokens']} + --max-new-tokens "
                             f"{self.settings['max_new_tokens']} exceed the model's context of {context} tokens: "
                             "lower either")
        done = len(self.rows)
        print(f"[distill] resuming: {done} rows done -> {self.out}" if done else f"[distill] -> {self.out}", flush=True)
        self.write_manifest(complete=False)  # the settings, before any row: a run stopped later resumes checked
        for name in self.sources:
            if name == "magpie":
                self._magpie()
            else:
                self._answer([p for p in static if p["source"] == name], desc=f"answers: {name}")
        if not self.rows:  # not marked complete: a rerun would find "nothing to do" and exit 0 on an empty set
            raise ValueError(f"no rows written to {self.out}: every prompt was skipped ({dict(self.skipped) or 'no prompts'})")
        return self.write_manifest(complete=True)

    def _answer(self, prompts: list[dict], desc: str) -> None:
        todo = []
        for p in prompts:
            if p["key"] in self.done:
                continue
            p["ids"] = chat_ids(self.tok, p["prompt"])
            if len(p["ids"]) > self.settings["max_prompt_tokens"]:
                self.skipped["prompt over --max-prompt-tokens"] += 1
            else:
                todo.append(p)
        for batch in greedy_batches(self.model, self.tok, todo, self.batch_size, self.settings["max_new_tokens"], desc=desc):
            rows = []
            for p, ids, stop in batch:
                row = answer_row(self.tok, p, ids, stop is not None, stop)
                if not row["response"].strip():
                    self.skipped["empty answer"] += 1
                    continue
                rows.append(row)
                self.done.add(p["key"])
            self._save(rows)

    def _save(self, rows: list[dict]) -> None:
        self.rows += rows
        self.new_rows += len(rows)
        if self.out.suffix == ".gz":
            write_jsonl(self.out, self.rows)
        else:
            append_jsonl(self.out, rows)
        self.write_manifest(complete=False)

    # -- self-generated prompts -------------------------------------------------------------
    def _magpie(self) -> None:
        """First turns until ``--magpie-limit`` pass the filters, their answers, then follow-ups."""
        from .data.magpie import PromptFilter, check_sampled, sample_user_turns, user_prefix_ids

        m, limit = self.magpie, self.sources["magpie"]
        leak_texts = self._leak_texts()  # read once: the follow-up filter checks the same prompts
        first = PromptFilter(leak_texts, self.tok.all_special_tokens)
        kept = [t for t in self._turns(1) if first.verdict(t["text"], t["finished"]) == "ok"]
        prefix = user_prefix_ids(self.tok, [])
        with tqdm(total=limit, initial=min(len(kept), limit), desc="magpie: first turns kept", unit="prompt") as bar:
            while len(kept) < limit:
                b = len(self._turns(1)) // m.batch_size
                check_sampled(b * m.batch_size, len(kept), limit, first, "lower --magpie-limit")
                new = [{"id": f"magpie/{b * m.batch_size + i}", "turn": 1, "text": text, "finished": finished}
                       for i, (text, finished) in enumerate(sample_user_turns(
                           self.model, self.tok, [prefix] * m.batch_size, m.seed * 1_000_003 + b,
                           m.max_new_tokens, m.temperature, m.top_p))]
                self._save_turns(new)
                for t in new:  # every sampled turn gets its verdict, as on a resumed run
                    if first.verdict(t["text"], t["finished"]) == "ok":
                        kept.append(t)
                        bar.update(int(len(kept) <= limit))
        self.filters["first turn"] = dict(first.counts)
        kept = kept[:limit]
        self._answer([_prompt_row(t["id"], "magpie", [{"role": "user", "content": t["text"]}]) for t in kept],
                     desc="answers: magpie")
        if m.follow_ups:
            self._follow_ups(kept, leak_texts)

    def _follow_ups(self, kept: list[dict], leak_texts: list[str]) -> None:
        """A second user turn after each first turn's finished answer, filtered, then answered."""
        from .data.magpie import PromptFilter, sample_user_turns, user_prefix_ids

        m = self.magpie
        answers = {row["id"]: row for row in self.rows if row["source"] == "magpie"}
        parents = [answers[t["id"]] for t in kept if t["id"] in answers and answers[t["id"]]["finished"]]
        have = {t["parent"] for t in self._turns(2)}
        todo = [p for p in parents if p["id"] not in have]
        for start in tqdm(range(0, len(todo), m.batch_size), desc="magpie: follow-up turns", unit="batch"):
            batch = todo[start:start + m.batch_size]
            history = [p["prompt"] + [{"role": "assistant", "content": p["response"]}] for p in batch]
            sampled = sample_user_turns(self.model, self.tok, [user_prefix_ids(self.tok, h) for h in history],
                                        m.seed * 1_000_003 + int(batch[0]["id"].split("/")[1]) + 500_000_000,
                                        m.max_new_tokens, m.temperature, m.top_p)
            self._save_turns([{"id": f"{p['id']}/turn2", "turn": 2, "parent": p["id"], "text": text, "finished": fin}
                              for p, (text, fin) in zip(batch, sampled)])
        second = PromptFilter(leak_texts, self.tok.all_special_tokens, dedupe=False)
        by_id = {p["id"]: p for p in parents}
        prompts = []
        for t in self._turns(2):
            if t["parent"] in by_id and second.verdict(t["text"], t["finished"]) == "ok":
                p = by_id[t["parent"]]
                context = p["prompt"] + [{"role": "assistant", "content": p["response"]}, {"role": "user", "content": t["text"]}]
                prompts.append(_prompt_row(t["id"], "magpie-turn2", context))
        self.filters["follow-up turn"] = dict(second.counts)
        self._answer(prompts, desc="answers: magpie follow-ups")

    def _leak_texts(self) -> list[str]:
        """What a self-generated prompt must not overlap: HumanEval, MT-Bench and the dev set."""
        from .data.dev_set import dev_prompts
        from .data.magpie import eval_texts

        return eval_texts(self.data_root) + [m["content"] for p in dev_prompts(self.data_root) for m in p["prompt"]]

    def _turns(self, turn: int) -> list[dict]:
        return [t for t in self.turns if t["turn"] == turn]

    def _save_turns(self, new: list[dict]) -> None:
        self.turns += new
        write_jsonl(self.turns_file, self.turns)
        self.write_manifest(complete=False)  # the settings that sampled them, for the resume check

    def write_manifest(self, complete: bool) -> dict:
        """Write ``<OUT stem>.manifest.json`` atomically; returns it."""
        import torch
        import transformers

        from .artifact import git_commit

        manifest = {
            "file": self.out.name, "complete": complete, "settings": self.settings,
            "sources": {k: v for k, v in self.sources.items()}, "answer_batch_sizes": self.batch_sizes,
            "devices": self.devices,
            "rows": len(self.rows), "rows_by_source": dict(Counter(r["source"] for r in self.rows)),
            "unfinished_answers": sum(not r["finished"] for r in self.rows),
            "magpie_turns_sampled": dict(Counter(f"turn {t['turn']}" for t in self.turns)) or self.turns_sampled,
            "filter_verdicts": self.filters, "skipped_this_run": dict(self.skipped),
            "new_rows_this_run": self.new_rows, "seconds_this_run": round(time.monotonic() - self.start, 1),
            "commit": git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.manifest_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.manifest_file, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        return manifest


def answer_row(tok, prompt: dict, ids: list[int], finished: bool, stop_id: int | None = None) -> dict:
    """A set's row (module docstring) for a prompt row (``id``, ``key``, ``source``, ``prompt``) and
    the answer's token ids, cut before the end id ``stop_id`` (recorded on a finished answer when
    given; sets made before it name none); ``response`` is their decoding, which is all
    ``space.data.set_archive`` needs to rebuild a row from its ids."""
    text = tok.decode(ids, skip_special_tokens=True)
    if not finished:  # cut inside a character: its bytes decode to U+FFFD, which the model never wrote
        text = text.rstrip("\ufffd")
    return {"id": prompt["id"], "key": prompt["key"], "source": prompt["source"], "prompt": prompt["prompt"],
            "response": text, "response_ids": ids, "new_tokens": len(ids), "finished": finished,
            **({"stop_id": stop_id} if finished and stop_id is not None else {})}


def _prompt_row(pid: str, source: str, context: list[dict]) -> dict:
    from .data.dev_set import prompt_key

    return {"id": pid, "source": source, "prompt": context, "key": prompt_key(context)}


def distill(out: Path, model_name: str = SMOLLM2, sources: dict[str, int | None] | None = None,
            batch_size: int = 16, max_new_tokens: int = 256, max_prompt_tokens: int = 384, data_root=None,
            magpie: MagpieSettings | None = None, dtype: str = "float32", device: str = "cpu") -> dict:
    """Write greedy responses for every prompt of ``sources`` (name -> limit) to ``out``.

    ``dtype`` (``space.models.parse_dtype`` names) and ``device`` (a torch device string) are the
    model's: on a GPU, a batch of hundreds of answers costs about what one answer costs (issue 60).
    The dtype is a resume key; the manifest records every run's device and answer batch size.

    Returns:
        the manifest (also written beside ``out``); for a set already complete with these sources
        and limits, its manifest with this call's counts (nothing written, the model not loaded).

    Raises:
        ValueError: ``out`` was made with other settings, another run is writing it, it is an
            unfinished Magpie set without its ``.magpie`` turns, or no row at all was written.
        FileNotFoundError: a missing dataset or model.
    """
    sources = sources or {"mbpp": None, "lima": 400}
    if sources.get("magpie") is None and "magpie" in sources:
        raise ValueError("the magpie source needs a limit (--magpie-limit)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # one run per output: two wrote every answer twice (the manifest counting each once)
    with held(out, str(out), "wait for it to end, or pass another --out"):
        from .models import load_model, parse_dtype

        dtype = str(parse_dtype(dtype)).removeprefix("torch.")  # one name per dtype in the manifest
        run = Distiller(out, model_name, sources, batch_size, max_new_tokens, max_prompt_tokens, data_root,
                        magpie or MagpieSettings(), dtype, device)  # settings are checked before the model loads
        if run.complete():  # the manifest stays as the run that finished it wrote it
            print(f"[distill] complete: {len(run.rows)} rows in {out}; nothing to do", flush=True)
            return {**run.old_manifest, "new_rows_this_run": 0, "skipped_this_run": {}, "seconds_this_run": 0.0}
        model, tok = load_model(model_name, dtype, device)
        if model.device.type == "cpu":
            from .cpu_kernels import optimize_for_cpu

            optimize_for_cpu(model)  # packed linears: about 25 % faster batched generation on these CPUs
        return run.run(model, tok)


def main(argv: list[str] | None = None) -> dict:
    """Parse and check the arguments, then distill; returns the manifest.

    Raises:
        ValueError: an unknown source, a count below its minimum, a source's setting (``--lima-limit``,
            ``--magpie-seed``, ...) given without the source, or ``--out`` that is a folder.
        FileNotFoundError: a missing dataset or model.
    """
    ap = argparse.ArgumentParser(prog="space-distill",
                                 description="Self-distillation: the model's own greedy answers to training prompts.")
    ap.add_argument("--model", default=SMOLLM2, help="alias or local HF directory (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("runs/distill/smollm2_mbpp_lima.jsonl"),
                    help="output .jsonl or .jsonl.gz; a manifest is written beside it (default: %(default)s)")
    ap.add_argument("--sources", default="mbpp,lima", help=f"comma list of prompt sources, answered in this order: "
                    f"{', '.join(SOURCES)} (default: %(default)s)")
    ap.add_argument("--mbpp-limit", type=int, default=None, help="MBPP prompts (default: all outside the dev set)")
    ap.add_argument("--lima-limit", type=int, default=400, help="LIMA single-turn prompts, 1000 for all "
                    "(default: %(default)s)")
    ap.add_argument("--stdlib-limit", type=int, default=None, help="stdlib function prompts (default: all)")
    ap.add_argument("--magpie-limit", type=int, default=1000, help="self-generated first turns kept by the filters "
                    "(default: %(default)s)")
    ap.add_argument("--magpie-seed", type=int, default=0, help=f"seed of the user-turn sampling, 0..{SEED_LIMIT - 1} "
                    "(default: %(default)s)")
    ap.add_argument("--no-follow-ups", action="store_true", help="self-generated prompts: first turns only")
    ap.add_argument("--magpie-batch-size", type=int, default=MagpieSettings.batch_size,
                    help="user turns sampled per generate call; part of what a seed draws (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=16, help="answers per generate call (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit (default: %(default)s)")
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped "
                    "(default: %(default)s)")
    ap.add_argument("--data-root", default=None, help="shared data folder (default: ../shared/data)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype: float32, bfloat16 or float16; part of the "
                    "set's settings (default: %(default)s)")
    ap.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N or mps; auto = cuda when "
                    "a CUDA GPU is usable, else cpu (the manifest records it) (default: auto)")
    add_threads_flag(ap)
    add_debug_flag(ap)
    a = ap.parse_args(argv)
    for name, minimum in (("batch_size", 1), ("magpie_batch_size", 1), ("max_new_tokens", 1), ("max_prompt_tokens", 1),
                          ("mbpp_limit", 0), ("lima_limit", 0), ("stdlib_limit", 0), ("magpie_limit", 1),
                          ("magpie_seed", 0)):
        value = getattr(a, name)
        if value is not None and value < minimum:  # None: no limit
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    if a.magpie_seed >= SEED_LIMIT:
        raise ValueError(f"--magpie-seed must be < {SEED_LIMIT}, got {a.magpie_seed}")
    if a.out.is_dir():
        raise ValueError(f"--out {a.out} is a folder; pass a .jsonl or .jsonl.gz file")
    limits = {"mbpp": a.mbpp_limit, "lima": a.lima_limit, "stdlib": a.stdlib_limit, "magpie": a.magpie_limit}
    names = [n.strip() for n in a.sources.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown or not names:
        raise ValueError(f"--sources: unknown {unknown or 'empty list'}; choose from {', '.join(SOURCES)}")
    # a source's settings without the source were unread: the set came out without what they asked for, exit 0
    unread = sorted(f"--{dest.replace('_', '-')}" for dest in given_flags(ap, argv)
                    if any(dest.startswith(n + "_") for n in SOURCES if n not in names) or
                    (dest == "no_follow_ups" and "magpie" not in names))
    if unread:
        raise ValueError(f"{', '.join(unread)} given, but --sources {a.sources} leaves them unread: add their source")
    from .cli import device_flag
    from .models import parse_dtype

    parse_dtype(a.dtype)
    device = device_flag(a.device)
    set_threads(a.threads)
    magpie = MagpieSettings(seed=a.magpie_seed, batch_size=a.magpie_batch_size, follow_ups=not a.no_follow_ups)
    summary = distill(a.out, a.model, {n: limits[n] for n in names}, a.batch_size, a.max_new_tokens,
                      a.max_prompt_tokens, a.data_root, magpie, a.dtype, device)
    print(f"[distill] {summary['rows']} rows in {a.out} ({summary['new_rows_this_run']} new, "
          f"{summary['seconds_this_run']:.0f} s); by source {summary['rows_by_source']}; "
          f"skipped {summary['skipped_this_run'] or 'none'}; filters {summary['filter_verdicts'] or 'none'}", flush=True)
    return summary


cli = console("space-distill", main, resumes=True)

if __name__ == "__main__":
    cli()
