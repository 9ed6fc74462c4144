"""Every YAML config parses; bad training input gets a clear error."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from space.config import parse_train_args
from space.data.sft import load_examples, to_example

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").glob("*.yaml"))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_train_config_parses(path):
    # GPU recipes ask for bf16, which TrainingArguments refuses on a CPU-only machine
    # and a DeepSpeed config needs the process group that torchrun creates (tested in tests/train)
    raw = yaml.safe_load(path.read_text())
    cpu = [] if torch.cuda.is_available() or "bf16" not in raw else ["--bf16", "false"]
    # without its DeepSpeed (fp32 master weights), a full-mode config of bf16 weights is refused
    if raw.get("mode") == "full" and "deepspeed" in raw:
        cpu += ["--dtype", "float32"]
    model, data, mask, train = parse_train_args(["--config", str(path), *cpu, "--deepspeed", ""])
    assert mask.mask_num >= 1 and train.output_dir
    assert data.datasets and model.mode in ("full", "lora", "frozen-base")
    if "deepspeed" in raw:
        assert (ROOT / raw["deepspeed"]).is_file()
    # HF's max_steps overrides the epoch count: a config that sets both says something it does not do
    assert not ("max_steps" in raw and "num_train_epochs" in raw), "num_train_epochs is ignored beside max_steps"


def test_deepspeed_configs_are_json_with_auto_values():
    for path in (ROOT / "configs" / "deepspeed").glob("*.json"):
        cfg = json.loads(path.read_text())
        assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["zero_optimization"]["stage"] in (2, 3)


def test_cli_overrides_yaml():
    _, _, mask, train = parse_train_args(["--config", str(ROOT / "configs/train/tiny_smoke.yaml"),
                                          "--mask_num", "7", "--learning_rate", "3e-4"])
    assert mask.mask_num == 7 and train.learning_rate == 3e-4


def test_unknown_and_missing_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"output_dir": "x", "mask_nmu": 3}))
    with pytest.raises(ValueError, match="unknown config keys.*mask_nmu"):
        parse_train_args(["--config", str(bad)])
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"mask_num": 3}))
    with pytest.raises(ValueError, match="missing config key: output_dir"):
        parse_train_args(["--config", str(missing)])


def test_bad_mask_num_in_training(tmp_path):
    with pytest.raises(ValueError, match="mask_num"):  # refused while parsing, before any model loads
        parse_train_args(["--config", str(ROOT / "configs/train/tiny_smoke.yaml"), "--output_dir", str(tmp_path),
                          "--mask_num", "0"])


def test_unknown_dataset_and_malformed_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match="unknown dataset 'nope'"):
        load_examples("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2"):
        load_examples(str(bad))
    bad.write_text('{"prompt": "a", "response": "b"}\n{"question": "a", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: unknown row format"):
        load_examples(str(bad))
    bad.write_text('{"prompt": "a", "response": ""}\n')
    with pytest.raises(ValueError, match="row 0: empty"):
        load_examples(str(bad))


def test_all_formats_normalize():
    lima = load_examples("lima", limit=50)
    assert len(lima) == 50 and lima[0].context[-1]["role"] == "user"
    assert any(len(ex.context) > 1 for ex in load_examples("lima"))  # history turns kept
    mbpp = load_examples("mbpp", limit=3)
    assert "def min_cost" in mbpp[0].context[0]["content"] and mbpp[0].response.startswith("```python")
    share = to_example({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    assert share.context == [{"role": "user", "content": "hi"}] and share.response == "hello"
    chat = to_example({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    assert chat.response == "a"
    distilled = to_example({"prompt": [{"role": "user", "content": "q"}], "response": "r"})
    assert distilled.context[0]["content"] == "q"


def test_sources_filter_on_distilled_rows(tmp_path):
    mix = tmp_path / "mix.jsonl"
    rows = [{"source": s, "prompt": f"q{i}", "response": f"r{i}"} for i, s in enumerate(["lima", "stdlib", "mbpp", "stdlib"])]
    mix.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [ex.response for ex in load_examples(str(mix), sources=["stdlib"])] == ["r1", "r3"]
    assert [ex.response for ex in load_examples(str(mix), sources=["stdlib", "lima"], limit=2)] == ["r0", "r1"]
    assert len(load_examples(str(mix))) == 4
    with pytest.raises(ValueError, match="no row has a source in"):
        load_examples(str(mix), sources=["humaneval"])
    mix.write_text('{"source": "lima", "prompt": "a", "response": "b"}\n{"prompt": "a", "response": "b"}\n')
    with pytest.raises(ValueError, match="row 1 has no 'source' field"):
        load_examples(str(mix), sources=["lima"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweep").glob("*.yaml")), ids=lambda p: p.name)
def test_sweep_arms_parse(path, tmp_path):
    """Every arm of a recipe sweep is a valid training configuration (base config plus its flags)."""
    sweep = yaml.safe_load(path.read_text())
    for name, flags in sweep["arms"].items():
        parse_train_args(["--config", str(ROOT / sweep["base_config"]), "--output_dir", str(tmp_path / name), *flags])


def test_settings_a_run_ignores_are_said(tmp_path):
    """LoRA settings in mode full, mask_chunk_rows outside frozen-base, teacher_topk with token targets
    and sampler_width without a sampler head were accepted without a word, the run never reading
    them: a warning names them (not an error: a sweep's arm in mode full inherits its base config's
    LoRA settings). At their defaults, or where they are read, nothing is said."""
    import warnings

    base = ["--config", str(ROOT / "configs/train/tiny_smoke.yaml"), "--output_dir", str(tmp_path)]
    for flags, named in (([ "--mode", "full", "--lora_r", "4", "--mask_chunk_rows", "64"], "lora_r, mask_chunk_rows"),
                         (["--mode", "lora", "--mask_chunk_rows", "64"], "mask_chunk_rows"),
                         # every LoRA setting in mode full (catches one left out of the list)
                         (["--mode", "full", "--lora_alpha", "7", "--lora_dropout", "0.3"], "lora_alpha, lora_dropout"),
                         (["--teacher_topk", "5"], "teacher_topk"), (["--sampler_width", "32"], "sampler_width")):
        with pytest.warns(UserWarning, match=f"^{named} set, but mode .* never reads"):
            parse_train_args([*base, *flags])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_train_args([*base, "--mode", "full"])
        parse_train_args([*base, "--lora_r", "4", "--mask_chunk_rows", "64", "--mask_target", "teacher", "--teacher_topk", "5"])
