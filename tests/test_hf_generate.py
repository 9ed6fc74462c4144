"""SPACE inside HF generate(): same ids, text, stops and distribution as plain generate()."""
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, pipeline
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.streamers import BaseStreamer, TextStreamer

from space.decoding import SamplingConfig, SpaceDecoder, ar_generate
from space.decoding.cache import CACHE_ARG, cache_input
from space.decoding.result import StopDecoding
from space.hf import space_generate
from space.models import tiny_random_llama
from tests.conftest import CycleLanguage
from tests.decoding.test_sampling import ALPHA, chi2_pvalue, exact_distribution, small_vocab_model  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "adapters" / "smollm2-135m-space"


class Recorder(BaseStreamer):
    """Records every put (as lists) and end() calls, as a streamer sees them."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ends += 1


class TextRecorder(TextStreamer):
    """transformers' TextStreamer, collecting the text it would print."""

    def __init__(self, tok):
        super().__init__(tok)
        self.text = ""

    def on_finalized_text(self, text, stream_end=False):
        self.text += text


def _hf(model, ids, **kw):
    """Plain greedy generate() on a (1, seq) prompt."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)


def _space(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=space_generate, **kw)


def _prompts(trained, n=3, length=12):
    """n prompts in the trained model's language (the same ones whatever ran before)."""
    language = CycleLanguage(trained[3].tokens, seed=11)
    return [torch.tensor([[11, 12] + language.sample(length)]) for _ in range(n)]


@pytest.mark.parametrize("mask_num,extra", [(1, {}), (3, {}), (8, {"num_groups": 2})])
def test_greedy_equals_plain_generate_untrained(tiny, mask_num, extra):
    model, tok, _ = tiny
    for text in ("hello", "The quick brown fox", "x = [1, 2"):
        ids = tok(text, return_tensors="pt")["input_ids"]
        ref = _hf(model, ids, max_new_tokens=24)
        assert torch.equal(_space(model, ids, max_new_tokens=24, mask_num=mask_num, **extra), ref), (text, mask_num)


def test_stop_decoding_hook(trained):
    """The hook space_generate's stopping criteria use: on_tokens raising StopDecoding(keep) keeps
    the first ``keep`` tokens of that step and ends generation, in SPACE and in the AR loop."""
    model, _, spec = trained[:3]
    ids = _prompts(trained, n=1)[0][0]
    full = SpaceDecoder(model, spec).generate(ids, 30)
    steps = []

    def stop_inside_second_long_step(tokens):
        steps.append(tokens)
        if len(tokens) > 1 and sum(len(t) > 1 for t in steps) == 2:
            raise StopDecoding(1)

    out = SpaceDecoder(model, spec).generate(ids, 30, on_tokens=stop_inside_second_long_step)
    n = sum(len(t) for t in steps[:-1]) + 1
    assert out.new_ids == full.new_ids[:n] and out.stop_reason == "stop"
    assert out.step_tokens[-1] == 1 and sum(out.step_tokens) == n == len(out.new_ids)
    calls = []

    def stop_at_fifth(tokens):
        calls.append(tokens)
        if len(calls) == 5:
            raise StopDecoding(0)

    ar = ar_generate(model, ids, 30, on_tokens=stop_at_fifth)
    assert ar.new_ids == full.new_ids[:4] and ar.stop_reason == "stop" and ar.num_steps == 5


@pytest.mark.parametrize("extra", [{}, {"mask_num": 2}, {"num_groups": 2}, {"lookup_tokens": 3}])
def test_greedy_equals_plain_generate_trained(trained, extra):
    """On a model whose drafts are accepted, so steps emit several tokens."""
    model = trained[0]
    per_step = []
    for ids in _prompts(trained):
        ref = _hf(model, ids, max_new_tokens=40)
        out = _space(model, ids, max_new_tokens=40, return_dict_in_generate=True, **extra)
        assert torch.equal(out.sequences, ref)
        assert sum(out.step_tokens[0]) == 40 and len(out.accept_lengths[0]) == len(out.step_tokens[0])
        per_step += out.tokens_per_step
    assert sum(per_step) / len(per_step) > 1.5  # multi-token steps did run


def test_streamer_stop_strings_and_max_length(trained):
    """Streamed text, stop strings met in the middle of a step, max_length cutting a step: all
    as plain generate()."""
    model, tok = trained[0], trained[1]
    ids = _prompts(trained, n=1)[0]
    ref, got = TextRecorder(tok), TextRecorder(tok)
    full = _hf(model, ids, max_new_tokens=40, streamer=ref)
    rec = Recorder()
    out = _space(model, ids, max_new_tokens=40, streamer=rec)
    _space(model, ids, max_new_tokens=40, streamer=got)
    assert torch.equal(out, full) and got.text == ref.text and ref.text
    assert rec.puts[0] == ids[0].tolist() and sum(rec.puts[1:], []) == full[0, ids.shape[1]:].tolist()
    assert rec.ends == 1 and len(rec.puts) < 40  # the prompt once, then whole steps, then end()
    new, step_ends, n = full[0, ids.shape[1]:].tolist(), set(), 0
    for chunk in rec.puts[1:]:  # the steps' boundaries, from what the streamer received
        n += len(chunk)
        step_ends.add(n - 1)
    # a one-character stop string ('!'..'~' are ids 0..93) met first inside a multi-token step:
    # a decoder that stopped at step granularity would return the rest of that step
    inside = [j for j in range(2, len(new)) if new[j] <= 93 and new[j] not in new[:j] and j not in step_ends][:2]
    assert inside
    for j in inside:
        stop = tok.decode([new[j]])
        ref = _hf(model, ids, max_new_tokens=40, stop_strings=[stop], tokenizer=tok)
        assert ref.shape[1] == ids.shape[1] + j + 1
        criteria = [StopStringCriteria(tok, [stop])]  # transformers keeps the tokenizer from callables
        assert torch.equal(_space(model, ids, max_new_tokens=40, stopping_criteria=criteria), ref), stop
    for max_length in (ids.shape[1] + 1, ids.shape[1] + 11):
        assert torch.equal(_space(model, ids, max_length=max_length), _hf(model, ids, max_length=max_length))


def test_local_custom_generate_folder(trained):
    """custom_generate="<repo>" loads custom_generate/generate.py: same ids, and stop_strings with a
    tokenizer work there (the folder path receives every argument of generate)."""
    model, tok = trained[0], trained[1]
    ids = _prompts(trained, n=1)[0]
    ref = _hf(model, ids, max_new_tokens=30)
    kw = dict(attention_mask=torch.ones_like(ids), custom_generate=str(ROOT), trust_remote_code=True)
    assert torch.equal(model.generate(ids, max_new_tokens=30, mask_num=2, **kw), ref)
    new = ref[0, ids.shape[1]:].tolist()
    stop = tok.decode([next(t for t in new[3:] if t <= 93)])  # an ASCII character ('!'..'~')
    ref_stop = _hf(model, ids, max_new_tokens=30, stop_strings=stop, tokenizer=tok)
    text, streamed = TextRecorder(tok), TextRecorder(tok)
    _hf(model, ids, max_new_tokens=30, stop_strings=stop, tokenizer=tok, streamer=text)
    out = model.generate(ids, max_new_tokens=30, stop_strings=stop, tokenizer=tok, streamer=streamed, **kw)
    assert torch.equal(out, ref_stop) and ref_stop.shape[1] < ref.shape[1] and streamed.text == text.text


def test_pipeline(tiny):
    model, tok, _ = tiny
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    ref = pipe("hello there", max_new_tokens=12, do_sample=False)
    assert pipe("hello there", max_new_tokens=12, do_sample=False, custom_generate=space_generate, mask_num=3) == ref


def test_batch_decodes_row_by_row(trained):
    """Left-padded rows give each prompt's own output; a row that stops early is padded with the
    pad id; a warning says the batch is decoded row by row."""
    model, tok = trained[0], trained[1]
    a, b = (p[0].tolist() for p in _prompts(trained, n=2))
    b = b[:7]
    new_a = _hf(model, torch.tensor([a]), max_new_tokens=20)[0, len(a):].tolist()
    new_b = _hf(model, torch.tensor([b]), max_new_tokens=20)[0, len(b):].tolist()
    eos = next(t for t in new_b[3:] if t not in new_a)  # b stops early, a does not
    pad = tok.pad_token_id
    ids = torch.tensor([a, [pad] * (len(a) - len(b)) + b])
    mask = (torch.arange(len(a)) >= len(a) - torch.tensor([[len(a)], [len(b)]])).long()
    with pytest.warns(UserWarning, match="one after another"):
        out = model.generate(ids, attention_mask=mask, custom_generate=space_generate, max_new_tokens=20,
                             eos_token_id=eos, pad_token_id=pad)
    ref_a = _hf(model, torch.tensor([a]), max_new_tokens=20, eos_token_id=eos, pad_token_id=pad)[0]
    ref_b = _hf(model, torch.tensor([b]), max_new_tokens=20, eos_token_id=eos, pad_token_id=pad)[0]
    assert ref_b[-1] == eos and len(ref_b) < len(b) + 20
    assert out[0].tolist() == ref_a.tolist()[: out.shape[1]] and out.shape[1] == len(a) + 20
    tail = out[1, len(a) - len(b):].tolist()
    assert tail == ref_b.tolist() + [pad] * (len(tail) - len(ref_b))


def test_batch_dynamic_tree_with_lookup_equals_ar(trained):
    """A left-padded batch of three prompts of different lengths, decoded with the dynamic tree and
    prompt lookup: each row is AR greedy (fp32) of its own prompt, token for token, with
    multi-token steps. Catches a dynamic-tree or lookup step that breaks greedy exactness in any
    row, the later ones included, which reuse the decoder (its cached layouts, its lookup generator)
    after the first, and rows placed or padded wrongly in the batch's output."""
    model, tok, spec = trained[:3]
    prompts = [p[0].tolist()[:n] for p, n in zip(_prompts(trained), (14, 10, 6))]
    width, pad, new = len(prompts[0]), tok.pad_token_id, 48
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with pytest.warns(UserWarning, match="one after another"):
        out = model.generate(ids, attention_mask=mask, custom_generate=space_generate, max_new_tokens=new,
                             tree="dynamic", lookup_tokens=4, pad_token_id=pad, return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    for b, p in enumerate(prompts):
        ref = ar_generate(model, torch.tensor(p), new, stop_token_ids=[eos], suppress_ids=spec.token_ids).new_ids
        assert out.sequences[b, :width].tolist() == ids[b].tolist()
        assert out.sequences[b, width:].tolist() == ref + [pad] * (out.sequences.shape[1] - width - len(ref)), b
        assert max(out.accept_lengths[b]) >= 3, (b, out.accept_lengths[b])
    assert sum(out.tokens_per_step) / len(prompts) > 1.8, out.tokens_per_step  # ~2.3 here


def test_sampling_matches_exact_distribution(small_vocab_model):
    """temperature/top_p through generate(): HF's warpers applied once, to target and drafts, so
    the 3-token outputs follow the AR distribution (EOS = token 2 ends a sequence early)."""
    model, spec = small_vocab_model
    model.config.space_mask = asdict(spec)  # what add_mask_tokens records; space_generate reads it
    prompt, temperature, top_p, eos = [1, 3, 0, 2], 1.5, 0.9, model.generation_config.eos_token_id
    exact = {}
    for seq, p in exact_distribution(model, prompt, SamplingConfig(temperature, top_p=top_p)).items():
        cut = seq[: seq.index(eos) + 1] if eos in seq else seq  # the outcome generate() returns
        exact[cut] = exact.get(cut, 0.0) + p
    n, counts, accepts = 1200, {}, []
    ids = torch.tensor([prompt])
    for seed in range(n):
        torch.manual_seed(seed)  # space_generate seeds SPACE from torch's RNG, as generate() samples
        out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=space_generate,
                             do_sample=True, temperature=temperature, top_p=top_p, max_new_tokens=3,
                             pad_token_id=eos, return_dict_in_generate=True)
        new = tuple(out.sequences[0, len(prompt):].tolist())
        counts[new] = counts.get(new, 0) + 1
        accepts += out.accept_lengths[0][1:]
    assert 0 in accepts and max(accepts) >= 2  # rejections and multi-token accepts both ran
    assert chi2_pvalue(counts, exact, n) > ALPHA


@pytest.mark.parametrize("kwargs,fragment", [
    ({"num_beams": 2}, "beam search (num_beams=2)"),
    ({"num_beams": 2, "do_sample": True}, "beam sampling"),
    ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
    ({"prompt_lookup_num_tokens": 3}, "assisted generation"),
    ({"return_dict_in_generate": True, "output_scores": True}, "output_scores=True"),
    ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
    # its processor keeps a state per generated token: a crash at k > 1, other tokens at k = 1
    ({"watermarking_config": __import__("transformers").SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=3)},
     "SynthID watermark"),
    ({"penalty_alpha": 0.5, "top_k": 4}, "contrastive_search"),
    # it was run with batch row 0 for every prompt, and with the draft rows as rows of their own (an
    # IndexError for a per-row list): another row's constraint, or a crash
    ({"prefix_allowed_tokens_fn": lambda batch_id, ids: [5, 6]}, "prefix_allowed_tokens_fn"),
])
def test_unsupported_options_say_what(tiny, kwargs, fragment):
    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="space_generate does not support") as err:
        _space(model, ids, max_new_tokens=4, **kwargs)
    assert fragment in str(err.value)


def test_unsupported_inputs_say_what(tiny):
    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="assisted generation"):
        _space(model, ids, max_new_tokens=4, assistant_model=model)
    with pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=model.get_input_embeddings()(ids), custom_generate=space_generate,
                       max_new_tokens=4)
    filled = DynamicCache(config=model.config)
    model(input_ids=ids, **cache_input(filled), use_cache=True)
    with pytest.raises(ValueError, match="a filled cache"):  # under the name the installed version uses
        _space(model, ids, max_new_tokens=4, **{CACHE_ARG: filled})
    plain, _ = tiny_random_llama(seed=0)  # no mask token
    with pytest.raises(ValueError, match="no SPACE mask token"):
        _space(plain, ids, max_new_tokens=4)


@pytest.mark.slow
def test_smollm2_shipped_adapter_equals_plain_generate():
    """Real SmolLM2 with the shipped adapter: 2 chat prompts x 32 tokens, the adapter's own layout;
    ids, streamed text, a stop string and max_length as plain generate()."""
    from space.data.prompts import chat_ids, code_prompt
    from space.eval.tasks import load_tasks
    from space.loader import load_space

    model, tok, _ = load_space(adapter=ADAPTER)
    assert model.config.space_decode  # the adapter's layout is what space_generate decodes with
    for i, task in enumerate(load_tasks("humaneval", limit=2)):
        ids = torch.tensor([chat_ids(tok, [{"role": "user", "content": code_prompt(task.problem["prompt"])}])])
        ref_text, text = TextRecorder(tok), TextRecorder(tok)
        ref = _hf(model, ids, max_new_tokens=32, streamer=ref_text)
        out = _space(model, ids, max_new_tokens=32, streamer=text, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and text.text == ref_text.text
        if i == 0:  # a stop string in the middle of the reply
            stop = tok.decode(ref[0, ids.shape[1] + 12: ids.shape[1] + 14])
            ref_stop = _hf(model, ids, max_new_tokens=32, stop_strings=[stop], tokenizer=tok)
            got = _space(model, ids, max_new_tokens=32, stopping_criteria=[StopStringCriteria(tok, [stop])])
            assert torch.equal(got, ref_stop) and ref_stop.shape[1] < ref.shape[1]
        else:
            length = ids.shape[1] + 19
            assert torch.equal(_space(model, ids, max_length=length), _hf(model, ids, max_length=length))


def test_generation_config_object(tiny):
    """A GenerationConfig passed whole is honoured like keyword arguments."""
    model, tok, _ = tiny
    ids = tok("abc", return_tensors="pt")["input_ids"]
    cfg = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    assert torch.equal(_space(model, ids, generation_config=cfg, mask_num=2), _hf(model, ids, generation_config=cfg))


def _left_padded(trained, short=7, pad=None):
    """Two prompts of the trained model's language, the second cut to ``short`` tokens and
    left-padded with ``pad`` (default: the tokenizer's pad id): (ids (2, seq), attention_mask
    (2, seq), the short prompt)."""
    a, b = (p[0].tolist() for p in _prompts(trained, n=2))
    b = b[:short]
    pad = trained[1].pad_token_id if pad is None else pad
    ids = torch.tensor([a, [pad] * (len(a) - len(b)) + b])
    mask = torch.tensor([[1] * len(a), [0] * (len(a) - len(b)) + [1] * len(b)])
    return ids, mask, b


@pytest.mark.parametrize("processor", ["forced_eos_token_id", "min_new_tokens", "min_length",
                                       "exponential_decay_length_penalty", "repetition_penalty"])
def test_batch_length_processors_equal_batched_generate(trained, processor):
    """Length-dependent processors count the left padding of a row, as in HF's batched loop: they
    fire at the same step as in plain batched generate (decoding a row without its padding fired
    them ``padding`` steps late). The repetition penalty skips each row's padding by a tensor of
    one count per batch row, which failed on SPACE's own row counts (a ValueError)."""
    model, tok = trained[0], trained[1]
    ids, mask, b = _left_padded(trained)
    new_b = _hf(model, torch.tensor([b]), max_new_tokens=20)[0, len(b):].tolist()
    j = next(j for j in range(6, 20) if new_b[j] not in new_b[:j])  # the first time the short row says it
    kw = {"forced_eos_token_id": dict(forced_eos_token_id=99, max_new_tokens=8),
          "min_new_tokens": dict(eos_token_id=new_b[j], min_new_tokens=j - 2, max_new_tokens=20),
          "min_length": dict(eos_token_id=new_b[j], min_length=ids.shape[1] + j - 2, max_new_tokens=20),
          "exponential_decay_length_penalty": dict(eos_token_id=new_b[j], exponential_decay_length_penalty=(1, 4.0),
                                                   max_new_tokens=20),
          "repetition_penalty": dict(repetition_penalty=1.5, max_new_tokens=20)}[processor]
    ref = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=tok.pad_token_id, **kw)
    with pytest.warns(UserWarning, match="one after another"):
        out = model.generate(ids, attention_mask=mask, custom_generate=space_generate, pad_token_id=tok.pad_token_id,
                             **kw)
    assert torch.equal(out, ref)
    if processor == "forced_eos_token_id":
        assert ref[:, -1].tolist() == [99, 99]


def test_batch_repetition_penalty_skips_the_padding_when_the_pad_id_is_a_token_of_the_answer(trained):
    """HF's batched repetition penalty leaves each row's left padding out of the tokens it
    penalizes (a count of pad tokens per row). Catches SPACE feeding a row's padding to the
    penalty with no count to skip: a pad id that is also a token of the answer (a tokenizer
    whose pad is another token it uses, such as EOS) was penalized as if said, and the short
    row's answer differed from plain batched generate's."""
    model = trained[0]
    _, _, b = _left_padded(trained)
    kw = dict(repetition_penalty=5.0, max_new_tokens=12)
    said = _hf(model, torch.tensor([b]), **kw)[0, len(b):].tolist()
    pad = next(t for t in said if t not in b)  # a token the short row says, not in its prompt
    ids, mask, _ = _left_padded(trained, pad=pad)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad, **kw)
    with pytest.warns(UserWarning, match="one after another"):
        out = model.generate(ids, attention_mask=mask, custom_generate=space_generate, pad_token_id=pad, **kw)
    assert torch.equal(out, ref)


def test_a_users_eos_and_max_length_criteria_stop_as_in_plain_generate(trained):
    """A ``stopping_criteria`` list with an ``EosTokenCriteria`` or ``MaxLengthCriteria`` takes the
    place of the one generate builds from the config: SPACE left them to its own eos and
    max_new_tokens and decoded on (30 tokens where plain generate stopped at 8, or at 5)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    model = trained[0]
    ids = _prompts(trained, n=1)[0]
    said = _hf(model, ids, max_new_tokens=30)[0, ids.shape[1]:].tolist()
    end = said[7]  # a token first said at position 7 or before: the run stops there
    for criteria in ([EosTokenCriteria(eos_token_id=end)], [MaxLengthCriteria(ids.shape[1] + 5)],
                     [EosTokenCriteria(eos_token_id=[end, said[2]]), MaxLengthCriteria(ids.shape[1] + 6)]):
        ref = _hf(model, ids, max_new_tokens=30, stopping_criteria=criteria)
        assert ref.shape[1] < ids.shape[1] + 30
        assert torch.equal(_space(model, ids, max_new_tokens=30, stopping_criteria=criteria), ref), criteria


def test_several_max_length_criteria_stop_at_the_shortest_as_in_plain_generate(trained):
    """Two ``MaxLengthCriteria`` given (the first takes the place of generate's own, the second is
    added): HF's loop stops at the first one met, the shorter. Catches SPACE decoding to the
    longer one (4 tokens past where plain generate stopped)."""
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model = trained[0]
    ids = _prompts(trained, n=1)[0]
    for lengths in ((9, 5), (5, 9)):
        criteria = [MaxLengthCriteria(ids.shape[1] + n) for n in lengths]
        ref = _hf(model, ids, max_new_tokens=30, stopping_criteria=criteria)
        assert ref.shape[1] == ids.shape[1] + 5
        assert torch.equal(_space(model, ids, max_new_tokens=30, stopping_criteria=criteria), ref), lengths


def test_a_users_repetition_penalty_with_a_tensor_to_skip_is_kept():
    """HF documents ``prompt_ignore_length`` as a (batch,) tensor too: the ids each row leaves out of
    the penalty (the prompt). SPACE replaced any tensor by the row's padding count (HF's own use of
    it), so a user's penalty fell on the prompt and the answer differed from plain generate's (a
    model that repeats its prompt's tokens, where penalizing them changes the answer)."""
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from space.tokens import add_mask_tokens

    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    add_mask_tokens(model, tok, mask_num=4)

    def penalty(skip):
        return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(50.0, prompt_ignore_length=skip)])

    for seed in range(3):
        ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(seed))
        as_int = _hf(model, ids, max_new_tokens=20, logits_processor=penalty(30))
        assert not torch.equal(_hf(model, ids, max_new_tokens=20, logits_processor=penalty(0)), as_int)  # it matters
        assert torch.equal(_hf(model, ids, max_new_tokens=20, logits_processor=penalty(torch.tensor([30]))), as_int)
        assert torch.equal(_space(model, ids, max_new_tokens=20, logits_processor=penalty(torch.tensor([30]))), as_int)


def test_greedy_applies_logits_processors(tiny):
    """Greedy decoding keeps the processors: repetition penalty + no_repeat_ngram_size as in HF
    (and they do change the output here)."""
    model, tok, _ = tiny
    for text in ("hello", "The quick brown fox"):
        ids = tok(text, return_tensors="pt")["input_ids"]
        kw = dict(max_new_tokens=20, repetition_penalty=3.0, no_repeat_ngram_size=1)
        ref = _hf(model, ids, **kw)
        assert not torch.equal(ref, _hf(model, ids, max_new_tokens=20))
        assert torch.equal(_space(model, ids, mask_num=3, **kw), ref), text


def test_generation_config_space_settings(trained):
    """GenerationConfig(mask_num=1) decodes with k = 1 (at most one draft accepted per step); a
    keyword argument of generate wins over it."""
    model = trained[0]
    ids = _prompts(trained, n=1)[0]
    ref = _hf(model, ids, max_new_tokens=30)
    cfg = GenerationConfig(max_new_tokens=30, do_sample=False, mask_num=1)
    out = _space(model, ids, generation_config=cfg, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and max(out.accept_lengths[0]) == 1
    out = _space(model, ids, generation_config=cfg, mask_num=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and max(out.accept_lengths[0]) > 1


def test_end_of_context_warns_and_stops_there():
    """Where plain generate warns and runs past max_position_embeddings, space_generate warns and
    stops at the context, with plain generate's tokens up to there; a full context is refused."""
    from space.tokens import add_mask_tokens

    model, tok = tiny_random_llama(seed=0, max_position_embeddings=64)
    add_mask_tokens(model, tok, mask_num=3)
    ids = torch.randint(0, 250, (1, 58), generator=torch.Generator().manual_seed(0))
    ref = _hf(model, ids, max_new_tokens=10)
    with pytest.warns(UserWarning, match="exceeds the model context 64"):
        out = _space(model, ids, max_new_tokens=10)
    assert out.shape[1] == 64 and torch.equal(out, ref[:, :64])
    full = torch.randint(0, 250, (1, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no room for a new token"):
        _space(model, full, max_new_tokens=4)


def test_flash_attention_is_refused(tiny):
    from copy import deepcopy

    model, tok, _ = tiny
    flash = deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    ids = tok("hello", return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*'sdpa'"):
        _space(flash, ids, max_new_tokens=4)


def test_right_padding_is_refused(trained):
    model, tok = trained[0], trained[1]
    ids, mask, _ = _left_padded(trained)
    with pytest.raises(ValueError, match="row 1 of attention_mask is not left padding"):
        model.generate(ids, attention_mask=mask.flip(1), custom_generate=space_generate, max_new_tokens=4,
                       pad_token_id=tok.pad_token_id)


def test_attention_mask_with_holes_is_refused(tiny):
    """A row whose attention mask has a hole (not one run of ones up to the last column) is
    refused like right padding: decoding only its ones would join tokens that were apart."""
    model, tok, _ = tiny
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 6, 0, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match="row 1 of attention_mask is not left padding"):
        model.generate(ids, attention_mask=mask, custom_generate=space_generate, max_new_tokens=4,
                       pad_token_id=tok.pad_token_id)


def test_rows_of_different_lengths_need_a_pad_id():
    """Without a pad id, rows that finished at different lengths cannot be padded: refused, not
    padded with token 0."""
    from types import SimpleNamespace

    from space.hf import _pad_outputs

    ids = torch.tensor([[5, 6], [7, 8]])
    results = [SimpleNamespace(new_ids=[1, 2, 3]), SimpleNamespace(new_ids=[4])]
    with pytest.raises(ValueError, match="no pad_token_id"):
        _pad_outputs(ids, results, None)
    assert _pad_outputs(ids, results, torch.tensor(9)).tolist() == [[5, 6, 1, 2, 3], [7, 8, 4, 9, 9]]


def test_stop_strings_in_a_generation_config(tiny):
    """``space.hf.generate`` takes stop strings from a GenerationConfig too (the tokenizer goes
    with them, which transformers does not hand a callable ``custom_generate``), stops where plain
    generate stops, and leaves the caller's config as it was."""
    from space.hf import generate

    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    full = _hf(model, ids, max_new_tokens=24)
    new = full[0, ids.shape[1]:].tolist()
    stop = tok.decode(new[:1])  # the untrained model repeats one ASCII character ('!'..'~' are ids 0..93)
    cfg = GenerationConfig(max_new_tokens=24, do_sample=False, stop_strings=[stop])
    ref = _hf(model, ids, generation_config=cfg, tokenizer=tok)
    assert new[0] <= 93 and ref.shape[1] == ids.shape[1] + 1
    out = generate(model, ids, attention_mask=torch.ones_like(ids), generation_config=cfg, tokenizer=tok, mask_num=3)
    assert torch.equal(out, ref) and cfg.stop_strings == [stop]


def test_stop_strings_in_the_models_own_generation_config(tiny):
    """Stop strings set on ``model.generation_config`` (no config passed) are moved out as those of
    a passed config are. Catches reading only a passed config: transformers then raised that it
    could not locate a tokenizer, where plain generate stops at the string."""
    from copy import deepcopy

    from space.hf import generate

    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    new = _hf(model, ids, max_new_tokens=24)[0, ids.shape[1]:].tolist()
    stop = tok.decode(new[:1])
    saved = deepcopy(model.generation_config)
    try:
        model.generation_config.stop_strings = [stop]
        model.generation_config.max_new_tokens = 24
        ref = _hf(model, ids, tokenizer=tok)
        out = generate(model, ids, attention_mask=torch.ones_like(ids), tokenizer=tok, mask_num=3, do_sample=False)
        assert torch.equal(out, ref) and ref.shape[1] == ids.shape[1] + 1
        assert model.generation_config.stop_strings == [stop]  # the model's config left as it was
    finally:
        model.generation_config = saved


def test_batch_rows_sample_with_seeds_of_their_own(tiny_varied):
    """Catches one seed for the whole batch: equal prompts, the workaround for the refused
    num_return_sequences, came back as copies (plain generate draws each row apart). Seeded from
    torch's RNG, so a call is still reproducible."""
    model, _, _ = tiny_varied
    ids = torch.tensor([[20, 30, 40, 50]] * 4)

    def draw():
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match="one after another"):
            return _space(model, ids, do_sample=True, top_k=0, max_new_tokens=12, pad_token_id=0)

    out = draw()
    assert len({tuple(row) for row in out.tolist()}) == 4 and torch.equal(out, draw())


def test_max_time_is_split_over_the_rows_of_a_batch(tiny_varied, monkeypatch):
    """Rows are decoded one after another: with one clock for the batch the first row took all of
    max_time and every later row stopped after one token. Each row now gets an even share, from
    its own start. The clock is faked (10 ms a reading): on a loaded machine one step of wall time
    took a row's whole share."""
    import itertools
    import types

    import transformers.generation.stopping_criteria as stopping
    from space.hf import _row_criteria
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    model, _, _ = tiny_varied
    ticks = itertools.count()
    monkeypatch.setattr(stopping, "time", types.SimpleNamespace(time=lambda: next(ticks) * 0.01))
    ids = torch.tensor([[20, 30, 40, 50], [21, 31, 41, 51]])
    with pytest.warns(UserWarning, match="one after another"):
        out = _space(model, ids, max_time=0.4, max_new_tokens=2000, eos_token_id=None, pad_token_id=0)
    monkeypatch.undo()  # the criteria below read the real clock
    assert out.shape[1] - ids.shape[1] < 2000  # the clock stopped it
    assert (out[1, ids.shape[1]:] != 0).sum() > 1
    [share] = _row_criteria([MaxTimeCriteria(0.4, initial_timestamp=0.0)], 2)
    assert share.max_time == 0.2 and share.initial_timestamp > 0.0


def test_max_time_stops_a_row_that_decodes_on_past_its_criteria(tiny_varied, monkeypatch):
    """Without EOS a batch's rows decode on past their criteria, but max_time still stops each (as
    HF's loop stops the batch). Catches the clock's hit only recorded as the row's stop: the rows
    were cut there afterwards, the output alike, but each decoded all of max_new_tokens first."""
    from space.decoding import SpaceDecoder

    model, _, _ = tiny_varied
    decoded = []
    generate = SpaceDecoder.generate

    def counted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        decoded.append(len(out.new_ids))
        return out

    monkeypatch.setattr(SpaceDecoder, "generate", counted)
    ids = torch.tensor([[20, 30, 40, 50], [21, 31, 41, 51]])
    with pytest.warns(UserWarning, match="one after another"):
        out = _space(model, ids, max_time=0.0, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    assert decoded == [1, 1] and out.shape[1] == ids.shape[1] + 1  # each row's clock ran out at its first token


def test_position_ids_other_than_the_default_are_refused(tiny):
    """SPACE places each row itself: other positions were accepted and ignored (plain generate
    honours them), so the output silently differed from generate's."""
    model, _, _ = tiny
    ids = torch.tensor([[20, 30, 40, 50]])
    with pytest.raises(ValueError, match="position_ids other than 0..n-1"):
        _space(model, ids, max_new_tokens=3, position_ids=torch.arange(4)[None] * 3)
    assert _space(model, ids, max_new_tokens=3, position_ids=torch.arange(4)[None]).shape == (1, 7)


def test_plain_generate_never_emits_a_mask_token_as_space_never_does(tmp_path, monkeypatch):
    """A mask token as the argmax: SPACE never emits one, and plain ``generate`` did (its argmax),
    so greedy SPACE differed from it. ``add_mask_tokens`` (and ``load_space`` for a checkpoint
    saved before) put the mask ids in the generation config's ``suppress_tokens``, beside any
    there; ``space_generate`` drops the mask ids' suppression (it costs every step the per-row
    processor path) and keeps any other."""
    from space.loader import load_space
    from space.models import TINY, load_model
    from space.tokens import add_mask_tokens

    model, tok = load_model(TINY)
    model.generation_config.suppress_tokens = [7]
    spec = add_mask_tokens(model, tok, 3)
    assert model.generation_config.suppress_tokens == sorted([7, *spec.token_ids])
    with torch.no_grad():  # the mask row of the (tied) head points along the last hidden state
        model.get_output_embeddings().weight[spec.token_ids[0]] = model.get_output_embeddings().weight[:256].sum(0) * 50
    ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert logits.argmax().item() == spec.token_ids[0]  # the precondition: a mask token would be emitted
    ref = _hf(model, ids, max_new_tokens=12)
    assert not set(ref[0, ids.shape[1]:].tolist()) & set(spec.token_ids)
    assert torch.equal(_space(model, ids, max_new_tokens=12, mask_num=3), ref)
    # the config's mask suppression sends no step down the per-row processor path (the decoder never
    # emits a mask token anyway); a suppression of another id is kept
    contexts, real = [], SpaceDecoder._contexts
    monkeypatch.setattr(SpaceDecoder, "_contexts", lambda self, *a: contexts.append(1) or real(self, *a))
    model.generation_config.suppress_tokens = list(spec.token_ids)
    assert torch.equal(_space(model, ids, max_new_tokens=12, mask_num=3), ref) and not contexts
    other = int(ref[0, ids.shape[1]])
    model.generation_config.suppress_tokens = sorted([other, *spec.token_ids])
    without = _hf(model, ids, max_new_tokens=12)
    assert without[0, ids.shape[1]] != other and torch.equal(_space(model, ids, max_new_tokens=12, mask_num=3), without)
    assert contexts
    model.generation_config.suppress_tokens = None  # as a checkpoint saved before this was
    model.save_pretrained(tmp_path / "full")
    tok.save_pretrained(tmp_path / "full")
    loaded, _, spec = load_space(str(tmp_path / "full"))
    assert loaded.generation_config.suppress_tokens == sorted(spec.token_ids)
    assert torch.equal(_hf(loaded, ids, max_new_tokens=12), ref)


def test_position_ids_are_checked_on_every_row_of_a_batch(tiny):
    """Each row of a batch is placed by SPACE itself: a later row's positions other than 0..n-1
    are refused as the first row's are, not only the first row's checked (the later rows' then
    ignored silently)."""
    model, _, _ = tiny
    ids = torch.tensor([[20, 30, 40, 50], [21, 31, 41, 51]])
    positions = torch.stack([torch.arange(4), torch.arange(4) * 3])
    with pytest.raises(ValueError, match=r"position_ids other than 0..n-1 .*\(row 1 has \[0, 3, 6, 9\]"):
        _space(model, ids, max_new_tokens=3, position_ids=positions, pad_token_id=0)


def test_a_users_repetition_penalty_tensor_gives_each_row_of_a_batch_its_own_skip():
    """A (batch,) ``prompt_ignore_length`` tensor holds one count per row: each row decoded on its
    own keeps its own count (the second row here penalizes its prompt, the first does not), as
    plain batched generate does; not the first row's count for every row."""
    from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from space.tokens import add_mask_tokens

    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    add_mask_tokens(model, tok, mask_num=4)

    def penalty(skip):
        return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(50.0, prompt_ignore_length=skip)])

    ids = torch.cat([torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(s)) for s in range(2)])
    skip = torch.tensor([30, 0])
    want = _hf(model, ids, max_new_tokens=20, logits_processor=penalty(skip), pad_token_id=0)
    assert not torch.equal(want[1], _hf(model, ids[1:], max_new_tokens=20, logits_processor=penalty(30))[0])  # it matters
    with pytest.warns(UserWarning, match="one after another"):
        got = _space(model, ids, max_new_tokens=20, logits_processor=penalty(skip), pad_token_id=0)
    assert torch.equal(got, want)


def test_a_refusal_after_the_prompt_was_streamed_ends_the_streamer(tiny):
    """generate puts the prompt into the streamer before it calls space_generate, so a refusal
    there (an option HF takes and SPACE does not) left a TextIteratorStreamer's reader waiting for
    an end that never came: the usual chat pattern (generate in a thread) hung. Ended first now."""
    from transformers import TextIteratorStreamer

    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    streamer = TextIteratorStreamer(tok, timeout=5, skip_prompt=True)
    with pytest.raises(ValueError, match="output_scores"):
        _space(model, ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, streamer=streamer)
    assert "".join(streamer) == ""  # ends at once (without the end: queue.Empty after 5 s)
    recorder = Recorder()
    _space(model, ids, max_new_tokens=4, streamer=recorder)
    assert recorder.ends == 1  # once, on success too


def test_a_streamer_with_a_batch_is_refused(trained):
    """HF gives a streamer one (batch,) tensor a step; SPACE decodes the rows one after another,
    so a batch-aware streamer read row 0's tokens as the batch's: refused (HF's own text streamers
    refuse a batch when given the prompt)."""
    model, tok = trained[0], trained[1]
    a, b = (p[0].tolist() for p in _prompts(trained, n=2))
    recorder = Recorder()
    with pytest.raises(ValueError, match="streams one prompt at a time"):
        model.generate(torch.tensor([a, b]), attention_mask=torch.ones(2, len(a), dtype=torch.long),
                       custom_generate=space_generate, max_new_tokens=4, pad_token_id=tok.pad_token_id,
                       streamer=recorder)
    assert recorder.ends == 1


class StopAfterToken:
    """A user's stopping criterion (not a StoppingCriteria subclass) that returns a Python bool,
    as HF's StoppingCriteriaList accepts: stop once the last token is ``token``."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return bool(input_ids[0, -1] == self.token) if input_ids.shape[0] == 1 else input_ids[:, -1] == self.token


def test_without_eos_a_row_stopped_by_its_criteria_decodes_on_as_in_plain_generate(trained):
    """Without an EOS criterion HF pads no row: a row whose own criteria stopped it decodes on to
    the longest row's length (SPACE padded it, or raised without a pad id). A criterion that
    returns a bool works as in HF (SPACE called .any() on it)."""
    from transformers import StoppingCriteriaList

    model, tok = trained[0], trained[1]
    prompts = [p[0].tolist() for p in _prompts(trained, n=4)]
    plain = [_hf(model, torch.tensor([row]), max_new_tokens=16, eos_token_id=None)[0, len(row):].tolist()
             for row in prompts]
    # a row b that meets the stop token early and a row a that never does
    (a, b, stop), = [(prompts[i], prompts[j], t) for i in range(4) for j in range(4) if i != j
                     for t in plain[j][1:8] if t not in plain[i]][:1]
    ids = torch.tensor([a, b])
    for pad in (tok.pad_token_id, None):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, eos_token_id=None, pad_token_id=pad,
                      stopping_criteria=StoppingCriteriaList([StopAfterToken(stop)]), do_sample=False)
        want = model.generate(ids, **kwargs)
        with pytest.warns(UserWarning, match="one after another"):
            got = model.generate(ids, custom_generate=space_generate, **kwargs)
        assert got.tolist() == want.tolist()
        assert stop in got[1, len(b):].tolist()[:8] and got.shape[1] == len(a) + 16  # b went on past its stop


def test_synced_gpus_as_generate_decides_it_is_refused(tiny, monkeypatch):
    """generate sets synced_gpus itself under ZeRO-3 or FSDP over several processes, and a callable
    custom_generate never gets it: SPACE decoded each rank on its own where HF keeps them in step
    (a deadlock). It is decided here as generate decides it, and refused."""
    import transformers.integrations.deepspeed as ds

    model, tok, _ = tiny
    ids = tok("hello", return_tensors="pt")["input_ids"]
    monkeypatch.setattr(ds, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    from space.hf import _synced_gpus

    assert _synced_gpus(model, None) and not _synced_gpus(model, False)
    # through generate itself, which never hands its synced_gpus to a callable custom_generate
    with pytest.raises(ValueError, match="synced_gpus"):
        model.generate(ids, custom_generate=space_generate, max_new_tokens=4, do_sample=False)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    assert not _synced_gpus(model, None)


class StopAtLength:
    """Stops each row after its own number of new tokens, told apart by its prompt (the first
    ``width`` ids): a batch criterion, as HF calls it with (batch, seq) ids."""

    def __init__(self, width, limits):
        self.width, self.limits = width, limits

    def __call__(self, input_ids, scores, **kwargs):
        new = input_ids.shape[1] - self.width
        return torch.tensor([new >= self.limits[tuple(row[: self.width].tolist())] for row in input_ids])


def test_without_eos_a_sampled_row_decodes_on_with_the_draws_it_makes_alone(trained):
    """Sampled, on the dynamic tree: without an EOS criterion, a row of a batch whose criterion is met
    (a after 4 tokens) goes on until the other row stops (b after 12), and its tokens are those it
    draws alone with the same seed and max_new_tokens. A second decode of the row with the shorter
    budget (12) planned other trees near its end and drew other tokens (2 of 20 seeds in a review)."""
    from transformers import StoppingCriteriaList

    model, tok = trained[0], trained[1]
    prompts = [p[0].tolist() for p in _prompts(trained, n=2)]
    a, b = prompts[0], prompts[1][: len(prompts[0])]
    stop = StoppingCriteriaList([StopAtLength(len(a), {tuple(a): 4, tuple(b): 12})])
    kwargs = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=tok.pad_token_id, do_sample=True,
                  tree="dynamic", custom_generate=space_generate)
    for seed in range(20):
        torch.manual_seed(seed)
        alone = model.generate(torch.tensor([a]), attention_mask=torch.ones(1, len(a), dtype=torch.long), **kwargs)
        torch.manual_seed(seed)
        with pytest.warns(UserWarning, match="one after another"):
            both = model.generate(torch.tensor([a, b]), attention_mask=torch.ones(2, len(a), dtype=torch.long),
                                  stopping_criteria=stop, **kwargs)
        assert both.shape[1] == len(a) + 12, seed  # the batch ends when b stops
        assert both[0].tolist() == alone[0, : len(a) + 12].tolist(), seed
