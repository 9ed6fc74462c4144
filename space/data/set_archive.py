"""A self-distilled set in a form small enough to commit, rebuilt byte for byte (issue 60).

A GPU session that distils about 40,000 samples has no time left to train on them, and what it
brings back lives outside the repository, which a later session's fresh checkout does not have. So
the sets travel to the training session through a commit, which issue 60 allows under 10 MB
compressed. A ``space-distill`` row carries three fields that follow from the others: ``response``
(the tokenizer's decoding of ``response_ids``, ``space.distill.answer_row``), ``key``
(``prompt_key`` of ``prompt``) and ``new_tokens``. The archive keeps the rest, one row a line,
xz-compressed, about 40 % smaller than the whole rows compressed the same way:

* ``<name>.lean.jsonl.xz``: per row ``id``, ``source``, ``prompt``, ``response_ids``, ``finished``;
* ``<name>.manifest.json``: the set's own manifest, as it was;
* ``archive.json``: per set its file name, rows and the sha256 of its JSONL text (a ``.jsonl``'s own
  bytes, as ``space-distill`` writes it; a ``.jsonl.gz`` comes back gzipped without a timestamp), and
  the model whose tokenizer rebuilds it.

:func:`unpack` rebuilds each set with that tokenizer and refuses one whose hash differs. Only
complete sets are packed: their ``.magpie`` turns (every sampled user turn) are left out, since
only an unfinished set's resume reads them, and ``space-distill`` on a complete set does nothing.

    python scripts/distilled_sets.py pack runs/gpu60/distill_*.jsonl --out data/distill/gpu60
    python scripts/distilled_sets.py unpack data/distill/gpu60 --out runs/gpu60
"""
from __future__ import annotations

import gzip
import hashlib
import json
import lzma
from pathlib import Path

from ..jsonl import read_jsonl, write_bytes_atomic, write_text_atomic
from .dev_set import prompt_key

INDEX = "archive.json"
MAX_BYTES = 10 * 10**6  # issue 60: the samples are committed only under 10 MB compressed


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)  # as space.jsonl writes them


def _rows(text: str) -> list[dict]:
    # split at "\n" alone: ensure_ascii=False leaves U+2028, U+2029 and U+0085 raw inside strings,
    # where str.splitlines() would cut a row
    return [json.loads(line) for line in text.split("\n") if line]


def lean_rows(rows: list[dict]) -> list[dict]:
    """The fields of ``id``, ``source``, ``prompt``, ``response_ids``, ``finished`` and ``stop_id`` (where a row has one); a prompt's assistant turn that is an earlier row's
    response (a follow-up's context) becomes ``{"role": "assistant", "answer_of": that row's id}``:
    the text would be stored again beside the ids it decodes from."""
    said: dict[str, str] = {}
    out = []
    for r in rows:
        prompt = [{"role": "assistant", "answer_of": said[m["content"]]}
                  if m.get("role") == "assistant" and set(m) == {"role", "content"} and m["content"] in said else m
                  for m in r["prompt"]]
        out.append({"id": r["id"], "source": r["source"], "prompt": prompt, "response_ids": r["response_ids"],
                    "finished": r["finished"], **({"stop_id": r["stop_id"]} if "stop_id" in r else {})})
        said.setdefault(r["response"], r["id"])
    return out


def rebuild(lean: list[dict], tok) -> list[dict]:
    """Whole rows from :func:`lean_rows`' in order: ``response`` decoded from ``response_ids``,
    ``key`` and ``new_tokens`` computed, an ``answer_of`` turn given that row's response, the fields
    in a set's order."""
    from ..distill import answer_row

    answers: dict[str, str] = {}
    rows = []
    for r in lean:
        prompt = [{"role": "assistant", "content": answers[m["answer_of"]]} if "answer_of" in m else m
                  for m in r["prompt"]]
        row = answer_row(tok, {"id": r["id"], "key": prompt_key(prompt), "source": r["source"], "prompt": prompt},
                         r["response_ids"], r["finished"], r.get("stop_id"))
        answers.setdefault(r["id"], row["response"])
        rows.append(row)
    return rows


def pack(sets: list[Path], out: Path, tok=None, max_bytes: int = MAX_BYTES) -> dict:
    """Write the archive of ``sets`` (``space-distill`` outputs, each with its manifest beside it)
    into the folder ``out``; returns the index. ``tok`` defaults to the tokenizer of the model the
    manifests name (``space.models.load_tokenizer``).

    Every set is rebuilt from its lean rows as stored before anything is written, and must equal its
    rows as ``space.jsonl`` writes them (a set ``space-distill`` wrote: its own bytes).

    Raises:
        FileNotFoundError: a set or its manifest is missing.
        ValueError: a set is unfinished (its manifest not ``complete``, or its rows not the
            manifest's count), made with another model than the others, whose bytes are not its rows
            as ``space.jsonl`` writes them, rebuilt unequal (another tokenizer than ``tok``'s), or the
            archive's compressed files exceed ``max_bytes``.
    """
    from ..distill import sibling

    index: dict = {"model": None, "sets": {}}
    files: dict[str, bytes] = {}
    for path in sets:
        manifest_path = sibling(path, "manifest", ".json")
        if not path.is_file() or not manifest_path.is_file():
            raise FileNotFoundError(f"{path} or its manifest {manifest_path.name} is missing")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        rows = read_jsonl(path)
        if not manifest.get("complete") or manifest.get("rows") != len(rows):
            raise ValueError(f"{path}: unfinished ({len(rows)} rows, manifest complete={manifest.get('complete')}, "
                             f"rows={manifest.get('rows')}); finish it with space-distill first: an unfinished set "
                             "resumes only with its .magpie turns, which the archive leaves out")
        model = manifest["settings"]["model"]
        if index["model"] not in (None, model):
            raise ValueError(f"{path} was made with {model!r}, the other sets with {index['model']!r}")
        index["model"] = model
        if tok is None:
            from ..models import load_tokenizer

            tok = load_tokenizer(model)
        text = _lines(rows)
        raw = path.read_bytes()
        if (gzip.decompress(raw) if path.name.endswith(".gz") else raw) != text.encode():
            # the sha256 stands for the file: unpack writes `text`, which must be the file's own bytes
            raise ValueError(f"{path}: its bytes are not its rows as space-distill writes them (edited or "
                             "reformatted); the archive would rebuild another file under its sha256")
        lean = _lines(lean_rows(rows))
        if _lines(rebuild(_rows(lean), tok)) != text:  # from the text stored, as unpack reads it
            raise ValueError(f"{path}: its rows do not rebuild from their token ids with this tokenizer (another "
                             "model's, or rows not written by space-distill)")
        name = manifest_path.name.removesuffix(".manifest.json")
        if name in index["sets"]:
            raise ValueError(f"two sets are named {name}: pack them into separate archives")
        files[f"{name}.lean.jsonl.xz"] = lzma.compress(lean.encode(), preset=9 | lzma.PRESET_EXTREME)
        files[manifest_path.name] = manifest_path.read_bytes()
        index["sets"][name] = {"file": path.name, "rows": len(rows),
                               "sha256": hashlib.sha256(text.encode()).hexdigest(),
                               "lean": f"{name}.lean.jsonl.xz", "lean_bytes": len(files[f"{name}.lean.jsonl.xz"])}
    total = sum(len(b) for b in files.values())
    index["bytes"] = total
    if total > max_bytes:
        raise ValueError(f"the archive would take {total / 1e6:.1f} MB, over {max_bytes / 1e6:.1f} MB "
                         "(issue 60 commits the samples only under 10 MB): not written")
    for name, data in files.items():
        write_bytes_atomic(out / name, data)
    write_text_atomic(out / INDEX, json.dumps(index, indent=1) + "\n")
    return index


def unpack(archive: Path, out: Path, tok=None) -> list[Path]:
    """Rebuild every set of ``archive`` (a folder :func:`pack` wrote) into ``out``, each beside its
    manifest; ``tok`` defaults to the tokenizer of the model the index names
    (``space.models.load_tokenizer``). Returns the sets' paths.

    Raises:
        FileNotFoundError: no ``archive.json`` in ``archive``, or a file it lists is missing.
        ValueError: a rebuilt set's sha256 differs from the index's (another tokenizer, a damaged
            file); nothing is written.
        FileExistsError: a set or manifest file in ``out`` differs from the archive's (nothing written).
    """
    index_path = archive / INDEX
    if not index_path.is_file():
        raise FileNotFoundError(f"{archive} holds no {INDEX}: not a distilled-set archive")
    index = json.loads(index_path.read_text(encoding="utf-8"))
    if tok is None:
        from ..models import load_tokenizer

        tok = load_tokenizer(index["model"])
    files: dict[Path, bytes] = {}
    for name, entry in index["sets"].items():  # every set rebuilt and checked before any file is written
        lean = _rows(lzma.decompress((archive / entry["lean"]).read_bytes()).decode())
        text = _lines(rebuild(lean, tok))
        if hashlib.sha256(text.encode()).hexdigest() != entry["sha256"] or len(lean) != entry["rows"]:
            raise ValueError(f"{archive / entry['lean']}: the rebuilt {entry['file']} differs from the one packed "
                             f"(sha256 or row count); another tokenizer than {index['model']!r}'s, or a damaged file")
        data = text.encode()  # a .gz set comes back gzipped, as write_jsonl writes one (no timestamp)
        files[out / entry["file"]] = gzip.compress(data, mtime=0) if entry["file"].endswith(".gz") else data
        manifest = f"{name}.manifest.json"
        files[out / manifest] = (archive / manifest).read_bytes()
    # a file already there that is not the archive's (a set resumed since, or another set of that name) is
    # the user's: replaced, its rows were lost
    clash = [p for p, data in files.items() if p.exists() and (not p.is_file() or p.read_bytes() != data)]
    if clash:
        raise FileExistsError(f"{clash[0]} exists and differs from the archive's: move it, or unpack into another --out")
    out.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        write_bytes_atomic(path, data)
    return [out / entry["file"] for entry in index["sets"].values()]
