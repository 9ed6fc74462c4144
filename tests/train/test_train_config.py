"""Settings that would fail hours into a run are refused before it starts (issue 59, finding 8)."""
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from space.config import parse_train_args

BASE = ["--config", "configs/train/tiny_smoke.yaml"]


def parse(tmp_path, *extra):
    return parse_train_args([*BASE, "--output_dir", str(tmp_path / "run"), *extra])


def zero3(tmp_path, gather):
    config = json.loads(open("configs/deepspeed/zero3.json").read())
    if gather is None:
        del config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    else:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("gather", [False, None])
def test_zero3_without_gathering_weights_on_save_is_refused(tmp_path, gather):
    with pytest.raises(ValueError, match="stage3_gather_16bit_weights_on_model_save true"):
        parse(tmp_path, "--deepspeed", zero3(tmp_path, gather))


def test_mask_chunk_rows_with_deepspeed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mask_chunk_rows > 0 does not work with DeepSpeed"):
        parse(tmp_path, "--deepspeed", "configs/deepspeed/zero2.json", "--mask_chunk_rows", "12")


def test_persistent_dataloader_workers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="dataloader_persistent_workers"):
        parse(tmp_path, "--dataloader_num_workers", "2", "--dataloader_persistent_workers", "true")


def test_the_shipped_deepspeed_configs_pass(tmp_path):
    for name in ("zero2", "zero3", "zero3_offload"):
        parse(tmp_path, "--deepspeed", f"configs/deepspeed/{name}.json")
    parse(tmp_path, "--deepspeed", zero3(tmp_path, True), "--dataloader_num_workers", "2")


@pytest.mark.parametrize("form", ["json", "base64"])
def test_a_deepspeed_config_given_as_text_is_read_as_transformers_reads_it(form):
    """TrainingArguments.deepspeed may be the config's JSON text or its base64, not only a path."""
    import base64

    from types import SimpleNamespace

    from space.config import check_deepspeed

    text = json.dumps({"zero_optimization": {"stage": 3}})
    given = text if form == "json" else base64.urlsafe_b64encode(text.encode()).decode()
    with pytest.raises(ValueError, match="stage3_gather_16bit_weights_on_model_save"):
        check_deepspeed(given, SimpleNamespace(mask_chunk_rows=0))


@pytest.mark.parametrize("flags, match", [
    (["--spans_per_sample", "0"], "spans_per_sample must be >= 1, got 0"),
    (["--max_length", "1"], "max_length must be >= 2, got 1"),
    (["--weight_decay", "-0.1"], "weight_decay must be >= 0"),
    (["--max_grad_norm", "-1"], "max_grad_norm must be >= 0"),
    (["--max_nonfinite_steps", "-1"], "max_nonfinite_steps must be >= 0, got -1"),
    # settings under which a run exited 0 with an artifact no step trained (a review, 2026-12-06)
    (["--max_steps", "0"], "trains no step"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "trains no step"),
    (["--mode", "frozen-base", "--mask_prob", "0"], "mask_prob 0 in mode frozen-base"),
    (["--mode", "frozen-base", "--mask_loss_weight", "0"], "mask_loss_weight 0"),
    # a ZeroDivisionError after the model loaded; a clear error, also after it
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps must be an integer >= 1"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be an integer >= 1"),
    # bf16 weights without DeepSpeed's fp32 master copy: 43 % of a tiny model's weights never moved
    (["--mode", "full", "--dtype", "bfloat16"], "mode full with dtype bfloat16 and no DeepSpeed"),
    # fp16 weights alike (a check of bf16 names alone let fp16 through)
    (["--mode", "full", "--dtype", "float16"], "mode full with dtype float16 and no DeepSpeed"),
    # refused by torch's optimizer or loader once training started, without the option's name
    (["--adam_beta1", "1.5"], r"adam_beta1 must lie in \[0, 1\), got 1.5"),
    (["--adam_beta2", "1"], r"adam_beta2 must lie in \[0, 1\), got 1"),
    # a check of the upper end alone let a negative beta (and NaN, which fails every comparison) through
    (["--adam_beta1", "-0.1"], r"adam_beta1 must lie in \[0, 1\), got -0.1"),
    (["--adam_beta2", "nan"], r"adam_beta2 must lie in \[0, 1\), got nan"),
    (["--adam_epsilon", "-1"], "adam_epsilon must be >= 0, got -1"),
    (["--dataloader_num_workers", "-1"], "dataloader_num_workers must be >= 0, got -1"),
    # an empty list failed after the model loaded, saying no sample fit max_length
    (["--datasets", ","], "datasets=',' names no dataset"),
    # HF's callback refused it after the model loaded and the data was tokenized
    (["--report_to", "no-such-tracker"], r"report_to \['no-such-tracker'\]: no such integration \(transformers has"),
    *([(["--report_to", "wandb"], r"report_to \['wandb'\]: not installed here")]
      if importlib.util.find_spec("wandb") is None else []),
    # HF's Trainer refused it when it built the optimizer, after the model loaded and the data was tokenized
    *([(["--optim", "adamw_bnb_8bit"], "optim adamw_bnb_8bit: You need to install `bitsandbytes`")]
      if importlib.util.find_spec("bitsandbytes") is None else []),
    *([(["--optim", "schedule_free_adamw"], "optim schedule_free_adamw: You need to install `schedulefree`")]
      if importlib.util.find_spec("schedulefree") is None else []),
    # transformers says these are missing with a ValueError, which the check took for a lookup wanting the model
    *([(["--optim", "grokadamw"], "optim grokadamw: Please install grokadamw")]
      if importlib.util.find_spec("grokadamw") is None else []),
    *([(["--optim", "adamw_anyprecision"], "optim adamw_anyprecision: Please install https://github.com/pytorch/torchdistx")]
      if importlib.util.find_spec("torchdistx") is None else []),
])
def test_out_of_range_values_are_refused_while_parsing(tmp_path, flags, match):
    """Each range check of check_train_args / SpaceSettings fires on its own (a dropped one let the
    value through to the model load or the trainer)."""
    with pytest.raises(ValueError, match=match):
        parse(tmp_path, *flags)


def test_what_trains_nothing_only_in_one_mode_passes_in_the_others(tmp_path):
    """The frozen-base refusals leave lora (its LoRA trains every token) alone, full mode in bf16
    passes with DeepSpeed's fp32 master weights, and a learning rate of 0 (a way to compare
    initializations, as the ZeRO-2 / ZeRO-3 test does) is said, not refused."""
    parse(tmp_path, "--mode", "lora", "--mask_prob", "0")
    # the consistency loss alone reaches the masks (a refusal of mask_loss_weight 0 whatever it is caught)
    parse(tmp_path, "--mode", "frozen-base", "--mask_loss_weight", "0", "--consistency_weight", "0.5")
    parse(tmp_path, "--mode", "full", "--dtype", "bfloat16", "--deepspeed", "configs/deepspeed/zero2.json")
    with pytest.warns(UserWarning, match="learning_rate 0"):
        parse(tmp_path, "--learning_rate", "0")


def test_an_optimizer_deepspeed_replaces_is_not_checked(tmp_path):
    """A DeepSpeed config with its own optimizer section replaces HF's optim, so a missing package
    behind the optim named is no error then (a check that ignored the config refused it); without
    that section the same optim is refused."""
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed: no optim here lacks its package")
    config = json.loads(open("configs/deepspeed/zero2.json").read())
    assert "optimizer" not in config
    with pytest.raises(ValueError, match="optim adamw_bnb_8bit"):
        parse(tmp_path, "--optim", "adamw_bnb_8bit", "--deepspeed", json.dumps(config))
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto"}}
    parse(tmp_path, "--optim", "adamw_bnb_8bit", "--deepspeed", json.dumps(config))


def test_an_installed_optimizer_that_needs_the_model_passes(tmp_path, monkeypatch):
    """GaLore, APOLLO and LOMO, once installed, make the Trainer's optimizer lookup ask for the model
    (a ValueError): a check that took that for a refusal refused every valid such run. A ValueError
    of another kind (a setting the lookup refuses before it asks for the model) is refused."""
    from transformers import Trainer

    def lookup(args, model=None):
        raise ValueError("You need to pass a model in order to correctly initialize a LOMO optimizer.")

    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(lookup))
    parse(tmp_path, "--optim", "lomo")

    def galore_lookup(args, model=None):  # asked before the model: a setting HF refuses whatever the model
        raise ValueError("You need to define `optim_target_modules` to use GaLore optimizers")

    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(galore_lookup))
    with pytest.raises(ValueError, match="optim galore_adamw: You need to define `optim_target_modules`"):
        parse(tmp_path, "--optim", "galore_adamw")


def test_the_edges_of_the_optimizer_loader_and_report_to_checks_pass(tmp_path, monkeypatch):
    """The parse-time checks refuse only what the optimizer, loader or trainer would: a beta of 0
    (Adam without momentum, RMSprop-like), an epsilon of 0 and no loader workers are valid; an
    integration installed here passes, and so do flyte and azure_ml, which HF's list of installed
    ones never names (their callbacks decide). Catches ``0 < beta``, a minimum above 0, and a
    report_to check that compares against the wrong list."""
    from transformers.integrations import integration_utils

    # tensorboard installed, whatever this machine holds (check_train_args asks HF's list at each call)
    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["tensorboard"])
    for flags in (["--adam_beta1", "0", "--adam_beta2", "0"], ["--adam_epsilon", "0"],
                  ["--dataloader_num_workers", "0"], ["--report_to", "tensorboard"], ["--report_to", "flyte"],
                  ["--report_to", "azure_ml"]):
        parse(tmp_path, *flags)


def test_output_dir_given_as_key_equals_value_or_with_an_empty_yaml(tmp_path):
    """--output_dir=PATH and --output-dir PATH count as passing output_dir, and an empty YAML is no keys (all defaults),
    not a config that is not a mapping."""
    from space.config import parse_train_args

    no_output = tmp_path / "no_output.yaml"
    no_output.write_text("mask_num: 2\n")
    *_, train = parse_train_args(["--config", str(no_output), f"--output_dir={tmp_path / 'a'}"])
    assert train.output_dir == str(tmp_path / "a")
    *_, train = parse_train_args(["--config", str(no_output), "--output-dir", str(tmp_path / "c")])  # the dash form
    assert train.output_dir == str(tmp_path / "c")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    model, _, mask, train = parse_train_args(["--config", str(empty), "--output_dir", str(tmp_path / "b")])
    assert train.output_dir == str(tmp_path / "b") and mask.mask_num >= 1 and model.mode == "frozen-base"


@pytest.mark.parametrize("line, match", [
    ("spans_per_sample: 2.5", r"spans_per_sample must be an integer, got 2.5"),
    ("mask_num: true", r"mask_num must be an integer, got True"),
    ("limit: 2.5", r"limit must be an integer or null, got 2.5"),
    ("bf16: 1", r"bf16 must be true or false, got 1"),
])
def test_a_yaml_value_of_the_wrong_type_is_refused_naming_file_and_key(tmp_path, line, match):
    """The YAML's values reach the dataclasses unconverted (``HfArgumentParser.set_defaults``).
    Catches taking them as they are: ``spans_per_sample: 2.5`` passed every range check and failed
    at the first batch, ``mask_num: true`` trained k = 1. A string goes to argparse, which
    converts it (``1e-4``, text to YAML 1.1, is a learning rate)."""
    config = tmp_path / "bad.yaml"
    key = line.split(":")[0]  # in place of the config's own value (a key given twice is refused)
    kept = [x for x in open("configs/train/tiny_smoke.yaml").read().splitlines() if not x.startswith(f"{key}:")]
    config.write_text("\n".join(kept) + f"\n{line}\n")
    with pytest.raises(ValueError, match=rf"bad.yaml: {match}"):
        parse_train_args(["--config", str(config), "--output_dir", str(tmp_path / "run")])


def test_a_key_given_twice_in_a_yaml_is_refused(tmp_path):
    """PyYAML keeps a repeated key's last value: ``mask_num: 3`` and, further down, ``mask_num: 5``
    trained k = 5 without a word. Nested mappings are checked too."""
    for text, key in (("mask_num: 3\nlearning_rate: 1e-3\nmask_num: 5\n", "mask_num"),
                      ("model_name_or_path: tiny-random-llama\nx:\n  a: 1\n  a: 2\n", "a")):
        config = tmp_path / "twice.yaml"
        config.write_text(text)
        with pytest.raises(ValueError, match=rf"twice.yaml: not valid YAML \(key '{key}' is given twice"):
            parse_train_args(["--config", str(config), "--output_dir", str(tmp_path / "run")])


def test_a_lora_target_that_names_no_module_is_refused():
    """peft refuses a target list only when none matches: ``q_proj, v_prj`` put LoRA on q_proj alone
    while adapter_config.json recorded both (and a resume compared those names, so it passed)."""
    from space.adapter_layers import prepare_model
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama()
    with pytest.raises(ValueError, match=r"lora_targets \['v_prj'\] name no module of this model; its linears: \["):
        prepare_model(model, tok, "lora", 3, lora_targets=["q_proj", "v_prj"])
    model, tok = tiny_random_llama()
    prepare_model(model, tok, "frozen-base", 3, lora_targets=["q_proj", "self_attn.v_proj"])  # peft's suffix rule
    # frozen-base is a LoRA mode too; and a bare suffix of a name ("proj" of "q_proj") matches no module for peft
    for mode, bad in (("frozen-base", "v_prj"), ("lora", "proj"), ("frozen-base", "_proj")):
        model, tok = tiny_random_llama()
        with pytest.raises(ValueError, match=rf"lora_targets \['{bad}'\] name no module of this model"):
            prepare_model(model, tok, mode, 3, lora_targets=["q_proj", bad])


def test_a_lora_target_that_names_no_linear_is_refused_before_the_model_changes():
    """A SPACE LoRA goes on linears only (its artifact stores and applies nothing else): peft wraps
    ``embed_tokens`` (whose LoRA the artifact then could not apply) and refused a DeepSeek-V3's
    ``experts`` only inside ``get_peft_model``, after the mask tokens had grown the vocabulary.
    Both are refused by name first; a target matching linears alone still passes."""
    from space.adapter_layers import prepare_model
    from space.models import tiny_random_llama, tiny_tokenizer
    from tests.train.test_modes import small_deepseek_moe

    for model, tok, bad, kind in ((*tiny_random_llama(), "embed_tokens", "Embedding"),
                                  (small_deepseek_moe(), tiny_tokenizer(), "experts", "Experts"),
                                  (*tiny_random_llama(), "mlp", "LlamaMLP")):
        vocab = model.get_input_embeddings().num_embeddings
        with pytest.raises(ValueError, match=rf"lora_targets \['{bad}'\] name modules that are not linear layers "
                                             rf"\(\{{'{bad}': \['\w*{kind}'\]\}}\): a SPACE LoRA goes on nn.Linear only; "
                                             r"this model's linears: \[.*'o_proj'"):
            prepare_model(model, tok, "frozen-base", 3, lora_targets=["o_proj", bad])
        assert model.get_input_embeddings().num_embeddings == vocab  # no mask token added
    # a subclass too (Falcon's FalconLinear): the artifact's loader takes exactly nn.Linear, and refused it
    model, tok = tiny_random_llama()
    for layer in model.model.layers:
        layer.self_attn.q_proj.__class__ = type("FalconLinear", (torch.nn.Linear,), {})
    with pytest.raises(ValueError, match=r"lora_targets \['q_proj'\] name modules that are not linear layers "
                                         r"\(\{'q_proj': \['FalconLinear'\]\}\)") as refused:
        prepare_model(model, tok, "frozen-base", 3, lora_targets=["o_proj", "q_proj"])
    # nor does the message then list it among the linears a LoRA may go on (isinstance listed it)
    linears = str(refused.value).split("this model's linears: ")[1]
    assert "'o_proj'" in linears and "'q_proj'" not in linears
    model, tok = tiny_random_llama()
    prepare_model(model, tok, "lora", 3, lora_targets=["o_proj", "mlp.down_proj"])


def test_the_lm_head_takes_a_lora_in_mode_lora_only_and_untied():
    """A frozen-base LoRA on ``lm_head`` trained, then every decoder failed on the head's weight (a
    gated layer has none). In mode lora the artifact merges it into the head's weight: tied to the
    input embeddings (SmolLM2, the tiny Llama), that moved the embeddings too, a silently other model.
    An untied head in mode lora takes it."""
    from space.adapter_layers import prepare_model
    from space.models import tiny_random_llama

    for mode, why in (("frozen-base", "in mode frozen-base"), ("lora", "tied to the input embeddings")):
        model, tok = tiny_random_llama()
        vocab = model.get_input_embeddings().num_embeddings
        with pytest.raises(ValueError, match=rf"lora_targets \['lm_head'\] name the LM head, which cannot take a "
                                             rf"SPACE LoRA {why}"):
            prepare_model(model, tok, mode, 3, lora_targets=["q_proj", "lm_head"])
        assert model.get_input_embeddings().num_embeddings == vocab  # refused before the mask tokens
    def untied():
        model, tok = tiny_random_llama()
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        return model, tok

    with pytest.raises(ValueError, match=r"in mode frozen-base \(the decoders read its weight itself\); leave it out, "
                                         r"or train in mode lora \(merged\)"):
        prepare_model(*untied(), "frozen-base", 3, lora_targets=["q_proj", "lm_head"])
    prepare_model(*untied(), "lora", 3, lora_targets=["q_proj", "lm_head"])


def test_an_lm_head_of_another_name_is_known_by_the_module_not_the_name():
    """The head is the model's output embedding, whatever its name: BioGPT calls it
    ``output_projection``. A LoRA on it in frozen-base is refused as on Llama's ``lm_head`` (every
    decoder then failed on the head's weight). Catches the head found by the name "lm_head"."""
    from transformers import BioGptConfig, BioGptForCausalLM

    from space.adapter_layers import prepare_model
    from space.models import tiny_tokenizer

    tok = tiny_tokenizer()
    model = BioGptForCausalLM(BioGptConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64))
    assert model.get_output_embeddings() is model.output_projection
    with pytest.raises(ValueError, match=r"lora_targets \['output_projection'\] name the LM head, which cannot take "
                                         r"a SPACE LoRA in mode frozen-base"):
        prepare_model(model, tok, "frozen-base", 3, lora_targets=["q_proj", "output_projection"])


def test_every_shipped_training_config_has_values_of_its_fields_types():
    from space.config import check_config_types, read_config_file

    paths = sorted((Path(__file__).resolve().parents[2] / "configs" / "train").glob("*.yaml"))
    assert paths
    for path in paths:
        check_config_types(read_config_file(path), path)


def test_a_teacher_topk_above_the_vocabulary_is_refused_before_training(tmp_path):
    """Catches a teacher_topk that passes the range check (>= 1) and fails inside the first step
    with torch's "selected index k out of range"."""
    from space.train.run import run_sft

    args = parse(tmp_path, "--mask_target", "teacher", "--teacher_topk", "100000")
    with pytest.raises(ValueError, match=r"teacher_topk 100000 exceeds the vocabulary of .* \(\d+ tokens\)"):
        run_sft(*args)
    assert not (tmp_path / "run").exists()


def test_a_max_length_that_leaves_no_response_room_is_refused_by_its_cause(tmp_path):
    """Samples keep 2 response tokens (a mask group follows one and drafts the next); at a
    max_length where no sample has them, the error names that, not "prompts alone are longer"
    (the old message, false for a prompt one token short of max_length)."""
    from space.train.run import run_sft

    args = parse(tmp_path, "--max_length", "8")
    with pytest.raises(ValueError, match=r"fits max_length=8 \(each prompt leaves its response fewer than 2 tokens\)"):
        run_sft(*args)
    assert not (tmp_path / "run").exists()


def test_samples_past_the_models_positions_are_refused_before_training(tmp_path):
    """A max_length above the model's max_position_embeddings trained on positions the model never
    had (decoding then refuses prompts that long), and exited 0."""
    from space.models import tiny_random_llama
    from space.train.run import run_sft

    model, tok = tiny_random_llama()
    model.config.max_position_embeddings = 64
    model.save_pretrained(tmp_path / "short")
    tok.save_pretrained(tmp_path / "short")
    args = parse(tmp_path, "--model_name_or_path", str(tmp_path / "short"), "--max_length", "384")
    with pytest.raises(ValueError, match=r"max_length 384 lets samples reach \d+ tokens, past the 64 positions of "
                                         r".*short \(max_position_embeddings\); set max_length <= 64"):
        run_sft(*args)
    assert not (tmp_path / "run").exists()


def test_dataloader_drop_last_with_no_whole_batch_is_refused(tmp_path):
    """Every batch dropped: the run trained 0 steps, exited 0 and wrote an untrained final/. A batch
    the samples fill still trains."""
    from space.train.run import run_sft

    args = parse(tmp_path, "--limit", "3", "--dataloader_drop_last", "true", "--max_steps", "1")
    with pytest.raises(ValueError, match=r"dataloader_drop_last with 3 samples and a batch of 4 "):
        run_sft(*args)
    assert not (tmp_path / "run").exists()
    assert run_sft(*parse(tmp_path, "--limit", "4", "--dataloader_drop_last", "true", "--max_steps", "1")).is_dir()


def test_an_earlier_runs_artifact_with_no_checkpoint_is_not_replaced(tmp_path):
    """A rerun into an output_dir whose run kept no checkpoint (save_strategy no, or checkpoints
    deleted) trained afresh, with any settings, and replaced its final/ without a word."""
    from space.train.run import run_sft

    final = run_sft(*parse(tmp_path, "--save_strategy", "no", "--max_steps", "1"))
    before = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"holds the artifact of an earlier run \(.*final\) and no checkpoint to "
                                         r"resume it from; use another output_dir, or delete that final/"):
        run_sft(*parse(tmp_path, "--save_strategy", "no", "--max_steps", "1", "--mask_num", "2"))
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == before


def test_a_yaml_string_for_a_number_or_a_flag_is_converted_as_argparse_converts_it(tmp_path):
    """YAML 1.1 reads ``1e-4`` (no dot) as text: argparse converts it with the field's type, as it
    converts ``'yes'`` for a flag. The type check leaves strings to it."""
    config = tmp_path / "strings.yaml"
    own = [x for x in open("configs/train/tiny_smoke.yaml").read().splitlines() if not x.startswith("learning_rate:")]
    config.write_text("\n".join(own) + "\nlearning_rate: 1e-4\nmask_diff: 'yes'\n")
    _, _, mask, train = parse_train_args(["--config", str(config), "--output_dir", str(tmp_path / "run")])
    assert train.learning_rate == 1e-4 and mask.mask_diff is True


def test_a_source_that_matches_no_row_is_refused_before_the_model_loads(tmp_path):
    """``sources: stdlib,lma`` kept the stdlib rows and dropped every LIMA row without a word: a
    source must match a row of some named file (the files together: each need not hold all)."""
    from space.train.run import run_sft

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a b c d", "source": s}) + "\n"
                            for i, s in enumerate(["lima", "stdlib"] * 4)))
    argv = ["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / "run"),
            "--datasets", str(rows), "--max_steps", "1"]
    with pytest.raises(ValueError, match=r"sources \['lma'\] match no row of .* \(their sources: \['stdlib'\]\)"):
        run_sft(*parse_train_args([*argv, "--sources", "stdlib,lma"]))
    assert not (tmp_path / "run").exists()


def rows_file(path, long_prompts=0, response_words=40):
    """A JSONL of 6 short prompts with ``response_words``-word answers, and ``long_prompts`` prompts
    that leave no room for a response at max_length 384."""
    rows = [{"prompt": f"q{i}", "response": " ".join(["word"] * response_words)} for i in range(6)]
    rows += [{"prompt": "long " * 400, "response": "a b c d"} for _ in range(long_prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_run_says_how_many_prompts_left_no_room_for_a_response(tmp_path, capsys):
    """Samples whose prompt leaves its response fewer than 2 of max_length's tokens are dropped;
    the run's summary line counts them apart from the dev-set prompts held out (and names none when
    none was). Catches the count left out, printed as 0, or counting the held-out prompts too."""
    from space.train.run import run_sft

    for long_prompts, said in ((2, "6 samples from .* \\(0 dev-set prompts held out, 2 whose prompt leaves its "
                                   "response < 2 of max_length's tokens dropped\\)"),
                               (0, "6 samples from .* \\(0 dev-set prompts held out\\);")):
        out = tmp_path / f"run{long_prompts}"
        run_sft(*parse_train_args([*BASE, "--output_dir", str(out), "--max_steps", "1", "--save_strategy", "no",
                                   "--datasets", rows_file(tmp_path / f"rows{long_prompts}.jsonl", long_prompts)]))
        printed = capsys.readouterr().out
        assert re.search(said, printed), printed
        assert long_prompts or "dropped" not in printed
    # the smoke config's MBPP rows: one is a dev-set prompt, held out before the count, and one prompt is too long
    run_sft(*parse(tmp_path, "--max_steps", "1", "--save_strategy", "no"))
    assert ("14 samples from ['mbpp'] (1 dev-set prompts held out, 1 whose prompt leaves its response < 2 of "
            "max_length's tokens dropped)") in capsys.readouterr().out


def test_samples_exactly_as_long_as_the_models_positions_train(tmp_path):
    """The longest sample may fill the model's max_position_embeddings, not one token more: at
    max_length = 64 on a 64-position model the run trains, at 65 it is refused (a sample of 65
    tokens and shorter ones beside it). Catches ``>=`` for ``>``, an off-by-one the other way, and
    the shortest sample measured instead of the longest."""
    from space.models import tiny_random_llama
    from space.train.run import run_sft

    model, tok = tiny_random_llama()
    model.config.max_position_embeddings = 64
    model.save_pretrained(tmp_path / "short")
    tok.save_pretrained(tmp_path / "short")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "response": " ".join(["word"] * (3 if i else 80))}) + "\n"
                            for i in range(4)))

    def args(max_length):
        return parse_train_args([*BASE, "--output_dir", str(tmp_path / f"run{max_length}"), "--datasets", str(rows),
                                 "--model_name_or_path", str(tmp_path / "short"), "--max_length", str(max_length),
                                 "--max_steps", "1", "--save_strategy", "no"])

    with pytest.raises(ValueError, match=r"max_length 65 lets samples reach 65 tokens, past the 64 positions"):
        run_sft(*args(65))
    assert run_sft(*args(64)).is_dir()


def test_fewer_samples_than_a_batch_train_without_dataloader_drop_last(tmp_path):
    """The drop_last refusal is for drop_last alone: without it the partial batch trains (3 samples,
    a batch of 4). Catches the refusal made whenever the samples fill no batch."""
    from space.train.run import run_sft

    assert run_sft(*parse(tmp_path, "--limit", "3", "--max_steps", "1", "--save_strategy", "no")).is_dir()


def test_a_model_that_names_no_position_limit_trains(tmp_path, monkeypatch):
    """A config that states no position limit (Bloom's and MPT's, ALiBi, have no max_position_embeddings)
    has no positions to check the samples against: the run trains. Catches ``longest > None`` (a
    TypeError after the model loaded)."""
    import space.train.run as run

    load = run.load_model

    def unlimited(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        object.__setattr__(model.config, "max_position_embeddings", None)  # past the config's int-only check
        return model, tok

    monkeypatch.setattr(run, "load_model", unlimited)
    assert run.run_sft(*parse(tmp_path, "--max_steps", "1", "--save_strategy", "no")).is_dir()


@pytest.mark.parametrize("processes, gpus", [(2, 0), (1, 2)])
def test_dataloader_drop_last_counts_every_process_and_dataparallel_gpu(tmp_path, monkeypatch, processes, gpus):
    """A batch is per_device_train_batch_size on each process (torchrun) and, in one process with
    several GPUs, on each GPU (DataParallel: HF's train_batch_size): 5 samples and a per-device
    batch of 4 fill no batch of 8. Catches the world size or the GPUs left out of the count."""
    from transformers import TrainingArguments

    import space.train.run as run

    args = parse(tmp_path, "--limit", "5", "--dataloader_drop_last", "true", "--max_steps", "1")
    train = args[3]
    train.device  # noqa: B018 (sets _n_gpu, which HF caches)
    train._n_gpu = gpus
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: processes))
    monkeypatch.setattr(run, "SpaceCollator", lambda *a, **k: pytest.fail("passed the drop_last check"))
    with pytest.raises(ValueError, match=r"dataloader_drop_last with 5 samples and a batch of 8 "):
        run.run_sft(*args)


def test_dataloader_drop_last_counts_the_samples_not_the_rows(tmp_path, monkeypatch):
    """Rows whose prompt leaves no room for a response are dropped before batching: 3 short prompts
    and 2 too long are 3 samples, no whole batch of 4. Catches the rows counted instead."""
    import space.train.run as run

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "long " * 400 if i > 2 else f"q{i}", "response": "a b c d"}) + "\n"
                            for i in range(5)))
    monkeypatch.setattr(run, "SpaceCollator", lambda *a, **k: pytest.fail("passed the drop_last check"))
    with pytest.raises(ValueError, match=r"dataloader_drop_last with 3 samples and a batch of 4 "):
        run.run_sft(*parse(tmp_path, "--datasets", str(rows), "--dataloader_drop_last", "true", "--max_steps", "1"))


def test_an_earlier_final_another_rank_sees_stops_this_rank_too(tmp_path, monkeypatch):
    """Each rank looks for an earlier run's final/ on its own filesystem and the ranks decide together
    (``any_rank``): a rank that sees none stops when another does, before the model loads. A check on
    rank 0 alone left the others waiting in the load's collectives."""
    import space.train.run as run

    seen = []
    monkeypatch.setattr(run, "any_rank", lambda flag: seen.append(flag) or True)  # another rank holds final/
    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(ValueError, match=r"holds the artifact of an earlier run"):
        run.run_sft(*parse(tmp_path, "--max_steps", "1"))
    assert seen == [False]  # this rank sees no final/ (and no checkpoint): it asked, and was told to stop


def test_a_named_checkpoint_does_not_replace_an_earlier_runs_artifact(tmp_path, monkeypatch):
    """resume_from_checkpoint (perhaps another run's checkpoint) into an output_dir holding an earlier
    run's final/ and no checkpoint of its own would replace that final/ as well: refused first,
    before the model loads. Catches the check made after the named checkpoint stands in for one."""
    import space.train.run as run

    other = tmp_path / "other" / "checkpoint-1"
    other.mkdir(parents=True)
    (other / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "final").mkdir(parents=True)
    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(ValueError, match=r"holds the artifact of an earlier run"):
        run.run_sft(*parse(tmp_path, "--max_steps", "1", "--resume_from_checkpoint", str(other)))


def test_a_file_named_final_in_output_dir_is_refused_while_parsing(tmp_path):
    """A plain file where the run saves its artifact let every step train, then the save failed on it
    (IsADirectoryError) and left .old-final-* and .tmp-final-* folders behind."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final").write_text("x")
    with pytest.raises(ValueError, match=r"run/final is a file where the run saves its artifact"):
        parse(tmp_path)


@pytest.mark.parametrize("alone", ["all", "none"])
def test_report_to_all_or_none_beside_other_integrations_is_refused_while_parsing(tmp_path, alone):
    """HF takes ``all`` and ``none`` only alone; in a config's list beside another integration the
    Trainer refused them after the model loaded and the data was tokenized."""
    import yaml

    from space.config import parse_train_args

    config = yaml.safe_load(open("configs/train/tiny_smoke.yaml"))
    config["report_to"] = [alone, "tensorboard"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=rf"report_to \['{alone}', 'tensorboard'\]: all and none stand alone"):
        parse_train_args(["--config", str(tmp_path / "c.yaml"), "--output_dir", str(tmp_path / "run")])
