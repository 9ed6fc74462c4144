"""space-chat: an interactive multi-turn chat that decodes with SPACE and streams its replies.

    space-chat                                      # SmolLM2 + the shipped adapter, greedy
    space-chat --compare --max-new-tokens 128       # also time an AR replay of every reply
    echo "Write a haiku" | space-chat               # a pipe: replies and status lines, exits at EOF
    space-chat --model tiny-random-llama --adapter none

After each reply one status line: new tokens, tokens/s (prefill included), tokens/step (target
forward passes, first step counted), and with ``--compare`` the speedup over an AR replay of the
same turn (``ar_generate``, same weights, same number of tokens; greedy replays must give the same
tokens, and the line says so if they do not). ``/reset`` clears the history, ``/quit`` or EOF
exits. Ctrl-C stops the reply being decoded and keeps the part already shown in the history (the
model sees what the user saw); at the prompt it only cancels the line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .choices import STEP_COST_CHOICES
from .cli import add_debug_flag, add_threads_flag, check_number, console, device_flag, set_threads

if TYPE_CHECKING:
    from .decoding import DecodeResult, SamplingConfig, SpaceDecoder

SHIPPED_ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-space"
COMMANDS = "/reset clears the history, /quit (or EOF) exits, Ctrl-C stops a reply"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="space-chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="alias (space.models.ALIASES) or local HF directory, e.g. a full "
                   "SAR-SFT checkpoint with its tuned layout (default: the shipped adapter's base, "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", default=None, help="SPACE adapter directory, or 'none' (default: the shipped "
                   "adapter when --model is not given, else none)")
    p.add_argument("--mask-num", type=int, default=None, help="k drafts per step (default: the adapter's layout)")
    p.add_argument("--num-groups", type=int, default=None, help="mask groups per step, 1..k+1 (default: the "
                   "adapter's layout)")
    p.add_argument("--lookup-tokens", type=int, default=None, help="prompt-lookup candidates per step (default: "
                   "the adapter's layout)")
    p.add_argument("--lookup-branches", type=int, default=None, help="dynamic tree: most prompt-lookup "
                   "continuations per step, the first occurrence's then the most recent others' (default: the "
                   "adapter's layout)")
    p.add_argument("--datastore", default=None, help="dynamic tree with lookup: comma list of space-distill sets "
                   "whose answers are a datastore, their continuations of the text's last 3 tokens more branches "
                   "(space.decoding.datastore; default: none)")
    p.add_argument("--datastore-branches", type=int, default=None, help="with --datastore: most datastore "
                   "continuations per step (default: 1)")
    p.add_argument("--tree", default=None, help="'chain', 'auto' (the adapter's tuned tree), 'dynamic' (chosen each step) or a token tree "
                   "as JSON paths of ranks (default: the adapter's layout)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact: the AR reply) "
                   "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first turn, +1 per turn "
                   "(default: %(default)s)")
    p.add_argument("--compare", action="store_true", help="time an AR replay of each reply and print the speedup")
    p.add_argument("--kernels", default="fast", help="CPU kernels, fast or stock (space/cpu_kernels.py; "
                   "default: %(default)s)")
    p.add_argument("--step-cost", default="auto", choices=STEP_COST_CHOICES,
                   help="what prices a dynamic tree's rows: stored (the adapter's curve for this setup), "
                        "measure (this machine's steps timed at load, a few seconds), auto: measure on a CUDA GPU "
                        "when the adapter stores no curve of that device, else stored (default: %(default)s)")
    add_threads_flag(p)
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N or mps; auto = cuda when "
                   "a CUDA GPU is usable, else cpu (printed at start) (default: auto)")
    add_debug_flag(p)
    return p


def check_args(args) -> None:
    """Every flag's range, before the model loads.

    Raises:
        ValueError: a count below 1 (below 0 for --lookup-tokens), a --temperature that is not a
            finite number >= 0, a --top-p outside (0, 1], an unknown --kernels or --device,
            --threads below 1, a bad --tree (a rank past the vocabulary too), or --datastore-branches
            without --datastore.
    """
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--mask-num", args.mask_num, 1),
                               ("--num-groups", args.num_groups, 1), ("--lookup-tokens", args.lookup_tokens, 0),
                               ("--lookup-branches", args.lookup_branches, 1),
                               ("--datastore-branches", args.datastore_branches, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.datastore_branches is not None and not args.datastore:
        raise ValueError("--datastore-branches counts the continuations of a --datastore: give one")
    import torch

    check_number("--temperature", args.temperature, 0, torch.finfo(torch.float32).max)  # inf in float32 logits
    if not 0 < args.top_p <= 1:  # NaN fails too
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
    from .choices import KERNEL_CHOICES
    from .decoding.tree import tree_flag
    from .eval.probe import check_tree_vocab
    from .tokens import MAX_MASK_NUM

    if args.kernels not in KERNEL_CHOICES:
        raise ValueError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {args.kernels!r}")
    set_threads(args.threads)
    args.device = device_flag(args.device)
    tree = tree_flag(args.tree, args.mask_num or MAX_MASK_NUM)  # a non-UTF-8 tree file is a ValueError there
    if tree not in (None, "chain", "dynamic"):
        check_tree_vocab(tree, args.model, adapter_path(args))


def turn_seed(seed: int, turn: int) -> int:
    """Turn ``turn``'s sampling seed: ``seed + turn`` wrapped into the generator's 0..2**64-1, so a
    first seed near the top (``--seed`` takes the whole range) does not fail every later turn."""
    return (seed + turn) % 2**64


class Chat:
    """One conversation: the model, its decoder, the history and the per-turn settings.

    Args:
        model, tokenizer, decoder: from :func:`load`.
        sampling: the first turn's settings; turn t uses seed ``sampling.seed + t`` (mod 2**64,
            :func:`turn_seed`).
        max_new_tokens: longest reply.
        out: the text stream replies are streamed to (status lines are printed by :func:`main`).
    """

    def __init__(self, model, tokenizer, decoder: SpaceDecoder, sampling: SamplingConfig, max_new_tokens: int,
                 out=sys.stdout):
        from .models import stop_ids

        self.model, self.tok, self.decoder, self.out = model, tokenizer, decoder, out
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.messages: list[dict] = []
        self.turn = 0
        self.stop_ids = stop_ids(model, tokenizer)  # as space-eval stops

    def reply(self, text: str) -> tuple[list[int], DecodeResult | None, bool]:
        """Add the user's ``text``, stream the reply, keep it in the history.

        Returns:
            (prompt ids, the DecodeResult or None when interrupted, interrupted).

        Raises:
            ValueError: history + max_new_tokens over the context (the user message is dropped).
        """
        import torch

        from .data.prompts import chat_ids
        from .decoding import SamplingConfig

        self.messages.append({"role": "user", "content": text})
        prompt = chat_ids(self.tok, self.messages)
        sampling = SamplingConfig(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p,
                                  turn_seed(self.sampling.seed, self.turn))
        self.turn += 1
        streamer = _streamer(self.tok, self.out)
        new: list[int] = []  # what was streamed, kept when Ctrl-C stops the reply

        def on_tokens(tokens: list[int]) -> None:
            new.extend(tokens)
            streamer.put(torch.tensor(tokens))

        result, interrupted = None, False
        try:
            result = self.decoder.generate(torch.tensor(prompt), self.max_new_tokens, sampling, self.stop_ids,
                                           on_tokens=on_tokens)
        except KeyboardInterrupt:
            interrupted = True
        except ValueError:  # raised before any token: the prompt does not fit
            self.messages.pop()
            raise
        streamer.end()
        reply = self.tok.decode(new, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        return prompt, result, interrupted

    def replay(self, prompt: list[int], result: DecodeResult) -> tuple[float, bool | None]:
        """AR decoding of the same turn, as many tokens: (AR tokens/s, whether it gave the same
        tokens; None when sampling, where a replay draws other tokens)."""
        import torch

        from .decoding import SamplingConfig, ar_generate

        sampling = SamplingConfig(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p,
                                  turn_seed(self.sampling.seed, self.turn - 1))
        ar = ar_generate(self.model, torch.tensor(prompt), len(result.new_ids), sampling, self.stop_ids,
                         self.decoder.mask.token_ids)
        return ar.tokens_per_s, (ar.new_ids == result.new_ids) if sampling.greedy else None

    def reset(self) -> None:
        self.messages.clear()


def _streamer(tokenizer, out):
    """transformers' incremental detokenizer (prints whole words, holds incomplete characters),
    writing to ``out`` instead of stdout; the prompt is never put, so nothing is skipped."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return Streamer(tokenizer, skip_prompt=False, skip_special_tokens=True)


def status_line(result: DecodeResult, ar: tuple[float, bool | None] | None = None) -> str:
    """``[n tokens, x tokens/s, y tokens/step(, z.zzx vs AR)]``; ``ar`` = (AR tokens/s, whether a
    greedy replay gave the same tokens, None when sampling)."""
    parts = [f"{len(result.new_ids)} tokens", f"{result.tokens_per_s:.1f} tokens/s",
             f"{result.tokens_per_step:.2f} tokens/step"]
    if ar is not None:
        ar_speed, same = ar
        parts.append(f"{result.tokens_per_s / max(ar_speed, 1e-9):.2f}x vs AR ({ar_speed:.1f} tokens/s)")
        if same is False:
            parts.append("AR replay gave other tokens")
    return "[" + ", ".join(parts) + "]"


def adapter_path(args) -> str | Path | None:
    """The adapter the flags select: --adapter, else the shipped one when --model is not given;
    None for 'none'."""
    adapter = args.adapter if args.adapter is not None else (SHIPPED_ADAPTER if args.model is None else "none")
    return None if str(adapter).lower() == "none" else adapter


def load(args) -> tuple:
    """(model, tokenizer, decoder) from the parsed flags; the adapter's layout, flags on top, a dynamic
    tree priced as ``--step-cost`` says (``space.eval.step_cost.price_at_load``).

    Raises:
        ValueError: ``--step-cost measure`` with a static layout; a ``--datastore`` with a layout that
            cannot take it (not a dynamic tree with lookup) or that is not a distilled set; as
            ``space.loader.load_space``.
        FileNotFoundError: a ``--datastore`` set is missing.
    """
    import torch

    from .artifact import SPACE_CONFIG, artifact_folder, priced_for_setup, read_space_config
    from .decoding import DEFAULT_MASK_NUM, DecodeConfig, SpaceDecoder
    from .eval.step_cost import price_at_load, trunk_dtype
    from .loader import load_space
    from .models import model_gpu

    # the kernels at load: a dynamic tree is priced by the adapter's curve for these kernels and threads
    adapter = adapter_path(args)
    model, tok, spec = load_space(args.model, adapter, args.mask_num or DEFAULT_MASK_NUM,
                                  device=args.device, kernels=args.kernels, step_cost="stored")  # priced below
    decode = DecodeConfig.of_model(model, spec.mask_num).with_flags(args)
    datastore = None
    if args.datastore:
        from .decoding.datastore import Datastore

        datastore = Datastore.from_sets(args.datastore, tok)
    # which stored curve priced it (None: none of this setup), for auto to tell whether to measure
    folder = artifact_folder(args.model, adapter)  # the adapter, or a full SAR-SFT checkpoint
    cfg = read_space_config(folder) if folder is not None else {}
    setup = priced_for_setup(decode, cfg, torch.get_num_threads(), args.kernels, Path(folder or ".") / SPACE_CONFIG,
                             next(model.parameters()).device.type, gpu=model_gpu(model), dtype=trunk_dtype(model))[1]
    decode, setup = price_at_load(model, decode, setup, args.step_cost, args.kernels, tool="space-chat")
    if decode.tree == "dynamic":  # priced by another setup's curve: said, as space-eval says it
        from .eval.step_cost import warn_step_cost_mismatch

        warn_step_cost_mismatch(setup, model, torch.get_num_threads(), args.kernels)
    return model, tok, SpaceDecoder(model, spec, decode, datastore=datastore)


def read_line(interactive: bool) -> str | None:
    """The next user line (None at EOF); Ctrl-C at the prompt gives an empty line."""
    try:
        return input("you> ") if interactive else (sys.stdin.readline() or None)
    except EOFError:
        return None
    except KeyboardInterrupt:
        print()
        return ""


def main(argv: list[str] | None = None) -> None:
    """Run the chat until /quit or EOF.

    Raises:
        ValueError, FileNotFoundError: bad flags (:func:`check_args`), unknown model or adapter,
            ``--max-new-tokens`` that fills the model's context (before the first turn).
    """
    args = build_parser().parse_args(argv)
    check_args(args)
    from .decoding import SamplingConfig

    # a line of bytes that are not UTF-8 becomes text with U+FFFD, not a crash (input() reads this too)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")
    sampling = SamplingConfig(args.temperature, top_p=args.top_p, seed=args.seed)
    model, tok, decoder = load(args)
    if args.max_new_tokens >= decoder.context:  # every turn failed, /reset included
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model "
                         f"context of {decoder.context} tokens")
    chat = Chat(model, tok, decoder, sampling, args.max_new_tokens)
    interactive = sys.stdin.isatty()
    print(f"space-chat: {decoder.config} on {args.device}, {'greedy' if sampling.greedy else 'sampling'}; {COMMANDS}",
          file=sys.stderr, flush=True)
    while (line := read_line(interactive)) is not None:
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            chat.reset()
            print("[history cleared]", flush=True)
            continue
        if not text:
            continue
        try:
            prompt, result, interrupted = chat.reply(text)
            if interrupted:
                print("[interrupted: the partial reply is kept]", flush=True)
                continue
            ar = chat.replay(prompt, result) if args.compare else None
            print(status_line(result, ar), flush=True)
        except ValueError as e:  # the history outgrew the context: say so, keep the chat alive
            print(f"[error: {e}; /reset to start over]", flush=True)
        except KeyboardInterrupt:  # Ctrl-C outside the decoding loop (AR replay, printing)
            print("\n[interrupted]", flush=True)


cli = console("space-chat", main)

if __name__ == "__main__":
    cli()
