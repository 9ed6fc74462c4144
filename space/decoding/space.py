"""The SPACE auto-correct decoder: verify the last drafts and draft the next ones in one pass.

DESIGN §3.3-§3.5. Each step feeds ``[x_{n-1}] [c_1..c_m] [G_0..G_{g-1}]`` after a KV cache that
holds ``x_0..x_{n-2}``, with the layout core's 4-D mask and position ids, then

1. verifies c_1..c_m on the m+1 verification rows (greedy or exact speculative sampling),
2. emits the a accepted candidates and the bonus (auto-correct) token,
3. crops the cache to ``x_0..x_{n-1}, c_1..c_a`` (candidates come first in the block, so this is
   a crop, never a gather),
4. drafts the next candidates from group G_a (or, when G_a was not attached, from the deepest
   group by shifting: DESIGN §3.5).

The LM head runs on the m+1 verification rows, then on the chosen group's rows; or once on every
row when that wastes few rows (one read of the head's weight instead of two). Greedy output is
token-for-token the AR greedy output of the same weights.

Optional prompt lookup (``lookup_tokens``, our addition): after each step, when the last n-gram of
the text so far (prompt + output) occurred earlier, the tokens that followed it replace the mask
drafts as the next candidates (transformers' ``PromptLookupCandidateGenerator`` finds them). Any
candidates are verified the same way, so output stays exact; the mask groups are attached as usual,
so a step whose lookup fails still yields mask drafts for the next one. In sampling mode a lookup
candidate's draft distribution q is one-hot.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..masking import decode_layout, to_additive_4d
from ..tokens import MaskSpec, check_mask_num
from .result import DecodeResult, check_prompt
from .sampling import SamplingConfig, logits_to_probs, sample
from .verify import verify_greedy, verify_rejection


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Keep the first ``keep`` cached tokens (negative crop works on transformers 4.x and 5.x)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


class SpaceDecoder:
    """SPACE decoding for a HF causal LM with mask tokens (batch size 1).

    Args:
        model: a ``LlamaForCausalLM``-like model whose vocabulary contains the mask token(s) of
            ``mask`` (``space.adapters.load_space`` gives one; a peft model is unwrapped).
        mask: the model's MaskSpec (``space.tokens.mask_spec``).
        mask_num: k, candidates drafted per step (1..MAX_MASK_NUM).
        num_groups: mask groups attached per step, 1..k+1 (default k+1, the paper's layout);
            fewer groups make a step cheaper, drafts after a long accept get staler.
        lookup_tokens: 0 (default) for pure SPACE; else up to this many prompt-lookup candidates
            per step when the text's last n-gram recurs (see the module docstring).
        lookup_ngram: longest n-gram matched by prompt lookup.

    Raises:
        ValueError: k, num_groups, lookup_tokens or lookup_ngram out of range.
    """

    def __init__(self, model, mask: MaskSpec, mask_num: int = 5, num_groups: int | None = None,
                 lookup_tokens: int = 0, lookup_ngram: int = 2):
        check_mask_num(mask_num, mask)
        num_groups = mask_num + 1 if num_groups is None else num_groups
        if not 1 <= num_groups <= mask_num + 1:
            raise ValueError(f"num_groups must lie in 1..{mask_num + 1} (k+1), got {num_groups}")
        if lookup_tokens < 0 or lookup_ngram < 1:
            raise ValueError(f"lookup_tokens must be >= 0 and lookup_ngram >= 1, got {lookup_tokens}, {lookup_ngram}")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.model, self.decoder, self.head = model, base.get_decoder(), base.get_output_embeddings()
        self.mask, self.k, self.num_groups = mask, mask_num, num_groups
        self.mask_ids = mask.ids_for(mask_num)
        self.config = base.config
        self.lookup_tokens = lookup_tokens
        self.lookup = PromptLookupCandidateGenerator(
            num_output_tokens=lookup_tokens, max_matching_ngram_size=lookup_ngram,
            max_length=self.config.max_position_embeddings) if lookup_tokens else None

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 256, sampling: SamplingConfig = SamplingConfig(),
                 stop_token_ids: Iterable[int] = (),
                 on_tokens: Callable[[list[int]], None] | None = None,
                 draft_override: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ((seq,) or (1, seq)).

        Args:
            sampling: greedy when temperature is 0, else exact speculative sampling.
            stop_token_ids: generation ends after the first of these.
            on_tokens: streaming callback, called with each step's new tokens.
            draft_override: greedy only, for tests and ablations: called with (tokens generated so
                far, the model's drafts (m,)), returns the candidates (<= k ids) to verify next.
                It is applied after prompt lookup.

        Returns:
            DecodeResult with the new ids and per-step statistics.

        Raises:
            ValueError: empty prompt, batch > 1, or prompt + max_new_tokens + 2k over the context.
        """
        ids = check_prompt(input_ids, max_new_tokens, self.config.max_position_embeddings,
                           reserve=self.k + max(self.k, self.lookup_tokens))
        device = self.head.weight.device
        res = DecodeResult(ids.numel(), max_new_tokens, frozenset(stop_token_ids), on_tokens)
        gen = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
        cache = DynamicCache(config=self.config)
        t0 = time.perf_counter()
        if ids.numel() > 1:  # prefill x_0..x_{n-2}; x_{n-1} enters the first step
            self.decoder(input_ids=ids[None, :-1].to(device), past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        last = int(ids[-1])
        cands = torch.empty(0, dtype=torch.long)
        q = None  # (m, vocab) draft distributions of cands, when sampling
        seq = ids.tolist()  # prompt + output so far, for prompt lookup
        while True:
            t0 = time.perf_counter()
            last, cands, q, emitted, a = self._step(cache, last, cands, q, sampling, gen)
            if self.lookup is not None:
                seq.extend(emitted)
                cands, q = self._lookup(seq, cands, q, sampling)
            if res.emit(emitted, time.perf_counter() - t0 + prefill_s, accepted=a):
                return res
            if draft_override is not None and sampling.greedy:
                cands = torch.as_tensor(draft_override(res.new_ids, cands), dtype=torch.long)[: self.k]
            prefill_s = 0.0

    def _step(self, cache, last: int, cands: torch.Tensor, q, sampling: SamplingConfig, gen):
        """One forward pass. Returns (bonus, next candidates, their q, emitted tokens, accepted a)."""
        device = self.head.weight.device
        m, L = cands.numel(), cache.get_seq_length()
        # 1. build the layout: x_{n-1}, m candidates, groups on x_{n-1} and the first candidates
        lay = decode_layout(L, m, min(self.num_groups, m + 1), self.k)
        block = lay.input_ids(torch.cat([torch.tensor([last]), cands]), self.mask_ids).to(device)
        # 2. one forward pass of the decoder (no LM head yet)
        hidden = self.decoder(input_ids=block[None], position_ids=lay.position_ids[None].to(device),
                              attention_mask=to_additive_4d(lay.allowed, self.head.weight.dtype).to(device),
                              past_key_values=cache, use_cache=True).last_hidden_state[0]  # (q, hidden)
        # 3. verify the candidates on the m+1 verification rows. The LM head's cost is mostly one
        # read of its (vocab, hidden) weight, so when few rows would be wasted, run it once on
        # every row (drafts included) rather than twice (SmolLM2 head on a 2-core CPU: 12 ms for
        # 1 row, 27 ms for 4, 37 ms for 10)
        logits = self._logits(hidden) if lay.num_rows <= 2 * (m + 1 + self.k) else None
        target = logits[: m + 1] if logits is not None else self._logits(hidden[: m + 1])  # (m+1, vocab)
        if sampling.greedy:
            a, bonus = verify_greedy(target, cands.to(device))
        else:
            a, bonus = verify_rejection(logits_to_probs(target, sampling).cpu(), q, cands, gen)
        # 4. emit accepted + bonus; 5. crop the cache to x_{n-1}, c_1..c_a
        emitted = cands[:a].tolist() + [bonus]
        crop_cache(cache, L + 1 + a)
        # 6. next drafts from G_a, or shifted from the deepest attached group (DESIGN §3.5)
        g = min(a, lay.group_ctx.numel() - 1)
        rows = lay.group_rows(g)[a - g:].to(device)  # mask j of G_g proposes position n+g+1+j
        draft_logits = logits[rows] if logits is not None else self._logits(hidden[rows])  # (<=k, vocab)
        if not rows.numel():  # all k accepted with only G_0 attached: next step drafts afresh
            return bonus, rows, None, emitted, a
        if sampling.greedy:
            return bonus, draft_logits.argmax(-1).cpu(), None, emitted, a
        q_next = logits_to_probs(draft_logits, sampling).cpu()
        return bonus, sample(q_next, gen), q_next, emitted, a

    def _lookup(self, seq: list[int], cands: torch.Tensor, q, sampling: SamplingConfig):
        """Prompt-lookup candidates for the next step when the last n-gram recurs, else the drafts."""
        found = self.lookup.get_candidates(torch.tensor([seq]))[0][0, len(seq):]
        if not found.numel():
            return cands, q
        if sampling.greedy:
            return found, None
        return found, torch.nn.functional.one_hot(found, self.head.weight.shape[0]).float()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on selected rows only, mask tokens suppressed: (rows, hidden) -> (rows, vocab)."""
        logits = self.head(hidden).float()
        logits[:, list(self.mask.token_ids)] = float("-inf")
        return logits
