"""The sampler head: sequentially dependent drafts on top of the mask tokens (issue 34).

A mask's last hidden state sees the earlier masks of its group but not the tokens drafted for
them, so mask j cannot follow the path a chain or tree has committed to. Hydra (Ankner et al.
2024, arXiv 2402.05109) made Medusa's heads read the earlier drafted tokens; Samragh et al. 2025
(arXiv 2507.11851) put a 2-layer sampler MLP on mask tokens with gated LoRA, our frozen-base
design. Here the head combines mask j's last hidden state with the input embedding of the token
at offset j-1 and feeds the model's own LM head:

* training (``space.train.steps.mask_pass``) is teacher-forced on the true previous token;
* decoding (``space.decoding.decoder``) drafts offset by offset after the step's forward, each
  offset conditioned on the token drafted before it (the bonus token before the first), with no
  extra model forward.

The head lives on the HF model as the submodule ``space_sampler`` (trained, placed and saved with
it); ``space.artifact`` writes and reads ``sampler_head.safetensors``.
"""
from __future__ import annotations

import torch
from torch import nn

SAMPLER_ATTR = "space_sampler"


class SamplerHead(nn.Module):
    """Sequentially dependent drafts (issue 34; Hydra, Ankner et al. 2024, arXiv 2402.05109; the
    sampler MLP of Samragh et al. 2025, arXiv 2507.11851): mask j's draft also sees the token at
    offset j-1, the drafted one in decoding, the true one in training.

    Args:
        hidden: the model width d.
        width: the MLP's hidden width (0: d).

    ``forward(hidden (..., d), prev_embeds (..., d)) -> (..., d)``: ``hidden + W2 silu(W1 [hidden;
    prev_embeds])``, fed to the model's own (tied) LM head. ``hidden`` is a mask row's last
    hidden state (after the final norm), ``prev_embeds`` the input embedding of the previous
    token. W2 starts at zero, so an untrained head drafts exactly what the masks alone draft. It
    computes in its own weights' dtype (fp32 from :func:`add_sampler_head`) and returns
    ``hidden``'s.

    Raises:
        ValueError: hidden < 1 or width < 0.
    """

    def __init__(self, hidden: int, width: int = 0):
        super().__init__()
        if hidden < 1 or width < 0:
            raise ValueError(f"sampler head: need hidden >= 1 and width >= 0, got {hidden}, {width}")
        self.width = width or hidden
        self.fc1 = nn.Linear(2 * hidden, self.width)
        self.fc2 = nn.Linear(self.width, hidden)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, hidden: torch.Tensor, prev_embeds: torch.Tensor) -> torch.Tensor:
        dtype = self.fc1.weight.dtype
        x = torch.cat([hidden.to(dtype), prev_embeds.to(dtype)], dim=-1)
        return (hidden.to(dtype) + self.fc2(nn.functional.silu(self.fc1(x)))).to(hidden.dtype)


def sampler_head(model) -> SamplerHead | None:
    """The sampler head of a SPACE model (a HF model or a peft model around one), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, SAMPLER_ATTR, None)


def add_sampler_head(model, width: int = 0) -> SamplerHead:
    """Give ``model`` (HF or peft) a new, trainable :class:`SamplerHead` of ``width`` (0: the model
    width), on the model's device, in fp32 whatever the model's dtype (as the mask rows: in a bf16
    head, Adam's late small updates were rounded away, about 29 % of 2e-5 steps at a 7B width,
    where peft keeps the LoRA in fp32), as a submodule so trainers optimize and place it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = base.get_input_embeddings().weight
    head = SamplerHead(base.config.hidden_size, width).to(device=emb.device, dtype=torch.float32)
    setattr(base, SAMPLER_ATTR, head)
    return head
