"""Per-generation statistics (space/decoding/result.py): what a step emitted after an EOS or
max_new_tokens cut, steps, tokens/step and tokens/s, from hand-fed steps (no model runs)."""
import pytest

from space.decoding.result import DecodeResult, StopDecoding


def test_space_steps_count_the_first_step_and_the_cut_tokens():
    """MAT = new tokens / steps with the first step counted (it was left out: 3.00 for 2.00), and a
    step cut by EOS records the tokens it emitted, EOS included (not the tokens it was given)."""
    r = DecodeResult(prompt_len=3, max_new_tokens=10, stop_token_ids=frozenset({99}))
    assert not r.emit([5], 0.5, accepted=0, candidates=0)  # first step: no candidate yet
    assert not r.emit([6, 7, 8], 0.25, accepted=2, candidates=3)
    assert r.emit([9, 99, 4], 0.25, accepted=2, candidates=3)  # EOS second: the 4 is dropped
    assert r.new_ids == [5, 6, 7, 8, 9, 99] and r.step_tokens == [1, 3, 2] and r.stop_reason == "eos"
    assert r.num_steps == 3 and r.tokens_per_step == pytest.approx(2.0)


def test_ar_steps_and_tokens_per_s_include_the_prefill_step():
    """AR steps carry no accept length but are steps all the same; tokens/s is over every step's
    time, the first one's prefill included (without it AR read 2x faster here); max_new_tokens
    cuts the last step."""
    r = DecodeResult(prompt_len=3, max_new_tokens=3, stop_token_ids=frozenset())
    assert not r.emit([5], 1.0)  # the prefill and the first token
    assert not r.emit([6], 0.5)
    assert r.emit([7, 8], 0.5)  # only one more fits
    assert r.new_ids == [5, 6, 7] and r.step_tokens == [1, 1, 1] and r.stop_reason == "length"
    assert r.num_steps == 3 and r.tokens_per_step == pytest.approx(1.0)
    assert r.wall_time == pytest.approx(2.0) and r.tokens_per_s == pytest.approx(1.5)


def test_stop_decoding_that_keeps_the_whole_step_still_stops():
    """on_tokens raising StopDecoding(keep=len(tokens)) drops nothing but ends generation (a stop
    string completed by a step's last token); the generation ran on when only a drop stopped it."""
    def stop(tokens):
        raise StopDecoding(len(tokens))

    r = DecodeResult(prompt_len=3, max_new_tokens=10, stop_token_ids=frozenset(), on_tokens=stop)
    assert r.emit([5, 6], 0.1, accepted=1, candidates=1)
    assert r.new_ids == [5, 6] and r.step_tokens == [2] and r.stop_reason == "stop"


def test_a_stop_token_on_the_last_allowed_token_is_an_eos_stop():
    """A step whose stop token is also the max_new_tokens-th token stopped on EOS: stop_reason
    "eos", not "length" (the length check overwrote the reason found in the same step)."""
    r = DecodeResult(prompt_len=3, max_new_tokens=4, stop_token_ids=frozenset({99}))
    assert not r.emit([5, 6], 0.1, accepted=1, candidates=1)
    assert r.emit([7, 99, 8], 0.1, accepted=2, candidates=2)
    assert r.new_ids == [5, 6, 7, 99] and r.stop_reason == "eos"
    r = DecodeResult(prompt_len=3, max_new_tokens=2, stop_token_ids=frozenset({99}))
    assert r.emit([5, 6, 99], 0.1) and r.new_ids == [5, 6] and r.stop_reason == "length"  # cut before the EOS


def test_check_prompt_refuses_no_new_token_and_accepts_a_full_context():
    """max_new_tokens must be >= 1 (0 generated nothing and reported a "length" stop), and a
    prompt + max_new_tokens of exactly the context fits."""
    from space.decoding.result import check_prompt

    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_new_tokens must be >= 1, got {bad}"):
            check_prompt([1, 2, 3], bad, 16)
    assert check_prompt([[1, 2, 3]], 13, 16).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"= 17 exceeds the model context 16"):
        check_prompt([1, 2, 3], 14, 16)


def test_check_prompt_refuses_a_non_integer_length_and_ids_outside_the_vocabulary():
    """Catches each reaching the model: ``max_new_tokens=2.5`` failed inside the cache code,
    ``True`` ran as 1, and an id past the vocabulary raised an embedding's IndexError on a CPU (a
    device-side assert on a GPU, after which the process's CUDA state is broken)."""
    from space.decoding.result import check_prompt

    for bad in (2.5, True, "3"):
        with pytest.raises(ValueError, match=f"max_new_tokens must be an integer, got {bad!r}"):
            check_prompt([1, 2, 3], bad, 16)
    for ids, bad in (([1, 20, 3], 20), ([1, -1], -1)):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the model's vocabulary \[0, 20\)"):
            check_prompt(ids, 4, 16, vocab=20)
    assert check_prompt([0, 19], 4, 16, vocab=20).tolist() == [0, 19]


def test_check_prompt_names_a_wrong_shape_and_ids_that_are_not_integers():
    """A one-token 0-D prompt and a 3-D one were called "empty", and float ids were truncated
    silently ([1.9, 2.7] decoded [1, 2])."""
    import torch

    from space.decoding.result import check_prompt

    for ids, shape in ((torch.tensor(65), r"\(\)"), (torch.tensor([[[65, 66]]]), r"\(1, 1, 2\)")):
        with pytest.raises(ValueError, match=rf"prompt ids must be \(seq,\) or \(1, seq\), got shape {shape}"):
            check_prompt(ids, 4, 16)
    for ids in ([1.9, 2.7], torch.tensor([1.0]), torch.tensor([True])):
        with pytest.raises(ValueError, match="prompt ids must be integers, got torch"):
            check_prompt(ids, 4, 16)
    with pytest.raises(ValueError, match="empty prompt"):
        check_prompt([], 4, 16)
    assert check_prompt(torch.tensor([3, 4], dtype=torch.int32), 4, 16).dtype == torch.long


def test_stop_ids_given_as_a_tensor_stop_the_generation(tiny):
    """Catches a frozenset of the given ids: a tensor's elements hash by identity, so
    ``5 in frozenset(torch.tensor([5]))`` is False and the generation ran to max_new_tokens."""
    import torch

    from space.decoding import DecodeConfig, SpaceDecoder, ar_generate

    model, _, spec = tiny
    prompt = torch.arange(11, 20)
    free = ar_generate(model, prompt, 8, suppress_ids=spec.token_ids).new_ids
    stop = free[3]
    want = free[: free.index(stop) + 1]
    decoder = SpaceDecoder(model, spec, DecodeConfig(3))
    # a bare int, as HF's eos_token_id takes it, failed with "'int' object is not iterable"
    import numpy as np

    for given in (torch.tensor([stop, 7]), [torch.tensor(stop)], torch.tensor(stop), stop, [np.array(stop)],
                  (np.int64(stop),), {stop}):
        assert ar_generate(model, prompt, 8, suppress_ids=spec.token_ids, stop_token_ids=given).new_ids == want
        assert decoder.generate(prompt, 8, stop_token_ids=given).new_ids == want


def test_stop_ids_as_text_or_non_integers_are_refused_and_none_means_no_stop(tiny):
    """A string was read one character at a time (``"67"`` stopped at token 6), a float was cut to
    an int (6.7 stopped at 6), and None failed as 'not iterable'; a bare SamplingConfig's
    temperature in its place failed as an AttributeError deep in the decoder."""
    import torch

    from space.decoding import DecodeConfig, SpaceDecoder, ar_generate

    model, _, spec = tiny
    prompt = torch.arange(11, 20)
    free = ar_generate(model, prompt, 8, suppress_ids=spec.token_ids).new_ids
    decoder = SpaceDecoder(model, spec, DecodeConfig(3))
    for generate in (lambda **kw: ar_generate(model, prompt, 8, suppress_ids=spec.token_ids, **kw),
                     lambda **kw: decoder.generate(prompt, 8, **kw)):
        assert generate(stop_token_ids=None).new_ids == free
        with pytest.raises(TypeError, match="stop_token_ids must be token ids \\(ints\\), got the text '67'"):
            generate(stop_token_ids="67")
        with pytest.raises(TypeError, match=r"got \[6.7\]"):
            generate(stop_token_ids=[free[0], 6.7])
        with pytest.raises(TypeError, match=r"got \[True\]"):
            generate(stop_token_ids=[True])
        with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
            generate(sampling=0.7)


def test_ar_step_times_are_per_step_not_cumulative(tiny, monkeypatch):
    """ar_generate times each step from its own start (a clock read once before the loop made
    step_times cumulative, so tokens/s fell with length). A fake clock that ticks 1 s per read
    gives exactly 1 s per step."""
    import itertools

    import torch

    import space.decoding.autoregressive as ar_mod

    model, _, spec = tiny
    ticks = itertools.count()
    monkeypatch.setattr(ar_mod, "clock", lambda device: float(next(ticks)))
    out = ar_mod.ar_generate(model, torch.arange(11, 20), 5, suppress_ids=spec.token_ids)
    assert len(out.new_ids) == 5 and out.step_times == [1.0] * 5


def test_ar_refuses_a_prompt_id_outside_the_vocabulary(tiny):
    """AR checks the prompt's ids against the LM head's rows as SPACE does: an id at the vocabulary
    size is a ValueError naming it, not an embedding's IndexError (a device-side assert on a GPU)."""
    import torch

    from space.decoding import DecodeConfig, SpaceDecoder, ar_generate

    model, _, spec = tiny
    vocab = model.get_output_embeddings().weight.shape[0]
    for bad in (vocab, -1):
        prompt = torch.tensor([5, bad, 7])
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the model's vocabulary \[0, {vocab}\)"):
            ar_generate(model, prompt, 4, suppress_ids=spec.token_ids)
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the model's vocabulary \[0, {vocab}\)"):
            SpaceDecoder(model, spec, DecodeConfig(3)).generate(prompt, 4)
