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


def test_a_refused_save_keeps_the_previous_artifact_and_writes_readable_files(tmp_path):
    """Catches save_artifact removing the old artifact before the new one passed its checks (a
    diverged run's save then loses the good one), and skipping the chmod (mkdtemp's 0700 left the
    artifact unreadable to other users)."""
    model, tok, spec = _model("frozen-base")
    out = save_artifact(tmp_path / "a", model, tok, spec, "frozen-base", {"base_model": TINY})
    assert (out.stat().st_mode & 0o777, (out / MASK_EMBEDDING).stat().st_mode & 0o777) == (0o755, 0o644)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        mask_embedding(model).mask_rows[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        save_artifact(out, model, tok, spec, "frozen-base", {"base_model": TINY})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


@pytest.mark.parametrize("shape", [(2, 64), (1, 32)])
def test_save_refuses_mask_rows_of_another_shape(tmp_path, shape):
    """Catches check_artifact skipping the mask rows' count or width: a gathered state dict with
    rows of another shape would be written as an artifact no model can load."""
    model, tok, spec = _model("frozen-base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    key = next(k for k in state if k.endswith(".mask_rows"))
    state[key] = torch.ones(shape)
    with pytest.raises(ValueError, match=rf"mask rows of shape \({shape[0]}, {shape[1]}\)"):
        save_artifact(tmp_path / "a", model, tok, spec, "frozen-base", {"base_model": TINY}, state_dict=state)
    assert not any(tmp_path.iterdir())


def test_load_space_refuses_a_full_checkpoint_missing_a_layer_weight(tmp_path):
    """Catches check_shapes ignoring a missing layer weight: from_pretrained would fill it with a
    fresh random init and load a wrong model with only a log line."""
    model, tok, spec = _model("full")
    out = save_artifact(tmp_path / "full", model, tok, spec, "full", {"base_model": TINY})
    weights = load_file(out / "model.safetensors")
    key = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.weight"))
    del weights[key]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing {key}"):
        load_space(model=str(out))
