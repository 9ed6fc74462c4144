"""The sampler head in training (issue 34): teacher-forced on the true previous token, saved with the
adapter and in checkpoints, resumed, refused outside frozen-base; an adapter without it is unchanged."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from space.adapter_layers import prepare_model
from space.artifact import SAMPLER_HEAD
from space.config import parse_train_args
from space.data.collator import SpaceCollator
from space.loader import load_space
from space.masking import IGNORE_INDEX, previous_ids
from space.models import load_model
from space.sampler_head import SamplerHead, add_sampler_head, sampler_head
from space.train.steps import mask_pass, real_pass


def train(tmp_path, steps=4, extra=()):
    from space.train.run import run_sft

    args = parse_train_args([
        "--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path), "--limit", "2",
        "--max_steps", str(steps), "--save_steps", "2", "--logging_steps", "1", "--mask_num", "3",
        "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--sampler_head", "true",
        "--sampler_width", "24", *extra])
    return run_sft(*args)


def test_previous_ids_is_the_real_token_before_each_target():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    # masks j = 0, 1 anchored at e = 2 sit at positions 2, 3 and predict rows 3, 4
    assert previous_ids(ids, torch.tensor([[2, 3]])).tolist() == [[7, 8]]
    assert previous_ids(ids, torch.tensor([[7, 12]])).tolist() == [[9, 9]]  # no target: clamped
    assert previous_ids(ids[0], torch.tensor([3, 4]), cache_len=2).tolist() == [6, 7]


def test_the_real_pass_is_the_clean_frozen_base_under_dropout():
    """The frozen real pass is what decoding runs: no dropout, whatever the base's config (OPT,
    GPT-2 and Phi-2 have some) and the model's train mode, which it leaves as it was. Catches a
    real pass in train mode: two calls drew two caches and teacher targets."""
    from space.models import tiny_random_llama

    torch.manual_seed(0)
    base, tok = tiny_random_llama(seed=0, attention_dropout=0.5)
    model, spec = prepare_model(base, tok, "frozen-base", 3)
    collator = SpaceCollator(spec.ids_for(3), 3, pad_id=0, spans_per_sample=4)
    batch = collator([{"input_ids": torch.randint(11, 250, (20,)).tolist(), "prompt_len": 2, "idx": 0}])
    model.train()
    (_, first), (_, second) = real_pass(model, batch), real_pass(model, batch)
    assert model.get_base_model().get_decoder().training
    model.eval()
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, real_pass(model, batch)[1])


def test_untrained_head_is_the_identity_and_mask_pass_feeds_it_the_true_previous_token():
    """A fresh head changes nothing (W2 = 0); with weights, the mask pass's logits are the LM head
    of the head's output given each mask's hidden state and previous_ids, computed here by hand."""
    torch.manual_seed(0)
    model, spec = prepare_model(*load_model("tiny-random-llama"), "frozen-base", 3)
    collator = SpaceCollator(spec.ids_for(3), 3, pad_id=0, spans_per_sample=4)
    batch = collator([{"input_ids": torch.randint(11, 250, (20,)).tolist(), "prompt_len": 2, "idx": i} for i in range(2)])
    cache, _ = real_pass(model, batch)
    plain = mask_pass(model, model, batch, cache, slice(0, batch["input_ids"].shape[1] - batch["num_real"]),
                      hidden_states=True)
    head = add_sampler_head(model, 16)
    assert sampler_head(model) is head and head.width == 16
    rows = slice(0, batch["input_ids"].shape[1] - batch["num_real"])
    fresh = mask_pass(model, model, batch, cache, rows)
    torch.testing.assert_close(fresh.logits, plain.logits)
    with torch.no_grad():
        head.fc2.weight.normal_(0, 0.5)
    out = mask_pass(model, model, batch, cache, rows)
    T = batch["num_real"]
    prev = batch["input_ids"][:, :T].gather(1, batch["position_ids"][:, T:].clamp(max=T - 1))
    scored = (batch["labels"][:, T:] != IGNORE_INDEX) & (batch["mask_offset"][:, T:] >= 0)
    assert scored.any()
    emb = model.get_input_embeddings()(prev)
    want = model.get_base_model().lm_head(head(plain.hidden_states[-1], emb))
    torch.testing.assert_close(out.logits[scored], want[scored])
    assert not torch.allclose(out.logits[scored], plain.logits[scored])
    out.logits[scored].sum().backward()  # the head trains
    assert head.fc1.weight.grad is not None and head.fc1.weight.grad.abs().sum() > 0


def test_a_fresh_head_changes_nothing_on_a_model_that_scales_its_logits():
    """Catches the sampler head's logits made by the bare LM head (``causal_lm_head`` skipped): on
    Granite (logits divided by logits_scaling 8) a fresh head's logits were 8x the model's own."""
    import transformers

    from space.models import tiny_tokenizer

    config = transformers.GraniteConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.2, logits_scaling=8.0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = transformers.GraniteForCausalLM(config).eval()
    model, spec = prepare_model(base, tiny_tokenizer(), "frozen-base", 3)
    collator = SpaceCollator(spec.ids_for(3), 3, pad_id=0, spans_per_sample=4)
    g = torch.Generator().manual_seed(1)
    batch = collator([{"input_ids": torch.randint(11, 250, (20,), generator=g).tolist(), "prompt_len": 2, "idx": 0}])
    cache, _ = real_pass(model, batch)
    rows = slice(0, batch["input_ids"].shape[1] - batch["num_real"])
    plain = mask_pass(model, model, batch, cache, rows)
    add_sampler_head(model, 16)
    torch.testing.assert_close(mask_pass(model, model, batch, cache, rows).logits, plain.logits)


def test_train_save_resume_and_load(tmp_path, capsys):
    out = train(tmp_path / "run", steps=2)
    cfg = json.loads((out / "space_config.json").read_text())
    assert cfg["sampler_head"] == {"width": 24} and (out / SAMPLER_HEAD).is_file()
    assert (tmp_path / "run" / "checkpoint-2" / SAMPLER_HEAD).is_file()
    saved = load_file(out / SAMPLER_HEAD)
    assert torch.count_nonzero(saved["fc2.weight"]) > 0  # trained away from its zero start
    model, _, _ = load_space(adapter=out)
    head = sampler_head(model)
    assert isinstance(head, SamplerHead) and not head.training
    assert torch.equal(head.fc2.weight, saved["fc2.weight"])
    capsys.readouterr()
    out = train(tmp_path / "run", steps=4)  # resumes from checkpoint-2 with its head
    assert "resuming: 2 of" in capsys.readouterr().out
    assert not torch.equal(load_file(out / SAMPLER_HEAD)["fc2.weight"], saved["fc2.weight"])
    with pytest.raises(ValueError, match="other SPACE settings"):  # the head is a setting of the run
        train(tmp_path / "run", steps=6, extra=("--sampler_width", "8"))
    for bad, match in ((["--mode", "lora"], "sampler_head needs"), (["--layout", "truncate"], "sampler_head needs"),
                       (["--sampler_width", "-1"], "sampler_width"),
                       (["--ddp_find_unused_parameters", "true"], "ddp_find_unused_parameters")):
        with pytest.raises(ValueError, match=match):
            train(tmp_path / "bad", extra=bad)


def test_adapter_without_head_and_damaged_head(tmp_path):
    """An adapter without a head loads with none (today's adapters); a damaged head file or entry
    is named."""
    model, _, _ = load_space(adapter="adapters/smollm2-135m-space")
    assert sampler_head(model) is None
    out = train(tmp_path / "run", steps=1)
    (out / SAMPLER_HEAD).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="sampler_head.safetensors"):
        load_space(adapter=out)
    cfg = json.loads((out / "space_config.json").read_text())
    cfg["sampler_head"] = {"width": "wide"}
    (out / "space_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bad sampler_head entry"):
        load_space(adapter=out)


def test_trains_under_torchrun(tmp_path):
    """The launcher wraps the model in DDP; the head runs outside its forward, so DDP's
    unused-parameter search must be off (with it, step 1 fails: a head weight "marked as ready twice")."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", "run_sft_multi_node.sh", "configs/train/tiny_smoke.yaml", "--output_dir",
                           str(tmp_path), "--limit", "2", "--max_steps", "2", "--save_steps", "2",
                           "--sampler_head", "true", "--sampler_width", "24"],
                          cwd=root, env={**os.environ, "PYTHON": sys.executable},  # this test's python, venv or not
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "final" / SAMPLER_HEAD).is_file()
