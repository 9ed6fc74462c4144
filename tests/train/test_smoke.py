"""``run_sft_multi_node.sh CONFIG --smoke`` (space/train/smoke.py): the stand-in copies the model's
attention shape, the smoke says what it changes, refuses what the effective settings need (a
``--deepspeed`` override included), checks the artifact's tensors, runs on this node alone, and
a failure names the user's config and keeps its log. Every config's smoke, run inside a 4-node
job's environment it must not join, with its summary line: tests/train/test_recipes.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from space.train.smoke import (REFUSED_EXIT, build_stand_in, check_trained, family, main, smoke_config,
                               stand_in_heads)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model, heads", [
    ("/models/Llama-2-7b-hf", (2, 2)),  # multi-head: 32/32
    ("/models/Llama-2-70b-hf", (8, 1)),  # grouped-query: 8 query heads per KV head
    ("smollm2-135m-instruct", (6, 2)),  # 9/3
    ("tiny-random-llama", (4, 2)),
])
def test_stand_in_copies_the_attention_shape(model, heads, tmp_path):
    build_stand_in(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == heads
    assert cfg["hidden_size"] == 16 * heads[0] and cfg["num_hidden_layers"] == 2


def test_stand_in_reads_the_model_directory(tmp_path):
    """A local model's config.json wins over its name (named like a 70B, multi-head here)."""
    from transformers import LlamaConfig

    model = tmp_path / "Llama-2-70b-hf"
    LlamaConfig(hidden_size=64, num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
                vocab_size=320).save_pretrained(model)
    from space.models import tiny_tokenizer

    tiny_tokenizer().save_pretrained(model)
    assert family(str(model))[:4] == ("llama", False, 16, 16)
    assert "2/2 heads (the model's 16/16)" in build_stand_in(str(model), tmp_path / "stand-in")
    assert stand_in_heads(71, 1) == (8, 1) and stand_in_heads(32, 8) == (8, 2)


def test_stand_in_of_a_multimodal_model_is_its_language_model(tmp_path):
    """Gemma 3 4B+ trains its language model alone (``models.text_part``): the smoke's stand-in is a
    text-only Gemma 3 with the text model's heads, untied as the whole model is (it failed on the
    top-level config's missing ``num_attention_heads``)."""
    import transformers

    from space.models import tiny_tokenizer

    model = tmp_path / "gemma-3-4b-it"
    transformers.Gemma3Config(text_config=dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=320),
                              tie_word_embeddings=False).save_pretrained(model)  # the text config's default: tied
    tiny_tokenizer().save_pretrained(model)
    assert family(str(model))[:4] == ("gemma3_text", False, 8, 4)
    build_stand_in(str(model), tmp_path / "stand-in")
    assert json.loads((tmp_path / "stand-in" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_stand_in_of_a_multimodal_model_reads_every_head_count_from_its_text_config(tmp_path):
    """Catches reading a multimodal model's query heads anywhere but its text config (the top-level
    config has none; a default of the text config's own 8 passed the test above): Mistral Small 3.1's
    stand-in is a Mistral with its text model's 4 query and 1 KV heads, tied as the whole model."""
    import transformers

    from space.models import tiny_tokenizer

    model = tmp_path / "mistral-small-3.1"
    transformers.Mistral3Config(text_config=dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1,
                                                 vocab_size=320), tie_word_embeddings=True).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    assert family(str(model))[:4] == ("mistral", True, 4, 1)


def test_smoke_config_says_what_it_changes(tmp_path):
    """One line per setting changed; sources (which filters a replaced data file) and init_adapter
    are left out with a line each; max_train_minutes is kept."""
    config = {"model_name_or_path": "/models/Llama-2-7b-hf", "datasets": "runs/distill/not_here.jsonl",
              "sources": "stdlib,lima", "init_adapter": "runs/x/final", "max_train_minutes": 30, "max_steps": 900,
              "logging_steps": 1, "learning_rate": 1e-4, "output_dir": "runs/x"}
    smoke, lines, replaced = smoke_config(config, tmp_path / "stand-in", tmp_path / "run", cuda=False)
    assert replaced == ["runs/distill/not_here.jsonl"] and smoke["datasets"] == "mbpp"
    assert smoke["max_train_minutes"] == 30 and smoke["learning_rate"] == 1e-4
    assert "sources" not in smoke and "init_adapter" not in smoke
    keys = [line.split(":")[0] for line in lines]
    assert keys == [f"smoke changes {k}" for k in ("model_name_or_path", "output_dir", "max_steps", "save_steps",
                                                   "limit", "max_length", "use_cpu",
                                                   "datasets", "init_adapter", "sources")], lines
    assert "smoke changes max_steps: 900 -> 2 (2 optimizer steps)" in lines
    assert "smoke changes sources: stdlib,lima -> (left out) (it filters the rows of the data replaced)" in lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs fp16 and offload")
@pytest.mark.parametrize("override, reason", [
    (["--deepspeed", "configs/deepspeed/zero3_offload.json"],
     "needs a GPU: ZeRO offload (offload_optimizer to cpu, offload_param to cpu, deepspeed "
     "configs/deepspeed/zero3_offload.json)"),
    (["--fp16", "true"], "needs a GPU: fp16 mixed precision"),
    (["--fp16"], "needs a GPU: fp16 mixed precision"),
])
def test_refusal_reads_the_overrides(override, reason, capsys):
    """The refusal reads the settings the run would have, a command-line override included."""
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/train/tiny_smoke.yaml", *override])
    out = capsys.readouterr().out
    assert exit_info.value.code == REFUSED_EXIT
    assert out == f"smoke: refused: configs/train/tiny_smoke.yaml: {reason}" + out.partition(reason)[2]
    assert out.count("\n") == 1


def test_the_init_adapter_check_reads_the_overrides(tmp_path):
    """The smoke checked init_adapter against the YAML's mode and k, not the flags on top of it:
    ``--smoke --mode lora`` over a frozen-base config whose init_adapter is a frozen-base adapter
    passed the check and failed in the training run instead."""
    config = tmp_path / "stage2.yaml"
    config.write_text((ROOT / "configs/train/tiny_smoke.yaml").read_text()
                      + "\ninit_adapter: adapters/smollm2-135m-space\n")
    with pytest.raises(ValueError, match=r"trained with mode frozen-base, k=3: it does not fit this config \(mode lora"):
        main([str(config), "--mode", "lora"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs any DeepSpeed file: the smoke does not read it")
def test_a_broken_deepspeed_override_is_named(tmp_path, capsys):
    from space.train.smoke import cli

    (tmp_path / "ds.json").write_text('{"zero_optimization": {')
    with pytest.raises(SystemExit) as exit_info:
        cli(["configs/train/tiny_smoke.yaml", "--deepspeed", str(tmp_path / "ds.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"space-smoke: error: deepspeed {tmp_path / 'ds.json'}: not valid JSON" in err


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    """(stand-in folder, a frozen-base artifact of it as training starts it: LoRA B zero)."""
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("smoke")
    build_stand_in("tiny-random-llama", root / "stand-in")
    tok = AutoTokenizer.from_pretrained(root / "stand-in")
    model, spec = prepare_model(AutoModelForCausalLM.from_pretrained(root / "stand-in"), tok, "frozen-base", 3)
    return root / "stand-in", save_artifact(root / "final", model, tok, spec, "frozen-base",
                                            {"base_model": str(root / "stand-in")})


def test_check_trained_refuses_untrained_and_non_finite_tensors(tiny_artifact, tmp_path):
    import shutil

    stand_in, artifact = tiny_artifact
    config = {"mode": "frozen-base", "mask_num": 3}
    with pytest.raises(ValueError, match=r"did not change in 2 steps \(base_model.*lora_B"):
        check_trained(artifact, stand_in, config)
    trained = shutil.copytree(artifact, tmp_path / "trained")
    lora = load_file(trained / "adapter_model.safetensors")
    save_file({k: v + 1e-3 if "lora_B" in k else v for k, v in lora.items()}, trained / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"1 of \d+ trained tensors did not change .*\(mask_rows\)"):
        check_trained(trained, stand_in, config)
    rows = load_file(trained / "mask_embedding.safetensors")
    save_file({"mask_rows": rows["mask_rows"] + 1e-3}, trained / "mask_embedding.safetensors")
    assert check_trained(trained, stand_in, config).endswith("trained ones changed")
    lora[next(k for k in lora if "lora_A" in k)][0, 0] = float("nan")
    save_file({k: v + 1e-3 if "lora_B" in k else v for k, v in lora.items()}, trained / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: .*lora_A.* holds NaN or inf"):
        check_trained(trained, stand_in, config)


@pytest.mark.distributed
def test_failed_smoke_names_the_users_config_and_keeps_its_log(tmp_path):
    config = tmp_path / "my_config.yaml"
    config.write_text((ROOT / "configs/train/tiny_smoke.yaml").read_text() + "no_such_key: 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "SPACE_LAUNCH_DRY_RUN")}
    proc = subprocess.run(["bash", "run_sft_multi_node.sh", str(config), "--smoke", "--timeout", "240"], cwd=ROOT,
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    err = proc.stderr
    assert f"space-smoke: error: smoke: {config}: training exited 2 (log: " in err, err
    assert f"{config}: unknown config keys ['no_such_key']" in err and "space-smoke-" not in err, err
    log = Path(err.partition("(log: ")[2].partition(")")[0])
    assert log.parent == ROOT / "runs" / "smoke" and "no_such_key" in log.read_text()
    log.unlink()


def test_last_loss_refuses_a_missing_or_non_finite_loss(tmp_path):
    """The smoke's first check: the loss logged at step 2. Catches a check that lets a NaN or inf
    loss through (the smoke would then report a diverged config as passed)."""
    from space.train.smoke import last_loss

    with pytest.raises(ValueError, match="did not reach step 2"):
        last_loss(tmp_path)
    (tmp_path / "checkpoint-2").mkdir()
    state = tmp_path / "checkpoint-2" / "trainer_state.json"
    for loss in ("NaN", "Infinity"):
        state.write_text(f'{{"log_history": [{{"loss": 1.5, "step": 1}}, {{"loss": {loss}, "step": 2}}]}}')
        with pytest.raises(ValueError, match="the loss at step 2 is"):
            last_loss(tmp_path)
    state.write_text('{"log_history": [{"loss": 1.5, "step": 1}, {"loss": 1.25, "step": 2}]}')
    assert last_loss(tmp_path) == 1.25


def test_check_trained_refuses_a_full_artifact_without_the_models_tensors(tiny_artifact):
    """Checked as full mode, the frozen-base artifact holds none of the stand-in's weight matrices:
    nothing trained was found, which must fail, not pass as "0 of 0 did not change"."""
    stand_in, artifact = tiny_artifact
    with pytest.raises(ValueError, match=r"0 of 0 trained tensors .*none found"):
        check_trained(artifact, stand_in, {"mode": "full", "mask_num": 3})


def test_a_smoke_whose_space_output_differs_from_ar_fails(tmp_path, monkeypatch):
    """Everything else passed, but greedy SPACE decoding differs from AR on the saved artifact: the
    smoke must raise (non-zero exit), not print exact=NO and return."""
    from space.train import smoke

    monkeypatch.setattr(smoke, "launch", lambda args, env, log_path, timeout: (0, ""))
    monkeypatch.setattr(smoke, "last_loss", lambda run_dir: 1.0)
    monkeypatch.setattr(smoke, "check_trained", lambda artifact, stand_in, config: "checked")
    monkeypatch.setattr(smoke, "size_of", lambda path: 0)
    monkeypatch.setattr(smoke, "decode_check", lambda stand_in, artifact, mode: (False, 16))
    with pytest.raises(ValueError, match="greedy SPACE output differs from AR"):
        smoke.run_smoke("configs/train/tiny_smoke.yaml", work_dir=str(tmp_path / "work"))
    monkeypatch.setattr(smoke, "decode_check", lambda stand_in, artifact, mode: (True, 16))
    assert smoke.run_smoke("configs/train/tiny_smoke.yaml", work_dir=str(tmp_path / "work"))["exact"]


def test_overrides_of_what_the_smoke_sets_stay_out_of_its_run(tmp_path, monkeypatch, capsys):
    """The overrides went to the launcher after the smoke's config, so they won: ``--smoke --output_dir
    <the real run's>`` wrote the stand-in's checkpoints and final/ there, and ``--model_name_or_path`` or
    ``--max_steps`` made the smoke train the real model or run long. Overrides of what the smoke sets
    are now kept out, and said; the others still reach the run as given."""
    from space.train import smoke

    launched = []

    def fake_launch(args, env, log_path, timeout):
        launched.append(args)
        return 1, "space-train: error: stopped by the test"

    monkeypatch.setattr(smoke, "launch", fake_launch)
    real = tmp_path / "the real run"
    with pytest.raises(ValueError, match="stopped by the test"):
        smoke.run_smoke("configs/train/tiny_smoke.yaml", str(tmp_path / "work"),
                        overrides=["--output-dir", str(real), "--max_steps=900", "--learning_rate", "5e-4", "--bf16"])
    [args] = launched
    assert args[1:] == ["--learning_rate", "5e-4", "--bf16"], args
    out = capsys.readouterr().out
    assert f"smoke keeps output_dir: {tmp_path / 'work' / 'run'} (--output_dir {real} is the real run's)" in out  # either spelling
    assert "smoke keeps max_steps: 2 (--max_steps 900 is the real run's)" in out
    assert not real.exists()
