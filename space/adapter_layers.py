"""The adapter's layers and the training modes (DESIGN §3.6): full, lora, frozen-base.

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

For decoding, each LoRA update of a frozen-base adapter sits in a :class:`GatedLoraLinear`
(:func:`apply_lora` from the artifact's weights, :func:`fuse_frozen_base` from a live peft model):
the same update, computed only on the block's mask rows and skipped entirely when the input holds
no mask token. peft's per-layer Python (4 module calls and a hook on each of 210 linears in
SmolLM2) cost about 45 ms per forward on a 2-core CPU, more than half an AR token; the fused layer
leaves AR forwards exactly the base model's cost.

The artifact's files are ``space.artifact``'s; ``space.loader.load_space`` puts them together.
"""
from __future__ import annotations

import copy
import os
import re

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from .masking import mask_rows_start
from .tokens import add_mask_tokens
from .zero3 import gathered

MODES = ("full", "lora", "frozen-base")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MaskEmbedding(nn.Module):
    """Input embedding with trainable mask rows.

    Args:
        base: the model's original embedding (frozen in lora / frozen-base).
        mask_ids: contiguous mask token ids.

    ``forward(input_ids (batch, seq)) -> (batch, seq, hidden)``: the base embedding, with the
    trainable row of each mask token in its place, scaled as the base scales its rows (Gemma's
    embeddings multiply by ``embed_scale``, sqrt(hidden): unscaled, a mask token entered 1/sqrt(hidden)
    of the mean embedding DESIGN §3.7 starts it at). It records nothing: which rows are masks
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
        # an embedding lookup, not mask_rows[idx]: advanced indexing's backward adds up in a varying
        # order on a multi-threaded CPU, so two identical runs trained apart by 1e-8 (issue 59)
        rows = nn.functional.embedding((input_ids - self.first_id).clamp(0, self.num - 1), self.mask_rows)
        scale = getattr(self.base, "embed_scale", None)  # a Gemma-style scaled embedding's factor
        if scale is not None:
            rows = rows * (scale.to(rows.dtype) if torch.is_tensor(scale) else scale)
        return torch.where(is_mask[..., None], rows.to(out.dtype), out)


class GatedLoraLinear(nn.Module):
    """A frozen-base LoRA linear for decoding: ``W x`` on real rows, ``W x + B A x`` on mask rows.

    Args:
        base: the frozen ``nn.Linear`` (in -> out), or a ``space.cpu_kernels.PackedLinear`` that
            packs ``lora_a`` under W (``extra_out`` > 0: one kernel call gives ``W x`` and ``A x``).
        lora_a: (r, in); lora_b: (out, r), already multiplied by the LoRA scaling.
        blocks: B^T's nonzero blocks, ``(rank start, rank end, out start, out end)`` each, when B is
            block-diagonal (a fused group's, ``space.decoding.fused``); None: B^T is one block.

    ``blockwise`` (off at construction; ``space.cpu_kernels`` turns it on for a CPU model) makes a
    decode step's update one ``addmm_`` per block of ``blocks``, never reading B's zero blocks.

    ``forward(x (batch, seq, in)) -> (batch, seq, out)``. Mask rows are rows
    ``space.masking.mask_rows_start()`` on (the layout puts mask groups last); the update runs on
    those rows only, so real rows get the base linear's output and no LoRA term. Outside a
    ``mask_rows`` block (AR, HF ``generate``), or when the call holds no mask row, the layer is
    the base alone and costs what the base costs. Under a gate tensor instead of a start (a
    captured decode step, ``space.decoding.graphs``; batch 1) every row's update is computed and
    multiplied by its gate, 0 or 1. (With the CPU kernels' per-row-count paths, a
    few-row call may take MKL's stock path and a many-row call the packed GEMM: the same weights, equal to fp32
    rounding, ``space.cpu_kernels``.)

    DESIGN (issue 58: on a GPU an eager step costs about its kernel launches): A is packed under
    W in one (out + r, in) tensor whose first ``out`` rows are the base's weight (a view: no second
    copy of W), so a call with mask rows is one GEMM giving ``x W^T`` and ``x A^T`` together, then
    one in-place ``addmm_`` of ``xA (B^T)`` on the contiguous mask rows, with B^T stored
    contiguous: 2 kernels where the unpacked update took 7 ops and 2 GEMMs of its own. The
    output is a view of the packed GEMM's (row stride out + r), which ``view`` / ``transpose``
    in the modeling code accept. Its ``state_dict`` holds ``base.weight``, ``base.bias``,
    ``lora_a`` and ``lora_b`` as before packing, and loads back into the packed tensors; a
    dtype or device move (``.to``) keeps the base's weight a view of the packed tensor.
    """

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 blocks: tuple[tuple[int, int, int, int], ...] | None = None):
        super().__init__()
        self.base = base
        self.blocks, self.blockwise = blocks, False
        with torch.no_grad():
            packed = torch.cat([base.weight.detach(), lora_a.detach().to(base.weight)])
            if type(base) is nn.Linear:  # the base keeps its weight as the packed tensor's first rows
                base.weight = nn.Parameter(packed[: base.out_features], requires_grad=False)
            bias = None if base.bias is None else torch.cat([base.bias.detach(), base.bias.new_zeros(lora_a.shape[0])])
        # buffers, out of the state dict: it holds base.weight, lora_a and lora_b, as before packing
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("packed_bias", bias, persistent=False)
        self.register_buffer("lora_bt", lora_b.detach().to(base.weight).T.contiguous(), persistent=False)  # (r, out)
        self._register_state_dict_hook(_lora_state)
        self._register_load_state_dict_pre_hook(_load_lora_state, with_module=True)

    def _apply(self, fn, recurse=True):
        # Module._apply converts the base's weight and the packed buffer one by one: point the
        # weight back at the packed rows, or W is held twice and the two copies can drift apart
        super()._apply(fn, recurse)
        if type(self.base) is nn.Linear:
            self.base.weight = nn.Parameter(self.packed[: self.base.out_features], requires_grad=False)
        return self

    @property
    def lora_a(self) -> torch.Tensor:
        """(r, in): the packed rows under W."""
        return self.packed[self.base.out_features:]

    @property
    def lora_b(self) -> torch.Tensor:
        """(out, r), scaled."""
        return self.lora_bt.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = mask_rows_start()
        gate = s if isinstance(s, torch.Tensor) else None  # a captured step's (rows, 1) gate
        if s is None or (gate is None and s >= x.shape[-2]):  # no mask row (AR, HF generate, real rows): the base alone
            return self.base(x)
        check_rows_axis(x)
        base = self.base
        # the buffers read from their dict, and the plain base told apart by its type: on a GPU an
        # eager decode step is bound by its host time, and nn.Module's attribute fallback (a missing
        # attribute raises inside it) took about 5 us of a mask-row call's 16 on top of the base's
        buffers = self._buffers
        out, bt = base.out_features, buffers["lora_bt"]
        if type(base) is not nn.Linear and getattr(base, "extra_out", 0):  # the CPU kernels' packed W and A
            y, xa = base.forward_extra(x)
        else:  # x W^T and x A^T in one GEMM
            both = nn.functional.linear(x, buffers["packed"], buffers["packed_bias"])
            y, xa = both[..., :out], both[..., out:]
        if gate is not None and torch.compiler.is_compiling():
            # compile mode frozen: out of place (inductor's frozen C++ GEMM failed to lower an
            # addmm_ into a slice of the packed GEMM's output)
            y = y + (xa * gate) @ bt
        elif gate is not None:  # a decode step's every row times the gate: one graph for every first mask row
            y[0].addmm_(xa[0] * gate, bt)
        elif self.blockwise and self.blocks and x.shape[0] == 1:  # a decode step, one in-place gemm per nonzero block of B
            for r0, r1, c0, c1 in self.blocks:
                y[0, s:, c0:c1].addmm_(xa[0, s:, r0:r1], bt[r0:r1, c0:c1])
        elif x.shape[0] == 1:  # a decode step: the update as one in-place gemm on the mask rows
            y[0, s:].addmm_(xa[0, s:], bt)
        else:
            y[:, s:] += xa[:, s:] @ bt
        return y


def check_rows_axis(x: torch.Tensor) -> None:
    """Refuse a gated LoRA input without its sequence axis: the mask rows are rows of (batch, seq,
    features); a layer called on flattened (tokens, features), such as Qwen2-MoE's shared expert,
    would gate columns at decoding (a shape error) and, in a batch, every row of the later
    sequences in training (real rows changed: frozen-base no longer lossless).

    Raises:
        ValueError: ``x`` is not 3-D.
    """
    if x.dim() != 3:
        raise ValueError(f"a frozen-base LoRA layer got input of shape {tuple(x.shape)}, not (batch, seq, features): "
                         "its module runs on flattened rows (e.g. an MoE's shared expert); leave it out of "
                         "lora_targets")


def _load_lora_state(module: GatedLoraLinear, state: dict, prefix: str, *_args) -> None:
    """Load a :class:`GatedLoraLinear`'s ``lora_a`` and ``lora_b`` entries into its packed tensors
    (views there, not parameters); an entry the state lacks leaves its tensor as it is.

    Raises:
        ValueError: the CPU kernels packed the layer (a ``PackedLinear`` base holding A): their
            packed copy of W and A would keep the old weights while the few-row stock path read
            the new ones. Load before ``space.cpu_kernels.apply_kernels``.
    """
    if getattr(module.base, "extra_out", 0):
        raise ValueError(f"{prefix or 'this layer'}: load the LoRA state before the CPU kernels pack it "
                         "(their packed copy of W and A is not repacked); apply_kernels after loading")
    with torch.no_grad():
        if prefix + "lora_a" in state:
            module.packed[module.base.out_features:] = state.pop(prefix + "lora_a")
        if prefix + "lora_b" in state:
            module.lora_bt.copy_(state.pop(prefix + "lora_b").T)


def _lora_state(module: GatedLoraLinear, state: dict, prefix: str, _metadata) -> dict:
    """A :class:`GatedLoraLinear`'s update in its state dict as ``lora_a`` (r, in) and ``lora_b``
    (out, r, scaled), copies (the packed tensor's views would look like tied weights to a saver)."""
    state[prefix + "lora_a"] = module.lora_a.detach().clone()
    state[prefix + "lora_b"] = module.lora_b.detach().clone()
    return state


def prepare_model(model, tokenizer, mode: str, mask_num: int, mask_diff: bool = False, lora_r: int = 16,
                  lora_alpha: int = 32, lora_dropout: float = 0.0, lora_targets=LORA_TARGETS):
    """Add mask tokens and set up the training mode.

    Returns:
        (model, MaskSpec): the model to train (a peft model for lora / frozen-base).

    Raises:
        ValueError: unknown mode, mask_num out of range, or a LoRA target that names no module of the
            model (peft refuses only a list that matches none, and a misspelt one dropped silently
            while adapter_config.json recorded it), one that peft moves onto an MoE model's fused
            experts (:func:`check_targets_kept`), or one that names a module other than an
            ``nn.Linear`` (an embedding, the experts), or the LM head in mode frozen-base or tied
            to the input embeddings, before the model changes.
    """
    if mode not in MODES:
        raise ValueError(f"unknown training mode {mode!r}; choose one of {MODES}")
    if mode != "full":  # peft's rule: a module's name is the target, or ends in "." + target
        modules = dict(model.named_modules())
        matched = {t: [m for n, m in modules.items() if n == t or n.endswith("." + t)] for t in lora_targets}
        # exactly nn.Linear, as the artifact's loader (apply_lora) takes: Falcon's FalconLinear, a router
        # subclass or a quantized linear trained, then every load refused the artifact
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if type(m) is nn.Linear})
        unknown = [t for t in lora_targets if not matched[t]]
        if unknown:
            raise ValueError(f"lora_targets {unknown} name no module of this model; its linears: {linears}")
        cfg = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                         target_modules=list(lora_targets), task_type="CAUSAL_LM")
        check_targets_kept(lora_targets, peft_rewrite(cfg, model), model)  # before the model changes
        # peft wraps embeddings and convolutions too, and refuses other modules (an MoE's experts) only
        # inside get_peft_model; SPACE's artifact stores and applies a LoRA on an nn.Linear alone
        others = {t: sorted({type(m).__name__ for m in ms if type(m) is not nn.Linear}) for t, ms in matched.items()}
        others = {t: kinds for t, kinds in others.items() if kinds}
        if others:
            raise ValueError(f"lora_targets {sorted(others)} name modules that are not linear layers ({others}): "
                             f"a SPACE LoRA goes on nn.Linear only; this model's linears: {linears}")
        out = model.get_output_embeddings()
        head = [t for t, ms in matched.items() if any(m is out for m in ms)]
        tied = out is not None and out.weight is model.get_input_embeddings().weight
        if head and mode == "frozen-base":  # it trained, then every decoder failed on the head's weight
            raise ValueError(f"lora_targets {head} name the LM head, which cannot take a SPACE LoRA in mode frozen-base "
                             "(the decoders read its weight itself); leave it out"
                             + ("" if tied else ", or train in mode lora (merged)"))
        if head and tied:  # merged into the shared weight, the update moved the input embeddings too (a tiny
            # Llama's logits by 1.9): a model other than the one trained
            raise ValueError(f"lora_targets {head} name the LM head, which cannot take a SPACE LoRA tied to the input "
                             "embeddings (merging it would change both); leave it out")
    spec = add_mask_tokens(model, tokenizer, mask_num, mask_diff)
    if mode == "full":
        model.requires_grad_(True)
        return model, spec
    emb = MaskEmbedding(model.get_input_embeddings(), spec.token_ids)
    model.set_input_embeddings(emb)
    peft_model = get_peft_model(model, cfg)
    check_targets_kept(lora_targets, peft_model.peft_config["default"])  # any other rewrite
    emb.mask_rows.requires_grad_(True)  # peft froze everything that is not LoRA
    if mode == "frozen-base":
        _gate_lora(peft_model)
    return peft_model, spec


def peft_rewrite(config: LoraConfig, model: nn.Module) -> LoraConfig:
    """``config`` as peft (>= 0.19, its transformers-5 conversion) will rewrite it when it injects the
    LoRA into ``model`` (a copy; the model is only read).

    Raises:
        ValueError: peft refuses the targets for this model type (e.g. ``gate_proj`` without
            ``up_proj`` on a model whose experts fuse the two), with SPACE's advice.
    """
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    converted = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(converted, model=model, conversions=None)
    except ValueError as e:
        raise ValueError(f"peft refuses lora_targets {sorted(config.target_modules)} on a {model.config.model_type} "
                         f"model ({e}); it moves this model type's MoE projection names onto fused expert weights, "
                         "which a SPACE LoRA cannot take: leave them out of lora_targets") from None
    return converted


def check_targets_kept(asked, config: LoraConfig, model: nn.Module | None = None) -> None:
    """Refuse a LoRA config that peft rewrote (or will: :func:`peft_rewrite`). For the model types
    in peft's transformers-5 conversion table (DeepSeek-V2/V3, Qwen3-MoE, OLMoE, GLM-4-MoE, ...),
    peft puts ``gate_proj`` / ``up_proj`` / ``down_proj`` (and the router ``gate``) targets on the
    MoE experts' stacked weights (``target_parameters``, rank and alpha doubled for the fused
    gate/up). peft 0.19-0.21 do so whether or not the model has MoE layers and drop those names from
    ``target_modules`` (a dense layer's MLP gets no LoRA); 0.22 does so only where there are experts
    (Qwen2-MoE's too) and keeps the names for the linears. Either way the experts' update reaches
    every row through the weight itself, where the frozen-base gate cannot hold it back (a tiny
    DeepSeek-V3's real-row logits moved by 1.4), and SPACE's artifact cannot store it: a run used to
    fail only when it saved its final adapter.

    Args:
        asked: the module names asked for (``lora_targets``).
        config: the config as peft rewrites it (``peft_model.peft_config["default"]``).
        model: the model before peft changes it; with it the message names the targets that peft's
            conversion takes alone (:func:`retargeted`), without it the ones it dropped, or all.

    Raises:
        ValueError: a target peft dropped from ``target_modules``, or any ``target_parameters``,
            ``rank_pattern`` or ``alpha_pattern`` it added.
    """
    dropped = sorted(set(asked) - set(config.target_modules or ()))
    if dropped or config.target_parameters or config.rank_pattern or config.alpha_pattern:
        names = sorted(set(dropped) | set(retargeted(asked, model) if model is not None else ())) or sorted(asked)
        model_type = f"a {model.config.model_type} model" if model is not None else "this model"
        raise ValueError(f"peft retargets lora_targets {names} of {model_type} to the parameters "
                         f"{sorted(config.target_parameters or ())} (its conversion for fused MoE experts): those "
                         f"names cannot take a SPACE LoRA on this model type; leave {names} out of lora_targets")


def retargeted(asked, model: nn.Module) -> list[str]:
    """The names in ``asked`` that peft's conversion (:func:`peft_rewrite`) changes when each is the
    only target: dropped, joined to parameters, given its own rank, or refused (half of a fused
    pair). Named one by one because peft 0.22 keeps them in ``target_modules`` while it adds the
    experts' parameters, so the rewritten config alone does not say which target brought them.
    """
    def changed(target):
        try:
            c = peft_rewrite(LoraConfig(target_modules=[target]), model)
        except ValueError:
            return True
        return target not in (c.target_modules or ()) or bool(c.target_parameters or c.rank_pattern or c.alpha_pattern)
    return sorted(t for t in asked if changed(t))


def _gate_lora(model) -> None:
    """Apply every LoRA update to mask rows only (frozen-base training): rows before
    ``mask_rows_start()`` get exactly zero, and outside a ``mask_rows`` block every row does."""
    def hook(module, args, out):
        s = mask_rows_start()
        if isinstance(s, torch.Tensor):  # a captured decode step's gate (space.masking.mask_rows)
            return out * s
        if s is None:
            return out * 0.0  # keeps the graph: the trainable weights still get (zero) gradients
        if s == 0:
            return out
        check_rows_axis(out)
        gate = (torch.arange(out.shape[-2], device=out.device) >= s).to(out.dtype)[:, None]
        return out * gate

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for lora_b in module.lora_B.values():
                lora_b.register_forward_hook(hook)


def fuse_frozen_base(peft_model) -> nn.Module:
    """Replace the peft LoRA layers of a frozen-base model by :class:`GatedLoraLinear` (decoding).

    Args:
        peft_model: a peft model from :func:`prepare_model` / ``PeftModel.from_pretrained`` whose
            input embedding is a MaskEmbedding, with the ``default`` adapter.

    Returns:
        the underlying HF model (``LlamaForCausalLM``-like), no longer wrapped by peft; its
        outputs equal the gated peft model's up to float rounding (real rows, too: in a call with mask
        rows they come out of the packed GEMM of W and A together).

    Raises:
        ValueError: the model has no MaskEmbedding (not a frozen-base model).
    """
    emb = mask_embedding(peft_model)
    if emb is None:
        raise ValueError("fuse_frozen_base needs a frozen-base model (its input embedding must be a MaskEmbedding)")
    model = peft_model.get_base_model()
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, layer in layers:
        a = layer.lora_A["default"].weight.detach()
        b = layer.lora_B["default"].weight.detach() * layer.scaling["default"]
        model.set_submodule(name, GatedLoraLinear(layer.get_base_layer(), a, b))
    return model.eval()


def mask_embedding(model) -> MaskEmbedding | None:
    emb = model.get_input_embeddings()
    return emb if isinstance(emb, MaskEmbedding) else None


def apply_lora(model: nn.Module, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], mode: str,
               where: os.PathLike | str) -> None:
    """Put :func:`read_lora`'s updates into ``model`` for decoding, in place: merged into the
    weights (``lora``), or as :class:`GatedLoraLinear` layers (``frozen-base``). Each update takes
    its layer's device and dtype (a device map included).

    Raises:
        ValueError: an update for a module the model lacks or of another shape, or none for a module
            the updates hold in other layers (a damaged or truncated file: the model would load
            without that layer's update, silently), ``where`` named.
    """
    # every layer's linear of each kind the updates hold: model.layers.{}.self_attn.q_proj, ...
    layer_index = re.compile(r"\.\d+\.")
    kinds = {layer_index.sub(".{}.", name) for name in updates}
    missing = sorted(name for name, m in model.named_modules()
                     if type(m) is nn.Linear and name not in updates and layer_index.sub(".{}.", name) in kinds)
    if missing:
        raise ValueError(f"{where}: no LoRA for {len(missing)} modules of kinds it holds in other layers "
                         f"({', '.join(missing[:3])}, ...): a damaged or truncated file")
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
            model.set_submodule(name, GatedLoraLinear(linear, a, b))


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
