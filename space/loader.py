"""Load a SPACE model: the base, its mask tokens, the adapter's layers and tuned layout
(:func:`load_space`, for decoding), or an artifact's weights into a model being trained
(:func:`warm_start`).

``load_space`` reads the LoRA weights without peft (``space.artifact.read_lora``) and puts a
frozen-base adapter's updates in ``space.adapter_layers.GatedLoraLinear`` layers, so AR forwards
cost exactly the base model's.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from peft import set_peft_model_state_dict

from .adapter_layers import MaskEmbedding, apply_lora, mask_embedding
from .artifact import (LORA_WEIGHTS, MASK_EMBEDDING, SAMPLER_HEAD, SPACE_CONFIG, adapter_decode_config,
                       artifact_folder, check_artifact, check_finite, check_lora_shape, copy_mask_rows,
                       load_mask_rows, load_sampler_head, priced_for_setup, read_lora, read_space_config,
                       read_tensors, sampler_width)
from .choices import COMPILE_MODES, STEP_COST_CHOICES
from .cli import device_flag
from .cpu_kernels import KERNEL_CHOICES, apply_kernels
from .decoding.compiled import compile_trunk
from .decoding.config import DEFAULT_MASK_NUM
from .decoding.backends import choose_sdpa
from .decoding.cache import attention_dtype
from .decoding.fused import fuse_trunk
from .eval.step_cost import price_at_load, trunk_dtype
from .models import SMOLLM2, dispatch, load_model, model_gpu, model_identity
from .sampler_head import add_sampler_head, sampler_head
from .tokens import MaskSpec, add_mask_tokens, mask_spec, suppress_in_generate


def load_space(model: str | None = None, adapter: str | os.PathLike | None = None, mask_num: int = DEFAULT_MASK_NUM,
               dtype="float32", device: str = "cpu", device_map: str | dict | None = None, kernels: str = "stock",
               compile: bool | str = False, step_cost: str = "auto"):
    """Load a model ready for SPACE decoding.

    Args:
        model: alias or path of the base (default: the adapter's recorded base, else SmolLM2).
            Another base than the adapter's recorded ``base_model`` gives a UserWarning naming both.
        adapter: a lora / frozen-base artifact directory, or None.
        mask_num: k for a model that has no mask token yet (untrained masks: exact, accepts little;
            loading such a model without an adapter gives a UserWarning).
        device_map: None (all on ``device``), or a ``space.models.parse_device_map`` value: the
            base loads placed, and once the mask token and adapter are in, the model is placed
            again by the resolved map (``space.models.dispatch``), so the new modules (mask
            embedding, resized embeddings) get their hooks too.
        kernels: ``"fast"`` applies ``space.cpu_kernels.optimize_for_cpu`` to an fp32 CPU model
            (prepacked linears, GQA attention, one-call RMSNorm; a no-op elsewhere): on a 2-core CPU plain
            ``generate`` runs about 2x faster, and SPACE's many-row steps gain more than that.
            ``"stock"`` (default) keeps PyTorch's own linears (on the fused trunk, below). Packed weights are for inference
            only: never train them.
        compile: ``torch.compile`` the trunk after the kernels (``space.decoding.compiled``, issue
            43); ``SpaceDecoder`` and ``ar_generate`` then preallocate their KV caches. True or
            ``"default"``: inductor's default mode; ``"reduce-overhead"``: with CUDA graphs (a GPU);
            ``"frozen"``: the weights folded into the graph for inductor's C++ GEMM (a CPU: AR's
            step about 2x faster than eager, ``results/compile_cpu``).
        step_cost: how an adapter's dynamic tree is priced (issue 58), as ``space-eval --step-cost``
            (``space.eval.step_cost.price_at_load``): ``"auto"`` (default) measures this machine's
            curve at load (a few seconds) on a CUDA GPU when the adapter's stored layout is the
            dynamic tree and it stores no curve of this setup, which a stored CPU curve would price
            wrong (14 rows at 1.6x one, where an H200's eager step pays about 1.3x), never on a
            compiled trunk; ``"measure"`` always; ``"stored"`` never. A measured curve differs from
            load to load, and so do the trees it prices: a seeded sampled call repeats within one
            load; ``"stored"`` gives every process the same layout. The curve's setup is recorded
            as ``model.space_step_cost_setup``.

    An eager model on one device gets the fused trunk (``space.decoding.fused.fuse_trunk``,
    issue 58: q/k/v and gate/up in one GEMM each, a frozen-base LoRA packed under them, an
    attention that reads the keys up to the mask's width, GQA without ``repeat_kv``, on CUDA one
    kernel per RMSNorm), which every method then runs, AR included; it
    computes what ``load_model``'s model computes up to float rounding (other GEMM shapes), and
    ``model.space_trunk`` records it. On CUDA in bf16 / fp16, cuDNN attention is turned off
    (process-wide: ``space.decoding.backends``), recorded in ``model.space_sdpa``.

    An adapter's tuned decode layout (``space_config.json`` ``"decode"``; a full SAR-SFT
    checkpoint's, given as ``model``, alike) is recorded on the returned model as
    ``model.config.space_decode``, the default of ``SpaceDecoder(model, spec)``; a dynamic tree is
    priced by the step-cost curve the adapter (or checkpoint) stores for ``kernels``,
    ``torch.get_num_threads()`` at load, the device type, the packed kernel the fast kernels
    chose and ``compile`` (``space.artifact.priced_for_setup``), else by its own.

    Returns:
        (model, tokenizer, MaskSpec): a plain HF model in every case. A lora adapter is merged
        into the weights; a frozen-base adapter stays separate as :class:`GatedLoraLinear` layers,
        so every forward without mask tokens (AR, HF ``generate``) computes exactly the original
        model, and real-token logits are the base model's in SPACE steps too.

    Raises:
        FileNotFoundError: adapter directory without space_config.json or another artifact file,
            unknown model.
        ValueError: the base's tokenizer gives the mask token another id than recorded; a damaged
            artifact file (space_config.json not a JSON object or lacking a key, a truncated or
            garbage safetensors file; the file is named); a NaN or inf weight (the tensor named);
            LoRA weights that do not fit the model;
            a ``device`` torch does not know or this machine lacks (``space.cli.device_flag``;
            ``"auto"`` is the GPU when there is one);
            a bad device map (``space.models.dispatch``); kernels not in ``KERNEL_CHOICES``; a
            ``compile`` this machine cannot run (:func:`check_compile`); ``step_cost`` not in
            ``STEP_COST_CHOICES``, or ``"measure"`` with ``compile`` (its graphs build first, minutes:
            ``space-tree --compile`` stores a compiled trunk's curve).
    """
    if kernels not in KERNEL_CHOICES:  # before the load, not after it
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if device_map is None:  # torch's own refusal came after the weights had loaded (an AssertionError for cuda)
        device = device_flag(device)  # "auto" as the CLIs take it: the GPU when there is one
    check_compile(compile, device, device_map)
    if step_cost not in STEP_COST_CHOICES:
        raise ValueError(f"step_cost must be one of {STEP_COST_CHOICES}, got {step_cost!r}")
    if step_cost == "measure" and compile:
        raise ValueError("step_cost measure times the eager trunk: a compiled trunk's curve builds its graphs first "
                         "(minutes); measure it with space-tree --compile --write-adapter")
    if adapter is None:
        folder = artifact_folder(model, None)  # a full SAR-SFT artifact, else a plain model
        cfg = check_artifact(folder) if folder is not None else None
        if cfg is not None and cfg["mode"] != "full":  # the mirror of a full checkpoint given as the adapter
            raise ValueError(f"{model} is a {cfg['mode']} adapter, not a model: pass it as the adapter "
                             f"(--adapter {model}), with its base model ({cfg.get('base_model')}) as the model")
        base, tok = load_model(model or SMOLLM2, dtype, device, device_map)
        try:
            spec = mask_spec(base, tok)
            suppress_in_generate(base, spec)  # a checkpoint saved without it
        except ValueError:  # a plain model: its new mask token is untrained, which a user rarely means
            warnings.warn(f"{model or SMOLLM2} has no SPACE mask token and no adapter was given: SPACE decodes "
                          f"exactly but with untrained masks, whose drafts are rarely accepted; pass a SPACE "
                          f"adapter (e.g. adapters/smollm2-135m-space) or a SAR-SFT checkpoint", stacklevel=2)
            spec = add_mask_tokens(base, tok, mask_num)
            if device_map is not None:  # the resized embeddings are new modules, without hooks
                dispatch(base, base.hf_device_map)
        _trunk(base, compile, device_map)
        applied = apply_kernels(base, kernels)
        if cfg is None:
            return (compile_trunk(base, None if compile is True else compile) if compile else base), tok, spec
        return _with_tuned_layout(base, cfg, folder, kernels, applied, compile, step_cost), tok, spec
    adapter = Path(adapter)
    cfg = read_space_config(adapter)
    if cfg["mode"] == "full":
        raise ValueError(f"{adapter} is a full checkpoint: pass it as the model, not as an adapter")
    if model is not None and model_identity(model) != model_identity(cfg["base_model"]):
        warnings.warn(f"adapter {adapter} was trained on base model {cfg['base_model']!r}, not on the given "
                      f"model {model!r}: its drafts may be rarely accepted"
                      + (" (output stays exact to the given model)" if cfg["mode"] == "frozen-base"
                         else " and its merged LoRA changes a model it was not trained for"), stacklevel=2)
    updates = read_lora(adapter)  # a damaged file fails here, before the base model loads
    rows = read_tensors(adapter / MASK_EMBEDDING)
    head_width = sampler_width(cfg, adapter)
    check_finite(adapter)  # after the files' own checks, which name what is damaged; NaN decodes "exactly"
    base, tok = load_model(model or cfg["base_model"], dtype, device, device_map)
    spec = add_mask_tokens(base, tok, cfg["mask_num"], cfg["mask_diff"])
    if list(spec.token_ids) != cfg["mask_token_ids"]:
        raise ValueError(f"mask ids {spec.token_ids} differ from the adapter's {cfg['mask_token_ids']}: wrong base model?")
    emb = MaskEmbedding(base.get_input_embeddings(), spec.token_ids)
    copy_mask_rows(emb, rows, adapter / MASK_EMBEDDING)
    base.set_input_embeddings(emb)
    apply_lora(base, updates, cfg["mode"], adapter / LORA_WEIGHTS)
    if head_width is not None:
        load_sampler_head(add_sampler_head(base, head_width).eval().requires_grad_(False), adapter / SAMPLER_HEAD)
    if device_map is not None:  # the new modules (embedding, gated layers, sampler head) have no hooks yet
        dispatch(base, base.hf_device_map)
    _trunk(base.eval(), compile, device_map)
    applied = apply_kernels(base, kernels)
    return _with_tuned_layout(base, cfg, adapter, kernels, applied, compile, step_cost), tok, spec


def _with_tuned_layout(base, cfg: dict, folder: Path, kernels: str, applied: dict, compile: bool | str,
                       step_cost: str):
    """``base`` compiled as ``compile`` says, with the tuned layout of the artifact in ``folder``
    (its ``space_config.json`` ``cfg``: an adapter's, or a full SAR-SFT checkpoint's) as
    ``config.space_decode``, a dynamic tree priced as ``step_cost`` says, and the curve's setup as
    ``space_step_cost_setup`` (:func:`load_space`). Returns the model."""
    # the tuned layout travels with the model: SpaceDecoder(model, spec) decodes with it
    on = next(base.parameters()).device.type  # a CPU's curve prices a GPU's steps wrong
    threads, packed = torch.get_num_threads(), applied.get("packed_kernel")
    dtype = trunk_dtype(base)  # a bf16 trunk's steps cost otherwise than fp32's
    gpu = model_gpu(base)  # on a host with two kinds of GPU, the model's, not the current one
    decode = adapter_decode_config(cfg, folder / SPACE_CONFIG, threads, kernels, on, packed, compile, dtype, gpu)
    # which stored curve priced it (None: none of this setup), for "auto" to tell whether to measure
    setup = priced_for_setup(decode.as_dynamic(), cfg, threads, kernels, folder / SPACE_CONFIG, on,
                             packed_kernel=packed, compile=compile, gpu=gpu, dtype=dtype)[1]
    model = compile_trunk(base, None if compile is True else compile) if compile else base
    # priced as a dynamic tree whatever the stored layout: a static one carries the curve for a
    # tree="dynamic" override (space-chat, space.hf.generate), as adapter_decode_config prices it
    # auto measures for a stored dynamic tree only: a static layout's curve serves an override alone
    mode = "stored" if step_cost == "auto" and decode.tree != "dynamic" else step_cost
    dynamic, model.space_step_cost_setup = price_at_load(model, decode.as_dynamic(), setup, mode, kernels,
                                                         compiled=compile, tool="load_space")
    if step_cost != "stored" and decode.tree == "dynamic":  # "stored": space-eval and space-chat warn themselves
        from .eval.step_cost import warn_step_cost_mismatch

        warn_step_cost_mismatch(model.space_step_cost_setup, model, threads, kernels, compile,
                                packed_kernel=packed, stacklevel=3)
    model.config.space_decode = decode.override(step_cost=dynamic.step_cost, adapter_cost=dynamic.adapter_cost).to_dict()
    return model


def check_compile(compile: bool | str, device: str = "cpu", device_map: str | dict | None = None) -> None:
    """Refuse a ``compile`` setting before anything loads (a compile that fails starts minutes in).

    Raises:
        ValueError: not a bool or one of ``COMPILE_MODES``; ``"reduce-overhead"`` (CUDA graphs)
            on a machine without a usable CUDA GPU, or on a CPU or MPS ``device``; ``"frozen"``
            off the CPU or with a ``device_map``.
    """
    if compile not in (False, True, *COMPILE_MODES):
        raise ValueError(f"compile must be a bool or one of {COMPILE_MODES}, got {compile!r}")
    if compile == "frozen" and (device_map is not None or str(device).split(":")[0] != "cpu"):
        raise ValueError(f"compile mode frozen packs the weights for inductor's C++ GEMM and runs on one CPU, got "
                         f"device {device!r}" + (f" and device_map {device_map!r}" if device_map is not None else "")
                         + "; on a GPU, space-eval --capture replays CUDA graphs")
    if compile != "reduce-overhead":
        return
    if not torch.cuda.is_available():
        raise ValueError("compile mode reduce-overhead records CUDA graphs and needs a CUDA GPU; none is usable "
                         "here (compile mode default compiles for the CPU)")
    if device_map is None and str(device).split(":")[0] in ("cpu", "mps"):
        raise ValueError(f"compile mode reduce-overhead records CUDA graphs and needs a CUDA device, got device "
                         f"{device!r}")


def _trunk(model, compile: bool | str, device_map) -> None:
    """The fused trunk (``space.decoding.fused.fuse_trunk``: q/k/v and gate/up in one GEMM each,
    ``space.decoding.backends.SDPA_GQA`` attention) for an eager model on one device, recorded as ``model.space_trunk``
    (``None`` when left unfused: a compiled trunk, whose graphs fuse on their own and must not
    hold module state, or a model spread over devices); and the attention backend for its device
    and dtype (``space.decoding.backends.choose_sdpa``), recorded as ``model.space_sdpa``."""
    model.space_trunk = None if compile or device_map is not None else fuse_trunk(model)
    # the trunk's dtype, not model.dtype: an adapter's fp32 mask rows come first in a bf16 model
    model.space_sdpa = choose_sdpa(model.device.type, attention_dtype(model.get_decoder()))


def warm_start(model, adapter: str | os.PathLike, mode: str, spec: MaskSpec) -> None:
    """Start training from a saved lora / frozen-base artifact: copy its LoRA weights and mask rows
    into ``model`` (a peft model from :func:`prepare_model` with the same LoRA shape).

    Continuing from the shipped adapter on new data trains a stronger drafter in less time than
    starting from zero LoRA and the base's mean embedding (#13).

    Raises:
        FileNotFoundError / ValueError: not an artifact (:func:`read_space_config`); a full
            checkpoint, another mode, k or mask_diff, a NaN or inf weight, or LoRA weights made
            with another rank, alpha or target list (:func:`space.artifact.check_lora_shape`).
    """
    adapter = Path(adapter)
    cfg = read_space_config(adapter)
    mine = {"mode": mode, "mask_num": spec.mask_num, "mask_diff": spec.mask_diff}
    diff = {k: (cfg[k], v) for k, v in mine.items() if cfg[k] != v}
    if diff:
        raise ValueError(f"init_adapter {adapter} was trained with other settings; (adapter, now): {diff}")
    lora = model.peft_config["default"]
    check_lora_shape(adapter, lora.r, lora.lora_alpha, lora.target_modules, lora.use_rslora, f"init_adapter {adapter}")
    check_finite(adapter)
    state = read_tensors(adapter / LORA_WEIGHTS)
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as e:  # size mismatch: another LoRA rank
        raise ValueError(f"init_adapter {adapter}: LoRA weights do not fit this model ({' '.join(str(e).split())[:300]})") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"init_adapter {adapter}: LoRA layers differ from this model's (unexpected "
                         f"{result.unexpected_keys[:3]}, missing {missing[:3]}): other lora_targets?")
    load_mask_rows(mask_embedding(model), adapter / MASK_EMBEDDING)
    head = sampler_head(model)
    if head is not None and sampler_width(cfg, adapter) is not None:  # else the head starts fresh
        load_sampler_head(head, adapter / SAMPLER_HEAD)
