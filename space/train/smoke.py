"""``bash run_sft_multi_node.sh CONFIG --smoke``: a training config, proven end to end in minutes.

Before a long GPU job, a user wants to know that the config launches, trains with a finite loss
and saves an artifact SPACE can decode with. The smoke run keeps every Trainer, DeepSpeed and LoRA
setting of ``CONFIG`` and changes only what a small check must change, one printed line per
setting (``smoke changes KEY: OLD -> NEW (why)``):

1. a **stand-in model**: the config's architecture family (``model_type``, tied or untied
   embeddings, and the attention shape: multi-head, grouped-query with the model's query heads
   per KV head, or multi-query) at 2 layers and 16 dimensions per head, saved to a directory
   first, so it loads the way the user's model does (``from_pretrained``, partitioned at load
   under ZeRO-3). The family is read from the model directory's ``config.json`` when it exists
   here, else from ``FAMILIES`` by the model's name. Its tokenizer is the real model's when that
   directory exists, else a byte-level one;
2. **2 optimizer steps** (``max_steps 2``, a checkpoint at step 2, a log every step; a NaN loss
   is logged as NaN, as in every SpaceTrainer run) on at most a few dozen rows of
   the config's data, samples cut to ``SMOKE_MAX_LENGTH`` tokens; a data file that is missing here
   is replaced by MBPP (and ``sources``, which filters that file's rows, is left out);
   ``init_adapter`` (made for the real model's shapes) is checked as an artifact, then left out;
3. the run goes **through the real launcher** (``run_sft_multi_node.sh``: torchrun; DeepSpeed on
   CPU uses gloo) on this node alone (``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and
   ``MASTER_PORT`` of a surrounding job are not passed on), with 2 processes on a CPU-only machine
   when the config uses DeepSpeed, so ZeRO really partitions (``NPROC_PER_NODE`` overrides);
4. the checks: the loss of step 2 is finite (``checkpoint-2/trainer_state.json``); every tensor
   the artifact saved is finite; the tensors the mode trains changed from the stand-in's (full:
   every weight matrix; lora and frozen-base: the mask rows, and the LoRA B matrices, which start
   at zero); the artifact loads with ``load_space`` in fp32 and decodes ``SMOKE_NEW_TOKENS`` tokens
   greedily with SPACE and with AR, equal token for token (DESIGN §6, exactness). Exactness alone would pass
   an all-NaN artifact: rejected drafts never change greedy output.

It prints one summary line, ``smoke: config=... steps=2 loss=... artifact=... exact=yes ...``, and
exits 0; any failure exits non-zero with an error that names the user's config file and, for a
failed training, its log (kept in ``runs/smoke/``). A config this machine cannot run (fp16, or a
ZeRO offload, in the config or in a ``--key value`` override) is refused by name with the reason
(exit 3), never counted as passed.
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
from typing import NamedTuple

import yaml

from ..cli import HelpFormatter, console
from ..config import read_config_file

ROOT = Path(__file__).resolve().parents[2]
SMOKE_STEPS = 2
SMOKE_MAX_LENGTH = 384
SMOKE_NEW_TOKENS = 16
REFUSED_EXIT = 3
# what every stand-in gets; its heads come from the model (stand_in_heads), 16 dimensions each
STAND_IN = dict(num_hidden_layers=2, max_position_embeddings=2048, head_dim=16)
# the environment of a surrounding multi-node job, which the smoke's single-node run must not join
RENDEZVOUS_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


class Family(NamedTuple):
    """What the stand-in copies of the config's model, and where it was read."""

    model_type: str
    tied: bool
    heads: int
    kv_heads: int
    path: Path | None  # the model's local directory, None when known by name


# the family of a model the smoke cannot read here, by its name (the first key the lower-cased
# name contains): (model_type, tie_word_embeddings, query heads, KV heads)
FAMILIES = (("tiny-random-llama", ("llama", True, 4, 2)), ("smollm2-135m", ("llama", True, 9, 3)),
            ("llama-2-70b", ("llama", False, 64, 8)), ("llama-2-13b", ("llama", False, 40, 40)),
            ("llama-2-7b", ("llama", False, 32, 32)), ("mistral-7b", ("mistral", False, 32, 8)))


class Refused(Exception):
    """A config this machine cannot smoke-test, with the reason (e.g. fp16 needs a GPU)."""


def parse_overrides(overrides: list[str]) -> dict:
    """The ``--key value`` / ``--key=value`` pairs passed to the training run (a flag alone: true),
    each value read as YAML reads it.

    Raises:
        ValueError: a word that is neither ``--key`` nor the value after one.
    """
    return {key: yaml.safe_load(value) for key, value, _ in override_pairs(overrides)}


def override_pairs(overrides: list[str]) -> list[tuple[str, str, list[str]]]:
    """``(key, value as written, the words that gave it)`` per ``--key value`` / ``--key=value`` /
    ``--flag`` of ``overrides``, the key spelt with underscores. Raises ValueError as :func:`parse_overrides`."""
    pairs, words = [], list(overrides)
    while words:
        word = words.pop(0)
        if not word.startswith("--"):
            raise ValueError(f"smoke: expected --key value after the config, got {word!r}")
        key, eq, value = word[2:].partition("=")
        given = [word]
        if not eq:
            value = "true"
            if words and not words[0].startswith("--"):
                value = words.pop(0)
                given.append(value)
        pairs.append((key.replace("-", "_"), value, given))  # --output-dir is --output_dir, as the run reads it
    return pairs


def deepspeed_settings(deepspeed) -> dict:
    """The DeepSpeed config a ``deepspeed`` setting names (a JSON file, relative to the repository
    like the training run's, or a mapping); {} for none or a file that is not here (the training
    run then says so).

    Raises:
        ValueError: a file that is not JSON (named).
    """
    if isinstance(deepspeed, dict):
        return deepspeed
    if not deepspeed:
        return {}
    path = Path(deepspeed) if Path(deepspeed).is_absolute() else ROOT / deepspeed
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"deepspeed {deepspeed}: not valid JSON ({e})") from None


def refusal(config: dict, cuda: bool) -> str | None:
    """Why this machine cannot run ``config``'s settings (the effective ones: the YAML with the
    overrides applied), or None. Raises as :func:`deepspeed_settings`."""
    if cuda:
        return None
    ds = deepspeed_settings(config.get("deepspeed"))
    if config.get("fp16") is True or ds.get("fp16", {}).get("enabled") is True:
        return "needs a GPU: fp16 mixed precision (torch's CPU autocast trains in bf16 only)"
    zero = ds.get("zero_optimization", {})
    offload = [f"{key} to {zero[key]['device']}" for key in ("offload_optimizer", "offload_param")
               if zero.get(key, {}).get("device", "none") != "none"]
    if offload:
        return (f"needs a GPU: ZeRO offload ({', '.join(offload)}, deepspeed {config['deepspeed']}) pins host memory "
                "for a CUDA device")
    return None


def family(model: str) -> Family:
    """The family of the config's model: its ``config.json`` when its directory is here, else by name.

    Raises:
        ValueError: no directory here and a name that names no family of ``FAMILIES``.
    """
    from transformers import AutoConfig

    path = Path(model)
    if (path / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(path)
        text = cfg.get_text_config(decoder=True)  # a multimodal model trains its language model (models.text_part)
        heads = text.num_attention_heads
        return Family(text.model_type, bool(getattr(cfg, "tie_word_embeddings", False)), heads,
                      getattr(text, "num_key_value_heads", None) or heads, path)
    for key, known in FAMILIES:
        if key in model.lower():
            return Family(*known, None)
    raise ValueError(f"--smoke: cannot tell the architecture of {model!r} (not a local HF directory, and its name "
                     f"names none of {[k for k, _ in FAMILIES]}); run the smoke where the model directory exists")


def stand_in_heads(heads: int, kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) of the stand-in: multi-head stays multi-head (2/2), multi-query
    stays multi-query, and grouped-query keeps the model's query heads per KV head, over 2 KV heads
    or 1 where that would pass 8 query heads (a ratio above 8 is cut to 8)."""
    per_kv = min(heads // kv_heads, 8)
    kv = min(kv_heads, 2, 8 // per_kv)
    return kv * per_kv, kv


def build_stand_in(model: str, out: Path) -> str:
    """Save a tiny random model of ``model``'s family and a tokenizer to ``out``; returns a
    description (``llama, untied, 2/2 heads (the model's 32/32), byte-level tokenizer``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..models import tiny_tokenizer

    fam = family(model)
    tok = AutoTokenizer.from_pretrained(fam.path) if fam.path is not None else tiny_tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    heads, kv_heads = stand_in_heads(fam.heads, fam.kv_heads)
    hidden = heads * STAND_IN["head_dim"]
    cfg = AutoConfig.for_model(fam.model_type, **STAND_IN, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=len(tok),
                               tie_word_embeddings=fam.tied, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stand_in = AutoModelForCausalLM.from_config(cfg)
    stand_in.save_pretrained(out)
    tok.save_pretrained(out)
    return (f"{fam.model_type}, {'tied' if fam.tied else 'untied'}, {heads}/{kv_heads} heads (the model's "
            f"{fam.heads}/{fam.kv_heads}{'' if fam.path else ' by its name'}), "
            f"{'its own' if fam.path else 'byte-level'} tokenizer")


def smoke_datasets(config: dict) -> tuple[str, list[str]]:
    """The config's datasets that exist here (registered names and files), the others replaced by
    MBPP; returns (comma list, names replaced)."""
    from ..data.sft import REGISTRY, data_lists

    kept, replaced = [], []
    for name in data_lists(str(config.get("datasets", "mbpp")))[0]:
        ok = name in REGISTRY or (ROOT / name).is_file() or Path(name).is_file()
        (kept if ok else replaced).append(name)
    if replaced and "mbpp" not in kept:
        kept.append("mbpp")
    return ",".join(kept), replaced


def smoke_config(config: dict, stand_in: Path, out_dir: Path, cuda: bool) -> tuple[dict, list[str], list[str]]:
    """``config`` with what the smoke changes (module docstring), nothing else; returns it, one
    line per setting changed (``smoke changes KEY: OLD -> NEW (why)``) and the data sets replaced."""
    datasets, replaced = smoke_datasets(config)
    procs = int(os.environ.get("NPROC_PER_NODE", "2" if config.get("deepspeed") and not cuda else "8"))
    batch = int(config.get("per_device_train_batch_size", 8)) * int(config.get("gradient_accumulation_steps", 1))
    why = {"model_name_or_path": "a 2-layer stand-in of its architecture", "output_dir": "a scratch folder",
           "datasets": f"{', '.join(replaced)} not here", "max_steps": f"{SMOKE_STEPS} optimizer steps",
           "save_steps": "a checkpoint at the last step", "logging_steps": "a loss for every step",
           "limit": "rows for every step on every process", "max_length": "short samples", "use_cpu": "no GPU here",
           "init_adapter": "made for the real model's shapes", "sources": "it filters the rows of the data replaced"}
    changed = {"model_name_or_path": str(stand_in), "output_dir": str(out_dir), "max_steps": SMOKE_STEPS,
               "save_steps": SMOKE_STEPS, "logging_steps": 1,
               # rows for every step on every process, and some spare for rows that do not fit
               "limit": batch * procs * SMOKE_STEPS * 2 + 8,
               "max_length": min(int(config.get("max_length", SMOKE_MAX_LENGTH)), SMOKE_MAX_LENGTH)}
    if not cuda:
        changed["use_cpu"] = True
    if replaced:
        changed["datasets"] = datasets
    dropped = {"init_adapter"} | ({"sources"} if replaced else set())
    smoke = {k: v for k, v in config.items() if k not in dropped}
    smoke.update(changed)
    lines = [f"smoke changes {key}: {config.get(key, '(unset)')} -> {value} ({why[key]})"
             for key, value in changed.items() if config.get(key) != value]
    lines += [f"smoke changes {key}: {config[key]} -> (left out) ({why[key]})" for key in sorted(dropped)
              if key in config]
    return smoke, lines, replaced


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


def last_loss(run_dir: Path) -> float:
    """The loss HF logged at the smoke's last step (``checkpoint-2/trainer_state.json``).

    Raises:
        ValueError: no checkpoint of the last step, no loss logged at it, or a loss that is not finite.
    """
    path = run_dir / f"checkpoint-{SMOKE_STEPS}" / "trainer_state.json"
    if not path.is_file():
        raise ValueError(f"the run wrote no {path.relative_to(run_dir)}, so it did not reach step {SMOKE_STEPS}")
    logs = [h for h in json.loads(path.read_text())["log_history"] if "loss" in h and h.get("step") == SMOKE_STEPS]
    if not logs:
        raise ValueError(f"{path} holds no training loss at step {SMOKE_STEPS}")
    loss = float(logs[-1]["loss"])
    if not math.isfinite(loss):
        raise ValueError(f"the loss at step {SMOKE_STEPS} is {loss}")
    return loss


def check_trained(artifact: Path, stand_in: Path, config: dict) -> str:
    """Check the saved tensors: every one finite, and the ones the mode trains changed from the
    stand-in's (full: every weight matrix; lora, frozen-base: the mask rows, and the LoRA B
    matrices, which start at zero). Returns what was checked, for the summary line.

    Raises:
        ValueError: a tensor with NaN or inf, or a trained tensor equal to its start (named).
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..artifact import LORA_WEIGHTS, MASK_EMBEDDING
    from ..decoding.config import DEFAULT_MASK_NUM
    from ..tokens import add_mask_tokens

    saved = {}
    for file in sorted(artifact.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"{file.name}: {name} holds NaN or inf after training")
            saved[file.name, name] = tensor
    # the stand-in as training starts it: with the mask tokens (rows = the mean embedding)
    start = AutoModelForCausalLM.from_pretrained(stand_in)
    spec = add_mask_tokens(start, AutoTokenizer.from_pretrained(stand_in),
                           int(config.get("mask_num", DEFAULT_MASK_NUM)), bool(config.get("mask_diff", False)))
    if config.get("mode", "frozen-base") == "full":
        before = {name: t for name, t in start.state_dict().items() if t.dim() >= 2}
        trained = {key: t for key, t in saved.items() if key[1] in before}
        same = [name for (_, name), t in trained.items() if torch.equal(t, before[name].to(t.dtype))]
    else:
        rows = start.get_input_embeddings().weight[list(spec.token_ids)].float()
        trained = {key: t for key, t in saved.items() if key[0] == LORA_WEIGHTS and "lora_B" in key[1]}
        same = [name for (_, name), t in trained.items() if not t.any()]
        mask = saved.get((MASK_EMBEDDING, "mask_rows"))
        if mask is None or torch.equal(mask, rows.to(mask.dtype)):
            same.append("mask_rows")
        trained[MASK_EMBEDDING, "mask_rows"] = mask
    if same or not trained:
        raise ValueError(f"{artifact}: {len(same)} of {len(trained)} trained tensors did not change in "
                         f"{SMOKE_STEPS} steps ({', '.join(same[:3]) or 'none found'}): a learning rate of 0, "
                         "or frozen weights?")
    return f"{len(saved)} tensors finite, {len(trained)} trained ones changed"


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


def shown(config_path: str) -> str:
    """The config's path as the user knows it: relative to the repository when it lies in it (the
    launcher passes it absolute), else as given."""
    path = Path(config_path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else config_path


def smoke_log(config_path: str) -> Path:
    """A new log file under ``runs/smoke/`` for the training run, named after the config: it
    outlives the smoke's temporary folder, so a failure's message can cite it."""
    logs = ROOT / "runs" / "smoke"
    logs.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"{Path(config_path).stem}-", suffix=".log", dir=logs)
    os.close(fd)
    return Path(path)


def smoke_env(config: dict, cuda: bool) -> dict:
    """The training run's environment: this one on this node alone (no rendezvous variables of a
    surrounding multi-node job), this Python, and on a CPU-only machine 2 processes for a DeepSpeed
    config (so ZeRO partitions), else 1, unless ``NPROC_PER_NODE`` says otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    env["PYTHON"] = os.environ.get("PYTHON", sys.executable)
    if not cuda:  # else the launcher counts the GPUs
        env.setdefault("NPROC_PER_NODE", "2" if config.get("deepspeed") else "1")
    return env


def run_smoke(config_path: str, work_dir: str | None = None, keep: bool = False, overrides: list[str] = (),
              timeout: float = 1800) -> dict:
    """Smoke-test one training config (module docstring); returns its summary.

    Args:
        overrides: ``--key value`` pairs passed to the training run after the smoke's config (e.g.
            ``--deepspeed configs/deepspeed/zero3.json``), except those of settings the smoke
            changes (its output_dir, stand-in model, steps, ...), which it keeps and says so.
        timeout: seconds the training run may take before it is killed (a failure).

    Raises:
        Refused: the effective settings (the config with ``overrides``) need what this machine
            lacks (a GPU for fp16 or a ZeRO offload).
        FileNotFoundError / ValueError: a missing config, model family unknown, the run failed
            (its exit code, its error line or the tail of its output, and its log, which is kept),
            a non-finite loss or saved tensor, trained tensors that did not change, an artifact that
            does not load, or SPACE output that differs from AR; each names the config as given.
    """
    import torch

    name = shown(config_path)
    path = Path(config_path)
    config = read_config_file(path if path.is_absolute() or path.is_file() else ROOT / path)
    effective = {**config, **parse_overrides(overrides)}
    cuda = torch.cuda.is_available()
    reason = refusal(effective, cuda)
    if reason:
        raise Refused(f"{name}: {reason}")
    note = check_init_adapter(effective)  # the flags on top: --mode lora over a frozen-base config's adapter
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="space-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    kept = bool(work_dir or keep)
    try:
        stand_in, run_dir = work / "stand-in", work / "run"
        shutil.rmtree(run_dir, ignore_errors=True)  # a smoke always trains its 2 steps from scratch
        arch = build_stand_in(str(effective.get("model_name_or_path", "smollm2-135m-instruct")), stand_in)
        # sized from the settings as run (an overridden batch size sizes the smoke's rows)
        smoke, changes, replaced = smoke_config(effective, stand_in, run_dir, cuda)
        for line in changes:
            print(line, flush=True)
        (work / "config.yaml").write_text(yaml.safe_dump(smoke, sort_keys=False))
        env = smoke_env(effective, cuda)
        log_path = work / "train.log" if kept else smoke_log(config_path)
        # the overrides after the smoke's config, as the real run takes them, but not those of what the smoke
        # sets itself: a --output_dir of the real run's got the stand-in's checkpoints and final/
        kept_overrides, unset = [], object()
        for key, value, given in override_pairs(overrides):
            if smoke.get(key, unset) != effective.get(key, unset):
                print(f"smoke keeps {key}: {smoke.get(key, '(left out)')} (--{key} {value} is the real run's)", flush=True)
            else:
                kept_overrides += given
        code, log = launch([str(work / "config.yaml"), *kept_overrides], env, log_path, timeout)
        if code != 0:
            # our own one-line error when a rank printed one, else the end of the log (a traceback)
            first = next((line for line in log.splitlines() if "space-train: error:" in line), None)
            tail = (first or "\n".join(log.strip().splitlines()[-25:])).replace(str(work / "config.yaml"), name)
            raise ValueError(f"smoke: {name}: training exited {code} (log: {log_path}):\n{tail}")
        try:
            loss = last_loss(run_dir)
            artifact = run_dir / "final"
            checked = check_trained(artifact, stand_in, effective)
            exact, n = decode_check(stand_in, artifact, effective.get("mode", "frozen-base"))
        except ValueError as e:
            raise ValueError(f"smoke: {name}: {e} (log: {log_path})") from None
        deepspeed = effective.get("deepspeed") or "off"
        summary = {"config": name, "steps": SMOKE_STEPS, "loss": loss, "artifact_bytes": size_of(artifact),
                   "exact": exact, "tokens": n, "stand_in": arch, "deepspeed": deepspeed, "replaced_data": replaced,
                   "processes": env.get("NPROC_PER_NODE", "one per GPU"), "checked": checked, "work_dir": str(work)}
        print(f"smoke: config={name} steps={SMOKE_STEPS} loss={loss:.4f} "
              f"artifact={summary['artifact_bytes'] / 2**20:.2f} MB exact={'yes' if exact else 'NO'} ({n} tokens; "
              f"{checked}; stand-in {arch}; processes {summary['processes']}; deepspeed {deepspeed}{note})", flush=True)
        if not exact:
            raise ValueError(f"smoke: {name}: greedy SPACE output differs from AR on the saved artifact ({artifact})")
        if not kept:
            log_path.unlink()
        return summary
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"smoke: stand-in, run and train.log kept in {work}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="run_sft_multi_node.sh CONFIG --smoke", formatter_class=HelpFormatter,
        description="Smoke-test a training config: its own Trainer/DeepSpeed/LoRA settings on a tiny stand-in model "
                    "of the same architecture, 2 optimizer steps through the real launcher, then load the artifact "
                    "with load_space, check its tensors and greedy SPACE == AR. A line per setting changed, one "
                    "summary line; non-zero exit on any failure.",
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
