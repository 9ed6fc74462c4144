"""The attention backend chosen at load (issue 58, item 3, ``space.decoding.backends``)."""
import pytest
import torch

from space.decoding.backends import choose_sdpa


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_turns_cudnn_attention_off(cudnn_flag, dtype):
    assert choose_sdpa("cuda", dtype) == {"cudnn_sdp": False}
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_fp32_and_other_devices_change_nothing(cudnn_flag):
    assert choose_sdpa("cuda", torch.float32) == {"cudnn_sdp": True}
    assert choose_sdpa("cpu", torch.bfloat16) == {} and torch.backends.cuda.cudnn_sdp_enabled()


def test_load_records_the_choice(cudnn_flag):
    from space.loader import load_space

    model, _, _ = load_space("tiny-random-llama")
    assert model.space_sdpa == {} and torch.backends.cuda.cudnn_sdp_enabled()  # a CPU model leaves CUDA's flags
