"""The opt-in compiled trunk (issue 43, ``space.decoding.compiled``): SPACE over a compiled trunk
equals AR over the same compiled trunk in fp32, for the chain, a static tree and the dynamic tree
with lookup, on the trained drafter (long accepts, moving tree paths); both then preallocate their
caches, and the graphs stay few (automatic dynamic shapes, not one graph per row count)."""
import copy

import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from space.decoding.compiled import compile_trunk, is_compiled


@pytest.fixture(scope="module")
def compiled(trained):
    model, tok, spec, lang = trained
    return compile_trunk(copy.deepcopy(model)), spec, lang


def test_compiled_trunk_is_exact_and_preallocates(compiled):
    from torch._dynamo.utils import counters

    model, spec, lang = compiled
    assert is_compiled(model) and compile_trunk(model) is model  # once
    graphs = counters["stats"]["unique_graphs"]
    for config in [DecodeConfig(3, 4), DecodeConfig(3, 2, tree=[[0], [1], [0, 0], [1, 0]]),
                   DecodeConfig(4, tree="dynamic", lookup_tokens=8, row_budget=24)]:
        dec = SpaceDecoder(model, spec, config)
        assert dec.static_cache  # a compiled trunk wants repeating shapes
        for n in (12, 30):
            prompt = torch.tensor(lang.sample(n))
            truth = ar_generate(model, prompt, 48, suppress_ids=spec.token_ids).new_ids
            out = dec.generate(prompt, 48)
            assert out.new_ids == truth, config
            assert max(out.accept_lengths) >= 2
    assert counters["stats"]["unique_graphs"] - graphs <= 12  # not one per shape and mask row


def test_an_eager_trunk_is_not_compiled(trained):
    model, _, spec, _ = trained
    assert not is_compiled(model)
    assert not SpaceDecoder(model, spec, DecodeConfig(3)).static_cache
    with pytest.raises(ValueError, match="get_decoder"):
        compile_trunk(torch.nn.Linear(2, 2))


def test_compile_refuses_the_fast_cpu_kernels():
    """Inductor cannot lower oneDNN's prepacked linears (it packs the stock ones itself)."""
    from space.adapters import load_space

    with pytest.raises(ValueError, match="stock kernels"):
        load_space("tiny-random-llama", mask_num=3, kernels="fast", compile=True)


def test_space_eval_compile_flag_is_recorded_and_a_resume_key(tmp_path):
    """``space-eval --compile``: every method runs over the compiled trunk, SPACE stays exact, the
    run records it, and a rerun without it refuses to mix the timings."""
    import json

    from space.eval.__main__ import main as eval_main

    args = ["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "12",
            "--mask-num", "3", "--threads", "1", "--methods", "ar,pld,space", "--out", str(tmp_path)]
    summary = eval_main([*args, "--compile"])
    assert summary["exact_match_rate"] == 1.0 and summary["meta"]["compile"] is True
    assert json.loads((tmp_path / "run_config.json").read_text())["compile"] is True
    with pytest.raises(ValueError, match="'compile': \\(True, False\\)"):
        eval_main([*args, "--kernels", "stock"])  # the same run but eager: its timings would mix
    with pytest.raises(ValueError, match="--compile takes --kernels stock"):
        eval_main([*args, "--compile", "--kernels", "fast"])
