"""space.data.set_archive: a distilled set packed small enough to commit and rebuilt byte for byte
(issue 60's sets travel from the GPU session that distils them to the one that trains on them)."""
import functools
import json
import lzma

import pytest

from space.data import set_archive
from space.models import tiny_random_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def magpie_set(tmp_path_factory):
    """A complete ``space-distill`` set of the tiny model with Magpie first turns and follow-ups (whose
    context holds the first answer's text), written as a plain .jsonl, as the GPU run writes it."""
    from space import distill as distill_mod
    from space import models
    from space.data import magpie

    out = tmp_path_factory.mktemp("set") / "distill_magpie.jsonl"
    with pytest.MonkeyPatch.context() as mp:  # as tests/data/test_magpie.py: the tiny model's text passes
        mp.setattr(magpie, "PromptFilter", functools.partial(magpie.PromptFilter, min_chars=1, min_words=1))
        mp.setattr(distill_mod.Distiller, "_leak_texts", lambda self: ["a planted evaluation prompt of several words"])
        real = magpie.sample_user_turns
        mp.setattr(magpie, "sample_user_turns", lambda *a, **k: [(t, True) for t, _ in real(*a, **k)])
        answers = distill_mod.greedy_batches
        # finished answers get follow-ups; one unfinished answer keeps its cut-character handling in play
        mp.setattr(distill_mod, "greedy_batches", lambda *a, **k: (
            [(p, ids, None if i == 1 else a[1].eos_token_id) for i, (p, ids, _) in enumerate(batch)]
            for batch in answers(*a, **k)))
        mp.setattr(models, "load_model", lambda name, dtype="float32", device="cpu":
                   tiny_random_llama(seed=0, initializer_range=0.3))
        manifest = distill_mod.distill(out, "tiny-random-llama", {"magpie": 4}, batch_size=2, max_new_tokens=12,
                                       magpie=distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4))
    assert manifest["complete"] and manifest["rows_by_source"].get("magpie-turn2")
    return out


def test_pack_then_unpack_rebuilds_the_set_byte_for_byte(magpie_set, tmp_path):
    """Catches a rebuilt row that differs from the written one (field order, the response's decoding,
    the key, a follow-up's context), a lean file that keeps the response text, and a follow-up whose
    first answer is stored again as text."""
    index = set_archive.pack([magpie_set], tmp_path / "archive")
    lean = [json.loads(line) for line in lzma.open(tmp_path / "archive" / "distill_magpie.lean.jsonl.xz")]
    assert all(set(r) == {"id", "source", "prompt", "response_ids", "finished", *(("stop_id",) * r["finished"])}
               for r in lean)
    follow_ups = [r for r in lean if r["source"] == "magpie-turn2"]
    assert follow_ups and all(r["prompt"][1].keys() == {"role", "answer_of"} for r in follow_ups)
    assert index["sets"]["distill_magpie"]["rows"] == len(lean) and index["model"] == "tiny-random-llama"
    written = set_archive.unpack(tmp_path / "archive", tmp_path / "back")
    assert [p.name for p in written] == ["distill_magpie.jsonl"]
    assert written[0].read_bytes() == magpie_set.read_bytes()
    manifest = magpie_set.with_name("distill_magpie.manifest.json")
    assert (tmp_path / "back" / manifest.name).read_bytes() == manifest.read_bytes()


def test_line_separators_inside_texts_and_gzipped_sets_round_trip(tmp_path):
    """A prompt holding U+2028 / U+2029 / U+0085 (json.dumps with ensure_ascii=False leaves them raw,
    and str.splitlines cuts there), a response that repeats another's (one answer_of for both), and a
    .jsonl.gz set. Catches an unpack that splits rows at those characters, a .gz set written back
    plain under its .gz name, and two sets of one name in one archive."""
    import gzip

    from space.data.dev_set import prompt_key
    from space.distill import answer_row
    from space.jsonl import write_jsonl

    tok = tiny_tokenizer()
    ids = tok("same answer", add_special_tokens=False)["input_ids"]
    first = {"id": "a/0", "source": "lima", "prompt": [{"role": "user", "content": "one\u2028two\u2029three\x85"}]}
    rows = [answer_row(tok, {**first, "key": prompt_key(first["prompt"])}, ids, True)]
    context = first["prompt"] + [{"role": "assistant", "content": rows[0]["response"]}, {"role": "user", "content": "more"}]
    rows.append(answer_row(tok, {"id": "a/0/turn2", "source": "magpie-turn2", "prompt": context,
                                 "key": prompt_key(context)}, ids, False))
    path = tmp_path / "s.jsonl.gz"
    write_jsonl(path, rows)
    (tmp_path / "s.manifest.json").write_text(json.dumps({"complete": True, "rows": 2,
                                                          "settings": {"model": "tiny-random-llama"}}))
    set_archive.pack([path], tmp_path / "archive")
    back = set_archive.unpack(tmp_path / "archive", tmp_path / "back")
    assert [p.name for p in back] == ["s.jsonl.gz"]
    assert gzip.decompress(back[0].read_bytes()) == gzip.decompress(path.read_bytes())
    with pytest.raises(ValueError, match="two sets are named s"):
        set_archive.pack([path, path], tmp_path / "again")


def test_a_set_that_does_not_rebuild_is_refused_at_both_ends(magpie_set, tmp_path):
    """Catches packing a set another tokenizer made (its texts would come back otherwise), and an
    unpack that writes a set whose rebuilt hash differs (a damaged or edited lean file)."""
    other = tiny_tokenizer()
    other.decode = lambda ids, **k: "x" * len(ids)  # another model's spelling of the same ids
    with pytest.raises(ValueError, match="do not rebuild"):
        set_archive.pack([magpie_set], tmp_path / "a", tok=other)
    assert not (tmp_path / "a").exists()
    set_archive.pack([magpie_set], tmp_path / "archive")
    path = tmp_path / "archive" / "distill_magpie.lean.jsonl.xz"
    rows = [json.loads(line) for line in lzma.open(path)]
    rows[0]["response_ids"][0] ^= 1
    path.write_bytes(lzma.compress("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()))
    with pytest.raises(ValueError, match="differs from the one packed"):
        set_archive.unpack(tmp_path / "archive", tmp_path / "back")
    assert not (tmp_path / "back" / "distill_magpie.jsonl").exists()


def test_a_set_whose_bytes_are_not_space_distills_is_refused(magpie_set, tmp_path):
    """The archive's sha256 stands for the file: a set edited or reformatted by hand (the same rows,
    other bytes: ASCII-escaped, spaced otherwise, a missing last newline) packed, and unpack then
    wrote another file than the one whose hash the GPU run recorded, saying "sha256 as packed"."""
    import shutil

    from space.distill import sibling

    copy = tmp_path / "set" / magpie_set.name
    copy.parent.mkdir()
    shutil.copy(sibling(magpie_set, "manifest", ".json"), sibling(copy, "manifest", ".json"))
    text = magpie_set.read_bytes().decode("utf-8")
    rows = [json.loads(line) for line in text.splitlines()]
    others = {text.rstrip("\n"), "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows),
              "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows)} - {text}
    assert len(others) >= 2
    for other in others:
        copy.write_bytes(other.encode())
        with pytest.raises(ValueError, match="bytes are not its rows as space-distill writes them"):
            set_archive.pack([copy], tmp_path / "a")
    copy.write_bytes(text.encode())
    set_archive.pack([copy], tmp_path / "a")


def test_unfinished_or_oversized_sets_are_not_packed(magpie_set, tmp_path):
    """Catches packing a set its manifest calls unfinished (it would resume without its .magpie turns
    and sample them again), one with rows missing, and an archive over the size limit written anyway."""
    import shutil

    work = tmp_path / "set"
    shutil.copytree(magpie_set.parent, work)
    manifest_path = work / "distill_magpie.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(ValueError, match="unfinished"):
        set_archive.pack([work / "distill_magpie.jsonl"], tmp_path / "a")
    manifest_path.write_text(json.dumps({**manifest, "rows": manifest["rows"] + 1}))
    with pytest.raises(ValueError, match="unfinished"):
        set_archive.pack([work / "distill_magpie.jsonl"], tmp_path / "a")
    with pytest.raises(ValueError, match="over 0.0 MB"):
        set_archive.pack([magpie_set], tmp_path / "a", max_bytes=100)
    assert not (tmp_path / "a").exists()
    with pytest.raises(FileNotFoundError, match="no archive.json"):
        set_archive.unpack(tmp_path, tmp_path / "back")


def test_space_distill_on_a_complete_set_does_nothing(magpie_set, monkeypatch):
    """An archive leaves the .magpie turns out, so a rerun of a restored set must not sample or load
    anything. Catches a rerun that loads the model, rewrites the manifest, or reports the first run's
    new rows as its own."""
    from space import distill as distill_mod
    from space import models

    magpie_set.with_name("distill_magpie.magpie.jsonl").rename(magpie_set.with_name("turns.moved"))
    before = {p.name: p.read_bytes() for p in magpie_set.parent.iterdir()}

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    try:
        again = distill_mod.distill(magpie_set, "tiny-random-llama", {"magpie": 4}, batch_size=2, max_new_tokens=12,
                                    magpie=distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4))
        assert again["new_rows_this_run"] == 0 and again["complete"]
        assert {p.name: p.read_bytes() for p in magpie_set.parent.iterdir()} == before
        # more first turns would sample again from batch 0 without the turns (other turns under the same ids)
        with pytest.raises(ValueError, match="magpie.jsonl is missing"):
            distill_mod.distill(magpie_set, "tiny-random-llama", {"magpie": 5}, batch_size=2, max_new_tokens=12,
                                magpie=distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4))
        magpie_set.with_name("turns.moved").rename(magpie_set.with_name("distill_magpie.magpie.jsonl"))
        with pytest.raises(AssertionError, match="model was loaded"):  # with them: a real resume
            distill_mod.distill(magpie_set, "tiny-random-llama", {"magpie": 5}, batch_size=2, max_new_tokens=12,
                                magpie=distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4))
    finally:
        if magpie_set.with_name("turns.moved").exists():
            magpie_set.with_name("turns.moved").rename(magpie_set.with_name("distill_magpie.magpie.jsonl"))


def test_the_script_packs_and_unpacks(magpie_set, tmp_path, capsys):
    """scripts/distilled_sets.py, the command the GPU run's README gives."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_script_distilled_sets", Path(__file__).resolve().parents[2] / "scripts" / "distilled_sets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["pack", str(magpie_set), "--out", str(tmp_path / "archive")])
    assert "MB in all" in capsys.readouterr().out
    script.main(["unpack", str(tmp_path / "archive"), "--out", str(tmp_path / "back")])
    assert (tmp_path / "back" / "distill_magpie.jsonl").read_bytes() == magpie_set.read_bytes()


def _small_set(folder, name="s.jsonl.gz", model="tiny-random-llama", turn_keys=None):
    """A complete two-row set written by ``space.jsonl`` (a first answer and a follow-up whose context
    repeats it) with a manifest naming ``model``; ``turn_keys``: extra keys of the repeated turn."""
    from space.data.dev_set import prompt_key
    from space.distill import answer_row
    from space.jsonl import write_jsonl

    tok = tiny_tokenizer()
    ids = tok("an answer", add_special_tokens=False)["input_ids"]
    first = {"id": "a/0", "source": "lima", "prompt": [{"role": "user", "content": "a question"}]}
    rows = [answer_row(tok, {**first, "key": prompt_key(first["prompt"])}, ids, True, tok.eos_token_id)]
    context = first["prompt"] + [{"role": "assistant", "content": rows[0]["response"], **(turn_keys or {})},
                                 {"role": "user", "content": "more"}]
    rows.append(answer_row(tok, {"id": "a/0/turn2", "source": "magpie-turn2", "prompt": context,
                                 "key": prompt_key(context)}, ids, False))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    write_jsonl(path, rows)
    stem = name.removesuffix(".gz").removesuffix(".jsonl")
    (folder / f"{stem}.manifest.json").write_text(json.dumps({"complete": True, "rows": 2,
                                                               "settings": {"model": model}}))
    return path


def test_a_gzipped_set_comes_back_with_its_own_bytes(tmp_path):
    """Catches a .gz set rebuilt with gzip's timestamp (unpack's gzip.compress without mtime=0): the
    file differs from the one packed, byte for byte, though its text is the same."""
    path = _small_set(tmp_path / "set")
    set_archive.pack([path], tmp_path / "archive", tok=tiny_tokenizer())
    back = set_archive.unpack(tmp_path / "archive", tmp_path / "back", tok=tiny_tokenizer())
    assert back[0].read_bytes() == path.read_bytes()


def test_an_archive_of_exactly_the_limit_is_written(tmp_path):
    """Catches an off-by-one in the size limit (an archive of max_bytes refused: the limit is "at most")."""
    path = _small_set(tmp_path / "set")
    index = set_archive.pack([path], tmp_path / "a", tok=tiny_tokenizer())
    assert set_archive.pack([path], tmp_path / "b", tok=tiny_tokenizer(), max_bytes=index["bytes"]) == index
    with pytest.raises(ValueError, match="not written"):
        set_archive.pack([path], tmp_path / "c", tok=tiny_tokenizer(), max_bytes=index["bytes"] - 1)


def test_sets_of_two_models_are_not_packed_together(tmp_path):
    """Catches an archive that records one model for sets made with two (unpack rebuilds every set
    with that one model's tokenizer)."""
    one = _small_set(tmp_path / "one")
    two = _small_set(tmp_path / "two", name="t.jsonl.gz", model="another-model")
    with pytest.raises(ValueError, match="made with 'another-model', the other sets with 'tiny-random-llama'"):
        set_archive.pack([one, two], tmp_path / "a", tok=tiny_tokenizer())
    assert not (tmp_path / "a").exists()


def test_an_earlier_answer_in_a_turn_with_more_keys_is_kept_as_it_is(tmp_path):
    """Catches lean_rows replacing an assistant turn that holds more than role and content by an
    ``answer_of`` (its other keys lost): the set then failed its own rebuild check and was refused."""
    path = _small_set(tmp_path / "set", turn_keys={"name": "bot"})
    set_archive.pack([path], tmp_path / "archive", tok=tiny_tokenizer())
    lean = [json.loads(line) for line in lzma.open(tmp_path / "archive" / "s.lean.jsonl.xz")]
    assert lean[1]["prompt"][1] == {"role": "assistant", "content": "an answer", "name": "bot"}
    back = set_archive.unpack(tmp_path / "archive", tmp_path / "back", tok=tiny_tokenizer())
    assert back[0].read_bytes() == path.read_bytes()


def test_the_scripts_max_mb_is_in_megabytes(magpie_set, tmp_path):
    """Catches scripts/distilled_sets.py converting --max-mb with the wrong unit (a limit the archive
    is over by one byte let through)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_script_distilled_sets", Path(__file__).resolve().parents[2] / "scripts" / "distilled_sets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    size = set_archive.pack([magpie_set], tmp_path / "sized")["bytes"]
    with pytest.raises(ValueError, match="not written"):
        script.main(["pack", str(magpie_set), "--out", str(tmp_path / "a"), "--max-mb", str((size - 1) / 1e6)])
    packed = script.main(["pack", str(magpie_set), "--out", str(tmp_path / "b"), "--max-mb", str((size + 1) / 1e6)])
    assert packed["bytes"] == size


def test_space_distill_on_a_set_missing_rows_resumes(magpie_set, tmp_path, monkeypatch):
    """Catches a set taken as complete on its manifest alone: a row lost after the manifest was
    written (a set with fewer rows than it counts) must be made again, not left out."""
    import shutil

    from space import distill as distill_mod
    from space import models

    work = tmp_path / "set"
    shutil.copytree(magpie_set.parent, work)
    out = work / magpie_set.name
    out.write_text("".join(out.read_text(encoding="utf-8").splitlines(keepends=True)[:-1]), encoding="utf-8")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    with pytest.raises(AssertionError, match="model was loaded"):  # a resume, which loads the model
        distill_mod.distill(out, "tiny-random-llama", {"magpie": 4}, batch_size=2, max_new_tokens=12,
                            magpie=distill_mod.MagpieSettings(max_new_tokens=8, batch_size=4))
