import copy

import pytest
import torch

from space.data.collator import SpaceCollator
from space.models import tiny_random_llama
from space.tokens import add_mask_tokens
from space.train.loss import space_loss


@pytest.fixture(autouse=True)
def two_threads():
    """Every test starts on 2 threads (CI's cores; the model fixtures set the same): a CLI run
    in-process with ``--threads N`` sets torch's threads for the whole process, and left every later
    test on one thread after a ``--threads 1`` run. Not the count a test found: a fixture built
    lazily inside a test (``request.getfixturevalue``) sets it there."""
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer, MaskSpec): tiny random Llama (fp32) with one mask token, k up to 8."""
    torch.set_num_threads(2)
    model, tok = tiny_random_llama(seed=0)
    spec = add_mask_tokens(model, tok, mask_num=8)
    return model, tok, spec


@pytest.fixture(scope="session")
def tiny_varied():
    """:func:`tiny` with init std 0.2: its greedy answers vary (about 40-50 distinct tokens in 60).
    ``tiny``'s (std 0.02) repeat one token, so a test on them cannot see tokens emitted in the
    wrong order, a bonus taken from the wrong row, or a stop token inside a step."""
    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    spec = add_mask_tokens(model, tok, mask_num=8)
    return model, tok, spec


@pytest.fixture(scope="session")
def tiny_untied():
    model, tok = tiny_random_llama(seed=1, tie_word_embeddings=False)
    spec = add_mask_tokens(model, tok, mask_num=8)
    return model, tok, spec


class CycleLanguage:
    """A synthetic language: walk a fixed cycle of tokens, jumping to a random place 10 % of the
    time. A model trained on it is mostly predictable (long accepts) but not always (rejections)."""

    def __init__(self, tokens: list[int], seed: int = 0):
        self.tokens, self.gen = tokens, torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> list[int]:
        i, out = int(torch.randint(len(self.tokens), (1,), generator=self.gen)), []
        while len(out) < n:
            out.append(self.tokens[i])
            i = (i + 1) % len(self.tokens)
            if torch.rand(1, generator=self.gen) < 0.1:
                i = int(torch.randint(len(self.tokens), (1,), generator=self.gen))
        return out


def train_drafter(model, spec, language: CycleLanguage, k: int, steps: int, seq_len: int = 48, lr: float = 3e-3):
    """SAR-SFT in full mode for a few seconds on ``language``: the masks learn to draft it."""
    collator = SpaceCollator(spec.ids_for(k), k, pad_id=0, spans_per_sample=16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        batch = collator([{"input_ids": language.sample(seq_len), "prompt_len": 1, "idx": step * 16 + b}
                          for b in range(16)])
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        loss, _ = space_loss(logits, batch["labels"], batch["mask_offset"], 1.0, k)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


TRAINED_K = 4


@pytest.fixture(scope="session")
def trained_drafter():
    """(model, tokenizer, MaskSpec, CycleLanguage): a tiny Llama (ordinary init) whose k=4 mask
    drafts are usually right on its language (~4.4 tokens/step with k+1 groups), trained in
    about 10 s, once per session. Tests take :func:`trained`; a module's fixture takes this one
    and a language of its own (``fresh_language``)."""
    torch.set_num_threads(2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, tok = tiny_random_llama(seed=3)
        spec = add_mask_tokens(model, tok, mask_num=TRAINED_K)
        cycle = (11 + torch.randperm(200, generator=torch.Generator().manual_seed(0))[:40]).tolist()
        train_drafter(model, spec, CycleLanguage(cycle, seed=0), TRAINED_K, steps=200)
    return model, tok, spec, CycleLanguage(cycle, seed=1)


def fresh_language(language: CycleLanguage) -> CycleLanguage:
    """``language``'s cycle with its generator at the start: the same prompts whatever ran before."""
    return CycleLanguage(language.tokens, seed=1)


@pytest.fixture
def trained(trained_drafter):
    """:func:`trained_drafter` with a language of the test's own, its generator at the start.
    Exactness tests on it compare SPACE with AR at high acceptance, not AR with AR. Shared, the
    language's generator gave each test other prompts whenever a test was added before it, and
    a test's precondition (a rank-1 path accepted, a tokens/step floor) could fail."""
    model, tok, spec, language = trained_drafter
    return model, tok, spec, fresh_language(language)


def random_frozen_base(model, tokenizer, spec, k: int, **lora):
    """``model`` as a frozen base with its own mask rows and a random gated LoRA (rank 4; ``lora``:
    more :func:`space.adapter_layers.prepare_model` arguments, e.g. ``lora_targets``), fused for
    decoding (``fuse_frozen_base``). Its output is the base's; its drafts move with the LoRA, so
    A (peft's init, from torch's global generator) and B (N(0, 0.02)) are both seeded: unseeded,
    A depended on which tests ran before: Phi-3's frozen-base trunk drafted 2.55-3.43 tokens/step
    over global seeds 0-7, and 2.45 in one CI run.

    Returns:
        (decoding model, MaskSpec of the frozen-base copy).
    """
    from space.adapter_layers import fuse_frozen_base, mask_embedding, prepare_model

    rows = model.get_input_embeddings().weight[list(spec.token_ids)].detach().clone()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        peft_model, spec2 = prepare_model(copy.deepcopy(model), copy.deepcopy(tokenizer), "frozen-base", k,
                                          lora_r=4, **lora)
    with torch.no_grad():
        mask_embedding(peft_model).mask_rows.copy_(rows)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02, generator=torch.Generator().manual_seed(0))
    return fuse_frozen_base(peft_model), spec2


def assert_cache_matches_fresh(model, cache, ids: torch.Tensor) -> None:
    """The decoder's KV cache equals a fresh forward of ``ids`` (the tokens it should hold)."""
    from transformers import DynamicCache

    from space.decoding.cache import cache_input

    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        model.get_decoder()(input_ids=ids[None], **cache_input(fresh), use_cache=True)
    for mine, ref in zip(cache.layers, fresh.layers):
        assert mine.keys.shape == ref.keys.shape
        torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, rtol=1e-4, atol=1e-5)


def sdpa_gqa_copy(model):
    """A copy of ``model`` whose attention is ``space.decoding.backends.SDPA_GQA`` (reads the keys up
    to the mask's width), as the fused trunk, the fast kernels and a CPU's compiled trunk run it."""
    import copy

    from space.decoding.backends import SDPA_GQA, register_attention

    gqa = copy.deepcopy(model)
    register_attention()
    gqa.set_attn_implementation(SDPA_GQA)
    return gqa


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every SDPA call from here on, as (query rows, key length, mask width or None)."""
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, **kwargs):
        seen.append((query.shape[-2], key.shape[-2], None if attn_mask is None else attn_mask.shape[-1]))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.fixture
def torn_writes(monkeypatch):
    """Every file opened for writing through ``pathlib`` (``Path.open``, ``write_text``,
    ``write_bytes``) takes the first half of its first write, then fails as a full disk or a kill
    would: what was written in place is torn, a temporary file renamed over the target is not."""
    import io

    real_open = io.open

    class Torn:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError("No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def torn_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Torn(f) if any(c in mode for c in "wa") else f

    monkeypatch.setattr(io, "open", torn_open)  # pathlib opens through io.open


def full_checkpoint(path, mask_num: int = 3, seed: int = 0, **meta):
    """A tiny-model full SAR-SFT checkpoint (the tiny model of ``seed``, untrained masks) saved
    at ``path``, its space_config.json holding ``meta`` beside the base model; returns its folder."""
    from space.adapter_layers import prepare_model
    from space.artifact import save_artifact
    from space.models import TINY

    model, tok = tiny_random_llama(seed=seed)
    full, spec = prepare_model(model, tok, "full", mask_num=mask_num)
    return save_artifact(path, full, tok, spec, "full", {"base_model": TINY, **meta})


class QuestionsNotRun(Exception):
    """Raised by :func:`no_questions_run` where space-eval would start its questions."""


@pytest.fixture
def no_questions_run(monkeypatch):
    """space-eval stops where its questions would start (``run_bench`` raises
    :class:`QuestionsNotRun`), after its record and checks; returns the exception class."""
    import space.eval.bench as bench

    def stop(*args, **kwargs):
        raise QuestionsNotRun

    monkeypatch.setattr(bench, "run_bench", stop)
    return QuestionsNotRun
