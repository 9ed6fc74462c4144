"""Host syncs per SPACE step, counted on the CPU as CUDA would make them (issue 43, ``tests.syncs``).

A greedy step of the chain or a static tree reads the device once: the accepted row, the bonus
token and the nodes in one copy. The accepted path's keys and values move in the cache by a gather
whose order is computed on the device before that copy, the bonus token stays on the device, and
verification indexes nothing by a 0-d tensor. Before issue 43 these steps made 3-4 syncs on the
tiny model and 27-31 on SmolLM2 (one upload per layer whenever the path moved).

Budgets measured today and asserted here (per generation, decoder warm, model on the "device"):

* chain, static tree: one read per step; besides, per generation, the prompt's upload and the
  KV cache's first allocation (2 per layer, transformers' lazy ``DynamicLayer``);
* static tree + prompt lookup: the same one read; the lookup candidates, found on the host, go up
  in a non-blocking copy (``decoder.upload``: pinned memory on CUDA), which the host does not wait
  for (it was one synchronizing upload per step that found candidates: 1.58 syncs per step by
  CUDA's count, ``results/gpu_compiled``);
* a logits processor: one read of the nodes per step besides verification's, and every
  verification row's context in one non-blocking upload (it was one upload per row);
* dynamic tree + lookup: the planner's read of the drafts and the verification read, 2 per step;
  the plan goes up non-blocking (it was 2.55 per step by CUDA's count, with the plan's upload).

CUDA's own count of the non-blocking uploads (``tests/test_cuda.py::test_sync_budget_seen_by_cuda``,
an H200, ``results/gpu_compiled``): 0.98 / 1.00 / 1.00 / 1.55 per step for the chain, static tree,
lookup and dynamic tree, the budgets counted here.

The counter was checked against CUDA's own count (``torch.cuda.set_sync_debug_mode``) on an H200
(issue 45): before these fixes CUDA saw 2.98 / 2.00 / 2.58 / 7.55 syncs per step for the chain,
static tree, lookup and dynamic layouts, and this counter, once it counted ``t[index] = scalar``
(PyTorch uploads the scalar), gives 3.00 / 2.00 / 2.62 / 8.00 on the same code. The missing 1-2
per step came from ``logits[:, mask_ids] = -inf``, now ``index_fill_``.
"""
import pytest
import torch

from space.decoding import DecodeConfig, SpaceDecoder, ar_generate
from tests.syncs import SyncCounter

STATIC_TREE = ((0,), (1,), (0, 0), (0, 1))


def count(trained, config: DecodeConfig, prompt_len: int = 20, new: int = 64, processor=None, static=False):
    model, _, spec, lang = trained
    dec = SpaceDecoder(model, spec, config, static_cache=static)
    prompt = torch.tensor(lang.sample(prompt_len))
    dec.generate(prompt, new, logits_processor=processor)  # warm: static layouts are built once per shape
    with SyncCounter(model, holders=[dec]) as syncs:  # the warm decoder's cached layouts live on the device
        out = dec.generate(prompt, new, logits_processor=processor)
    ar = ar_generate(model, prompt, new, suppress_ids=spec.token_ids, logits_processor=processor)
    assert out.new_ids == ar.new_ids
    return syncs, out, 1 + 2 * model.config.num_hidden_layers  # per generation: prompt, cache init


@pytest.mark.parametrize("static", [False, True], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("config", [DecodeConfig(3, 4), DecodeConfig(4, 5), DecodeConfig(2, 2, tree=STATIC_TREE)],
                         ids=["chain k3", "chain k4", "static tree"])
def test_greedy_step_reads_the_device_once(trained, config, static):
    """The preallocated cache (issue 43) keeps its length on the device and is cropped by the
    host's count, so it adds no sync."""
    syncs, out, per_generation = count(trained, config, static=static)
    assert out.tokens_per_step > 1.5  # drafts are accepted, so the cache really compacts
    assert syncs.kinds["read"] == out.num_steps, syncs.where
    assert syncs.kinds["index"] == syncs.kinds["shape"] == 0, syncs.where
    assert syncs.total <= out.num_steps + per_generation, syncs.where


def test_lookup_step_reads_the_device_once(trained):
    syncs, out, per_generation = count(trained, DecodeConfig(2, 2, tree=STATIC_TREE, lookup_tokens=10))
    assert syncs.kinds["read"] == out.num_steps, syncs.where
    assert syncs.total <= out.num_steps + per_generation, syncs.where
    assert syncs.queued >= 1  # the candidates went up, without a wait


@pytest.mark.parametrize("config", [DecodeConfig(3, 4), DecodeConfig(2, 2, tree=STATIC_TREE)],
                         ids=["chain k3", "static tree"])
def test_logits_processor_uploads_without_a_wait(trained, config):
    """A logits processor needs every verification row's context (x_0..x_{n-1} and the row's
    path) on the device: one upload for all rows, split into views (it was one per row, and one
    more for the drafting group's context), plus the nodes' read that builds those contexts."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    processor = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=1.5)])
    syncs, out, per_generation = count(trained, config, processor=processor)
    assert syncs.kinds["read"] == 2 * out.num_steps, syncs.where
    assert syncs.kinds["upload"] <= per_generation and syncs.queued >= out.num_steps, syncs.where
    assert syncs.kinds["index"] == syncs.kinds["shape"] == 0, syncs.where


@pytest.mark.parametrize("static", [False, True], ids=["dynamic cache", "static cache"])
def test_dynamic_tree_sync_budget(trained, static):
    """Two reads (the planner's drafts, the verification) and one non-blocking upload of the whole
    plan (parents, group anchors and lengths, node tokens, split into views on the device): it was
    five uploads, and 7.55 syncs per step by CUDA's own count (issue 45), then 2.55."""
    syncs, out, per_generation = count(trained, DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10), static=static)
    assert syncs.kinds["read"] == 2 * out.num_steps, syncs.where
    assert syncs.kinds["upload"] <= per_generation and syncs.queued >= out.num_steps, syncs.where
    assert syncs.total <= 2 * out.num_steps + per_generation, syncs.where


def test_counter_sees_what_cuda_would_sync(tiny):
    """The counter itself: reads, 0-d indexing, boolean masks and uploads of device tensors count;
    host bookkeeping does not."""
    model, _, _ = tiny
    with SyncCounter(model) as syncs:
        x = model.get_input_embeddings().weight[:4, 0] * 2  # a device tensor
        host = torch.tensor([1, 2, 3])
        host.tolist(), int(host[0])  # host work: free
        x.tolist()
        x[torch.tensor(1, device=x.device)]
        x[x > 0]
        torch.tensor([5], device=x.device)
        x[[0, 1]]  # a list index goes up first
        y = x.clone()
        y[x.argmax(0, keepdim=True)] = 0.0  # advanced-index setitem of a scalar: CUDA uploads the scalar
        y.index_fill_(0, x.argmax(0, keepdim=True), 0.0)  # the scalar travels as a kernel argument: free
        y[:2] = x[2:]  # device to device: free
        y.copy_(host.float().repeat(2)[:4])  # host data into a device tensor
        host.to(x.device, non_blocking=True)  # queued on the stream: the host does not wait
    assert dict(syncs.kinds) == {"read": 1, "upload": 5, "index": 1, "shape": 1}, syncs.where
    assert syncs.queued == 1


def test_sampling_sync_budget(trained):
    """Issue 43, under sampling, the budgets reached (asserted so they do not grow back):

    * the sampled chain (p/q rule): one read per step, like greedy;
    * a sampled tree (multi-candidate sampling, ``verify_tree_sampling``): at most 8 per step
      today. The tree's rows are tried on the host (the node tokens, each sibling's residual and
      draw), and the cache's path moves by host-built indices; a device-side sibling loop would
      bring it to the chain's count. Not done."""
    from space.decoding import SamplingConfig

    model, _, spec, lang = trained
    sampling = SamplingConfig(0.8, top_p=0.95, seed=1)
    for config, budget in ((DecodeConfig(3, 4), None), (DecodeConfig(2, 2, tree=STATIC_TREE), 8),
                           (DecodeConfig(3, 4, tree="dynamic", lookup_tokens=10), 8)):
        dec = SpaceDecoder(model, spec, config)
        prompt = torch.tensor(lang.sample(20))
        dec.generate(prompt, 64, sampling=sampling)  # warm
        with SyncCounter(model, holders=[dec]) as syncs:
            out = dec.generate(prompt, 64, sampling=sampling)
        per_generation = 1 + 2 * model.config.num_hidden_layers
        if budget is None:
            assert syncs.kinds["read"] == out.num_steps, syncs.where
            assert syncs.total <= out.num_steps + per_generation, syncs.where
        else:
            assert syncs.total <= budget * out.num_steps + per_generation, (config, syncs.where)
