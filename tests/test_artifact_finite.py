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


def test_gathered_gathers_when_any_parameter_is_partitioned(monkeypatch):
    """Catches ``zero3.gathered`` doing nothing unless every parameter is partitioned: a list
    mixing a ZeRO-3 partition with a plain tensor (or a None) must still be gathered, or the code
    inside reads a (0,)-shaped partition; with no partition at all it must not import DeepSpeed.
    DeepSpeed is stood in for by a module that records the call."""
    import sys
    import types
    from contextlib import nullcontext

    from space.zero3 import gathered

    plain, part = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.empty(0))
    part.ds_id = 7
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import of it raises ImportError
    with gathered([plain, None]):
        pass
    calls = []
    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(GatheredParameters=lambda params, modifier_rank=None: (
        calls.append((params, modifier_rank)) or nullcontext()))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    with gathered([plain, part, None], modifier_rank=0):
        pass
    assert len(calls) == 1 and calls[0][0] == [plain, part] and calls[0][1] == 0


def test_shape_check_reads_every_shard_of_a_sharded_checkpoint(tmp_path):
    """Catches ``zero3.saved_shapes`` reading only some files of a sharded checkpoint
    (``model-00001-of-00002.safetensors``, ...): the layer weights in the other shards counted as
    missing and a good full checkpoint was refused, or a partition saved in a later shard passed."""
    from space.zero3 import check_saved_shapes, saved_shapes

    model, _ = tiny_random_llama(seed=0)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2
    check_saved_shapes(tmp_path)
    assert saved_shapes(tmp_path) == {k: tuple(v.shape) for k, v in load_file(shards[0]).items()} | {
        k: tuple(v.shape) for shard in shards[1:] for k, v in load_file(shard).items()}
    weights = load_file(shards[-1])
    key = next(k for k in weights if ".layers." in k)
    weights[key] = torch.empty(0)
    save_file(weights, shards[-1], metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"empty tensors .*{key}"):
        check_saved_shapes(tmp_path)


def test_shape_check_calls_any_tensor_with_a_zero_dimension_a_partition():
    """Catches ``zero3.check_shapes`` taking only shape (0,) as empty: a tensor with a zero in any
    dimension holds no weights either. Named as a ZeRO-3 partition it is refused even where the
    config has no shape to compare (a tensor the model does not declare)."""
    from space.zero3 import check_shapes

    with pytest.raises(ValueError, match=r"f: 1 empty tensors \(extra\).*ZeRO-3"):
        check_shapes({"extra": (0, 64)}, {}, "f")
    with pytest.raises(ValueError, match=r"empty tensors \(w\).*ZeRO-3"):
        check_shapes({"w": (64, 0)}, {"w": (64, 64)}, "f")
    check_shapes({"w": (64, 64), "extra": (3,)}, {"w": (64, 64)}, "f")


def test_shape_check_refuses_a_checkpoint_without_safetensors_by_name(tmp_path):
    """Catches ``zero3.check_saved_shapes`` going on with no tensors read: a checkpoint saved as
    ``pytorch_model.bin`` (or an empty folder) must be refused as having no safetensors weights,
    not as a model whose every layer weight is missing."""
    from space.zero3 import check_saved_shapes

    model, _ = tiny_random_llama(seed=0)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        check_saved_shapes(tmp_path)
