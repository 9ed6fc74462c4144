"""Training modes and SPACE artifacts (DESIGN §3.6): full, lora, frozen-base.

* ``full``: every weight trains, the mask rows of the embedding included; saved as a HF checkpoint.
* ``lora``: peft LoRA on every token plus trainable mask embeddings; saved as a small adapter.
* ``frozen-base``: base weights frozen; trainable mask embeddings plus a LoRA whose update is
  multiplied by a gate that is 1 on mask rows and 0 on real rows. Real tokens never attend to
  masks, so every real-token logit equals the original model's: SPACE is lossless against the
  user's own checkpoint.

Which rows are masks travels explicitly: the caller wraps its forward in
``space.masking.mask_rows(start)`` (mask groups are always the block's tail, so one integer says it;
the decoder and the frozen-base trainer do this), and forward hooks on the peft ``lora_B`` modules
(training) or :class:`GatedLoraLinear` (decoding) read it. No module stores per-call state, and a
forward outside such a block (AR, HF ``generate``) is exactly the base model. No modeling file is
forked.

For decoding, :func:`load_space` reads the LoRA weights without peft and puts each LoRA update
of a frozen-base adapter in a :class:`GatedLoraLinear` (:func:`fuse_frozen_base` does the same
to a live peft model): the same update, computed only on the block's mask rows and skipped
entirely when the input holds no mask token. peft's per-layer Python (4 module calls and a hook on
each of 210 linears in SmolLM2) cost about 45 ms per forward on a 2-core CPU, more than half an AR
token; the fused layer leaves AR forwards exactly the base model's cost.

Artifact layout (lora / frozen-base): ``adapter_model.safetensors`` + ``adapter_config.json``
(peft), ``mask_embedding.safetensors`` (the k or 1 mask rows), ``space_config.json`` (base model,
mode, mask ids, mask_num, training data, commit), and with the optional sampler head (issue 34,
``space.sampler_head``) ``sampler_head.safetensors`` plus its width under ``"sampler_head"`` in
``space_config.json``. Written to a temporary directory and renamed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .cpu_kernels import KERNEL_CHOICES, apply_kernels
from .decoding.compiled import compile_trunk
from .decoding.config import DEFAULT_MASK_NUM, DecodeConfig
from .masking import mask_rows_start
from .models import SMOLLM2, dispatch, load_model, model_identity
from .sampler_head import SAMPLER_ATTR, SamplerHead, add_sampler_head, sampler_head
from .tokens import MaskSpec, add_mask_tokens, mask_spec
from .zero3 import check_saved_shapes, gathered

MODES = ("full", "lora", "frozen-base")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPACE_CONFIG = "space_config.json"
MASK_EMBEDDING = "mask_embedding.safetensors"
LORA_WEIGHTS, LORA_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names
SAMPLER_HEAD = "sampler_head.safetensors"


class MaskEmbedding(nn.Module):
    """Input embedding with trainable mask rows.

    Args:
        base: the model's original embedding (frozen in lora / frozen-base).
        mask_ids: contiguous mask token ids.

    ``forward(input_ids (batch, seq)) -> (batch, seq, hidden)``: the base embedding, with the
    trainable row of each mask token in its place. It records nothing: which rows are masks
    travels through :func:`space.masking.mask_rows`.

    Raises:
        ValueError: mask ids that are not contiguous.
    """

    def __init__(self, base: nn.Embedding, mask_ids: tuple[int, ...]):
        super().__init__()
        if list(mask_ids) != list(range(mask_ids[0], mask_ids[0] + len(mask_ids))):
            raise ValueError(f"mask ids must be contiguous, got {mask_ids}")
        self.base = base
        self.first_id, self.num = mask_ids[0], len(mask_ids)
        with gathered([base.weight]):  # ZeRO-3: the rows live on every rank only while gathered
            # fp32 whatever the base's dtype: a bf16 base trains its mask rows in fp32 (forward casts)
            self.mask_rows = nn.Parameter(base.weight[list(mask_ids)].detach().float())

    @property
    def weight(self) -> torch.Tensor:  # HF utilities (tying, resizing) look for .weight
        return self.base.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids)
        is_mask = (input_ids >= self.first_id) & (input_ids < self.first_id + self.num)
        rows = self.mask_rows[(input_ids - self.first_id).clamp(0, self.num - 1)]
        return torch.where(is_mask[..., None], rows.to(out.dtype), out)


class GatedLoraLinear(nn.Module):
    """A frozen-base LoRA linear for decoding: ``W x`` on real rows, ``W x + B A x`` on mask rows.

    Args:
        base: the frozen ``nn.Linear`` (in -> out), or a ``space.cpu_kernels.PackedLinear`` that
            packs ``lora_a`` under W (``extra_out`` > 0: one kernel call gives ``W x`` and ``A x``).
        lora_a: (r, in); lora_b: (out, r), already multiplied by the LoRA scaling.

    ``forward(x (batch, seq, in)) -> (batch, seq, out)``. Mask rows are rows
    ``space.masking.mask_rows_start()`` on (the layout puts mask groups last); the update runs on
    those rows only, so real rows get the base linear's output and no LoRA term. Outside a
    ``mask_rows`` block (AR, HF ``generate``), or when the call holds no mask row, the layer is
    the base alone and costs what the base costs. (With the CPU kernels' per-row-count paths, a
    few-row call may take MKL and a many-row call oneDNN: the same weights, equal to fp32
    rounding, ``space.cpu_kernels``.)
    """

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_b = nn.Parameter(lora_a, requires_grad=False), nn.Parameter(lora_b, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = mask_rows_start()
        if s is None or s >= x.shape[-2]:  # no mask row (AR, HF generate, a block of real rows): the base alone
            return self.base(x)
        if getattr(self.base, "extra_out", 0):  # A packed under W: x W^T and x A^T in one call
            y, xa = self.base.forward_extra(x)
            xa = xa[:, s:]
        else:
            y = self.base(x)
            xa = nn.functional.linear(x[:, s:], self.lora_a)
        if x.shape[0] == 1:  # a decode step: the update as one in-place gemm on the mask rows
            y[0, s:].addmm_(xa[0], self.lora_b.T)
        else:
            y[:, s:] += nn.functional.linear(xa, self.lora_b)
        return y


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


def fuse_frozen_base(peft_model) -> nn.Module:
    """Replace the peft LoRA layers of a frozen-base model by :class:`GatedLoraLinear` (decoding).

    Args:
        peft_model: a peft model from :func:`prepare_model` / ``PeftModel.from_pretrained`` whose
            input embedding is a MaskEmbedding, with the ``default`` adapter.

    Returns:
        the underlying HF model (``LlamaForCausalLM``-like), no longer wrapped by peft; its
        outputs equal the gated peft model's (mask rows up to float rounding, real rows exactly).

    Raises:
        ValueError: the model has no MaskEmbedding (not a frozen-base model).
    """
    emb = mask_embedding(peft_model)
    if emb is None:
        raise ValueError("fuse_frozen_base needs a frozen-base model (its input embedding must be a MaskEmbedding)")
    model = peft_model.get_base_model()
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, layer in layers:
        parent, _, attr = name.rpartition(".")
        a = layer.lora_A["default"].weight.detach()
        b = layer.lora_B["default"].weight.detach() * layer.scaling["default"]
        setattr(model.get_submodule(parent), attr, GatedLoraLinear(layer.get_base_layer(), a, b))
    return model.eval()


def _gate_lora(model) -> None:
    """Apply every LoRA update to mask rows only (frozen-base training): rows before
    ``mask_rows_start()`` get exactly zero, and outside a ``mask_rows`` block every row does."""
    def hook(module, args, out):
        s = mask_rows_start()
        if s is None:
            return out * 0.0  # keeps the graph: the trainable weights still get (zero) gradients
        if s == 0:
            return out
        gate = (torch.arange(out.shape[-2], device=out.device) >= s).to(out.dtype)[:, None]
        return out * gate

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for lora_b in module.lora_B.values():
                lora_b.register_forward_hook(hook)


def prepare_model(model, tokenizer, mode: str, mask_num: int, mask_diff: bool = False, lora_r: int = 16,
                  lora_alpha: int = 32, lora_dropout: float = 0.0, lora_targets=LORA_TARGETS):
    """Add mask tokens and set up the training mode.

    Returns:
        (model, MaskSpec): the model to train (a peft model for lora / frozen-base).

    Raises:
        ValueError: unknown mode or mask_num out of range.
    """
    if mode not in MODES:
        raise ValueError(f"unknown training mode {mode!r}; choose one of {MODES}")
    spec = add_mask_tokens(model, tokenizer, mask_num, mask_diff)
    if mode == "full":
        model.requires_grad_(True)
        return model, spec
    emb = MaskEmbedding(model.get_input_embeddings(), spec.token_ids)
    model.set_input_embeddings(emb)
    cfg = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                     target_modules=list(lora_targets), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    emb.mask_rows.requires_grad_(True)  # peft froze everything that is not LoRA
    if mode == "frozen-base":
        _gate_lora(peft_model)
    return peft_model, spec


def mask_embedding(model) -> MaskEmbedding | None:
    emb = model.get_input_embeddings()
    return emb if isinstance(emb, MaskEmbedding) else None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def save_artifact(out_dir: str | os.PathLike, model, tokenizer, spec: MaskSpec, mode: str, meta: dict,
                  state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trained SPACE model atomically (temporary directory, then rename), after checking
    what was written (:func:`check_artifact`).

    Args:
        meta: extra provenance for space_config.json (base model, training data, steps, ...).
        state_dict: the model's full weights when the live ones are partitioned (DeepSpeed ZeRO-3:
            ``accelerator.get_state_dict`` gathers them on every rank); None: the model's own.

    Raises:
        ValueError: the weights written are empty or do not fit the model's config (e.g. a ZeRO-3
            partition saved without ``state_dict``); nothing is written then.
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
    for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700: give the artifact normal permissions
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _entry(state_dict: dict[str, torch.Tensor] | None, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of a gathered state dict under ``key`` (a parameter's last name, or a module
    prefix ending in "."), keyed by what follows it; None without a state dict."""
    if state_dict is None:
        return None
    if not key.endswith("."):
        return {key: v for k, v in state_dict.items() if k.endswith("." + key)}
    return {k.split(key, 1)[1]: v for k, v in state_dict.items() if key in k}


def check_artifact(folder: Path, hidden_size: int | None = None, where: os.PathLike | str | None = None) -> None:
    """Refuse an artifact whose weights are empty or do not fit its model (a ZeRO-3 partition
    saved without gathering has tensors of shape (0,)).

    Full checkpoints: every tensor against the shapes ``config.json`` gives
    (``space.zero3.check_saved_shapes``). Adapters: the LoRA pairs (``read_lora``) and the mask rows,
    ``(1 or k, hidden_size)`` when ``hidden_size`` is given.

    Raises:
        ValueError: an empty tensor or a wrong shape; the file is named (with ``where`` for a
            folder not yet in place).
    """
    where = Path(where or folder)
    cfg = read_space_config(folder)
    if cfg["mode"] == "full":
        try:
            check_saved_shapes(folder)
        except ValueError as e:
            raise ValueError(str(e).replace(str(folder), str(where))) from None
        return
    read_lora(folder)
    rows = read_tensors(folder / MASK_EMBEDDING).get("mask_rows")
    n = len(cfg["mask_token_ids"])
    if rows is None or rows.dim() != 2 or rows.shape[0] != n or 0 in rows.shape or (
            hidden_size is not None and rows.shape[1] != hidden_size):
        shape = None if rows is None else tuple(rows.shape)
        raise ValueError(f"{where / MASK_EMBEDDING}: mask rows of shape {shape}, expected ({n}, "
                         f"{hidden_size or 'hidden'}): saved while partitioned by ZeRO-3? refusing this artifact")


def load_space(model: str | None = None, adapter: str | os.PathLike | None = None, mask_num: int = DEFAULT_MASK_NUM,
               dtype="float32", device: str = "cpu", device_map: str | dict | None = None, kernels: str = "stock",
               compile: bool = False):
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
            (oneDNN-prepacked linears, GQA attention; a no-op elsewhere): on a 2-core CPU plain
            ``generate`` runs about 2x faster, and SPACE's many-row steps gain more than that.
            ``"stock"`` (default) keeps transformers' kernels, so the model computes bit for bit
            what ``load_model`` gives. Packed weights are for inference only: never train them.
        compile: ``torch.compile`` the trunk after the kernels (``space.decoding.compiled``, issue
            43); ``SpaceDecoder`` and ``ar_generate`` then preallocate their KV caches.

    An adapter's tuned decode layout (``space_config.json`` ``"decode"``) is recorded on the
    returned model as ``model.config.space_decode``, the default of ``SpaceDecoder(model, spec)``.

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
            garbage safetensors file; the file is named); LoRA weights that do not fit the model;
            a bad device map (``space.models.dispatch``); kernels not in ``KERNEL_CHOICES``.
    """
    if kernels not in KERNEL_CHOICES:  # before the load, not after it
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if adapter is None:
        if model is not None and (Path(model) / SPACE_CONFIG).is_file():  # a full SAR-SFT artifact
            check_artifact(Path(model))
        base, tok = load_model(model or SMOLLM2, dtype, device, device_map)
        try:
            spec = mask_spec(base, tok)
        except ValueError:  # a plain model: its new mask token is untrained, which a user rarely means
            warnings.warn(f"{model or SMOLLM2} has no SPACE mask token and no adapter was given: SPACE decodes "
                          f"exactly but with untrained masks, whose drafts are rarely accepted; pass a SPACE "
                          f"adapter (e.g. adapters/smollm2-135m-space) or a SAR-SFT checkpoint", stacklevel=2)
            spec = add_mask_tokens(base, tok, mask_num)
            if device_map is not None:  # the resized embeddings are new modules, without hooks
                dispatch(base, base.hf_device_map)
        apply_kernels(base, kernels)
        return (compile_trunk(base) if compile else base), tok, spec
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
    # the adapter's tuned layout travels with the model: SpaceDecoder(model, spec) decodes with it
    base.config.space_decode = adapter_decode_config(cfg, adapter, torch.get_num_threads(), kernels).to_dict()
    apply_kernels(base.eval(), kernels)
    return (compile_trunk(base) if compile else base), tok, spec


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


def read_lora(adapter: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The LoRA updates of a lora / frozen-base artifact (peft's files, read without peft:
    ``PeftModel`` costs a wrapper and a deprecation warning per load for weights we fuse anyway).

    Returns:
        module name (``model.layers.0.self_attn.q_proj``) -> (A (r, in), B (out, r) times the LoRA
        scaling alpha / r, or alpha / sqrt(r) with rsLoRA).

    Raises:
        FileNotFoundError: adapter_config.json or adapter_model.safetensors missing.
        ValueError: either file damaged, a LoRA variant other than plain LoRA (DoRA, per-layer
            ranks, biases), or weights that do not pair up (the file is named).
    """
    where = adapter / LORA_CONFIG
    cfg = read_json(where)
    try:
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a valid LoRA config (bad or missing r / lora_alpha: {e})") from None
    if r < 1:
        raise ValueError(f"{where}: not a valid LoRA config (r must be >= 1, got {r})")
    variant = {k: cfg[k] for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "lora_bias")
               if cfg.get(k)}
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


def apply_lora(model: nn.Module, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], mode: str,
               where: os.PathLike | str) -> None:
    """Put :func:`read_lora`'s updates into ``model`` for decoding, in place: merged into the
    weights (``lora``), or as :class:`GatedLoraLinear` layers (``frozen-base``). Each update takes
    its layer's device and dtype (a device map included).

    Raises:
        ValueError: an update for a module the model lacks or of another shape (``where`` named).
    """
    for name, (a, b) in updates.items():
        linear = model.get_submodule(name) if _has_module(model, name) else None
        if type(linear) is not nn.Linear or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
            raise ValueError(f"{where}: LoRA for {name} of shapes {tuple(a.shape)}, {tuple(b.shape)} does not fit "
                             f"this model ({type(linear).__name__}): wrong base model?")
        a, b = a.to(linear.weight), b.to(linear.weight)
        if mode == "lora":
            with torch.no_grad():
                linear.weight += b @ a
        else:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, GatedLoraLinear(linear, a, b))


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def read_space_config(adapter: Path) -> dict:
    """The ``space_config.json`` of artifact directory ``adapter``.

    Raises:
        FileNotFoundError: no space_config.json in ``adapter``.
        ValueError: not valid JSON, or a required key missing (the file is named).
    """
    if not (adapter / SPACE_CONFIG).is_file():
        raise FileNotFoundError(f"{adapter} is not a SPACE adapter (no {SPACE_CONFIG})")
    cfg = read_json(adapter / SPACE_CONFIG)
    missing = [key for key in ("mode", "base_model", "mask_num", "mask_diff", "mask_token_ids") if key not in cfg]
    if missing:
        raise ValueError(f"{adapter / SPACE_CONFIG}: not a valid SPACE config (missing {', '.join(missing)})")
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


def warm_start(model, adapter: str | os.PathLike, mode: str, spec: MaskSpec) -> None:
    """Start training from a saved lora / frozen-base artifact: copy its LoRA weights and mask rows
    into ``model`` (a peft model from :func:`prepare_model` with the same LoRA shape).

    Continuing from the shipped adapter on new data trains a stronger drafter in less time than
    starting from zero LoRA and the base's mean embedding (#13).

    Raises:
        FileNotFoundError / ValueError: not an artifact (:func:`read_space_config`); a full
            checkpoint, another mode, k or mask_diff, or LoRA weights that do not fit ``model``
            (another rank or target list).
    """
    adapter = Path(adapter)
    cfg = read_space_config(adapter)
    mine = {"mode": mode, "mask_num": spec.mask_num, "mask_diff": spec.mask_diff}
    diff = {k: (cfg[k], v) for k, v in mine.items() if cfg[k] != v}
    if diff:
        raise ValueError(f"init_adapter {adapter} was trained with other settings; (adapter, now): {diff}")
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


def stored_step_cost(cfg: dict, threads: int, kernels: str) -> dict | None:
    """The step-cost entry of an adapter's ``space_config.json`` measured with ``threads`` CPU threads
    and ``kernels`` (``"step_costs"``: a list of ``{"threads", "kernels", "step_cost", "adapter_cost"}``,
    one per setup, written by ``space-tree --write-adapter``; issue 44), else None."""
    entries = cfg.get("step_costs") or []
    return next((e for e in entries if isinstance(e, dict) and e.get("threads") == threads
                 and e.get("kernels") == kernels), None)


def adapter_decode_config(cfg: dict, where: os.PathLike | str = SPACE_CONFIG, threads: int | None = None,
                          kernels: str | None = None) -> DecodeConfig:
    """The decode layout an adapter's ``space_config.json`` records (``"decode"``), else k = its
    trained k with the paper's k+1 groups.

    With ``threads`` and ``kernels``, a dynamic tree prices its rows by the curve stored for that
    setup (:func:`stored_step_cost`) when there is one: a curve measured at 1 thread prices rows
    wrong at 2 (issue 44). Else by the ``"decode"`` entry's own curve.

    Raises:
        ValueError: a malformed ``decode`` or ``step_costs`` entry (``where`` names the file).
    """
    try:
        decode = DecodeConfig.from_dict(cfg["decode"]) if "decode" in cfg else DecodeConfig(mask_num=cfg["mask_num"])
        entry = stored_step_cost(cfg, threads, kernels) if decode.tree == "dynamic" and threads else None
        if entry is not None:
            decode = decode.override(step_cost=tuple(map(tuple, entry["step_cost"])),
                                     adapter_cost=entry.get("adapter_cost", 0.0))
        return decode
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{where}: bad decode settings: {e}") from None


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
