import pytest
import torch

from space.models import tiny_random_llama
from space.tokens import add_mask_tokens


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer, MaskSpec): tiny random Llama (fp32) with one mask token, k up to 8."""
    torch.set_num_threads(2)
    model, tok = tiny_random_llama(seed=0)
    spec = add_mask_tokens(model, tok, mask_num=8)
    return model, tok, spec


@pytest.fixture(scope="session")
def tiny_untied():
    model, tok = tiny_random_llama(seed=1, tie_word_embeddings=False)
    spec = add_mask_tokens(model, tok, mask_num=8)
    return model, tok, spec
