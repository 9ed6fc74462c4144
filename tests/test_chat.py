"""space-chat: replies and status lines through a pipe; Ctrl-C under tmux stops a reply, not the chat."""
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from space.chat import Chat, cli
from space.data.prompts import chat_ids
from space.decoding import SamplingConfig, SpaceDecoder
from space.decoding.config import DEFAULT_MASK_NUM
from space.choices import SMOLLM2
from space.loader import load_space

# these tests decode tiny-random-llama without an adapter on purpose: its untrained-mask warning
# (space.loader.load_space) is expected here; tests/test_load_space.py checks it with pytest.warns
pytestmark = pytest.mark.filterwarnings("ignore:tiny-random-llama has no SPACE mask token:UserWarning")

ROOT = Path(__file__).resolve().parents[1]
# stock kernels and one thread: the reference below decodes with the same numerics in this process
CHAT = [sys.executable, "-m", "space.chat", "--model", "tiny-random-llama", "--adapter", "none",
        "--kernels", "stock", "--threads", "1"]
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


def reference_replies(turns: list[str], max_new: int, temperature: float, seed: int) -> list[tuple[str, int] | None]:
    """What the chat must print per input line: (reply text, new tokens), None after /reset.
    Turn t samples with seed + t, and every turn sees the history since the last /reset."""
    model, tok, spec = load_space("tiny-random-llama", None, DEFAULT_MASK_NUM)
    decoder = SpaceDecoder(model, spec)
    stop = sorted({tok.eos_token_id, model.generation_config.eos_token_id} - {None})
    messages, out, turn = [], [], 0
    for text in turns:
        if text == "/reset":
            messages = []
            out.append(None)
            continue
        messages.append({"role": "user", "content": text})
        res = decoder.generate(torch.tensor(chat_ids(tok, messages)), max_new,
                               SamplingConfig(temperature, seed=seed + turn), stop)
        turn += 1
        reply = tok.decode(res.new_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        out.append((reply, len(res.new_ids)))
    return out


def test_pipe_two_turns_reset_and_status_lines():
    """Both replies (as the decoder gives them with the chat's seeds and history), /reset, and
    after each reply one status line: tokens, tokens/s, tokens/step, speedup over the AR replay.
    (The tiny random model barely reads its history: test_history_... checks the history.)"""
    turns = ["hello", "and then?", "/reset", "hello"]
    run = subprocess.run(CHAT + ["--max-new-tokens", "12", "--temperature", "1", "--seed", "3", "--compare"],
                         input="\n".join(turns + [""]).encode(), capture_output=True, cwd=ROOT, env=ENV,
                         timeout=300)
    stdout, stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    pattern = ""
    for item in reference_replies(turns, 12, 1.0, 3):
        if item is None:
            pattern += re.escape("[history cleared]\n")
            continue
        reply, n = item
        pattern += (re.escape(reply + "\n") + rf"\[{n} tokens, [\d.]+ tokens/s, [\d.]+ tokens/step, "
                    rf"[\d.]+x vs AR \([\d.]+ tokens/s\)\]\n")
    assert re.fullmatch(pattern, stdout), stdout


class InterruptingOut(io.StringIO):
    """A terminal whose user presses Ctrl-C once, after the reply's first printed words."""

    pressed = False

    def write(self, text):
        super().write(text)
        if text and not self.pressed:
            self.pressed = True
            raise KeyboardInterrupt


def test_history_and_interrupted_reply_kept():
    """The second prompt holds the first turn; a reply stopped by Ctrl-C keeps what was shown;
    /reset empties the history."""
    model, tok, spec = load_space("tiny-random-llama", None, 3)
    chat = Chat(model, tok, SpaceDecoder(model, spec), SamplingConfig(1.0, seed=5), 10, out=io.StringIO())
    _, first, interrupted = chat.reply("hello")
    assert first is not None and not interrupted
    prompt, _, _ = chat.reply("and then?")
    shown = tok.decode(first.new_ids, skip_special_tokens=True)
    assert chat.messages[1] == {"role": "assistant", "content": shown}
    assert tok.decode(prompt).count("<|im_start|>") == 4 and "hello" in tok.decode(prompt)
    chat.out, chat.sampling = InterruptingOut(), SamplingConfig()  # greedy: a line per token here
    _, result, interrupted = chat.reply("more")
    assert interrupted and result is None
    kept = chat.messages[-1]
    assert kept["role"] == "assistant" and kept["content"] and kept["content"] + "\n" == chat.out.getvalue()
    chat.reset()
    assert chat.messages == []


def test_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["--help"])
    assert exit_info.value.code == 0 and "--compare" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli(["--max-new-tokens", "0"])
    assert exit_info.value.code == 2 and "space-chat: error: --max-new-tokens" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
def test_ctrl_c_stops_the_reply_not_the_chat(tmp_path):
    """In a terminal (tmux), Ctrl-C during a long reply prints the interruption and the chat goes
    on: /reset answers, /quit exits 0."""
    sock = f"space-chat-test-{os.getpid()}"  # a private tmux server: our environment, killed after
    rc_file = tmp_path / "rc"
    command = shlex.join(CHAT + ["--max-new-tokens", "1900"]) + f"; echo $? > {shlex.quote(str(rc_file))}"

    def tmux(*args) -> str:
        return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, check=True).stdout

    def wait_for(what: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                screen = tmux("capture-pane", "-p", "-t", "chat", "-S", "-3000")
            except subprocess.CalledProcessError:  # the session ended: the chat exited
                raise AssertionError(f"space-chat exited while waiting for {what!r}") from None
            if what in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{what!r} did not appear in {timeout} s:\n{screen[-2000:]}")

    tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", "-c", str(ROOT), command)
    try:
        wait_for("you>", 120)  # capture-pane drops trailing spaces
        tmux("send-keys", "-t", "chat", "hello", "Enter")
        wait_for("you> hello", 10)
        time.sleep(1.5)  # well inside a 1900-token reply
        tmux("send-keys", "-t", "chat", "C-c")
        screen = wait_for("[interrupted", 30)
        assert "1900 tokens" not in screen  # the reply had not finished on its own
        tmux("send-keys", "-t", "chat", "/reset", "Enter")
        wait_for("[history cleared]", 30)
        tmux("send-keys", "-t", "chat", "/quit", "Enter")
        end = time.monotonic() + 30
        while not rc_file.exists() and time.monotonic() < end:
            time.sleep(0.2)
        assert rc_file.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


def test_a_turn_that_does_not_fit_is_dropped_from_the_history(capsys):
    """Catches keeping the refused user message: the next turn would carry it (and fail again).
    Also --top-p above 1 is refused."""
    model, tok, spec = load_space("tiny-random-llama", None, 3)
    chat = Chat(model, tok, SpaceDecoder(model, spec), SamplingConfig(), 5000, out=io.StringIO())
    with pytest.raises(ValueError):
        chat.reply("hello")
    assert chat.messages == []
    with pytest.raises(SystemExit) as exit_info:
        cli(["--top-p", "1.5"])
    assert exit_info.value.code == 2 and "--top-p must lie in (0, 1]" in capsys.readouterr().err


def test_a_first_seed_at_the_top_of_the_range_samples_every_turn():
    """--seed takes 0..2**64-1 and turn t samples with seed + t. Catches the plain sum: from the
    second turn on a seed of 2**64 - 1 failed SamplingConfig's range check, every turn after it
    too, and /reset did not clear it."""
    model, tok, spec = load_space("tiny-random-llama", None, 3)
    top = 2**64 - 1
    chat = Chat(model, tok, SpaceDecoder(model, spec), SamplingConfig(1.0, seed=top), 4, out=io.StringIO())
    for text in ("hello", "and then?", "more"):
        _, result, _ = chat.reply(text)
        assert result is not None and result.new_ids
    from space.chat import turn_seed

    assert [turn_seed(top, t) for t in range(3)] == [top, 0, 1] and turn_seed(3, 2) == 5


def test_step_cost_flag_prices_the_dynamic_tree_as_space_eval_does(monkeypatch, capsys):
    """``--step-cost`` (issue 58: a GPU user's chat was priced by the shipped CPU curve, which puts 14
    rows at 1.6x one where an H200's eager step pays about 1.3x): ``measure`` puts the curve timed
    at load in the decoder's layout and says so on one line; ``auto`` measures on a GPU when the
    adapter stores no curve of that device (the CPU stands for the GPU here: ``AUTO_MEASURED``), but
    not on a CPU, and not where the adapter's stored curve is of this device and setup (the shipped
    adapter at 2 threads, fast kernels); ``stored`` never; ``measure`` over a static layout is refused.
    The measurement is stubbed except in the first call, which times the tiny model's real steps."""
    import space.chat as chat_module
    import space.eval.step_cost as ts

    calls, real = [], ts.measure_step_cost
    monkeypatch.setattr(ts, "measure_step_cost", lambda *a, **k: calls.append(1) or real(*a, **k))

    def decoder(*flags, model="tiny-random-llama", adapter="none"):
        args = chat_module.build_parser().parse_args(["--model", model, "--adapter", adapter, "--kernels", "fast",
                                                      "--threads", "2", "--tree", "dynamic", *flags])
        chat_module.check_args(args)
        return chat_module.load(args)[2]

    stored = decoder("--step-cost", "stored").config
    measured = decoder("--step-cost", "measure").config
    assert calls == [1] and "[space-chat] measured this machine's step cost" in capsys.readouterr().out
    assert [q for q, _ in measured.step_cost] == [1, 2, 4, 8, 12, 16, 24, 32] and measured.step_cost != stored.step_cost
    assert decoder().config == stored and calls == [1]  # auto on a CPU
    monkeypatch.setattr(ts, "measure_step_cost", lambda *a, **k: calls.append(2) or
                        {"step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.5, "seconds": 1.0})
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("cpu",))
    priced = decoder().config
    assert calls == [1, 2] and priced.step_cost == ((1, 2.0), (32, 3.0)) and priced.adapter_cost == 0.5
    shipped = decoder(model=SMOLLM2, adapter=str(chat_module.SHIPPED_ADAPTER)).config
    assert calls == [1, 2] and shipped.step_cost != ((1, 2.0), (32, 3.0))  # a curve of this device is stored
    assert decoder("--step-cost", "stored").config == stored and calls == [1, 2]
    with pytest.raises(ValueError, match="layout is static"):
        decoder("--step-cost", "measure", "--tree", "chain")


def test_a_full_checkpoints_stored_curve_prices_its_chat(tmp_path, monkeypatch):
    """A full SAR-SFT checkpoint given as --model stores its layout and curves as an adapter does:
    the chat decodes with its layout, priced by its curve of this setup, and ``auto`` does not
    measure over it on a GPU (the CPU stands in). Catches the checkpoint's space_config.json left
    unread (no stored curve: every GPU chat measured, and the curve of another setup priced it)."""
    import space.chat as chat_module
    import space.eval.step_cost as ts
    from space.decoding import DecodeConfig
    from space.eval.tree_search import write_decode
    from tests.conftest import full_checkpoint

    ckpt = full_checkpoint(tmp_path / "full")
    write_decode(ckpt, DecodeConfig(2, tree="dynamic", lookup_tokens=6).to_dict(), {1: 0.003, 32: 0.009},
                 setup={"threads": 2, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused"})
    write_decode(ckpt, DecodeConfig(2, tree="dynamic", lookup_tokens=6).to_dict(), {1: 0.001, 32: 0.002},
                 setup={"threads": 1, "kernels": "fast", "device": "cpu", "capture": False, "trunk": "fused"})
    calls = []
    monkeypatch.setattr(ts, "measure_step_cost", lambda *a, **k: calls.append(1) or
                        {"step_cost": [[1, 2.0], [32, 3.0]], "adapter_cost": 0.5, "seconds": 1.0})
    monkeypatch.setattr(ts, "AUTO_MEASURED", ("cpu",))
    args = chat_module.build_parser().parse_args(["--model", str(ckpt), "--kernels", "fast", "--threads", "2"])
    chat_module.check_args(args)
    config = chat_module.load(args)[2].config
    assert calls == [] and config.step_cost == ((1, 3.0), (32, 9.0))  # this setup's curve (2 threads), not the last
    assert (config.mask_num, config.tree, config.lookup_tokens) == (2, "dynamic", 6)
    # at 3 threads no curve of this setup is stored: another one prices the tree, and the chat says so, as
    # space-eval does (it said nothing)
    monkeypatch.setattr(ts, "AUTO_MEASURED", ())
    args = chat_module.build_parser().parse_args(["--model", str(ckpt), "--kernels", "fast", "--threads", "3"])
    chat_module.check_args(args)
    with pytest.warns(UserWarning, match=r"step-cost curve was measured with threads \d \(run: 3\)"):
        chat_module.load(args)
    torch.set_num_threads(2)


def test_a_datastore_reaches_the_chats_decoder(tmp_path):
    """``--datastore`` gives the decoder the sets' answers and one datastore branch a step unless
    ``--datastore-branches`` says more (a decoder built without it, or with no branch, drafted
    nothing from it, unsaid)."""
    import json

    import space.chat as chat_module

    sets = tmp_path / "set.jsonl"
    sets.write_text(json.dumps({"prompt": "Count.", "response": "one two three four five"}) + "\n")
    flags = ["--model", "tiny-random-llama", "--tree", "dynamic", "--lookup-tokens", "4", "--datastore", str(sets)]
    for extra, branches in (((), 1), (("--datastore-branches", "3"), 3)):
        args = chat_module.build_parser().parse_args([*flags, *extra])
        chat_module.check_args(args)
        decoder = chat_module.load(args)[2]
        assert decoder.datastore is not None and len(decoder.datastore) > 0
        assert decoder.config.datastore_branches == branches
