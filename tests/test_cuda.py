"""The decoders on a GPU (skipped without CUDA: CI has none; run on a GPU machine with
``pytest tests/test_cuda.py``)."""
import copy
import json

import pytest
import torch

from space.decoding import DecodeConfig, SamplingConfig, SpaceDecoder, ar_generate
from space.eval.__main__ import main as eval_main
from tests.conftest import TRAINED_K as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("groups", [1, 2, K + 1])
def test_greedy_exact_on_cuda_at_high_acceptance(trained, groups):
    model, _, spec, lang = trained
    gpu = copy.deepcopy(model).cuda()
    dec = SpaceDecoder(gpu, spec, DecodeConfig(K, groups))
    for i in range(4):
        prompt = torch.tensor(lang.sample(3 + 2 * i))
        ar = ar_generate(gpu, prompt, 40, suppress_ids=spec.token_ids)
        out = dec.generate(prompt, 40)  # a CPU prompt for a CUDA model: the decoder moves it
        assert out.new_ids == ar.new_ids and out.tokens_per_step > 1.5
        assert out.new_ids == ar_generate(model, prompt, 40, suppress_ids=spec.token_ids).new_ids  # == CPU


def test_sampling_runs_on_the_device(trained):
    model, _, spec, lang = trained
    gpu = copy.deepcopy(model).cuda()
    dec = SpaceDecoder(gpu, spec, DecodeConfig(K, 2))
    prompt, cfg = torch.tensor(lang.sample(6)), SamplingConfig(0.8, top_p=0.95, seed=1)
    out, again = dec.generate(prompt, 40, sampling=cfg), dec.generate(prompt, 40, sampling=cfg)
    assert out.new_ids == again.new_ids  # a seeded generator on the device
    assert len(out.new_ids) == 40 and max(out.accept_lengths) >= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_space_eval_on_cuda(tmp_path, dtype):
    s = eval_main(["--model", "tiny-random-llama", "--dataset", "humaneval", "--limit", "2", "--max-new-tokens", "16",
                   "--device", "cuda", "--dtype", dtype, "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "run_config.json").read_text())
    assert torch.cuda.get_device_name() in json.dumps(meta["machine"])
    assert set(s["methods"]) == {"ar", "hf", "pld", "space"}
    if dtype == "float32":
        assert s["exact_match_rate"] == 1.0
