"""Paper-scale evaluation on CPU (issue 18): torchrun / --shard ranks merged into one process's
result, per-rank resume, --device-map through accelerate hooks, and bad input."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from space.adapter_layers import MaskEmbedding, prepare_model
from space.artifact import save_artifact
from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.cache import CACHE_ARG, cache_input
from space.eval.__main__ import cli as eval_cli
from space.eval.__main__ import main as eval_main
from space.eval.shard import Shard, current_shard, parse_shard
from space.loader import load_space
from space.models import parse_device_map, tiny_random_llama
from tests.oracle import oracle_generate

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny-random-llama", "--adapter", "none", "--dataset", "humaneval", "--limit", "4",
        "--max-new-tokens", "8", "--mask-num", "3", "--methods", "ar,hf,space", "--threads", "1"]
# the tiny model's modules as two groups of accelerate-hooked entries, all on cpu
TWO_GROUPS = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def token_ids(records: list[dict]) -> list[tuple]:
    return [(r["question_id"], r["model_id"], r["choices"][0]["token_ids"]) for r in records]


def counts(summary: dict) -> dict:
    """The summary numbers that do not depend on timing."""
    methods = {m: {k: st.get(k) for k in ("samples", "new_tokens", "forward_passes", "tokens_per_step",
                                           "tokens_per_step_histogram")} for m, st in summary["methods"].items()}
    return {"methods": methods, "exact": summary.get("exact_match_rate"), "pass_at_1": summary["pass_at_1"],
            "skipped": summary.get("skipped"), "questions": summary["meta"]["num_questions"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no device map: (samples, summary)."""
    out = tmp_path_factory.mktemp("one")
    summary = eval_main([*ARGS, "--out", str(out)])
    return rows(out / "samples.jsonl"), summary


@pytest.mark.distributed
def test_torchrun_two_ranks_merge_to_the_one_process_result(tmp_path, reference):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29641", "-m", "space.eval", *ARGS, "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [{r["question_id"] for r in rows(tmp_path / f"samples.rank{i}.jsonl")} for i in (0, 1)]
    assert ranks == [{"HumanEval/0", "HumanEval/2"}, {"HumanEval/1", "HumanEval/3"}]  # a stride over the questions
    one, summary_one = reference
    merged = rows(tmp_path / "samples.jsonl")
    assert token_ids(merged) == token_ids(one)  # same ids, in one process's order
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert counts(summary) == counts(summary_one) and summary["exact_match_rate"] == 1.0
    assert summary["meta"]["ranks"] == 2 and summary_one["meta"]["ranks"] == 1
    assert "2 ranks" in (tmp_path / "summary.md").read_text()


def test_shard_rank_resumes_after_a_kill_then_merges(tmp_path, reference):
    """--shard ranks without a process group; rank 1 is cut mid-write, rerun, and --merge gives
    the one-process result with no duplicate record."""
    for rank in (0, 1):
        assert eval_main([*ARGS, "--shard", f"{rank}/2", "--out", str(tmp_path)]) is None
    rank1 = tmp_path / "samples.rank1.jsonl"
    lines = rank1.read_text().split("\n")[:-1]
    assert len(lines) == 6  # 2 questions x 3 methods
    kept = "".join(line + "\n" for line in lines[:4])
    rank1.write_text(kept + lines[4][:30])  # killed while writing: 4 records and a torn fifth
    with pytest.raises(ValueError, match=r"rank 1 of 2 has not finished: 2 of 6 \(question, method\) records"):
        eval_main(["--merge", str(tmp_path)])
    eval_main([*ARGS, "--shard", "1/2", "--out", str(tmp_path)])
    text = rank1.read_text()
    assert text.startswith(kept)  # the finished records were kept, not redone
    keys = [(r["question_id"], r["model_id"]) for r in rows(rank1)]
    assert len(keys) == len(set(keys)) == 6
    summary = eval_main(["--merge", str(tmp_path)])
    one, summary_one = reference
    assert token_ids(rows(tmp_path / "samples.jsonl")) == token_ids(one)
    assert counts(summary) == counts(summary_one) and summary["meta"]["ranks"] == 2
    # the merged folder resumes as a one-process run: nothing left to do, the same records
    assert counts(eval_main([*ARGS, "--out", str(tmp_path)])) == counts(summary_one)
    assert token_ids(rows(tmp_path / "samples.jsonl")) == token_ids(one)


@pytest.mark.parametrize("tree", [None, [[0], [1], [1, 0], [1, 1], [1, 0, 0]]], ids=["chain", "tree"])
@pytest.mark.parametrize("adapter", [None, "frozen-base"])
def test_device_map_hooks_space_equals_ar_and_every_layer_is_cropped(tmp_path, adapter, tree):
    """An explicit map (a JSON file) puts the tiny model on cpu as hooked entries: accelerate moves
    every module's inputs, SPACE greedy output equals AR, and each layer's cache ends cropped (a
    tree: compacted, the accepted path through a second-rank sibling) to exactly a fresh forward's
    over the tokens so far. A frozen-base adapter's new modules (mask embedding) are hooked too."""
    if adapter:
        model, tok = tiny_random_llama()
        model, spec = prepare_model(model, tok, "frozen-base", 3)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a non-zero gated update: the drafts differ from the untrained masks
                torch.nn.init.normal_(p, std=0.5)
        adapter = save_artifact(tmp_path / "adapter", model, tok, spec, "frozen-base", {"base_model": "tiny-random-llama"})
    (tmp_path / "map.json").write_text(json.dumps(TWO_GROUPS))
    model, tok, spec = load_space("tiny-random-llama", adapter, 3, device_map=parse_device_map(str(tmp_path / "map.json")))
    assert all(hasattr(model.get_submodule(name), "_hf_hook") for name in TWO_GROUPS) and hasattr(model, "_hf_hook")
    assert isinstance(model.model.embed_tokens, MaskEmbedding) == bool(adapter)
    prompt = tok("def fib(n):", return_tensors="pt").input_ids[0]
    truth = ar_generate(model, prompt, 40, suppress_ids=spec.token_ids).new_ids
    decoder = SpaceDecoder(model, spec, DecodeConfig(3, tree=tree))

    def oracle(done, drafts):  # the true drafts, with a wrong one every third step: a from 0 to k
        right = truth[len(done):len(done) + 3]
        if tree:  # (k, ranks): the truth at ranks 1, 0, 0 (the path [1, 0, 0]), wrong tokens elsewhere
            out = torch.arange(20, 20 + 3 * decoder.draft_ranks).view(3, decoder.draft_ranks)
            for j, token in enumerate(right):
                out[j, 1 if j == 0 else 0] = token
        else:
            out = list(right)
        if len(done) % 3 == 1 and len(right) > 1:
            out[1] = out[1] + 1
        return out

    caches = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: caches.append(kw[CACHE_ARG]),
                                                 with_kwargs=True)
    try:
        out = oracle_generate(decoder, prompt, 40, override=oracle)
    finally:
        hook.remove()
    assert out.new_ids == truth and max(out.accept_lengths) == 3 and 0 < min(out.accept_lengths[1:]) < 3
    cache = caches[-1]  # after the last step: the prompt and every emitted token but the bonus
    length = len(prompt) + sum(a + 1 for a in out.accept_lengths) - 1
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.cat([prompt, torch.tensor(truth)])[None, :length], **cache_input(fresh))
    for i, layer in enumerate(model.model.layers):
        assert cache.layers[i].keys.shape[-2] == cache.layers[i].values.shape[-2] == length, i
        assert cache.layers[i].keys.device == next(layer.parameters()).device
        torch.testing.assert_close(cache.layers[i].keys, fresh.layers[i].keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.layers[i].values, fresh.layers[i].values, rtol=1e-4, atol=1e-5)


def test_eval_with_a_device_map_gives_the_one_process_ids(tmp_path, reference):
    summary = eval_main([*ARGS, "--device-map", json.dumps(TWO_GROUPS), "--out", str(tmp_path)])
    assert token_ids(rows(tmp_path / "samples.jsonl")) == token_ids(reference[0])
    assert summary["exact_match_rate"] == 1.0 and summary["meta"]["device"] == "cpu"
    assert json.loads(summary["meta"]["device_map"]) == TWO_GROUPS


@pytest.mark.parametrize("extra,message", [
    (["--shard", "3/2"], "--shard 3/2: rank 3 is not in 0..1"),
    (["--shard", "0/0"], "--shard 0/0: n must be a process count >= 1"),  # it said "rank 0 is not in 0..-1"
    (["--shard=-1/2"], "rank -1 is not in 0..1"),
    (["--shard", "1"], "--shard '1': expected i/n"),
    (["--shard", "a/b"], "expected i/n"),
    (["--device-map", "everywhere"], "not one of auto, balanced, balanced_low_0, sequential, a JSON file"),
    (["--device-map", "[0, 1]"], "must be a non-empty object"),
    (["--device-map", '{"lm_head": "banana"}'], "module 'lm_head' has unknown device 'banana'"),
    (["--device-map", '{"model.layers.0": 0, "lm_head": "cpu"}'], "offloads lm_head to cpu/disk"),
    pytest.param(["--device-map", '{"model": 0, "lm_head": "cuda:1"}'], "no CUDA GPU is usable here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["--device-map", '{"model": "cpu", "lm_hed": "cpu"}'], "names modules the model does not have: ['lm_hed']"),
    (["--device-map", '{"model": "cpu"}'], "does not give any device for the following parameters: lm_head"),
])
def test_bad_shard_and_device_map_are_one_line_errors(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        eval_cli([*ARGS, "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("space-eval: error: ") and message in err
    assert "\n" not in err and not (tmp_path / "samples.jsonl").exists()


def test_merge_refuses_ranks_with_different_settings(tmp_path, capsys, monkeypatch):
    short = [*ARGS, "--limit", "2"]  # one question per rank
    eval_main([*short, "--shard", "0/2", "--out", str(tmp_path)])
    eval_main([*short, "--shard", "1/2", "--max-new-tokens", "6", "--out", str(tmp_path)])
    capsys.readouterr()  # the runs' progress bars
    with pytest.raises(SystemExit) as exit_:
        eval_cli(["--merge", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert "ranks in" in err and "different settings, cannot merge: max_new_tokens = 8 (rank 0), 6 (rank 1)" in err
    with pytest.raises(FileNotFoundError, match="no sharded run to merge"):
        eval_main(["--merge", str(tmp_path / "empty")])
    (tmp_path / "run_config.rank1.json").unlink()
    with pytest.raises(ValueError, match=r"rank 1 of 2 has not run .* run it with --shard 1/2"):
        eval_main(["--merge", str(tmp_path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="the launcher assigns the ranks; drop --shard"):
        eval_main([*short, "--shard", "0/2", "--out", str(tmp_path)])


def test_sampled_shards_draw_the_one_process_samples(tmp_path):
    """Sampling (temperature > 0): rank i draws question q's samples with the same seed as one
    process does, so the merged samples do not depend on the number of ranks."""
    sampled = [*ARGS, "--limit", "2", "--methods", "ar,space", "--temperature", "0.9", "--top-k", "50"]
    one = tmp_path / "one"
    eval_main([*sampled, "--out", str(one)])
    for rank in (0, 1):
        eval_main([*sampled, "--shard", f"{rank}/2", "--out", str(tmp_path / "two")])
    eval_main(["--merge", str(tmp_path / "two")])
    assert token_ids(rows(tmp_path / "two" / "samples.jsonl")) == token_ids(rows(one / "samples.jsonl"))


def test_merge_keeps_questions_a_plain_run_added(tmp_path):
    """Merge, then a plain run in the same folder adds questions (it resumes the merged file),
    then merge again: the added records stay (they were dropped: 8 records became 6)."""
    short = [*ARGS, "--methods", "ar,space", "--out", str(tmp_path)]
    for rank in (0, 1):
        eval_main([*short, "--limit", "3", "--shard", f"{rank}/2"])
    eval_main(["--merge", str(tmp_path)])
    assert len(rows(tmp_path / "samples.jsonl")) == 6
    # a merged record names its ranks' devices and machines: a plain run on another device type or
    # machine would mix its timings into the run's speedup (it resumed, as no single run repeats them)
    config = tmp_path / "run_config.json"
    merged = json.loads(config.read_text())
    for key, other in (("device", "cuda:0; cuda:1"), ("machine", "x86_64 96 cores, an H200 host; another host")):
        config.write_text(json.dumps({**merged, key: other}))
        with pytest.raises(ValueError, match=rf"other settings .*'{key}'"):
            eval_main([*short, "--limit", "4"])
    config.write_text(json.dumps(merged))
    eval_main([*short, "--limit", "4"])
    plain = rows(tmp_path / "samples.jsonl")
    assert len(plain) == 8
    summary = eval_main(["--merge", str(tmp_path)])
    assert token_ids(rows(tmp_path / "samples.jsonl")) == token_ids(plain)
    assert summary["meta"]["num_questions"] == 4 and summary["methods"]["space"]["samples"] == 4


def test_shard_ranks_and_devices(monkeypatch):
    """--shard i/n needs i < n (rank n of n ran rank 0's questions a second time); under torchrun a
    bare ``cuda`` is this node's GPU LOCAL_RANK (every rank on GPU 0 before), nothing else changes."""
    assert parse_shard("1/3") == Shard(1, 3) and Shard(1, 3).select(list(range(7))) == [1, 4]
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        parse_shard("2/2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    launched = Shard(3, 4, launched=True)
    assert launched.device("cuda") == "cuda:3" and launched.device("cuda:1") == "cuda:1" and launched.device("cpu") == "cpu"
    assert Shard(3, 4).device("cuda") == "cuda"  # --shard: the scheduler chose the GPU (CUDA_VISIBLE_DEVICES)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert current_shard(None) == launched
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert current_shard(None) is None


@pytest.mark.parametrize("world, rank, fragment", [
    ("2", None, "WORLD_SIZE=2 with RANK=None: a launched process needs a RANK in 0..1"),  # a KeyError traceback
    ("2", "5", "WORLD_SIZE=2 with RANK='5'"),  # accepted: rank 5 of 2 selected no question
    ("2", "2", "WORLD_SIZE=2 with RANK='2'"),  # the first rank past the last: an off-by-one let it in
    ("0", "0", "WORLD_SIZE='0' in the environment: not a process count"),  # not blamed on the RANK
    ("two", "0", "WORLD_SIZE='two' in the environment: not a process count"),
])
def test_a_launcher_environment_that_is_not_one_is_refused(monkeypatch, world, rank, fragment):
    monkeypatch.setenv("WORLD_SIZE", world)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        current_shard(None)


def test_rank_0_s_refused_merge_says_how_to_merge_later(tmp_path, monkeypatch):
    """Catches rank 0 of a launched run letting the merge's refusal through bare (here a plain run
    holds samples.jsonl): the message must say that the ranks' files are kept and that
    ``space-eval --merge OUT`` merges them later. No process group: its join and barrier are skipped."""
    from space.eval import __main__ as eval_module
    from space.eval.resume import hold_samples

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(eval_module, "join", lambda shard: None)
    monkeypatch.setattr(eval_module, "wait_for_all", lambda shard: None)
    hint = (r"being written by another run .*; the ranks' own files are kept: merge them later with "
            rf"space-eval --merge {re.escape(str(tmp_path))}$")
    with hold_samples(tmp_path / "samples.jsonl"):
        with pytest.raises(ValueError, match=hint):
            eval_main([*ARGS, "--limit", "2", "--methods", "ar", "--out", str(tmp_path)])
    assert [r["question_id"] for r in rows(tmp_path / "samples.rank0.jsonl")] == ["HumanEval/0"]


def test_merge_keeps_the_kernels_timed_choices_only_where_the_ranks_agree(tmp_path):
    """A merged record copied rank 0's timed kernel choices (``kernel_paths``, ``packed_min_rows``),
    which a resume pins (``recorded_paths``): resumed on rank 1's machine, it packed as rank 0's
    machine had timed. They are kept now only where every rank chose alike."""
    short = [*ARGS, "--limit", "2", "--out", str(tmp_path)]
    for rank in (0, 1):
        eval_main([*short, "--shard", f"{rank}/2"])
    ranks = [json.loads((tmp_path / f"run_config.rank{r}.json").read_text()) for r in (0, 1)]
    alike = {"packed_min_rows": 4, "kernel_paths": {"576x576": {"stock_rows": 2}}}
    for r in (0, 1):
        (tmp_path / f"run_config.rank{r}.json").write_text(json.dumps({**ranks[r], **alike}))
    eval_main(["--merge", str(tmp_path)])
    merged = json.loads((tmp_path / "run_config.json").read_text())
    assert {k: merged.get(k) for k in alike} == alike
    (tmp_path / "run_config.rank1.json").write_text(json.dumps(
        {**ranks[1], "packed_min_rows": 8, "kernel_paths": {"576x576": {"stock_rows": 6}}}))
    eval_main(["--merge", str(tmp_path)])
    merged = json.loads((tmp_path / "run_config.json").read_text())
    assert "packed_min_rows" not in merged and "kernel_paths" not in merged
    # a plain run resuming the merged record keeps its own choices out of it too (it names two machines)
    config = tmp_path / "run_config.json"
    config.write_text(json.dumps({**merged, **alike}))
    eval_main([*ARGS, "--limit", "3", "--out", str(tmp_path), "--kernels", "fast"])
    resumed = json.loads(config.read_text())
    assert resumed["ranks"] == 2
    assert all(resumed.get(k) in (None, alike[k]) for k in alike), {k: resumed.get(k) for k in alike}


def test_shard_under_a_launcher_is_refused_and_i_n_must_be_integers(monkeypatch):
    """``--shard`` with torchrun's ``WORLD_SIZE=2``: the launcher assigns the ranks, so two ranks
    given one ``--shard`` would both run that shard's questions while the other's were never run.
    Catches the check applied only from 3 processes on, and ``i/n`` parsed leniently (``1.5/3``
    read as rank 1)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--shard 0/2 under torchrun/accelerate \\(WORLD_SIZE=2\\)"):
        current_shard("0/2")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert current_shard("1/2") == Shard(1, 2)
    for bad in ("1.5/3", "1/2.0", "1/2/3"):
        with pytest.raises(ValueError, match="expected i/n"):
            parse_shard(bad)
