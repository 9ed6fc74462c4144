"""Settings that would fail hours into a run are refused before it starts (issue 59, finding 8)."""
import json

import pytest

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
