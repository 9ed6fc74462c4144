"""``--device auto`` (issue 58, item 6): space-eval, space-chat and run_eval.sh take the GPU when
there is one, else the CPU, and the run says which."""
from pathlib import Path

import torch

from space.chat import build_parser as chat_parser
from space.chat import check_args as check_chat
from space.eval.__main__ import build_parser as eval_parser
from space.eval.__main__ import check_args as check_eval
from space.models import resolve_device

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_cuda_when_usable(monkeypatch):
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"


def test_auto_is_the_default_and_the_choice_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = eval_parser().parse_args(["--model", "tiny-random-llama", "--out", str(tmp_path / "out")])
    assert args.device == "auto"
    check_eval(args)
    assert (args.device_requested, args.device) == ("auto", "cpu")  # the record's device_flag and device
    chat = chat_parser().parse_args(["--model", "tiny-random-llama", "--adapter", "none"])
    assert chat.device == "auto"
    check_chat(chat)
    assert chat.device == "cpu"
    assert "--device auto" in (ROOT / "run_eval.sh").read_text()
