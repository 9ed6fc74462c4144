"""The fused trunk (issue 58): q/k/v in one GEMM and gate/up in one GEMM, with the stock HF
modeling code.

A Llama-like attention calls ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` on the same tensor,
and its MLP ``gate_proj(x)`` and ``up_proj(x)``. :func:`fuse_projections` replaces each such
group by :class:`ProjectionSlice` modules over one :class:`SharedProjection`, whose weights are
the members' concatenated (out_1 + out_2 + ..., in), and for a frozen-base adapter the members'
LoRA A's packed under them and their B's block-diagonal in one
``space.adapter_layers.GatedLoraLinear``: the first member called runs the one GEMM (and on mask
rows the one ``addmm_``; on a CPU with the fast kernels one per member's block,
``space.cpu_kernels.blockwise_lora``) for all, and each member returns its columns, a view. On
SmolLM2 a layer's 7 linears become 4 GEMMs (AR) or 4 GEMMs and 4 ``addmm_`` (a SPACE step with mask
rows; 7 ``addmm_`` blockwise).

DESIGN. The modeling file is not forked: the modules keep their names and the layer's forward is
transformers' own. The price is state between the members' calls: the shared projection keeps
the group's outputs from the first member's call until each member has taken its own (then it
lets go of them). It recognizes its input by identity and by its version counter, per thread:
a member called with another tensor (another model's call order, a hook that replaces the
input), or with the same tensor edited in place since, recomputes the group on what it was given
instead of returning another input's result (at worst one more GEMM); threads that share the
model keep their own outputs. An inference tensor (``torch.inference_mode``, as the decoders
run) has no version counter: there only identity is checked, and transformers' layers never
edit a projection's input in place between its members' calls. A member's
``weight`` and ``bias`` are views of the fused tensors (HF utilities that read them still work);
the fused model is for inference (``requires_grad`` off), and ``torch.compile`` is left the
unfused trunk (``space.loader`` fuses only eager models: the kept outputs are module state).
Its ``state_dict`` (``save_pretrained``) is the unfused one: each member's ``weight`` and ``bias``
(a gated member's ``base.weight``, ``base.bias``, ``lora_a``, ``lora_b``) under its own name, a
member without a LoRA or a bias saved without one, so a saved fused model loads as the model it
came from; loading a state dict into a fused model is not supported.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from ..adapter_layers import GatedLoraLinear
from ..rms_norm import swap_rms_norms
from .cache import attention_dtype

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# devices whose torch.nn.functional.rms_norm is one kernel (torch >= 2.9), where the fused trunk swaps
# transformers' RMSNorms for it (space.rms_norm); a CPU runs it as several ops, its fast kernels swap it to the bit
ONE_KERNEL_NORM = ("cuda",)


class SharedProjection(nn.Module):
    """One GEMM for several linears that read the same input.

    Args:
        members: ``nn.Linear`` or ``GatedLoraLinear`` (over a plain ``nn.Linear``), all of one
            ``in_features``, dtype and device.

    Attributes:
        fused: ``nn.Linear`` (in, sum of outs), or a ``GatedLoraLinear`` over it when a member has
            a LoRA (A's stacked, B block-diagonal: members without one get zero blocks).
        splits: each member's out_features.
        ranks: each member's LoRA rank (0: none).
        gated: whether each member was a ``GatedLoraLinear``; biased: whether it had a bias.
    """

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        linears = [m.base if isinstance(m, GatedLoraLinear) else m for m in members]
        self.splits = [lin.out_features for lin in linears]
        self.gated = [isinstance(m, GatedLoraLinear) for m in members]
        self.biased = [lin.bias is not None for lin in linears]
        w = linears[0].weight
        with torch.no_grad():
            linear = nn.Linear(linears[0].in_features, sum(self.splits), bias=any(lin.bias is not None for lin in linears),
                               device=w.device, dtype=w.dtype)
            linear.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
            if linear.bias is not None:
                linear.bias = nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features)
                                                      for lin in linears]), requires_grad=False)
            loras = [(m.lora_a, m.lora_b) if isinstance(m, GatedLoraLinear) else None for m in members]
            self.ranks = ranks = [0 if lr is None else lr[0].shape[0] for lr in loras]
            if any(loras):
                a = torch.cat([lr[0] for lr in loras if lr is not None])
                b = w.new_zeros(sum(self.splits), sum(ranks))
                row = col = 0
                blocks = []  # B^T's nonzero blocks: (rank start, rank end, out start, out end)
                for lr, out, r in zip(loras, self.splits, ranks):
                    if lr is not None:
                        b[row: row + out, col: col + r] = lr[1]
                        blocks.append((col, col + r, row, row + out))
                    row, col = row + out, col + r
                self.fused = GatedLoraLinear(linear, a, b, blocks=tuple(blocks))
            else:
                self.fused = linear.requires_grad_(False)
        # per thread: (input, its version when the GEMM ran, the members' outputs not yet taken)
        self._kept = threading.local()

    def __getstate__(self):  # copy.deepcopy, torch.save: a thread-local cannot be pickled (nor is it worth keeping)
        state = super().__getstate__().copy()
        del state["_kept"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._kept = threading.local()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s output for input ``x`` (batch, seq, in) -> (batch, seq, out_index):
        a view of the group's one GEMM, run when a member first asks for ``x`` as it is now."""
        kept = getattr(self._kept, "value", None)
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        if kept is None or kept[0] is not x or kept[1] != version or kept[2][index] is None:
            kept = (x, version, list(self.fused(x).split(self.splits, dim=-1)))
        outputs = kept[2]
        out, outputs[index] = outputs[index], None
        # every member served: keep no activation alive
        self._kept.value = None if all(o is None for o in outputs) else kept
        return out

    def holds_outputs(self) -> bool:
        """Whether this thread's last group call left outputs not yet taken by their members."""
        return getattr(self._kept, "value", None) is not None

    def lora_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (r, in), B (out, r)) of member ``index`` (a gated fused linear; copies, r = 0 for a
        member that had no LoRA)."""
        start, r0 = sum(self.splits[:index]), sum(self.ranks[:index])
        rows = slice(r0, r0 + self.ranks[index])
        bt = self.fused.lora_bt[rows, start: start + self.splits[index]]
        return self.fused.lora_a[rows].detach().clone(), bt.T.detach().clone()

    def weight_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight (out, in), bias or None) of member ``index``: views of the fused tensors. A
        member that had no bias gets None, not the zero slice that stands in for it in the GEMM."""
        linear = self.fused.base if isinstance(self.fused, GatedLoraLinear) else self.fused
        start = sum(self.splits[:index])
        bias = linear.bias[start: start + self.splits[index]] if self.biased[index] else None
        return linear.weight[start: start + self.splits[index]], bias


class ProjectionSlice(nn.Module):
    """A member of a :class:`SharedProjection`, in place of its linear:
    ``forward(x (batch, seq, in)) -> (batch, seq, out)``, the group's GEMM's columns for it."""

    def __init__(self, shared: SharedProjection, index: int, in_features: int):
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = in_features, shared.splits[index]

    @property
    def weight(self) -> torch.Tensor:
        return self.shared.weight_of(self.index)[0]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.shared.weight_of(self.index)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(x, self.index)


class _UnfusedState:
    """A state-dict hook for the parent of fused members ``names``: their entries as the unfused
    modules had them (copies: one storage's views would look like tied weights to a saver). A
    class, not a closure, so a fused model can be deep-copied and pickled."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __call__(self, module, state, prefix, _metadata):
        for i, name in enumerate(self.names):
            for key in [k for k in state if k.startswith(f"{prefix}{name}.")]:
                del state[key]
            member = getattr(module, name)
            shared = member.shared
            weight, bias = shared.weight_of(i)
            base = f"{prefix}{name}.base." if shared.gated[i] else f"{prefix}{name}."
            state[base + "weight"] = weight.detach().clone()
            if shared.biased[i]:  # a zero bias stands in for a member without one only inside the GEMM
                state[base + "bias"] = bias.detach().clone()
            if shared.gated[i]:
                a, b = shared.lora_of(i)
                state[f"{prefix}{name}.lora_a"], state[f"{prefix}{name}.lora_b"] = a, b
        return state


def _fusable(members: list[nn.Module | None]) -> bool:
    linears = [m.base if isinstance(m, GatedLoraLinear) else m for m in members]
    if any(type(lin) is not nn.Linear for lin in linears):  # absent, a packed CPU kernel, or another module
        return False
    w = linears[0].weight
    return all(lin.in_features == linears[0].in_features and lin.weight.dtype == w.dtype
               and lin.weight.device == w.device for lin in linears)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of ``model`` in place (:data:`GROUPS`, by module name:
    Llama, Mistral, Qwen2 and kin). A group is left alone unless each member is an ``nn.Linear``
    (or a ``GatedLoraLinear`` over one) of the same input size, dtype and device. Call it before
    ``space.cpu_kernels.apply_kernels``, which then packs the fused linears.

    Returns:
        how many groups were fused (0 for a model without such groups, or already fused).
    """
    count = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if not _fusable(members):
                continue
            shared = SharedProjection(members)
            for i, name in enumerate(names):
                setattr(parent, name, ProjectionSlice(shared, i, members[0].in_features if isinstance(members[0], nn.Linear)
                                                      else members[0].base.in_features))
            parent._register_state_dict_hook(_UnfusedState(names))
            count += 1
    return count


def fuse_trunk(model: nn.Module) -> dict:
    """Make ``model``'s trunk cheap in launches, in place, as ``space.loader.load_space`` does
    for every eager model: :func:`fuse_projections`, and an ``sdpa`` model's attention
    ``space.decoding.backends.SDPA_GQA`` (registered with transformers here, at load, never at
    import). That attention reads the keys only up to the mask's width, so a step over a static
    cache attends over the slots that hold tokens (a captured step over its slot bucket,
    ``space.decoding.graphs``), and it runs grouped-query attention without ``repeat_kv``:
    transformers' ``sdpa`` turns GQA off whenever a mask is given, which a SPACE step's always
    is, and then copies the keys and values, the whole cache included, in every layer. On the CPU
    SDPA takes the grouped heads as they are; on CUDA, whose memory-efficient kernel has no GQA
    (torch 2.11), the query heads are folded into the batch. On CUDA the RMSNorms become one
    kernel each (``space.rms_norm.swap_rms_norms`` with ``exact=False``, :data:`ONE_KERNEL_NORM`: their fp32
    output is transformers' to rounding, every method runs the same trunk, and each row's bits do not
    depend on the others).

    Returns:
        the run record's entry ``{"fused_groups": n, "attention": implementation, "rms_norms": n}``
        (norms swapped here: on CUDA; a CPU's fast kernels swap them later, ``space.cpu_kernels``).
    """
    from .backends import SDPA_GQA, register_attention

    fused = fuse_projections(model)
    # on CUDA a native RMSNorm is one kernel where transformers' launches six (eight in bf16): about
    # 300 of an AR step's 1,016 launches on SmolLM2. The CPU's fast kernels swap them there, to the bit
    on = next(model.parameters()).device.type
    norms = swap_rms_norms(model, exact=False, dtype=attention_dtype(model.get_decoder())) if on in ONE_KERNEL_NORM else 0
    config = model.config
    if config._attn_implementation == "sdpa":
        register_attention()
        model.set_attn_implementation(SDPA_GQA)
    return {"fused_groups": fused, "attention": config._attn_implementation, "rms_norms": norms}
