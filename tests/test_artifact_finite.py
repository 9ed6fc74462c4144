"""A diverged run's weights are refused where they are written and where they are read (issue 59).

SPACE decodes a NaN model "exactly" (every draft is rejected, so greedy output is AR's), so
exactness cannot catch a diverged artifact: these checks must.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from space.adapter_layers import mask_embedding, prepare_model
from space.artifact import MASK_EMBEDDING, save_artifact
from space.loader import load_space, warm_start
from space.models import TINY, tiny_random_llama


def _model(mode):
    model, tok = tiny_random_llama(seed=0)
    model, spec = prepare_model(model, tok, mode, mask_num=3)
    return model, tok, spec


@pytest.mark.parametrize("mode", ["full", "lora", "frozen-base"])
def test_save_refuses_a_nan_weight_naming_it_and_writes_nothing(tmp_path, mode):
    model, tok, spec = _model(mode)
    param = next(p for n, p in model.named_parameters() if "lora_B" in n or (mode == "full" and "down_proj" in n))
    with torch.no_grad():
        param.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="1 of .* tensors hold NaN or inf, first .*(lora_B|down_proj)"):
        save_artifact(tmp_path / "final", model, tok, spec, mode, {"base_model": TINY})
    assert not any(tmp_path.iterdir())  # neither final/ nor a temporary folder is left


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_save_refuses_inf_mask_rows(tmp_path, mode):
    model, tok, spec = _model(mode)
    with torch.no_grad():
        if mode == "full":
            model.get_input_embeddings().weight[spec.token_ids[0], 0] = float("inf")
        else:
            mask_embedding(model).mask_rows[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        save_artifact(tmp_path / "final", model, tok, spec, mode, {"base_model": TINY})


@pytest.mark.parametrize("mode", ["lora", "frozen-base"])
def test_load_space_and_warm_start_refuse_an_artifact_with_nan_mask_rows(tmp_path, mode):
    model, tok, spec = _model(mode)
    adapter = save_artifact(tmp_path / "a", model, tok, spec, mode, {"base_model": TINY})
    load_space(adapter=adapter)  # finite: loads
    rows = load_file(adapter / MASK_EMBEDDING)
    rows["mask_rows"][0, 2] = float("nan")
    save_file(rows, adapter / MASK_EMBEDDING)
    with pytest.raises(ValueError, match=f"{MASK_EMBEDDING}:mask_rows"):
        load_space(adapter=adapter)
    with pytest.raises(ValueError, match="NaN or inf"):
        warm_start(_model(mode)[0], adapter, mode, spec)


def test_load_space_refuses_a_full_checkpoint_with_a_nan_weight(tmp_path):
    model, tok, spec = _model("full")
    out = save_artifact(tmp_path / "full", model, tok, spec, "full", {"base_model": TINY})
    weights = load_file(out / "model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[key][0, 0] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.safetensors:{key}"):
        load_space(model=str(out))
