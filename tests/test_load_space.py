"""load_space: adapters read without peft, their recorded base model checked, CPU kernels on request."""
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from space.adapter_layers import MaskEmbedding, fuse_frozen_base, prepare_model
from space.artifact import load_mask_rows, save_artifact
from space.cpu_kernels import PackedLinear, packing_available
from space.decoding import DecodeConfig
from space.loader import load_space
from space.masking import mask_rows
from space.models import TINY, load_model, tiny_random_llama
from space.tokens import add_mask_tokens
from tests.conftest import full_checkpoint


def _artifact(path, mode):
    """A tiny-model adapter of ``mode`` with random (non-zero) LoRA weights, trained on TINY."""
    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, mode, mask_num=3)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "mask_rows" in name:
                p.normal_(0, 0.05)
    return save_artifact(path, peft_model, tok, spec, mode, {"base_model": TINY})


def _via_peft(adapter, mode):
    """What load_space built with peft before: PeftModel.from_pretrained, then merge or fuse."""
    base, tok = load_model(TINY)
    spec = add_mask_tokens(base, tok, 3)
    emb = MaskEmbedding(base.get_input_embeddings(), spec.token_ids)
    load_mask_rows(emb, adapter / "mask_embedding.safetensors")
    base.set_input_embeddings(emb)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    return peft_model.merge_and_unload() if mode == "lora" else fuse_frozen_base(peft_model)


@pytest.mark.parametrize("mode", ["frozen-base", "lora"])
def test_adapter_without_peft_equals_peft_load(tmp_path, mode):
    """Mask rows and real rows as peft's loader gave them (frozen-base bit for bit), and no
    FutureWarning (peft's wrapper asked transformers for a deprecated attribute on every load)."""
    adapter = _artifact(tmp_path / mode, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model, _, spec = load_space(adapter=adapter)
    ref = _via_peft(adapter, mode)
    ids = torch.tensor([[5, 70, 33, 200, *spec.token_ids * 3]])
    with torch.no_grad(), mask_rows(4):
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    if mode == "frozen-base":
        assert torch.equal(got, want)
    else:  # merged in another order of float operations
        assert torch.allclose(got, want, atol=1e-5)


def test_other_base_model_warns_naming_both(tmp_path):
    adapter = _artifact(tmp_path / "a", "frozen-base")
    other, tok = tiny_random_llama(seed=5)  # same shapes, other weights
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.warns(UserWarning, match="trained on base model 'tiny-random-llama'") as record:
        load_space(str(tmp_path / "other"), adapter)
    assert str(tmp_path / "other") in str(record[0].message)
    with warnings.catch_warnings():  # the recorded base, implicit or named, loads silently
        warnings.simplefilter("error", UserWarning)
        load_space(adapter=adapter)
        load_space(TINY, adapter)


def test_plain_model_without_adapter_warns_of_untrained_masks(tmp_path):
    """A plain model loaded without an adapter gets a new, untrained mask token: a UserWarning says
    so (a forgotten --adapter otherwise reads as a weak drafter); a model that has its mask token does not."""
    with pytest.warns(UserWarning, match="no SPACE mask token and no adapter"):
        model, tok, spec = load_space(TINY)
    model.save_pretrained(tmp_path / "sar")  # now with its mask token, as a SAR-SFT checkpoint has
    tok.save_pretrained(tmp_path / "sar")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert load_space(str(tmp_path / "sar"))[2].token_ids == spec.token_ids


@pytest.mark.skipif(not packing_available(), reason="torch build without a packed linear kernel")
def test_kernels_fast_packs_for_inference_and_generate_stays_exact(tmp_path):
    """kernels="fast" packs every linear (the gated LoRA layers too); plain greedy generate and
    SPACE on that model agree token for token; the default leaves the model as load_model gives it."""
    from space.hf import space_generate

    adapter = _artifact(tmp_path / "a", "frozen-base")
    model, _, _ = load_space(adapter=adapter, kernels="fast")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    ids = torch.tensor([[5, 70, 33, 200, 41]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20)
    assert torch.equal(model.generate(ids, do_sample=False, **kw), model.generate(ids, custom_generate=space_generate, **kw))
    stock, _, _ = load_space(adapter=adapter)
    assert not any(isinstance(m, PackedLinear) for m in stock.modules())
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_space(adapter=adapter, kernels="turbo")


# ---- damaged or mismatched artifact files: each refused with a clear ValueError (mutation audit 2) ----

import json  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from space.artifact import read_lora  # noqa: E402
from space.loader import warm_start  # noqa: E402


def _edit_json(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _r0(a):
    _edit_json(a / "adapter_config.json", r=0)


def _dora(a):
    _edit_json(a / "adapter_config.json", use_dora=True)


def _other_rank(a):
    _edit_json(a / "adapter_config.json", r=8)  # the weights are rank 16: another scaling, another model


def _extra_key(a):
    state = load_file(a / "adapter_model.safetensors")
    state["base_model.model.lm_head.weight"] = torch.zeros(4, 4)
    save_file(state, a / "adapter_model.safetensors")


def _no_mask_ids(a):
    cfg = json.loads((a / "space_config.json").read_text())
    del cfg["mask_token_ids"]
    (a / "space_config.json").write_text(json.dumps(cfg))


def _json_list(a):
    (a / "space_config.json").write_text("[1, 2]")


def _edited(**values):
    """A hand-edited space_config.json: "mode": "Lora" loaded silently as frozen-base, a null
    base model failed later with a TypeError traceback."""
    def damage(a):
        cfg = json.loads((a / "space_config.json").read_text())
        (a / "space_config.json").write_text(json.dumps({**cfg, **values}))
    return damage


def _scalar_mask_rows(a):
    save_file({"mask_rows": torch.full((1, 1), 0.5)}, a / "mask_embedding.safetensors")


@pytest.mark.parametrize("damage, fragment", [
    (_r0, "r must be >= 1, got 0"),
    (_dora, "only plain LoRA adapters load here"),
    (_other_rank, "not rank 8"),
    (_extra_key, "unexpected keys"),
    (_no_mask_ids, "missing mask_token_ids"),
    (_json_list, "not an object"),
    (_edited(mode="Lora"), r"not a valid SPACE config \(mode='Lora'; mode is one of full, lora, frozen-base\)"),
    (_edited(base_model=None), "base_model=None"),
    (_edited(mask_num="3"), "mask_num='3'"),
    (_edited(mask_token_ids=[]), r"mask_token_ids=\[\]"),
    (_edited(mask_num=0), "mask_num=0"),  # k = 0: no mask; named here, not later by the decoder without the file
    (_scalar_mask_rows, r"mask rows of shape \(1, 1\)"),
    # decoded with masks at offsets never trained (one shared mask token), or refused later by the
    # decoder without naming the file
    (_edited(decode={"mask_num": 5}), "a/space_config.json: decode mask_num 5 exceeds the trained mask_num 3"),
    (_edited(decode={"mask_num": 4}), "a/space_config.json: decode mask_num 4 exceeds the trained mask_num 3"),  # one past: the bound
])
def test_damaged_adapter_is_refused_naming_the_fault(tmp_path, damage, fragment):
    """Catches a dropped check in read_lora (r >= 1, plain LoRA only, every A of rank r, no unpaired
    key), read_space_config (every required key, of its kind), read_json (an object) or copy_mask_rows (rows of
    the model's shape: (1, 1) rows would broadcast into every mask row and load a wrong model silently)."""
    adapter = _artifact(tmp_path / "a", "frozen-base")
    damage(adapter)
    with pytest.raises(ValueError, match=fragment):
        load_space(adapter=adapter)


def test_a_full_checkpoint_passed_as_adapter_says_so(tmp_path):
    """Catches load_space reading a full checkpoint as an adapter (then a bare missing-file error)."""
    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "full", mask_num=3)
    out = save_artifact(tmp_path / "full", peft_model, tok, spec, "full", {"base_model": TINY})
    with pytest.raises(ValueError, match="is a full checkpoint: pass it as the model"):
        load_space(adapter=out)


@pytest.mark.parametrize("mode", ["frozen-base", "lora"])
def test_an_adapter_passed_as_the_model_says_so(tmp_path, mode):
    """The mirror case: an adapter given as the model failed deep in the tokenizer's load ("Couldn't
    instantiate the backend tokenizer"), naming neither the mistake nor the fix."""
    adapter = _artifact(tmp_path / "a", mode)
    with pytest.raises(ValueError, match=f"is a {mode} adapter, not a model: pass it as the adapter"):
        load_space(model=str(adapter))


@pytest.mark.parametrize("mode", ["frozen-base", "lora"])
def test_an_adapter_missing_a_layers_lora_is_refused(tmp_path, mode):
    """An adapter file with every tensor of one layer gone (a truncated copy, a bad merge) loaded
    silently: that layer kept the base weights, and in lora mode the merged model was not the one
    trained. Refused, naming the file and the modules; a peft layers_to_transform adapter (some
    layers on purpose) is refused as a variant this loader does not read."""
    adapter = _artifact(tmp_path / "a", mode)
    raw = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in raw.items() if ".layers.1." not in k}, adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: no LoRA for \d+ modules .*layers\.1\."):
        load_space(adapter=adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "layers_to_transform": [0]}))
    with pytest.raises(ValueError, match="only plain LoRA adapters"):
        load_space(adapter=adapter)


def test_rslora_scaling_is_alpha_over_sqrt_r(tmp_path):
    """Catches read_lora ignoring use_rslora (B scaled by alpha / r instead of alpha / sqrt(r))."""
    adapter = _artifact(tmp_path / "a", "frozen-base")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    raw = load_file(adapter / "adapter_model.safetensors")
    _edit_json(adapter / "adapter_config.json", use_rslora=True)
    name, (_, b) = next(iter(read_lora(adapter).items()))
    want = raw[f"base_model.model.{name}.lora_B.weight"] * (cfg["lora_alpha"] / cfg["r"] ** 0.5)
    torch.testing.assert_close(b, want)


def test_a_base_whose_mask_id_differs_is_refused(tmp_path):
    """Catches load_space dropping the mask-id check: a base whose tokenizer has one more token gives
    the mask another id, and the adapter's mask rows would sit on the wrong token."""
    adapter = _artifact(tmp_path / "a", "frozen-base")
    other, tok = tiny_random_llama(seed=0)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.warns(UserWarning, match="trained on base model"), pytest.raises(ValueError, match="differ from the adapter's"):
        load_space(str(tmp_path / "other"), adapter)


def test_the_recorded_base_named_by_another_path_loads_silently(tmp_path, monkeypatch):
    """Catches model_identity comparing unresolved paths: the same directory named relatively and
    absolutely warned of a wrong base model."""
    base, tok = tiny_random_llama(seed=0)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    peft_model, spec = prepare_model(*load_model(str(tmp_path / "base")), "frozen-base", mask_num=3)
    adapter = save_artifact(tmp_path / "a", peft_model, tok, spec, "frozen-base", {"base_model": str(tmp_path / "base")})
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_space("base", adapter)
        load_space("./sub/../base", adapter)


@pytest.mark.parametrize("lora, saved_now", [({"lora_targets": ["q_proj"]}, "'lora_targets'"),
                                             ({"lora_alpha": 64}, "'lora_alpha': (64, 32)"),
                                             ({"lora_r": 4}, "'lora_r': (4, 16)")])
def test_warm_start_refuses_an_adapter_with_another_lora(tmp_path, lora, saved_now):
    """Catches warm_start ignoring LoRA layers the artifact lacks (other lora_targets: they would
    silently start from zero) or taking weights trained at another alpha (every update rescaled)."""
    model, tok = tiny_random_llama(seed=0)
    other, spec = prepare_model(model, tok, "frozen-base", mask_num=3, **lora)
    adapter = save_artifact(tmp_path / "a", other, tok, spec, "frozen-base", {"base_model": TINY})
    now, spec2 = prepare_model(*tiny_random_llama(seed=0), "frozen-base", mask_num=3)
    with pytest.raises(ValueError, match=f"init_adapter .* holds LoRA weights made with other settings.*{re.escape(saved_now)}"):
        warm_start(now, adapter, "frozen-base", spec2)


def test_warm_start_refuses_lora_weights_its_config_does_not_describe(tmp_path):
    """adapter_config.json names every target but the weights file lacks some (a hand-edited or
    damaged artifact): the layers left out would silently start from zero."""
    from safetensors.torch import load_file, save_file

    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=3)
    adapter = save_artifact(tmp_path / "a", peft_model, tok, spec, "frozen-base", {"base_model": TINY})
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "q_proj" not in k}, adapter / "adapter_model.safetensors")
    now, spec2 = prepare_model(*tiny_random_llama(seed=0), "frozen-base", mask_num=3)
    with pytest.raises(ValueError, match="LoRA layers differ.*missing"):
        warm_start(now, adapter, "frozen-base", spec2)


def test_an_artifact_replaced_by_a_run_stopped_part_way_is_kept(tmp_path, monkeypatch):
    """Saving over an existing artifact: a run stopped after the old one left its place and before
    the new one took it (a kill, Ctrl-C) keeps the old one whole beside it. Catches deleting the old
    artifact first: the only trained model was gone, the new one left in a hidden .tmp folder."""
    import os

    import space.artifact

    out = _artifact(tmp_path / "final", "frozen-base")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def stopped(src, dst):
        if "tmp" in Path(src).name:  # the new artifact's rename into place
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(space.artifact.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        _artifact(out, "frozen-base")
    monkeypatch.undo()
    (old,) = tmp_path.glob(".old-final-*")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    _artifact(out, "frozen-base")  # a later save still lands, and leaves no old copy of its own
    assert {p.name for p in out.iterdir()} == set(before)
    assert len(list(tmp_path.glob(".old-final-*"))) == 1


def test_a_bf16_load_is_priced_by_the_adapters_bf16_curve(tmp_path):
    """Catches load_space pricing a bf16 trunk with the fp32 curve (the trunk's dtype not passed to
    the curve's choice): an adapter storing both curves of one setup decodes each load with its own."""
    from space.cpu_kernels import cpu_identity
    from space.eval.tree_search import write_decode

    adapter = _artifact(tmp_path / "a", "frozen-base")
    setup = {"threads": torch.get_num_threads(), "kernels": "stock", "device": "cpu", "capture": False,
             "trunk": "fused", "cpu": cpu_identity()}
    decode = DecodeConfig(3, tree="dynamic").to_dict()
    write_decode(adapter, decode, {1: 0.010, 32: 0.020}, setup=setup)  # naming no dtype: fp32's
    write_decode(adapter, decode, {1: 0.030, 32: 0.050}, setup={**setup, "dtype": "bfloat16"})
    for dtype, curve in (("float32", [[1, 10.0], [32, 20.0]]), ("bfloat16", [[1, 30.0], [32, 50.0]])):
        model = load_space(adapter=adapter, dtype=dtype, step_cost="stored")[0]
        assert model.config.space_decode["step_cost"] == curve
        assert model.space_step_cost_setup.get("dtype", "float32") == dtype


def test_step_cost_prices_an_adapters_tree_at_load_as_space_eval_does(tmp_path, monkeypatch, capsys):
    """``load_space(step_cost=...)`` (issue 58): a Python user's dynamic tree on a GPU was priced by
    the adapter's stored CPU curve (14 rows at 1.6x one, where an H200's eager step pays about 1.3x).
    ``auto`` measures at load on a device of ``AUTO_MEASURED`` (the CPU stands for the GPU here)
    when the adapter's stored layout is the dynamic tree and it stores no curve of this setup, and
    puts it in the model's layout, which ``SpaceDecoder`` and ``space.hf`` decode with; not on a
    CPU, not for a static layout, not over a stored curve of this setup, not compiled; ``stored``
    never; ``measure`` always; the setup is recorded. A stored layout of prompt lookup alone loads
    (it failed: priced as a dynamic tree with 0 groups). The measurement is stubbed (its real steps
    are timed in tests/test_chat.py)."""
    import space.eval.step_cost as ts
    from space.decoding import SpaceDecoder
    from space.eval.tree_search import write_decode

    adapter = _artifact(tmp_path / "a", "frozen-base")
    calls = []
    monkeypatch.setattr(ts, "measure_step_cost", lambda model, max_rows, **k: calls.append(max_rows) or
                        {"step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.5, "seconds": 1.0})
    write_decode(adapter, DecodeConfig(3, tree="dynamic").to_dict())  # a stored dynamic tree, no curve
    model, _, spec = load_space(adapter=adapter)  # auto on a CPU
    assert calls == [] and model.space_step_cost_setup is None and model.config.space_decode["step_cost"] is None
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("cpu",))
    write_decode(adapter, DecodeConfig(3).to_dict())  # a static layout: auto measures nothing
    assert load_space(adapter=adapter)[0].config.space_decode["step_cost"] is None and calls == []
    write_decode(adapter, DecodeConfig(3, tree="dynamic").to_dict())
    model, _, spec = load_space(adapter=adapter)
    assert len(calls) == 1 and "[load_space] measured this machine's step cost" in capsys.readouterr().out
    assert model.config.space_decode["step_cost"] == [[1, 2.0], [32, 3.0]]
    assert model.config.space_decode["adapter_cost"] == 0.5 and model.config.space_decode["tree"] == "dynamic"
    assert model.space_step_cost_setup["measured"] == "at load" and model.space_step_cost_setup["device"] == "cpu"
    assert SpaceDecoder(model, spec).config.step_cost == ((1, 2.0), (32, 3.0))
    assert load_space(adapter=adapter, step_cost="stored")[0].config.space_decode["step_cost"] is None
    assert len(calls) == 1
    # a curve of this setup stored: auto takes it; measure still measures
    decode = DecodeConfig(3, tree="dynamic").to_dict()
    write_decode(adapter, decode, {1: 0.010, 32: 0.020}, setup={
        "threads": torch.get_num_threads(), "kernels": "stock", "device": "cpu", "capture": False, "trunk": "fused"})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = load_space(adapter=adapter)[0]
    assert not [w for w in said if "step-cost curve" in str(w.message)]
    assert len(calls) == 1 and model.config.space_decode["step_cost"] == [[1, 10.0], [32, 20.0]]
    assert model.space_step_cost_setup["threads"] == torch.get_num_threads() and "measured" not in \
        model.space_step_cost_setup
    assert load_space(adapter=adapter, step_cost="measure")[0].config.space_decode["step_cost"] == [[1, 2.0], [32, 3.0]]
    assert len(calls) == 2
    # only another setup's curve stored (other threads): it prices the tree, and a Python user is told
    # so, as space-eval tells its runs (load_space said nothing); "stored" leaves it to its caller
    other = tmp_path / "b"
    shutil.copytree(adapter, other)
    cfg = json.loads((other / "space_config.json").read_text())
    cfg["step_costs"] = [{**e, "threads": torch.get_num_threads() + 1} for e in cfg["step_costs"]]
    cfg["step_cost_setup"]["threads"] = torch.get_num_threads() + 1
    (other / "space_config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(ts, "AUTO_MEASURED", ())
    with pytest.warns(UserWarning, match=rf"step-cost curve was measured with threads {torch.get_num_threads() + 1}"):
        load_space(adapter=other)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        load_space(adapter=other, step_cost="stored")
    assert not [w for w in said if "step-cost curve" in str(w.message)]
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("cpu",))
    # a stored layout of prompt lookup alone (no mask group) loads, and carries its curve as the others
    write_decode(adapter, DecodeConfig(3, 0, lookup_tokens=8).to_dict())
    model, _, spec = load_space(adapter=adapter, step_cost="measure")
    assert SpaceDecoder(model, spec).config.groups == 0 and model.config.space_decode["step_cost"] == [[1, 2.0], [32, 3.0]]
    assert len(calls) == 3
    with pytest.raises(ValueError, match="step_cost must be one of"):
        load_space(adapter=adapter, step_cost="sometimes")
    with pytest.raises(ValueError, match="step_cost measure times the eager trunk"):
        load_space(adapter=adapter, step_cost="measure", compile="frozen")
    assert len(calls) == 3


def test_saving_over_an_artifact_leaves_only_the_new_one(tmp_path):
    """A completed save over an existing artifact (a rerun of a finished training writing final/
    again). Catches keeping the old artifact moved aside: every save left a whole model copy in a
    hidden .old-final-* folder beside final/, filling the disk run after run."""
    first = _artifact(tmp_path / "final", "frozen-base")
    model, tok = tiny_random_llama(seed=0)
    peft_model, spec = prepare_model(model, tok, "frozen-base", mask_num=3)
    out = save_artifact(tmp_path / "final", peft_model, tok, spec, "frozen-base", {"base_model": TINY, "run": 2})
    assert out == first
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert json.loads((out / "space_config.json").read_text())["run"] == 2


def test_a_full_checkpoints_tuned_layout_travels_with_it(tmp_path, monkeypatch, capsys):
    """A full SAR-SFT checkpoint (the paper's own fine-tuning) keeps its tuned layout and step-cost
    curves in its space_config.json, as an adapter does (``space-tree --write-adapter`` with the
    checkpoint as ``--model``); ``load_space(model=...)`` decodes with it, the dynamic tree priced by
    the curve stored for this setup, measured at load under ``auto`` on a GPU (the CPU stands in)
    when none is. Catches a full checkpoint loaded with the default layout whatever it stores (as
    before: every full checkpoint decoded k = its trained k with k + 1 groups)."""
    import space.eval.step_cost as ts
    from space.decoding import SpaceDecoder
    from space.eval.tree_search import write_decode

    ckpt = full_checkpoint(tmp_path / "full")
    loaded, _, spec = load_space(model=str(ckpt))  # none stored: the trained k, k + 1 groups
    assert SpaceDecoder(loaded, spec).config == DecodeConfig(3)
    layout = DecodeConfig(2, 2, lookup_tokens=6, tree=[[0], [1], [0, 0]])
    write_decode(ckpt, layout.to_dict())
    loaded, _, spec = load_space(model=str(ckpt))
    assert SpaceDecoder(loaded, spec).config == layout
    calls = []
    monkeypatch.setattr(ts, "measure_step_cost", lambda model, max_rows, **k: calls.append(max_rows) or
                        {"step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.0, "seconds": 1.0})
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("cpu",))
    write_decode(ckpt, DecodeConfig(3, tree="dynamic").to_dict())  # a dynamic tree, no curve of this setup
    loaded, _, spec = load_space(model=str(ckpt))
    assert len(calls) == 1 and "[load_space] measured this machine's step cost" in capsys.readouterr().out
    assert SpaceDecoder(loaded, spec).config.step_cost == ((1, 2.0), (32, 3.0))
    assert loaded.space_step_cost_setup["measured"] == "at load"
    write_decode(ckpt, DecodeConfig(3, tree="dynamic").to_dict(), {1: 0.010, 32: 0.020}, setup={
        "threads": torch.get_num_threads(), "kernels": "stock", "device": "cpu", "capture": False, "trunk": "fused"})
    loaded, _, spec = load_space(model=str(ckpt))  # a curve of this setup: auto takes it
    assert SpaceDecoder(loaded, spec).config.step_cost == ((1, 10.0), (32, 20.0)) and len(calls) == 1
    assert loaded.space_step_cost_setup["trunk"] == "fused"
    cfg = json.loads((ckpt / "space_config.json").read_text())
    cfg["decode"]["mask_num"] = 4  # past the trained k: a hand edit, refused naming the file
    (ckpt / "space_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"full/space_config.json: decode mask_num 4 exceeds the trained mask_num 3"):
        load_space(model=str(ckpt))


def test_a_full_checkpoint_compiles_its_trunk_and_an_adapter_outranks_it(tmp_path, monkeypatch):
    """``load_space(model=<full checkpoint>, compile=...)`` compiles the trunk it returns, with the
    checkpoint's layout on it (the compile moved into ``_with_tuned_layout``); and the artifact a
    run reads its layout from is the adapter when one is given, else the checkpoint, else none.
    Catches the full path returning the eager trunk, and a checkpoint's layout taken over an
    adapter's."""
    import space.loader as loader
    from space.artifact import artifact_folder
    from space.decoding import SpaceDecoder
    from space.eval.tree_search import write_decode

    ckpt = full_checkpoint(tmp_path / "full")
    write_decode(ckpt, DecodeConfig(2, 2).to_dict())
    compiled = []
    monkeypatch.setattr(loader, "compile_trunk", lambda m, mode=None: compiled.append(mode) or m)
    loaded, _, spec = load_space(model=str(ckpt), compile=True)
    assert compiled == [None] and loaded.space_trunk is None  # inductor's default mode, unfused
    assert SpaceDecoder(loaded, spec).config == DecodeConfig(2, 2)
    adapter = tmp_path / "adapter"
    assert artifact_folder(str(ckpt), adapter) == adapter and artifact_folder(str(ckpt), None) == ckpt
    assert artifact_folder(str(tmp_path), None) is None and artifact_folder(TINY, None) is None


@pytest.mark.parametrize("device, match", [
    ("gpu", r"unknown --device 'gpu'"),
    # torch knows them, so they passed: an AssertionError (xpu) or .item() on a meta tensor, from inside torch
    ("xpu", r"--device xpu: not supported \(the decoders run on cpu, cuda, cuda:N or mps\)"),
    ("meta", r"--device meta: not supported"),
    (f"cuda:{torch.cuda.device_count()}", r"--device cuda:\d+: (no CUDA GPU is usable|only \d+ CUDA device)")])
def test_a_device_this_machine_lacks_is_refused_before_the_weights_load(monkeypatch, device, match):
    """The Python API checks its device as the CLIs' --device does: torch's own refusal (a bare
    AssertionError for cuda on a CPU build) came from ``model.to`` after the weights had loaded."""
    from space import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(ValueError, match=match):
        load_space(TINY, device=device)


def test_device_auto_is_the_gpu_when_there_is_one():
    """``device="auto"``, every CLI's default, means to the Python API what it means there."""
    model, _, _ = load_space(TINY, device="auto")
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
