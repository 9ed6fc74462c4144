"""Instruction rows -> examples -> token ids (space.data.sft): each format's fields, malformed rows
refused with the row named, and the tokenized sample's prompt/response split the collator trains on."""
import json

import pytest

from space.data.prompts import chat_ids
from space.data.sft import data_lists, load_examples, to_example, tokenize
from space.models import tiny_tokenizer


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_alpaca_input_and_history_go_into_the_context():
    """Catches dropping the Alpaca ``input`` field (the task's data) from the question."""
    ex = to_example({"instruction": "Sum these.", "input": "1 2 3", "output": "6",
                     "history": [["hi", "hello"]]})
    assert ex.context == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "Sum these.\n\n1 2 3"}]
    assert ex.response == "6"
    assert to_example({"instruction": "Q", "input": "", "output": "A"}).context == [{"role": "user", "content": "Q"}]


def test_sharegpt_response_is_the_last_assistant_turn():
    """Catches taking the first assistant turn (or any other) as the response of a multi-turn chat:
    the earlier turns are context, the last assistant turn the target."""
    ex = to_example({"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                       {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
                                       {"from": "human", "value": "trailing question, unanswered"}]})
    assert ex.response == "a2"
    assert ex.context == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "q2"}]


@pytest.mark.parametrize("row, message", [
    ({"instruction": "q", "output": "a", "history": [["q0", "a0", "extra"]]}, "'history' must be a list of"),
    ({"instruction": "q", "output": "a", "history": [["q0"]]}, "'history' must be a list of"),
    ({"prompt": "q", "response": "  \n\t"}, "empty or non-string response"),
    ({"prompt": "q", "response": 3}, "empty or non-string response"),
    ({"prompt": [], "response": "a"}, "missing or non-string prompt"),
    ({"conversations": [{"from": "gpt", "value": "an answer to nothing"}]}, "missing or non-string prompt"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
    ({"prompt": [{"content": "q"}], "response": "a"}, "role None is not one of system, user, assistant"),
    ({"prompt": [{"role": "userr", "content": "q"}], "response": "a"}, "role 'userr' is not one of"),
    ({"prompt": ["q"], "response": "a"}, "missing or non-string prompt"),
    # silently changed before: a misspelt, missing or tool role read as the user's, "false" or 0 as
    # finished (an answer cut at the length limit then got an end of turn), None and lists as text
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gtp", "value": "a"}]}, "role 'gtp' is not one of"),
    ({"conversations": [{"value": "q"}, {"from": "gpt", "value": "a"}]}, "role None is not one of"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"},
                        {"from": "gpt", "value": "a"}]}, "role 'function_call' is not one of"),
    ({"conversations": "q"}, "'conversations' must be a list of turns"),
    ({"prompt": "q", "response": "a", "finished": "false"}, "'finished' must be true or false, got 'false'"),
    ({"prompt": "q", "response": "a", "finished": 0}, "'finished' must be true or false, got 0"),
    ({"instruction": "q", "output": "a", "history": [[None, "x"]]}, "pairs of strings"),
    ({"instruction": "q", "output": "a", "input": ["a", "b"]}, "'input' must be a string, got list"),
])
def test_malformed_rows_are_refused_naming_the_row(tmp_path, row, message):
    """Catches a dropped check: a history turn that is not a [question, answer] pair, a blank
    response (nothing to train on), a response with no prompt before it, or a prompt message
    without a chat role (the chat template failed on it with a jinja traceback after the model
    loaded, or took a misspelt role as text), each loaded silently."""
    path = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "fine", "response": "ok"}, row])
    with pytest.raises(ValueError, match=rf"rows.jsonl: row 1: .*{message}"):
        load_examples(path)


def test_a_json_file_must_hold_a_list(tmp_path):
    """Catches accepting a .json object (its keys would be read as rows)."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"prompt": "q", "response": "a"}))
    with pytest.raises(ValueError, match="rows.json: expected a JSON list of rows"):
        load_examples(str(path))


def test_a_malformed_row_is_named_by_its_line_after_the_source_filter(tmp_path):
    """Catches numbering rows after the ``sources`` filter: the error must name the row's place in
    the file (row 3), not its place among the kept rows (row 1)."""
    rows = [{"source": "lima", "prompt": "q", "response": "a"}, {"source": "mbpp", "prompt": "q", "response": "a"},
            {"source": "mbpp", "prompt": "q2", "response": "b"}, {"source": "lima", "prompt": "q3", "response": ""}]
    with pytest.raises(ValueError, match=r"rows.jsonl: row 3: empty"):
        load_examples(_jsonl(tmp_path / "rows.jsonl", rows), sources=["lima"])


def test_a_training_config_s_lists_split_as_training_reads_them():
    """Catches the splitter that space-train and space-eval's ``trained_questions`` share keeping
    blank or padded entries (a dataset named " lima"), or turning no ``sources`` into an empty
    filter (which keeps no row)."""
    assert data_lists(" mbpp , lima,,") == (["mbpp", "lima"], None)
    assert data_lists("a.jsonl", " stdlib , ,lima ") == (["a.jsonl"], ["stdlib", "lima"])
    assert data_lists(None, "") == ([], None)
    with pytest.raises(ValueError, match="names no source"):
        data_lists("a.jsonl", " , ")  # given, but blank: an empty filter would keep no row


def test_tokenize_splits_prompt_and_response_as_the_chat_template():
    """Catches a wrong ``prompt_len`` (the collator trains on the tokens after it: a short one
    trains on the prompt), input ids that are not the template's rendering of the whole chat, a wrong
    ``idx`` (it seeds the sample's spans) and an off-by-one in the truncation or in the drop of
    samples that leave their response fewer than 2 tokens."""
    tok = tiny_tokenizer()
    examples = [to_example({"prompt": "Hi", "response": "Hello there"}),
                to_example({"prompt": "x" * 200, "response": "long prompt"}),
                to_example({"prompt": "Why?", "response": "Because."})]
    data = tokenize(examples, tok, max_length=64)
    assert [row["idx"] for row in data] == [0, 2]  # the 200-byte prompt alone fills 64 tokens: dropped
    for row, ex in zip(data, [examples[0], examples[2]]):
        prompt = chat_ids(tok, ex.context)
        full = chat_ids(tok, ex.context + [{"role": "assistant", "content": ex.response}], add_generation_prompt=False)
        assert row["prompt_len"] == len(prompt) and row["input_ids"] == full
        assert tok.decode(row["input_ids"][row["prompt_len"]:]) == f"{ex.response}<|im_end|>\n"
    prompt_len = data[0]["prompt_len"]
    cut = tokenize(examples[:1], tok, max_length=prompt_len + 3)[0]  # cut inside the response
    assert cut["input_ids"] == data[0]["input_ids"][: prompt_len + 3] and cut["prompt_len"] == prompt_len
    assert len(tokenize(examples[:1], tok, max_length=prompt_len + 2)) == 1  # room for 2 tokens: kept
    assert len(tokenize(examples[:1], tok, max_length=prompt_len + 1)) == 0  # room for 1: dropped


def test_an_answer_cut_at_the_length_limit_gets_no_end_of_turn():
    """space-distill records ``finished: false`` for an answer cut at max_new_tokens (a third to
    a half of the committed self-distilled rows). Catches tokenizing it as a whole turn: the
    template's end of turn after the cut taught the masks (and in lora / full mode the model)
    to close the turn where the teacher never did."""
    tok = tiny_tokenizer()
    cut, whole = (to_example({"prompt": "Hi", "response": "Hello there", "finished": f}) for f in (False, True))
    assert not cut.finished and whole.finished and to_example({"prompt": "Hi", "response": "Hello"}).finished
    rows = tokenize([cut, whole], tok, max_length=64)
    assert tok.decode(rows[0]["input_ids"][rows[0]["prompt_len"]:]) == "Hello there"
    assert rows[1]["input_ids"][: len(rows[0]["input_ids"])] == rows[0]["input_ids"]
    assert tok.decode(rows[1]["input_ids"][rows[1]["prompt_len"]:]) == "Hello there<|im_end|>\n"
    # cut inside a multi-byte character: its bytes decoded alone gave U+FFFD, which the model never wrote
    [torn] = tokenize([to_example({"prompt": "Hi", "response": "Hello th\ufffd", "finished": False})], tok, 64)
    assert tok.decode(torn["input_ids"][torn["prompt_len"]:]) == "Hello th"
    # a template that ends a turn with a token other than EOS (Llama-3's <|eot_id|>): cut there too
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}" \
                        "{% if add_generation_prompt %}assistant: {% endif %}"
    rows = tokenize([cut, whole], tok, max_length=64)
    assert tok.decode(rows[0]["input_ids"][rows[0]["prompt_len"]:]) == "Hello there"
    assert tok.decode(rows[1]["input_ids"][rows[1]["prompt_len"]:]) == "Hello there<|eot_id|>"


def test_tokenize_falls_back_when_the_template_rerenders_the_prompt():
    """A template that renders the prompt differently once an answer follows it (here: a system
    line only with the generation prompt): the sample is the prompt as generation sees it, the
    response and EOS. Catches inverting the prefix check (or dropping the fallback)."""
    tok = tiny_tokenizer()
    tok.chat_template = ("{% if add_generation_prompt %}sys\n{% endif %}{% for m in messages %}"
                         "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    ex = to_example({"prompt": "Hi", "response": "Hello"})
    [row] = tokenize([ex], tok, max_length=64)
    prompt = chat_ids(tok, ex.context)
    assert tok.decode(prompt) == "sys\nuser: Hi\nassistant: "
    assert row["prompt_len"] == len(prompt)
    assert row["input_ids"] == prompt + tok("Hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_conversation_the_chat_template_refuses_names_its_example():
    """A template that enforces alternating roles (Mistral-Instruct's, Llama-2-chat's) raises a jinja2
    TemplateError on two user turns in a row: it escaped tokenize and the CLI's error handling as a
    traceback on every rank. Now a ValueError naming the example (the CLI's one line, exit 2)."""
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}"
                         "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    good = to_example({"prompt": "Hi", "response": "Hello"})
    bad = to_example({"prompt": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "response": "c"})
    assert len(tokenize([good], tok, max_length=64)) == 1
    with pytest.raises(ValueError, match=r"training example 1: the tokenizer's chat template refused .*alternate"):
        tokenize([good, bad], tok, max_length=64)


@pytest.mark.parametrize("response", ["  two spaces", "\ndef f(): pass", " def f(): pass", "\tx = 1"])
def test_without_a_chat_template_every_answer_ends_with_eos(response):
    """A base checkpoint without a chat template: chat_ids writes "role: content" lines, whose end
    of turn is a newline. Catches EOS only on the rows whose first characters happened to merge
    with the prompt's last token (the fallback's branch): the model never learned to stop."""
    tok = tiny_tokenizer()
    tok.chat_template = None
    ex = to_example({"prompt": "Hi", "response": response})
    [row] = tokenize([ex], tok, max_length=64)
    prompt = chat_ids(tok, ex.context)
    assert row["input_ids"] == prompt + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _merging_tokenizer():
    """The byte-level tiny tokenizer with one merge, two newlines into one token ("ĊĊ"), so a text
    has two spellings, as in SmolLM2, whose answers retokenized split 7-18 % differently."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer()
    vocab = {t: i for t, i in base.get_vocab().items() if i < 256}
    vocab["ĊĊ"] = 256
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = base.chat_template
    return tok


def test_a_distilled_answer_trains_on_the_model_s_own_token_ids():
    """space-distill stores the generated ids beside the text. Catches training on the text
    tokenized again (the merged "ĊĊ" where the model generated two "Ċ"), a finished answer
    without the EOS its generation stopped at (or with the template's text after it), an EOS
    after an unfinished one, a cut character's byte dropped from the ids, and ids that do not
    spell the text in this tokenizer (another model's) used instead of the text; and the tokenizer's
    EOS after an answer that ended at another end id (``stop_id``: Llama-3-Instruct's ``<|eot_id|>``),
    or a bad ``stop_id`` accepted."""
    tok = _merging_tokenizer()
    nl, a, b = tok.convert_tokens_to_ids(["Ċ", "a", "b"])
    assert tok("a\n\nb", add_special_tokens=False)["input_ids"] == [a, 256, b]  # the text's own spelling
    generated = [a, nl, nl, b]  # what the model generated: the same text, spelt otherwise
    rows = [{"prompt": "Hi", "response": "a\n\nb", "response_ids": generated},
            {"prompt": "Hi", "response": "a\n\nb", "response_ids": generated, "finished": False},
            # cut inside "é" (bytes C3 A9): the text lost the byte, the ids keep what was generated
            {"prompt": "Hi", "response": "a", "response_ids": [a, tok.convert_tokens_to_ids("Ã")], "finished": False},
            {"prompt": "Hi", "response": "a\n\nb", "response_ids": [b, nl, nl, a]},  # another tokenizer's ids
            {"prompt": "Hi", "response": "a\n\nb", "response_ids": [a, 10_000]},  # outside the vocabulary
            {"prompt": "Hi", "response": "a\n\nb"},
            {"prompt": "Hi", "response": "a\n\nb", "response_ids": generated, "stop_id": nl}]  # ended at "Ċ"
    data = tokenize([to_example(r) for r in rows], tok, max_length=64)
    prompt = chat_ids(tok, [{"role": "user", "content": "Hi"}])
    assert all(row["prompt_len"] == len(prompt) for row in data)
    assert data[0]["input_ids"] == prompt + generated + [tok.eos_token_id]
    assert data[1]["input_ids"] == prompt + generated
    assert data[2]["input_ids"] == prompt + rows[2]["response_ids"]
    text_spelling = chat_ids(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a\n\nb"}],
                             add_generation_prompt=False)
    assert data[3]["input_ids"] == data[4]["input_ids"] == data[5]["input_ids"] == text_spelling
    assert data[6]["input_ids"] == prompt + generated + [nl]
    assert data["own_ids"] == [True, True, True, False, False, False, True]
    for bad in ({"stop_id": "2"}, {"stop_id": True}, {"stop_id": 2, "finished": False}):
        with pytest.raises(ValueError, match="'stop_id' must be"):
            to_example({"prompt": "Hi", "response": "a", **bad})


def test_an_id_at_the_tokenizer_s_length_is_not_an_own_id():
    """Ids run 0..len(tokenizer) - 1. The decode drops an id it does not know, so ids that end
    in len(tokenizer) still spell the text: only the range check keeps them out. Catches an
    off-by-one there: the sample trained on an id that names no token of the tokenizer."""
    tok = _merging_tokenizer()
    nl, a, b = tok.convert_tokens_to_ids(["Ċ", "a", "b"])
    generated = [a, nl, nl, b]
    rows = [{"prompt": "Hi", "response": "a\n\nb", "response_ids": generated},
            {"prompt": "Hi", "response": "a\n\nb", "response_ids": generated + [len(tok)]}]
    assert tok.decode(rows[1]["response_ids"], skip_special_tokens=True) == "a\n\nb"
    data = tokenize([to_example(r) for r in rows], tok, max_length=64)
    assert data["own_ids"] == [True, False]
    assert max(data[1]["input_ids"]) < len(tok)


@pytest.mark.parametrize("ids", ["[1, 2]", [], [1.0, 2.0], [True, 2], [[1], 2]])
def test_malformed_response_ids_are_refused(tmp_path, ids):
    """Catches response_ids that are not a list of integers loaded and used as tokens."""
    path = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "q", "response": "a", "response_ids": ids}])
    with pytest.raises(ValueError, match="rows.jsonl: row 0: 'response_ids' must be a non-empty list of token ids"):
        load_examples(path)
