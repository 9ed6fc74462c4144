"""Model loading by alias, the mask token, and the real embedded SmolLM2."""
import gzip
import json
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


def test_bad_mask_num():
    for bad in (0, -1, MAX_MASK_NUM + 1):
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
