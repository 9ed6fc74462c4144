"""A SPACE artifact's files (DESIGN §3.6): written atomically, read with every damage named.

Layout (lora / frozen-base): ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's
names, read here without peft), ``mask_embedding.safetensors`` (the k or 1 mask rows),
``space_config.json`` (base model, mode, mask ids, mask_num, training data, commit; the tuned
``"decode"`` layout and its step-cost curves, ``"step_costs"``, one per setup), and
with the optional sampler head (issue 34, ``space.sampler_head``) ``sampler_head.safetensors`` plus
its width under ``"sampler_head"``. A ``full`` artifact is a HF checkpoint with ``space_config.json``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .adapter_layers import MODES, MaskEmbedding, mask_embedding
from .decoding.config import DecodeConfig
from .jsonl import publish_folder
from .sampler_head import SAMPLER_ATTR, SamplerHead, sampler_head
from .tokens import MaskSpec
from .zero3 import check_saved_shapes

SPACE_CONFIG = "space_config.json"
MASK_EMBEDDING = "mask_embedding.safetensors"
LORA_WEIGHTS, LORA_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names
SAMPLER_HEAD = "sampler_head.safetensors"


def save_artifact(out_dir: str | os.PathLike, model, tokenizer, spec: MaskSpec, mode: str, meta: dict,
                  state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trained SPACE model atomically (temporary directory, then rename), after checking
    what was written (:func:`check_artifact`). An artifact already at ``out_dir`` is renamed aside
    first and deleted after: a run stopped between the two renames leaves it whole in
    ``.old-<name>-*/`` beside ``out_dir``, the new one in ``.tmp-<name>-*/``.

    Args:
        meta: extra provenance for space_config.json (base model, training data, steps, ...).
        state_dict: the model's full weights when the live ones are partitioned (DeepSpeed ZeRO-3:
            ``accelerator.get_state_dict`` gathers them on every rank); None: the model's own.

    Raises:
        ValueError: the weights written are empty, do not fit the model's config (e.g. a ZeRO-3
            partition saved without ``state_dict``), or hold NaN or inf (a diverged run); nothing
            is written then.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    config = {"mode": mode, "mask_token_ids": list(spec.token_ids), "mask_num": spec.mask_num,
              "mask_diff": spec.mask_diff, "commit": git_commit(), **meta}
    try:
        if mode == "full":
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
        else:
            # peft: LoRA weights + adapter_config.json only; the base embedding (resized for the mask
            # token) is the base model's, and the mask rows are saved on their own just below
            model.save_pretrained(tmp, state_dict=state_dict, save_embedding_layers=False)
            save_mask_rows(mask_embedding(model), tmp / MASK_EMBEDDING, _entry(state_dict, "mask_rows"))
            head = sampler_head(model)
            if head is not None:
                save_sampler_head(head, tmp / SAMPLER_HEAD, _entry(state_dict, SAMPLER_ATTR + "."))
                config["sampler_head"] = {"width": head.width}
        (tmp / SPACE_CONFIG).write_text(json.dumps(config, indent=2))
        check_artifact(tmp, model.config.hidden_size, where=out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_folder(tmp, out)
    return out


def _entry(state_dict: dict[str, torch.Tensor] | None, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of a gathered state dict under ``key`` (a parameter's last name, or a module
    prefix ending in "."), keyed by what follows it; None without a state dict."""
    if state_dict is None:
        return None
    if not key.endswith("."):
        return {key: v for k, v in state_dict.items() if k.endswith("." + key)}
    return {k.split(key, 1)[1]: v for k, v in state_dict.items() if key in k}


def check_artifact(folder: Path, hidden_size: int | None = None, where: os.PathLike | str | None = None) -> dict:
    """Refuse an artifact whose weights are empty, do not fit its model (a ZeRO-3 partition
    saved without gathering has tensors of shape (0,)), or are not finite; return its
    ``space_config.json`` (:func:`read_space_config`), read once here.

    Full checkpoints: every tensor against the shapes ``config.json`` gives
    (``space.zero3.check_saved_shapes``). Adapters: the LoRA pairs (``read_lora``) and the mask rows,
    ``(1 or k, hidden_size)`` when ``hidden_size`` is given. Both: every tensor of every
    safetensors file finite (:func:`check_finite`).

    Raises:
        FileNotFoundError / ValueError: no or a damaged space_config.json (:func:`read_space_config`).
        ValueError: an empty tensor, a wrong shape, or a NaN / inf value; the file is named (with
            ``where`` for a folder not yet in place).
    """
    where = Path(where or folder)
    cfg = read_space_config(folder)
    if cfg["mode"] == "full":
        try:
            check_saved_shapes(folder)
        except ValueError as e:
            raise ValueError(str(e).replace(str(folder), str(where))) from None
        check_finite(folder, where)
        return cfg
    read_lora(folder)
    check_finite(folder, where)
    rows = read_tensors(folder / MASK_EMBEDDING).get("mask_rows")
    n = len(cfg["mask_token_ids"])
    if rows is None or rows.dim() != 2 or rows.shape[0] != n or 0 in rows.shape or (
            hidden_size is not None and rows.shape[1] != hidden_size):
        shape = None if rows is None else tuple(rows.shape)
        raise ValueError(f"{where / MASK_EMBEDDING}: mask rows of shape {shape}, expected ({n}, "
                         f"{hidden_size or 'hidden'}): saved while partitioned by ZeRO-3? refusing this artifact")
    return cfg


def check_finite(folder: Path, where: os.PathLike | str | None = None) -> None:
    """Refuse a folder whose safetensors files hold a NaN or inf anywhere.

    A diverged run's weights are non-finite, yet SPACE still decodes them "exactly" (a rejected
    draft never changes greedy output), so exactness cannot catch them: this check does (issue
    59). Tensors are read one at a time (``safe_open``), so a 7B checkpoint never sits in memory
    whole.

    Raises:
        ValueError: names the first non-finite tensor and its file, and how many tensors are.
    """
    bad, total = [], 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    t, total = f.get_tensor(key), total + 1
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad.append(f"{path.name}:{key}")
        except SafetensorError as e:
            raise ValueError(f"{Path(where or folder) / path.name}: not a valid safetensors file ({e})") from None
    if bad:
        raise ValueError(f"{Path(where or folder)}: {len(bad)} of {total} tensors hold NaN or inf, first "
                         f"{bad[0]}: the training diverged; refusing this artifact")


def artifact_folder(model: str | os.PathLike | None, adapter: str | os.PathLike | None) -> Path | None:
    """The SPACE artifact whose ``space_config.json`` holds a run's tuned layout and step-cost
    curves (STYLE.md item 15): ``adapter`` when given, else ``model`` when it is a full SAR-SFT
    checkpoint (a folder holding a space_config.json); None for a plain model or a hub name."""
    if adapter is not None:
        return Path(adapter)
    if model is not None and (Path(model) / SPACE_CONFIG).is_file():
        return Path(model)
    return None


def read_space_config(adapter: Path) -> dict:
    """The ``space_config.json`` of artifact directory ``adapter``.

    Raises:
        FileNotFoundError: no space_config.json in ``adapter``.
        ValueError: not valid JSON, a required key missing, or one of the wrong kind (a mode that is
            not one of the training modes, which loaded as frozen-base; a base model that is not a
            name; mask ids that are not integers); the file is named.
    """
    if not (adapter / SPACE_CONFIG).is_file():
        raise FileNotFoundError(f"{adapter} is not a SPACE adapter (no {SPACE_CONFIG})")
    cfg = read_json(adapter / SPACE_CONFIG)
    where = adapter / SPACE_CONFIG
    missing = [key for key in ("mode", "base_model", "mask_num", "mask_diff", "mask_token_ids") if key not in cfg]
    if missing:
        raise ValueError(f"{where}: not a valid SPACE config (missing {', '.join(missing)})")
    ids = cfg["mask_token_ids"]
    bad = [key for key, ok in (("mode", cfg["mode"] in MODES), ("base_model", isinstance(cfg["base_model"], str)),
                               ("mask_num", type(cfg["mask_num"]) is int and cfg["mask_num"] >= 1),
                               ("mask_diff", isinstance(cfg["mask_diff"], bool)),
                               ("mask_token_ids", isinstance(ids, list) and ids and all(type(i) is int for i in ids)))
           if not ok]
    if bad:
        raise ValueError(f"{where}: not a valid SPACE config ({', '.join(f'{k}={cfg[k]!r}' for k in bad)}; "
                         f"mode is one of {', '.join(MODES)})")
    return cfg


def read_json(path: Path) -> dict:
    """A JSON object from ``path``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8 JSON holding an object, e.g. a truncated or garbage file (named).
    """
    try:  # a damaged or hand-edited file: name it, rather than a bare JSONDecodeError / UnicodeDecodeError
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not valid JSON for this file (a {type(data).__name__}, not an object)")
    return data


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file ``path`` (on the CPU).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a truncated or garbage file (named).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f"{path}: not a valid safetensors file ({e})") from None


def check_lora_shape(folder: Path, r: int, alpha: float, targets, use_rslora: bool, what: str) -> None:
    """Refuse LoRA weights in ``folder`` (an artifact or a peft checkpoint, by its
    adapter_config.json) made with another rank, alpha, rsLoRA setting or target list than the run
    about to continue from them: another alpha scales every trained update silently.

    Raises:
        ValueError: a setting differs (``what`` names the folder; both values given), or
            adapter_config.json is damaged.
        FileNotFoundError: no adapter_config.json.
    """
    cfg = read_json(folder / LORA_CONFIG)
    saved = {"lora_r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "use_rslora": bool(cfg.get("use_rslora")),
             "lora_targets": sorted(cfg.get("target_modules") or [])}
    now = {"lora_r": r, "lora_alpha": alpha, "use_rslora": bool(use_rslora), "lora_targets": sorted(targets)}
    diff = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
    if diff:
        raise ValueError(f"{what} holds LoRA weights made with other settings; (saved, now): {diff}")


def read_lora(adapter: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The LoRA updates of a lora / frozen-base artifact (peft's files, read without peft:
    ``PeftModel`` costs a wrapper and a deprecation warning per load for weights we fuse anyway).

    Returns:
        module name (``model.layers.0.self_attn.q_proj``) -> (A (r, in), B (out, r) times the LoRA
        scaling alpha / r, or alpha / sqrt(r) with rsLoRA).

    Raises:
        FileNotFoundError: adapter_config.json or adapter_model.safetensors missing.
        ValueError: either file damaged, a LoRA variant other than plain LoRA (DoRA, per-layer
            ranks, biases, some layers only), or weights that do not pair up (the file is named).
    """
    where = adapter / LORA_CONFIG
    cfg = read_json(where)
    try:
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a valid LoRA config (bad or missing r / lora_alpha: {e})") from None
    if r < 1:
        raise ValueError(f"{where}: not a valid LoRA config (r must be >= 1, got {r})")
    variant = {k: cfg[k] for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "lora_bias",
                                   "layers_to_transform", "layers_pattern") if cfg.get(k)}
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("bias", "none") != "none" or variant:
        raise ValueError(f"{where}: only plain LoRA adapters load here, not peft_type={cfg.get('peft_type')!r} "
                         f"bias={cfg.get('bias')!r} {variant}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    where = adapter / LORA_WEIGHTS
    state = read_tensors(where)
    prefix, a_key, b_key = "base_model.model.", ".lora_A.weight", ".lora_B.weight"
    names = sorted(k[len(prefix): -len(a_key)] for k in state if k.startswith(prefix) and k.endswith(a_key))
    unpaired = sorted(set(state) - {prefix + n + s for n in names for s in (a_key, b_key)})
    if unpaired or not names:
        raise ValueError(f"{where}: not a LoRA weight file of this format (unexpected keys {unpaired[:3]})")
    updates = {}
    for n in names:
        a, b = state[prefix + n + a_key], state[prefix + n + b_key]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{where}: {n} has LoRA shapes {tuple(a.shape)}, {tuple(b.shape)}, not rank {r}")
        updates[n] = (a, b * scaling)
    return updates


def sampler_width(cfg: dict, where: os.PathLike | str = SPACE_CONFIG) -> int | None:
    """The sampler head's width an adapter's ``space_config.json`` records, None without a head.

    Raises:
        ValueError: a malformed ``sampler_head`` entry (``where`` names the adapter).
    """
    entry = cfg.get("sampler_head")
    if entry is None:
        return None
    width = entry.get("width") if isinstance(entry, dict) else None
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"{where}: bad sampler_head entry {entry!r} (expected {{\"width\": n >= 1}})")
    return width


def compile_setup(compile: bool | str | None) -> bool | str:
    """A ``--compile`` setting as runs and step-cost curves record it: False (eager), True
    (inductor's default mode, as runs before the modes recorded it) or the mode's name."""
    return True if compile in (True, "default") else (compile or False)


def setup_key(entry: dict) -> tuple[int, str, str, bool, bool | str, str, str, str, str]:
    """What tells two step-cost setups apart: (threads, kernels, device type, captured steps,
    compile mode, packed kernel, CPU, GPU, dtype). An entry written before issue 58 names no device, capture or
    compile: it was measured eagerly on a CPU. A compiled trunk's steps cost otherwise (a frozen
    trunk on a 2-core Zen 4: 20 ms at 1 row, 36 ms at 16, adapter cost 0,
    ``results/tree_search/zen4_frozen_threads2``). The packed kernel ("" when none is named) is
    the fast kernels' timed choice, which follows the CPU (MKL on an AVX-512 Intel CPU, oneDNN on
    an AVX2 AMD one): curves of two CPUs are kept side by side. So are two CPUs of one packed kernel
    by their ``"cpu"`` (``cpu_kernels.cpu_identity``; "" for an entry written before it): an AVX2
    EPYC's and a Zen 4 EPYC's oneDNN curves differ (``results/humaneval20_zen4_curve``). A CUDA
    curve's ``"gpu"`` (``models.gpu_identity``; "" for an entry written before it) keeps two GPUs'
    curves apart the same way, and the trunk's ``"dtype"`` (an entry written before it was fp32's:
    on a 2-core Zen 4 SmolLM2's 32-row step cost 2.6x a 1-row one in fp32, 2.07x in bf16)."""
    return (entry["threads"], entry["kernels"], entry.get("device", "cpu"), bool(entry.get("capture", False)),
            compile_setup(entry.get("compile", False)), entry.get("packed_kernel") or "", entry.get("cpu") or "",
            entry.get("gpu") or "", entry.get("dtype") or "float32")


def stored_step_costs(cfg: dict, where: os.PathLike | str = SPACE_CONFIG) -> list[dict]:
    """The step-cost curves of an adapter's ``space_config.json`` (``"step_costs"``: one
    ``{"threads", "kernels", "device", "capture", "compile", "step_cost", "adapter_cost"}`` per setup
    (:func:`setup_key`, with the fast kernels' ``"packed_kernel"``, the ``"cpu"`` or ``"gpu"`` and the ``"dtype"``
    where recorded), plus
    ``"trunk"``; written by ``space-tree --write-adapter --dynamic`` (issue 44). [] when it has none.

    Raises:
        ValueError: ``step_costs`` is not such a list (``where`` names the file).
    """
    entries = cfg.get("step_costs", [])
    good = isinstance(entries, list) and all(
        isinstance(e, dict) and type(e.get("threads")) is int and e["threads"] >= 1
        and isinstance(e.get("kernels"), str) and isinstance(e.get("step_cost"), list)
        and isinstance(e.get("device", "cpu"), str) and type(e.get("capture", False)) is bool
        and isinstance(e.get("compile", False), (bool, str)) and isinstance(e.get("packed_kernel", ""), str)
        and isinstance(e.get("cpu", ""), str) and isinstance(e.get("gpu", ""), str)
        and isinstance(e.get("dtype", ""), str)
        for e in entries)
    if not good:
        raise ValueError(f"{where}: bad step_costs: expected a list of {{\"threads\": n >= 1, \"kernels\": str, "
                         f"\"device\": str, \"capture\": bool, \"compile\": bool or mode (optional), "
                         f"\"packed_kernel\": str (optional), \"cpu\" or \"gpu\", \"dtype\": str (optional), "
                         f"\"step_cost\": [[rows, ms], ...], "
                         f"\"adapter_cost\": ms}}, got {entries!r:.200}")
    return entries


def priced_for_setup(decode: DecodeConfig, cfg: dict, threads: int, kernels: str,
                     where: os.PathLike | str = SPACE_CONFIG, device: str = "cpu",
                     capture: bool = False, packed_kernel: str | None = None,
                     compile: bool | str = False, cpu: str | None = None,
                     gpu: str | None = None, dtype: str = "float32") -> tuple[DecodeConfig, dict | None]:
    """A dynamic tree priced by the step-cost curve the adapter stores for ``threads`` CPU threads,
    ``kernels``, the ``device`` type, ``capture`` (captured steps, ``space.decoding.graphs``) and
    ``compile`` (the trunk's compile mode, :func:`compile_setup`; :func:`stored_step_costs`): a
    curve measured at 1 thread prices rows wrong at 2 (issue 44), a CPU's prices a GPU's
    launch-bound steps wrong, and an eager trunk's a compiled one's (issue 58). Apply it after any
    layout flags, so ``--tree dynamic`` over a static stored layout is priced too.

    Which curve: among those of the same kernels, device, capture and compile mode, the ones of the run's
    ``packed_kernel`` (the fast kernels' choice on this CPU) if any; of those, on a CPU, the ones of
    ``cpu`` (None: this machine's, ``cpu_kernels.cpu_identity``) if any, on a CUDA GPU the ones of
    ``gpu`` (None: this machine's, ``models.gpu_identity``) if any; of those, the ones of the trunk's
    ``dtype`` if any (an entry naming none was fp32's); of those, the one of this
    thread count (off a CPU, whatever its threads: a GPU's steps barely depend on the host's), else
    the nearest; with none of the same kernels, device, capture and compile mode, the decode entry's own (which
    may be another device's, the last ``space-tree`` wrote).

    Returns:
        (the layout, the setup its curve was measured with: the stored curve's when one applied,
        else the adapter's ``"step_cost_setup"`` or None). Layouts other than the dynamic tree
        price no rows by a curve and come back unchanged, with None.

    Raises:
        ValueError: a malformed ``step_costs`` entry (``where`` names the file).
    """
    if decode.tree != "dynamic":
        return decode, None
    compile = compile_setup(compile)
    alike = [e for e in stored_step_costs(cfg, where) if setup_key(e)[1:5] == (kernels, device, capture, compile)]
    alike = [e for e in alike if e.get("packed_kernel") == packed_kernel] or alike
    if device == "cpu":  # another CPU's curve only when none is this CPU's (step_cost_mismatch names a named one)
        from .cpu_kernels import cpu_identity

        cpu = cpu or cpu_identity()
        alike = [e for e in alike if e.get("cpu") == cpu] or alike
    elif device == "cuda":  # likewise another GPU's
        from .models import gpu_identity

        gpu = gpu or gpu_identity()
        alike = [e for e in alike if e.get("gpu") == gpu] or alike
    alike = [e for e in alike if (e.get("dtype") or "float32") == dtype] or alike
    entry = next((e for e in alike if device != "cpu" or e["threads"] == threads),
                 min(alike, key=lambda e: abs(e["threads"] - threads), default=None))
    if entry is None:
        return decode, cfg.get("step_cost_setup")
    try:
        priced = decode.override(step_cost=tuple(map(tuple, entry["step_cost"])),
                                 adapter_cost=entry.get("adapter_cost") or 0.0)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: bad step_costs entry for {entry['threads']} threads, {kernels} kernels, {device}"
                         f"{', captured' if capture else ''}{f', compile {compile}' if compile else ''}: {e}") from None
    # the trunk it was measured on: an entry without one predates the fused trunk (issue 58); the
    # packed kernel, when the entry names one (issue 58: MKL's packed GEMM or oneDNN's)
    return priced, {"threads": entry["threads"], "kernels": kernels, "device": device, "capture": capture,
                    "trunk": entry.get("trunk", "unfused"), **({"compile": compile} if compile else {}),
                    **({"packed_kernel": entry["packed_kernel"]} if "packed_kernel" in entry else {}),
                    **{key: entry[key] for key in ("cpu", "gpu", "dtype") if key in entry}}


def adapter_decode_config(cfg: dict, where: os.PathLike | str = SPACE_CONFIG, threads: int | None = None,
                          kernels: str | None = None, device: str = "cpu", packed_kernel: str | None = None,
                          compile: bool | str = False, dtype: str = "float32", gpu: str | None = None) -> DecodeConfig:
    """The decode layout an adapter's ``space_config.json`` records (``"decode"``), else k = its
    trained k with the paper's k+1 groups; with ``threads`` and ``kernels``, its step-cost curve
    the one stored for that setup on the ``device`` type, ``packed_kernel``, ``compile`` mode,
    trunk ``dtype`` and ``gpu`` (a CUDA device's name; None: the current one's), steps not captured
    (:func:`priced_for_setup`), else the entry's own: a dynamic tree's prices, which a static layout
    carries for a ``tree="dynamic"`` override.

    Raises:
        ValueError: a malformed ``decode`` or ``step_costs`` entry, or a ``decode`` k above the
            trained ``mask_num`` (masks at offsets never trained: ``where`` names the file).
    """
    try:
        decode = DecodeConfig.from_dict(cfg["decode"]) if "decode" in cfg else DecodeConfig(mask_num=cfg["mask_num"])
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{where}: bad decode settings: {e}") from None
    if decode.mask_num > cfg["mask_num"]:  # space-tree caps k at the trained k: only a hand edit gets here
        raise ValueError(f"{where}: decode mask_num {decode.mask_num} exceeds the trained mask_num {cfg['mask_num']}")
    if not threads:
        return decode
    # priced as a dynamic tree whatever the stored layout: a static one carries the curve too (it
    # prices nothing there), so --tree dynamic over it in space-chat or space.hf.generate is priced
    # for this setup, as space-eval prices it after its flags
    priced = priced_for_setup(decode.as_dynamic(), cfg, threads, kernels, where, device,
                              packed_kernel=packed_kernel, compile=compile, gpu=gpu, dtype=dtype)[0]
    return decode.override(step_cost=priced.step_cost, adapter_cost=priced.adapter_cost)


def save_mask_rows(emb: MaskEmbedding, path: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the trainable mask rows of ``emb`` to ``path`` (safetensors, fp32, key ``mask_rows``).

    Args:
        state: ``{"mask_rows": tensor}`` gathered from a ZeRO-3 model; None: ``emb``'s own rows.
    """
    rows = emb.mask_rows if state is None else state["mask_rows"]
    save_file({"mask_rows": rows.detach().float().contiguous().cpu()}, path)


def load_mask_rows(emb: MaskEmbedding, path: str | os.PathLike) -> None:
    """Copy mask rows written by :func:`save_mask_rows` into ``emb``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a damaged file, or rows of another shape (another mask_diff, k or model width).
    """
    copy_mask_rows(emb, read_tensors(Path(path)), path)


def copy_mask_rows(emb: MaskEmbedding, tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Copy the ``mask_rows`` tensor of a mask-embedding file (read from ``path``) into ``emb``.

    Raises:
        ValueError: no ``mask_rows`` in it, or rows of another shape (the file is named).
    """
    rows = tensors.get("mask_rows")
    if rows is None:
        raise ValueError(f"{path}: no mask_rows tensor (keys {sorted(tensors)[:3]})")
    if rows.shape != emb.mask_rows.shape:
        raise ValueError(f"{path}: mask rows of shape {tuple(rows.shape)}, expected {tuple(emb.mask_rows.shape)}")
    with torch.no_grad():
        emb.mask_rows.copy_(rows)


def save_sampler_head(head: SamplerHead, path: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``head``'s weights to ``path`` (safetensors, fp32); ``state``: its weights gathered from
    a ZeRO-3 model (None: the head's own)."""
    state = head.state_dict() if state is None else state
    save_file({k: v.detach().float().contiguous().cpu() for k, v in state.items()}, path)


def load_sampler_head(head: SamplerHead, path: str | os.PathLike) -> None:
    """Copy weights written by :func:`save_sampler_head` into ``head``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a damaged file, or weights of other names or shapes (another width or model).
    """
    state = read_tensors(Path(path))
    mine = head.state_dict()
    if set(state) != set(mine) or any(state[k].shape != mine[k].shape for k in mine):
        raise ValueError(f"{path}: sampler head weights {({k: tuple(v.shape) for k, v in state.items()})} do not "
                         f"fit a head of width {head.width} on this model")
    head.load_state_dict({k: v.to(mine[k]) for k, v in state.items()})


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
