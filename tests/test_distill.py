"""space.distill on a stub model that answers fixed texts: greedy batches cut at EOS, what is
skipped, single-turn prompts only, and a plain .jsonl output that resumes after a torn append
without losing or repeating a row."""
import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from space.data.prompts import chat_ids
from space.data.sft import load_examples, tokenize
from space.distill import Distiller, MagpieSettings, collect_prompts, greedy_batches
from space.models import tiny_tokenizer


class StubModel:
    """``generate`` answers each left-padded prompt with ``answers[user text]`` (a text, or token ids
    as they are) (+ EOS unless the text is in ``unfinished``), padded on the right like HF's
    batched output."""

    device = torch.device("cpu")

    def __init__(self, tok, answers, unfinished=()):
        from transformers import GenerationConfig

        self.tok, self.answers, self.unfinished = tok, answers, set(unfinished)
        self.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id)
        self.config = SimpleNamespace(max_position_embeddings=2048)  # what greedy_batches checks prompts against

    def generate(self, input_ids, attention_mask, **kwargs):
        tok, rows = self.tok, []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            assert mask[-1] == 1, "prompts must be padded on the left"
            prompt = tok.decode([i for i, m in zip(ids, mask) if m])
            user = next(u for u in self.answers if f"user\n{u}<|im_end|>" in prompt)
            answer = self.answers[user]
            new = answer if isinstance(answer, list) else tok(answer, add_special_tokens=False)["input_ids"]
            rows.append(ids + new + ([] if user in self.unfinished else [tok.eos_token_id]))
        width = max(map(len, rows))
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])


def test_greedy_batches_cut_at_eos_shortest_first():
    """Catches keeping the EOS (or anything after it) in an answer, a wrong end id (None: cut at the
    length limit), and the tokenizer's padding side left changed."""
    tok = tiny_tokenizer()
    model = StubModel(tok, {"a longer question": "one", "q": "two", "mid q": "three"}, unfinished={"mid q"})
    prompts = [{"text": t, "ids": chat_ids(tok, [{"role": "user", "content": t}])} for t in model.answers]
    side = tok.padding_side
    batches = list(greedy_batches(model, tok, prompts, batch_size=2))
    assert [[p["text"] for p, _, _ in b] for b in batches] == [["q", "mid q"], ["a longer question"]]
    got = {p["text"]: (tok.decode(ids), done) for b in batches for p, ids, done in b}
    eos = tok.eos_token_id
    assert got == {"q": ("two", eos), "mid q": ("three", None), "a longer question": ("one", eos)}
    assert tok.padding_side == side


def test_greedy_batches_record_the_end_id_each_answer_generated():
    """Catches recording the smallest end id (``stop_ids`` is sorted) in place of the one an answer
    ended with: a row ended by the tokenizer's EOS where the model also lists a lower end id."""
    tok = tiny_tokenizer()
    other = 7  # an end id the model lists beside the EOS, below it
    model = StubModel(tok, {"q": "two", "mid q": [83, other, 86]})
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    prompts = [{"text": t, "ids": chat_ids(tok, [{"role": "user", "content": t}])} for t in model.answers]
    got = {p["text"]: (ids, stop) for b in greedy_batches(model, tok, prompts, batch_size=2) for p, ids, stop in b}
    assert got == {"q": (tok("two", add_special_tokens=False)["input_ids"], tok.eos_token_id), "mid q": ([83], other)}


def test_greedy_batches_are_the_models_greedy_output_whatever_its_generation_config():
    """The answers are the teacher's greedy AR output (``ar_generate``, what the decoders emit), so
    the model's own ``generation_config`` settings stay out (HF fills every setting a call leaves
    out from it: a repetition penalty made other answers, and with pad = eos penalized a padded
    row's eos), and an end id the model lists beside the tokenizer's (a chat model's end of turn)
    ends an answer, as space-eval stops. The tiny random model, real HF ``generate``."""
    from space.decoding import ar_generate
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama()
    prompts = [{"text": t, "ids": chat_ids(tok, [{"role": "user", "content": t}])} for t in ("hi", "a longer one")]
    truth = {p["text"]: ar_generate(model, torch.tensor(p["ids"]), 24).new_ids for p in prompts}
    model.generation_config.repetition_penalty = 1.5
    got = {p["text"]: ids for b in greedy_batches(model, tok, prompts, 2, 24) for p, ids, _ in b}
    assert got == {t: ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids for t, ids in truth.items()}
    assert model.generation_config.repetition_penalty == 1.5  # set aside for the call only
    end = truth["hi"][3]  # an end id the model lists, the tokenizer does not
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    (p, ids, stop), = [row for b in greedy_batches(model, tok, prompts[:1], 2, 24) for row in b]
    assert ids == truth["hi"][: truth["hi"].index(end)] and stop == end


def test_collect_prompts_takes_single_turn_prompts_once(tmp_path):
    """Catches taking multi-turn rows (their context holds human answers, not the model's own)
    and a limit that takes one prompt too many or counts skipped rows."""
    path = tmp_path / "rows.jsonl"
    rows = [{"instruction": "q0", "output": "a", "history": [["earlier", "human answer"]]},
            {"prompt": "q1", "response": "a"}, {"prompt": "q1", "response": "dup"}, {"prompt": "q2", "response": "a"},
            {"prompt": "q3", "response": "a"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = collect_prompts({str(path): None}, exclude_dev=False)
    assert [p["id"].rsplit("/", 1)[1] for p in got] == ["1", "3", "4"]
    assert all(len(p["prompt"]) == 1 for p in got)
    assert [p["prompt"][0]["content"] for p in collect_prompts({str(path): 2}, exclude_dev=False)] == ["q1", "q2"]


def test_distill_jsonl_skips_and_resumes_after_a_torn_append(tmp_path):
    """Prompts over --max-prompt-tokens and blank answers are skipped (a prompt exactly at the
    limit is kept); an interrupted run (torn last line) resumes with the missing rows only; a
    resume with another model is refused. Catches resuming with a reader that fails on the torn
    line, an output rewritten with only the new rows, an off-by-one in the prompt limit, blank
    answers kept, and the model missing from the resume check."""
    tok = tiny_tokenizer()
    answers = {"Hiya": "Hello", "Hiya!": "too long", "Why?": "Because.", "Blk?": " \n ", "How?": "Like so."}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in answers))
    limit = len(chat_ids(tok, [{"role": "user", "content": "Hiya"}]))  # bytes: "Hiya!" is one token longer
    out = tmp_path / "set.jsonl"

    def run(model_name="stub"):
        return Distiller(out, model_name, {str(source): None}, 2, 16, limit, None, MagpieSettings()).run(
            StubModel(tok, answers), tok)

    first = run()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["prompt"][0]["content"]: r["response"] for r in rows} == {"Hiya": "Hello", "Why?": "Because.", "How?": "Like so."}
    assert all(r["finished"] and r["new_tokens"] == len(tok(r["response"])["input_ids"]) for r in rows)
    assert all(r["response_ids"] == tok(r["response"])["input_ids"] for r in rows)
    assert all(r["stop_id"] == tok.eos_token_id for r in rows)  # the end id generated, which training appends
    assert first["skipped_this_run"] == {"prompt over --max-prompt-tokens": 1, "empty answer": 1}
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:10])  # killed during the second append: one row whole, one torn
    again = run()
    assert again["new_rows_this_run"] == 2 and again["rows"] == 3
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(resumed, key=lambda r: r["id"]) == sorted(rows, key=lambda r: r["id"])
    with pytest.raises(ValueError, match="other settings.*model"):
        run("another-model")


def test_distill_resume_checks_hold_before_the_first_row_and_across_sources(tmp_path):
    """Catches five gaps in the resume check: rows written before the first manifest (a run killed
    then, resumed with other settings, mixed them silently); a rerun without magpie erasing the
    magpie settings and verdicts (a later magpie resume was refused) or the count of turns sampled
    (with the .magpie file gone, as an unpacked set has it, a later magpie run sampled again from
    batch 0 under ids the rows hold); an alias refused against its own folder; x.jsonl.gz resumed
    from x.jsonl's manifest (the two share it: the finished set's record was overwritten)."""
    from space.models import SMOLLM2, cache_dir

    tok = tiny_tokenizer()
    answers = {"Hiya": "Hello", "Why?": "Because."}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in answers))
    out, manifest_file = tmp_path / "set.jsonl", tmp_path / "set.manifest.json"

    def distiller(model_name="stub", max_new_tokens=16):
        return Distiller(out, model_name, {str(source): None}, 2, max_new_tokens, 64, None, MagpieSettings())

    out.write_text(json.dumps({"id": "x", "key": "k", "source": "s", "prompt": [], "response": "r",
                               "new_tokens": 1, "finished": True}) + "\n")  # killed before its first manifest
    with pytest.raises(ValueError, match="has no manifest"):
        distiller(max_new_tokens=8)
    out.unlink()
    distiller().run(StubModel(tok, answers), tok)
    manifest = json.loads(manifest_file.read_text())
    magpie = asdict(MagpieSettings(seed=7))
    manifest["settings"]["magpie"], manifest["filter_verdicts"] = magpie, {"first turn": {"ok": 3}}
    manifest["settings"]["model"], manifest["magpie_turns_sampled"] = SMOLLM2, {"turn 1": 3}
    manifest_file.write_text(json.dumps(manifest))  # a set that also holds magpie turns, made with the alias
    distiller(str(cache_dir() / SMOLLM2)).run(StubModel(tok, answers), tok)  # the other sources again, by folder
    kept = json.loads(manifest_file.read_text())
    assert kept["settings"]["magpie"] == magpie and kept["filter_verdicts"] == {"first turn": {"ok": 3}}
    assert kept["magpie_turns_sampled"] == {"turn 1": 3}  # its .magpie file is gone: a magpie resume is refused
    with pytest.raises(ValueError, match="records sampled Magpie turns"):
        Distiller(out, SMOLLM2, {"magpie": 2}, 2, 16, 64, None, MagpieSettings(seed=7))
    with pytest.raises(ValueError, match=r"records the set set.jsonl, not set.jsonl.gz"):
        Distiller(tmp_path / "set.jsonl.gz", "stub", {str(source): None}, 2, 16, 64, None, MagpieSettings())
    # a set copied under another stem with its manifest (which names set.jsonl) is the same set: it resumes
    # (it was refused as sharing a manifest)
    for name in ("set.jsonl", "set.manifest.json"):
        (tmp_path / name.replace("set", "mine")).write_bytes((tmp_path / name).read_bytes())
    Distiller(tmp_path / "mine.jsonl", str(cache_dir() / SMOLLM2), {str(source): None}, 2, 16, 64, None, MagpieSettings())


def test_a_run_stopped_right_after_its_first_rows_resumes(tmp_path, monkeypatch):
    """Ctrl-C between the first append and the manifest written after it. The settings are
    written before any row, so the rerun checks them and goes on. Catches the manifest written
    only after a batch: the rerun found rows without one and refused ("has no manifest"), though
    the same command made them."""
    import space.distill as distill

    tok = tiny_tokenizer()
    answers = {"Hiya": "Hello", "Why?": "Because."}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in answers))
    out = tmp_path / "set.jsonl"

    def run():
        return Distiller(out, "stub", {str(source): None}, 1, 16, 64, None, MagpieSettings()).run(
            StubModel(tok, answers), tok)

    real = distill.append_jsonl

    def append_then_interrupt(path, rows):
        real(path, rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "append_jsonl", append_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    assert len(out.read_text().splitlines()) == 1
    summary = run()
    assert summary["new_rows_this_run"] == 1 and summary["rows"] == 2
    assert sorted(r["prompt"][0]["content"] for r in map(json.loads, out.read_text().splitlines())) == ["Hiya", "Why?"]


def test_a_distilled_row_keeps_the_generated_ids_of_a_cut_character(tmp_path):
    """An answer cut inside a multi-byte character: its text drops the byte's U+FFFD, which the
    model never wrote; its ``response_ids`` are what it generated, the byte included, and training
    uses them. Catches ids taken from the text (tokenized again) instead of the generation."""
    tok = tiny_tokenizer()
    e_acute = tok("é", add_special_tokens=False)["input_ids"]
    generated = tok("caf", add_special_tokens=False)["input_ids"] + e_acute[:1]
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "Cafe?", "response": "-"}) + "\n")
    out = tmp_path / "set.jsonl"
    Distiller(out, "stub", {str(source): None}, 2, 16, 64, None, MagpieSettings()).run(
        StubModel(tok, {"Cafe?": generated}, unfinished={"Cafe?"}), tok)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["response"], row["response_ids"], row["finished"]) == ("caf", generated, False)
    [sample] = tokenize(load_examples(str(out)), tok, 64)
    assert sample["input_ids"][sample["prompt_len"]:] == generated and sample["own_ids"]


def test_a_second_run_into_the_same_out_is_refused(tmp_path):
    """Two runs into one --out each answered every prompt and appended it (120 rows over 60 keys,
    the manifest saying 60). Catches a run that does not hold its output."""
    from space.distill import distill
    from space.jsonl import held

    out = tmp_path / "set.jsonl"
    with held(out, str(out), "-"):
        with pytest.raises(ValueError, match=rf"{out} is being written by another run \(pid \d+\); wait for it"):
            distill(out, "tiny-random-llama", {"mbpp": 1}, max_new_tokens=2)
    assert not out.exists()


def test_a_set_records_every_runs_answer_batch_size(tmp_path):
    """A batch's padding moves fp32 greedy answers at near-ties as a device does, so a set resumed
    at another answer batch size (a GPU's 512 after a CPU's 16) records both; it recorded the last
    run's alone. A manifest from before the list names one size, kept."""
    tok = tiny_tokenizer()
    answers = {"Hiya": "Hello", "Why?": "Because."}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in answers))
    out, manifest_file = tmp_path / "set.jsonl", tmp_path / "set.manifest.json"

    def run(batch_size):
        Distiller(out, "stub", {str(source): None}, batch_size, 16, 64, None, MagpieSettings()).run(
            StubModel(tok, answers), tok)
        return json.loads(manifest_file.read_text())

    assert run(2)["answer_batch_sizes"] == [2]
    assert run(16)["answer_batch_sizes"] == [2, 16]
    older = {k: v for k, v in run(16).items() if k != "answer_batch_sizes"}
    manifest_file.write_text(json.dumps({**older, "answer_batch_size": 8}))
    assert run(2)["answer_batch_sizes"] == [2, 8]


def test_a_set_records_its_dtype_and_device_and_resumes_only_in_its_dtype(tmp_path, monkeypatch):
    """``--dtype`` and ``--device`` (issue 60: self-distillation in large batches on a GPU). bf16
    greedy answers part from fp32 ones at near-ties, so a set resumed in another dtype would mix two
    teachers: refused by name. Sets made before the flag are fp32 and resume as they did; every
    run's device is recorded, not checked. The model loads in the dtype asked for."""
    from space.distill import distill, main

    tok = tiny_tokenizer()
    answers = {"Hiya": "Hello", "Why?": "Because."}
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in answers))
    out, manifest_file = tmp_path / "set.jsonl", tmp_path / "set.manifest.json"

    def distiller(dtype, device="cpu"):
        return Distiller(out, "stub", {str(source): None}, 2, 16, 64, None, MagpieSettings(), dtype, device)

    distiller("bfloat16", "cuda:0").run(StubModel(tok, answers), tok)
    manifest = json.loads(manifest_file.read_text())
    assert manifest["settings"]["dtype"] == "bfloat16" and manifest["devices"] == ["cuda:0"] and manifest["rows"] == 2
    with pytest.raises(ValueError, match=r"other settings \(dtype: 'bfloat16' -> 'float32'\)"):
        distiller("float32")
    distiller("bfloat16").run(StubModel(tok, answers), tok)  # another device: resumed
    assert json.loads(manifest_file.read_text())["devices"] == ["cpu", "cuda:0"]
    del manifest["settings"]["dtype"]  # as written before --dtype: an fp32 set
    manifest_file.write_text(json.dumps(manifest))
    distiller("float32").run(StubModel(tok, answers), tok)
    # a manifest from before the devices' list names one device, one from before --device a CPU's
    for older, earlier in (({"device": "cuda:1"}, "cuda:1"), ({}, "cpu")):
        manifest_file.write_text(json.dumps({**{k: v for k, v in manifest.items() if k != "devices"}, **older}))
        distiller("float32", "cuda:0").run(StubModel(tok, answers), tok)
        assert json.loads(manifest_file.read_text())["devices"] == sorted({earlier, "cuda:0"})
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"dtype: None -> 'bfloat16'"):
        distiller("bfloat16")

    loaded = {}
    monkeypatch.setattr(Distiller, "run", lambda self, model, tok: loaded.update(dtype=model.dtype, settings=self.settings)
                        or {"rows": 0, "new_rows_this_run": 0, "seconds_this_run": 0, "rows_by_source": {},
                            "skipped_this_run": {}, "filter_verdicts": {}})
    distill(tmp_path / "bf16.jsonl", "tiny-random-llama", {"mbpp": 1}, dtype="bf16", device="cpu")
    assert loaded["dtype"] == torch.bfloat16 and loaded["settings"]["dtype"] == "bfloat16"
    main(["--model", "tiny-random-llama", "--out", str(tmp_path / "gpu.jsonl"), "--sources", "magpie", "--device", "cpu",
          "--dtype", "bf16", "--magpie-batch-size", "512"])  # issue 60's flags, through the command line
    assert loaded["settings"]["magpie"]["batch_size"] == 512 and loaded["settings"]["dtype"] == "bfloat16"
    for flag, value, match in (("--dtype", "fp8", "unknown dtype 'fp8'"), ("--device", "cuda:9", "--device cuda:9"),
                               ("--magpie-batch-size", "0", "--magpie-batch-size must be >= 1")):
        with pytest.raises(ValueError, match=match):
            main(["--model", "tiny-random-llama", "--out", str(tmp_path / "x.jsonl"), flag, value])
    assert not (tmp_path / "x.jsonl").exists()


def test_a_set_whose_longest_prompt_and_answer_exceed_the_context_is_refused_before_any_answer(tmp_path):
    """--max-prompt-tokens + --max-new-tokens past the model's context: each batch's check
    (greedy_batches) stopped a set of several sources part way, after the earlier ones were written;
    refused before the first answer and before the manifest."""
    tok = tiny_tokenizer()
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "Hiya", "response": "-"}) + "\n")
    out = tmp_path / "set.jsonl"
    with pytest.raises(ValueError, match="--max-prompt-tokens 64 \\+ --max-new-tokens 2000 exceed the model's context "
                                         "of 2048 tokens"):
        Distiller(out, "stub", {str(source): None}, 2, 2000, 64, None, MagpieSettings()).run(
            StubModel(tok, {"Hiya": "Hello"}), tok)
    assert not out.exists() and not (tmp_path / "set.manifest.json").exists()
