"""``bash run_sft_multi_node.sh CONFIG --smoke``: a training config, proven end to end in minutes.

Before a long GPU job, a user wants to know that the config launches, trains with a finite loss
and saves an artifact SPACE can decode with. The smoke run keeps every Trainer, DeepSpeed and LoRA
setting of ``CONFIG`` and changes only what a small check must change:

1. a **stand-in model**: the config's architecture family (``model_type``, tied or untied
   embeddings, grouped-query attention) at 2 layers and hidden size 64, saved to a directory first,
   so it loads the way the user's model does (``from_pretrained``, partitioned at load under
   ZeRO-3). Its tokenizer is the real model's when that directory exists, else a byte-level one;
2. **2 optimizer steps** (``max_steps 2``, a checkpoint at step 2, a log every step) on at most a
   few dozen rows of the config's data, samples cut to ``SMOKE_MAX_LENGTH`` tokens; a data file
   that is missing here is replaced by MBPP (named in the output), and ``init_adapter`` (made for
   the real model's shapes) is checked as an artifact, then left out;
3. the run goes **through the real launcher** (``run_sft_multi_node.sh``: torchrun; DeepSpeed on
   CPU uses gloo), with 2 processes on a CPU-only machine when the config uses DeepSpeed, so ZeRO
   really partitions (``NPROC_PER_NODE`` overrides);
4. the artifact is loaded back with ``load_space`` in fp32 and decodes ``SMOKE_NEW_TOKENS`` tokens
   greedily with SPACE and with AR: they must be equal token for token (DESIGN §5).

It prints one line, ``smoke: config=... steps=2 loss=... artifact=... exact=yes ...``, and exits 0;
any failure (launch, non-finite loss, empty artifact, a SPACE/AR mismatch) exits non-zero. A config
this machine cannot run is refused by name with the reason (exit 3), never counted as passed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ..cli import HelpFormatter, console
from ..config import read_config_file

ROOT = Path(__file__).resolve().parents[2]
SMOKE_STEPS = 2
SMOKE_MAX_LENGTH = 384
SMOKE_NEW_TOKENS = 16
REFUSED_EXIT = 3
# what every stand-in gets: small enough for a CPU, with grouped-query attention like Llama-2-70B
STAND_IN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048)
# the family of a model the smoke cannot read here, by its name: (model_type, tie_word_embeddings)
FAMILIES = (("tiny-random-llama", ("llama", True)), ("smollm", ("llama", True)), ("llama", ("llama", False)),
            ("mistral", ("mistral", False)), ("qwen", ("qwen2", True)))


class Refused(Exception):
    """A config this machine cannot smoke-test, with the reason (e.g. fp16 needs a GPU)."""


def refusal(config: dict, cuda: bool) -> str | None:
    """Why this machine cannot run ``config``'s settings, or None."""
    if not cuda and config.get("fp16"):
        return "needs a GPU: fp16 mixed precision (torch's CPU autocast trains in bf16 only)"
    if not cuda and "offload" in str(config.get("deepspeed", "")):
        return "needs a GPU: ZeRO offload pins host memory for a CUDA device"
    return None


def family(model: str) -> tuple[str, bool, Path | None]:
    """(model_type, tie_word_embeddings, local directory or None) of the config's model."""
    from transformers import AutoConfig

    path = Path(model)
    if (path / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(path)
        return cfg.model_type, bool(getattr(cfg, "tie_word_embeddings", False)), path
    for key, (model_type, tied) in FAMILIES:
        if key in model.lower():
            return model_type, tied, None
    raise ValueError(f"--smoke: cannot tell the architecture of {model!r} (not a local HF directory, and its name "
                     f"names none of {[k for k, _ in FAMILIES]}); run the smoke where the model directory exists")


def build_stand_in(model: str, out: Path) -> str:
    """Save a tiny random model of ``model``'s family and a tokenizer to ``out``; returns a
    description (``llama, untied, byte-level tokenizer``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..models import tiny_tokenizer

    model_type, tied, path = family(model)
    tok = AutoTokenizer.from_pretrained(path) if path is not None else tiny_tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    cfg = AutoConfig.for_model(model_type, **STAND_IN, vocab_size=len(tok), tie_word_embeddings=tied,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stand_in = AutoModelForCausalLM.from_config(cfg)
    stand_in.save_pretrained(out)
    tok.save_pretrained(out)
    return f"{model_type}, {'tied' if tied else 'untied'}, {'its own' if path else 'byte-level'} tokenizer"


def smoke_datasets(config: dict) -> tuple[str, list[str]]:
    """The config's datasets that exist here (registered names and files), the others replaced by
    MBPP; returns (comma list, names replaced)."""
    from ..data.sft import REGISTRY

    kept, replaced = [], []
    for name in (n.strip() for n in str(config.get("datasets", "mbpp")).split(",") if n.strip()):
        ok = name in REGISTRY or (ROOT / name).is_file() or Path(name).is_file()
        (kept if ok else replaced).append(name)
    if replaced and "mbpp" not in kept:
        kept.append("mbpp")
    return ",".join(kept), replaced


def smoke_config(config: dict, stand_in: Path, out_dir: Path, datasets: str, cuda: bool) -> dict:
    """``config`` with what the smoke changes (module docstring), nothing else."""
    procs = int(os.environ.get("NPROC_PER_NODE", "2" if config.get("deepspeed") and not cuda else "8"))
    batch = int(config.get("per_device_train_batch_size", 8)) * int(config.get("gradient_accumulation_steps", 1))
    changed = {"model_name_or_path": str(stand_in), "output_dir": str(out_dir), "datasets": datasets,
               "max_steps": SMOKE_STEPS, "save_steps": SMOKE_STEPS, "logging_steps": 1,
               # rows for every step on every process, and some spare for rows that do not fit
               "limit": batch * procs * SMOKE_STEPS * 2 + 8,
               "max_length": min(int(config.get("max_length", SMOKE_MAX_LENGTH)), SMOKE_MAX_LENGTH),
               "max_train_minutes": 0}
    if not cuda:
        changed["use_cpu"] = True
    # init_adapter has the real model's shapes; `sources` filters self-distilled rows, which a
    # replacement data set lacks
    dropped = {"init_adapter"} | ({"sources"} if datasets != config.get("datasets") else set())
    smoke = {k: v for k, v in config.items() if k not in dropped}
    smoke.update(changed)
    return smoke


def check_init_adapter(config: dict) -> str:
    """A note on ``init_adapter``: checked as a SPACE artifact when it exists here, never applied
    (its LoRA weights have the real model's shapes)."""
    from ..artifact import read_space_config

    where = config.get("init_adapter")
    if not where:
        return ""
    path = ROOT / where if not Path(where).is_absolute() else Path(where)
    if not path.is_dir():
        return f"; init_adapter={where} (not here, left out)"
    cfg = read_space_config(path)
    if cfg["mode"] != config.get("mode", "frozen-base") or cfg["mask_num"] != config.get("mask_num", cfg["mask_num"]):
        raise ValueError(f"init_adapter {where} was trained with mode {cfg['mode']}, k={cfg['mask_num']}: it does not "
                         f"fit this config (mode {config.get('mode')}, k={config.get('mask_num')})")
    return f"; init_adapter={where} (checked, left out)"


def last_loss(run_dir: Path) -> tuple[int, float]:
    """(global step, loss) of the last training log of a finished run.

    Raises:
        ValueError: no log, or a loss that is not finite.
    """
    path = run_dir / "log_history.json"
    if not path.is_file():
        raise ValueError(f"smoke: the run wrote no {path.name}, so it did not finish")
    logs = [h for h in json.loads(path.read_text()) if "loss" in h]
    if not logs:
        raise ValueError(f"smoke: {path} holds no training loss")
    step, loss = logs[-1]["step"], float(logs[-1]["loss"])
    if not math.isfinite(loss):
        raise ValueError(f"smoke: the loss at step {step} is {loss}")
    return step, loss


def decode_check(stand_in: Path, artifact: Path, mode: str) -> tuple[bool, int]:
    """Load the artifact with ``load_space`` (fp32) and decode ``SMOKE_NEW_TOKENS`` tokens with
    SPACE and AR, greedy, from a chat prompt. Returns (equal, tokens compared)."""
    import torch

    from ..decoding.autoregressive import ar_generate
    from ..decoding.decoder import SpaceDecoder
    from ..loader import load_space

    if mode == "full":
        model, tok, spec = load_space(model=str(artifact))
    else:
        model, tok, spec = load_space(model=str(stand_in), adapter=artifact)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a function that adds two numbers."}],
                                     add_generation_prompt=True, tokenize=False) if tok.chat_template else "def add(a, b):"
    ids = torch.tensor(tok(prompt, add_special_tokens=False)["input_ids"])
    ar = ar_generate(model, ids, SMOKE_NEW_TOKENS).new_ids
    space = SpaceDecoder(model, spec).generate(ids, SMOKE_NEW_TOKENS).new_ids
    return ar == space, len(ar)


def launch(args: list[str], env: dict, log_path: Path, timeout: float) -> tuple[int, str]:
    """Run ``run_sft_multi_node.sh ARGS``; returns (exit code, output), also written to
    ``log_path``. A run past ``timeout`` seconds is killed with its workers (a hung collective
    must fail the smoke, not hang it) and returns 124."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(ROOT / "run_sft_multi_node.sh"), *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker: they share its session
            proc.wait()
            code = 124
    text = log_path.read_text(errors="replace")
    if code == 124:
        text += f"\nsmoke: killed after {timeout:.0f} s (--timeout)"
    return code, text


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_smoke(config_path: str, work_dir: str | None = None, keep: bool = False, overrides: list[str] = (),
              timeout: float = 1800) -> dict:
    """Smoke-test one training config (module docstring); returns its summary.

    Args:
        overrides: ``--key value`` pairs passed to the training run after the smoke's changes
            (e.g. ``--deepspeed configs/deepspeed/zero3.json``).
        timeout: seconds the training run may take before it is killed (a failure).

    Raises:
        Refused: the config needs what this machine lacks (a GPU for fp16 or offload).
        FileNotFoundError / ValueError: a missing config, model family unknown, the run failed
            (its exit code and the tail of its output), a non-finite loss, an artifact that does
            not load, or SPACE output that differs from AR.
    """
    import torch

    path = Path(config_path)
    config = read_config_file(path if path.is_absolute() or path.is_file() else ROOT / path)
    cuda = torch.cuda.is_available()
    reason = refusal(config, cuda)
    if reason:
        raise Refused(f"{config_path}: {reason}")
    note = check_init_adapter(config)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="space-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        stand_in, run_dir = work / "stand-in", work / "run"
        shutil.rmtree(run_dir, ignore_errors=True)  # a smoke always trains its 2 steps from scratch
        arch = build_stand_in(str(config.get("model_name_or_path", "smollm2-135m-instruct")), stand_in)
        datasets, replaced = smoke_datasets(config)
        smoke = smoke_config(config, stand_in, run_dir, datasets, cuda)
        (work / "config.yaml").write_text(yaml.safe_dump(smoke, sort_keys=False))
        env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
        if not cuda:  # else the launcher counts the GPUs
            env.setdefault("NPROC_PER_NODE", "2" if config.get("deepspeed") else "1")
        code, log = launch([str(work / "config.yaml"), *overrides], env, work / "train.log", timeout)
        if code != 0:
            # our own one-line error when a rank printed one, else the end of the log (a traceback)
            first = next((line for line in log.splitlines() if "space-train: error:" in line), None)
            tail = first or "\n".join(log.strip().splitlines()[-25:])
            raise ValueError(f"smoke: training exited {code} (log: {work / 'train.log'}):\n{tail}")
        step, loss = last_loss(run_dir)
        if step != SMOKE_STEPS:
            raise ValueError(f"smoke: the run stopped at step {step}, not {SMOKE_STEPS}")
        artifact = run_dir / "final"
        exact, n = decode_check(stand_in, artifact, config.get("mode", "frozen-base"))
        summary = {"config": config_path, "steps": step, "loss": loss, "artifact_bytes": size_of(artifact),
                   "exact": exact, "tokens": n, "stand_in": arch, "processes": env.get("NPROC_PER_NODE", "one per GPU"),
                   "deepspeed": config.get("deepspeed"), "replaced_data": replaced, "work_dir": str(work)}
        print(f"smoke: config={config_path} steps={step} loss={loss:.4f} artifact={summary['artifact_bytes'] / 2**20:.2f} MB "
              f"exact={'yes' if exact else 'NO'} ({n} tokens; stand-in {arch}; processes {summary['processes']}; "
              f"deepspeed {config.get('deepspeed') or 'off'}"
              + (f"; {','.join(replaced)} not here, mbpp instead" if replaced else "") + note + ")", flush=True)
        if not exact:
            raise ValueError(f"smoke: greedy SPACE output differs from AR on the saved artifact ({artifact})")
        return summary
    finally:
        if not keep and not work_dir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"smoke: stand-in, run and train.log kept in {work}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="run_sft_multi_node.sh CONFIG --smoke", formatter_class=HelpFormatter,
        description="Smoke-test a training config: its own Trainer/DeepSpeed/LoRA settings on a tiny stand-in model "
                    "of the same architecture, 2 optimizer steps through the real launcher, then load the artifact "
                    "with load_space and check greedy SPACE == AR. One line; non-zero exit on any failure.",
        epilog="Any other --key value is passed to the training run (e.g. --deepspeed configs/deepspeed/zero3.json).")
    parser.add_argument("config", help="a YAML under configs/train")
    parser.add_argument("--work-dir", help="keep the stand-in, run and log here (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a hung training run is killed")
    args, overrides = parser.parse_known_args(argv)
    try:
        return run_smoke(args.config, args.work_dir, args.keep, overrides, args.timeout)
    except Refused as e:
        print(f"smoke: refused: {e}", flush=True)
        sys.exit(REFUSED_EXIT)


cli = console("space-smoke", main)

if __name__ == "__main__":
    cli()
