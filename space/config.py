"""Training configuration: dataclasses (the only source of defaults), YAML, CLI overrides.

``parse_train_args(["--config", "configs/train/x.yaml", "--learning_rate", "1e-4"])``: the YAML
sets values, command-line flags override them (``HfArgumentParser`` over ModelArgs, DataArgs,
MaskArgs and :class:`SpaceTrainingArguments`, HF's ``TrainingArguments`` plus a time budget). Unknown YAML keys and missing required keys
raise ValueError.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
import warnings
from dataclasses import dataclass, field

import yaml
from transformers import HfArgumentParser, TrainingArguments

from .choices import SMOLLM2
from .cli import DEBUG_HELP, HelpFormatter, check_number
from .data.sft import data_lists
from .decoding.config import DEFAULT_MASK_NUM


@dataclass
class ModelArgs:
    _argument_group_name = "SPACE: model"  # HfArgumentParser's help section (a class attribute, not a field)

    model_name_or_path: str = field(default=SMOLLM2, metadata={"help": "alias or local HF directory"})
    mode: str = field(default="frozen-base", metadata={"help": "full | lora | frozen-base (DESIGN §3.6)"})
    lora_r: int = field(default=16, metadata={"help": "lora / frozen-base: LoRA rank, >= 1"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator (update x alpha / r), > 0"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input, in [0, 1)"})
    lora_targets: str = field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                              metadata={"help": "comma list of the linear layers that get a LoRA, by the model's "
                                                "own names (Phi-3: qkv_proj,o_proj,gate_up_proj,down_proj; an MoE "
                                                "model whose experts peft fuses: attention only)"})
    dtype: str = field(default="float32", metadata={"help": "weights dtype when loading (bf16 is slower on CPU)"})
    init_adapter: str | None = field(default=None, metadata={
        "help": "lora / frozen-base: start from this SPACE artifact's LoRA weights and mask rows (same mode, "
                "k, mask_diff, lora_r and targets), e.g. adapters/smollm2-135m-space"})


@dataclass
class DataArgs:
    _argument_group_name = "SPACE: data"

    datasets: str = field(default="mbpp", metadata={"help": "comma list of registered names (mbpp, lima) or .json/.jsonl paths"})
    data_root: str | None = field(default=None, metadata={"help": "shared data folder (default ../shared/data or $SPACE_DATA)"})
    max_length: int = field(default=512, metadata={"help": "tokens per sample, prompt included"})
    limit: int | None = field(default=None, metadata={"help": "rows per dataset, for smoke runs (default: all)"})
    sources: str | None = field(default=None, metadata={
        "help": "self-distilled files: keep only rows whose 'source' is in this comma list (mbpp, lima, stdlib; "
                "default: every row)"})


@dataclass
class MaskArgs:
    _argument_group_name = "SPACE: mask tokens and loss"

    mask_num: int = field(default=DEFAULT_MASK_NUM, metadata={"help": "k: masks per group = candidates per step"})
    mask_diff: bool = field(default=False, metadata={"help": "a distinct mask token per offset j"})
    mask_prob: float = field(default=1.0, metadata={"help": "probability that a sample gets mask groups per epoch"})
    mask_loss_weight: float = field(default=1.0, metadata={"help": "lambda in CE(AR) + lambda * CE(mask)"})
    spans_per_sample: int = field(default=4, metadata={"help": "G: mask groups per sample (efficient layout)"})
    layout: str = field(default="efficient", metadata={"help": "efficient | truncate (the paper's)"})
    span_density: float = field(default=0.0, metadata={
        "help": "dense supervision: share in (0, 1] of the answer positions that anchor a group (1 = every "
                "one); overrides spans_per_sample. 0 = off (spans_per_sample groups)"})
    mask_chunk_rows: int = field(default=0, metadata={
        "help": "frozen-base: mask rows per forward/backward chunk (whole groups; 0 = all in one pass)"})
    mask_target: str = field(default="token", metadata={
        "help": "token: CE on the next tokens | teacher: soft CE on the frozen base's top-K at row e+j (frozen-base)"})
    teacher_topk: int = field(default=20, metadata={"help": "K of the teacher's top-K distribution (renormalized)"})
    chain_weight: float = field(default=0.0, metadata={
        "help": "alpha in [0, 1]: weight mask j's loss by (1 - alpha) + alpha * P(the chain reaches j), the product "
                "of the true tokens' probabilities at offsets 0..j-1 (teacher's, else the model's own, detached); "
                "0 = off"})
    consistency_weight: float = field(default=0.0, metadata={
        "help": "frozen-base: weight of the hidden-state consistency loss, mask j anchored at e pulled towards "
                "the base's last hidden state at row e+j (0 = off)"})
    sampler_head: bool = field(default=False, metadata={
        "help": "frozen-base, efficient layout: train a sampler head (issue 34) that conditions mask j's draft on "
                "the token at offset j-1 (the drafted one when decoding), saved with the adapter"})
    sampler_width: int = field(default=0, metadata={"help": "the sampler head's hidden width (0 = the model width)"})


@dataclass
class SpaceTrainingArguments(TrainingArguments):
    """``transformers.TrainingArguments`` plus a wall-clock budget, for recipe sweeps at equal time
    (issue #13): arms whose steps cost different amounts get the same minutes, not the same steps,
    and a limit on consecutive non-finite steps (a run that cannot learn stops, non-zero)."""

    _argument_group_name = "HF TrainingArguments (SPACE's max_train_minutes and max_nonfinite_steps last)"
    max_train_minutes: float = field(default=0.0, metadata={
        "help": "stop after the step that crosses this many minutes of training in this launch, save a "
                "checkpoint and write the artifact (0 = off). A cosine schedule is then cut mid-way: pair it "
                "with a constant one"})
    max_nonfinite_steps: int = field(default=3, metadata={
        "help": "stop with an error (non-zero exit) after this many consecutive optimizer steps whose loss or "
                "gradient norm is NaN or inf; those steps save no checkpoint, so the last good one stays (0 = never "
                "stop; under fp16 only the loss counts, as the loss scaler skips overflowing steps)"})


@dataclass(frozen=True)
class SpaceSettings:
    """What ``SpaceTrainer`` and the per-batch step (``space.train.steps``) need, validated once.

    Built from the parsed arguments by :meth:`from_args` (``check_train_args`` does, so a bad value
    fails before the model loads); a Python caller may build one directly. Fields are MaskArgs'
    and ModelArgs' of the same names (DESIGN §3.2, §3.6), plus ``suppress_ids`` (the mask token
    ids, which the teacher never proposes) and ``max_nonfinite_steps``
    (:class:`SpaceTrainingArguments`).

    Raises:
        ValueError: unknown mode, layout or mask_target; mask_num outside 1..MAX_MASK_NUM;
            teacher_topk < 1, mask_chunk_rows, mask_loss_weight, consistency_weight or
            max_nonfinite_steps < 0 (or NaN/inf); chain_weight outside [0, 1]; a teacher or
            consistency loss without mode frozen-base and layout efficient.
    """

    mode: str = "frozen-base"
    layout: str = "efficient"
    mask_num: int = DEFAULT_MASK_NUM
    mask_loss_weight: float = 1.0
    mask_target: str = "token"
    teacher_topk: int = 20
    mask_chunk_rows: int = 0
    chain_weight: float = 0.0
    consistency_weight: float = 0.0
    max_nonfinite_steps: int = 3
    suppress_ids: tuple[int, ...] = ()

    @property
    def frozen_base(self) -> bool:
        """The two-pass step: real tokens without gradients, then the mask rows (DESIGN §3.6)."""
        return self.mode == "frozen-base"

    @classmethod
    def from_args(cls, model_args, mask_args, train_args, suppress_ids: tuple[int, ...] = ()) -> "SpaceSettings":
        names = ("mask_num", "mask_loss_weight", "mask_target", "teacher_topk", "mask_chunk_rows", "chain_weight",
                 "consistency_weight", "layout")
        return cls(mode=model_args.mode, max_nonfinite_steps=getattr(train_args, "max_nonfinite_steps", 3),
                   suppress_ids=tuple(suppress_ids), **{name: getattr(mask_args, name) for name in names})

    def __post_init__(self):
        from .adapter_layers import MODES  # here, not at the top: importing the config needs no model code
        from .tokens import check_mask_num

        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        if self.layout not in ("efficient", "truncate"):
            raise ValueError(f"unknown layout {self.layout!r}; choose efficient or truncate")
        check_mask_num(self.mask_num)
        for name, minimum in (("mask_chunk_rows", 0), ("teacher_topk", 1), ("mask_loss_weight", 0),
                              ("max_nonfinite_steps", 0), ("consistency_weight", 0)):
            check_number(name, getattr(self, name), minimum)  # NaN and inf too
        if not 0 <= self.chain_weight <= 1:  # False for NaN
            raise ValueError(f"chain_weight must lie in [0, 1], got {self.chain_weight}")
        if self.mask_target not in ("token", "teacher"):
            raise ValueError(f"unknown mask_target {self.mask_target!r}; choose token or teacher")
        two_pass = self.frozen_base and self.layout == "efficient"
        if self.mask_target == "teacher" and not two_pass:
            raise ValueError("mask_target teacher needs mode frozen-base and layout efficient (the two-pass step "
                             "computes the base's distribution)")
        if self.consistency_weight > 0 and not two_pass:
            raise ValueError("consistency_weight needs mode frozen-base and layout efficient (the two-pass step "
                             "computes the base's hidden states)")


ARG_CLASSES = (ModelArgs, DataArgs, MaskArgs, SpaceTrainingArguments)


def parse_train_args(argv: list[str] | None = None):
    """Returns (ModelArgs, DataArgs, MaskArgs, SpaceTrainingArguments).

    Raises:
        ValueError: unknown key in the YAML, YAML that is broken, not UTF-8 or not a mapping, a
            required key (output_dir) missing, or a value out of range (see :func:`check_train_args`).
        FileNotFoundError: the config file does not exist.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    # the console wrapper (space.cli) takes --debug off the command line, so TrainingArguments'
    # own --debug option can only be set in the YAML
    parser = HfArgumentParser(ARG_CLASSES, prog="space-train", formatter_class=HelpFormatter,
                              description="SAR-SFT training for SPACE (python -m space.train). Resumes from the "
                                          "last checkpoint in output_dir.",
                              epilog=f"--debug: {DEBUG_HELP} (TrainingArguments' debug option: set it in the YAML)")
    # argparse prints the ungrouped options (--help, --config) before the groups
    parser.add_argument("--config", help="YAML file setting any of the keys below (e.g. configs/train/"
                        "smollm2_frozen_base_cpu.yaml); command-line flags override its keys")
    values = {}
    if known.config:
        values = read_config_file(known.config)
        fields = {f.name for cls in ARG_CLASSES for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{known.config}: unknown config keys {unknown}")
        check_config_types(values, known.config)
        parser.set_defaults(**values)
    wants_help = any(a in ("-h", "--help") for a in rest)
    # the parser takes both spellings, with the value after a space or an "="
    given = any(a.split("=")[0] in ("--output_dir", "--output-dir") for a in rest)
    if not wants_help and "output_dir" not in values and not given:
        raise ValueError("missing config key: output_dir (set it in the YAML or pass --output_dir)")
    args = tuple(parser.parse_args_into_dataclasses(rest)[:4])
    check_train_args(*args)
    return args


# a field's plain type -> (what the YAML value may be, how the error says it); bool is an int to
# Python, so it is refused by name for the number types
_YAML_TYPES = {int: ((int,), "an integer"), float: ((int, float), "a number"), bool: ((bool,), "true or false"),
               str: ((str,), "a string")}


def check_config_types(values: dict, path: str | os.PathLike) -> None:
    """Refuse a YAML value whose type its field does not take (plain int, float, bool and str
    fields, or those or None). ``HfArgumentParser.set_defaults`` hands a default to argparse
    as it is, and argparse converts only strings, so ``spans_per_sample: 2.5`` or ``mask_num: true``
    got in and failed (or ran as k = 1) later. Strings are left to argparse's conversion
    (``learning_rate: 1e-4``, which YAML 1.1 reads as text, works).

    Raises:
        ValueError: the file, the key, the type it needs and the value.
    """
    hints = {f.name: typing.get_type_hints(cls)[f.name] for cls in ARG_CLASSES for f in dataclasses.fields(cls)}
    for key, value in values.items():
        hint = hints[key]
        args = typing.get_args(hint)
        optional = type(None) in args
        plain = next((a for a in args if a is not type(None)), None) if optional and len(args) == 2 else hint
        if plain not in _YAML_TYPES or (optional and value is None):
            continue
        allowed, what = _YAML_TYPES[plain]
        if isinstance(value, str) and plain is not str:
            continue  # argparse converts a string default with the field's type ("1e-4", "yes"), or says why not
        if not isinstance(value, allowed) or (plain is not bool and isinstance(value, bool)):
            raise ValueError(f"{path}: {key} must be {what}{' or null' if optional else ''}, got {value!r}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (it kept the last one: a
    config with ``mask_num: 3`` and, further down, ``mask_num: 5`` trained k = 5 without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config_file(path: str | os.PathLike) -> dict:
    """The key-value mapping of a training config YAML (unchecked keys).

    Raises:
        FileNotFoundError: no such file.
        ValueError: broken YAML, a key given twice, not UTF-8, or not a mapping (the file is named).
    """
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:  # its own message spans lines: make it one, and name the file
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return values


def check_train_args(model_args, data_args, mask_args, train_args) -> None:
    """Range checks that need no model, so a typo fails before the model loads (the trainer's
    own settings through :class:`SpaceSettings`, which validates them once).

    Raises:
        ValueError: unknown mode, layout or mask_target, mask_num outside 1..MAX_MASK_NUM,
            a datasets list naming no dataset, spans_per_sample, limit, max_length, mask_chunk_rows,
            teacher_topk or lora_r too small,
            mask_prob or span_density outside [0, 1], lora_dropout outside [0, 1), lora_alpha <= 0,
            a negative mask_loss_weight, max_train_minutes, max_nonfinite_steps, learning_rate, weight_decay,
            num_train_epochs, max_grad_norm, sampler_width, adam_epsilon or dataloader_num_workers,
            adam_beta1 or adam_beta2 outside [0, 1), a report_to integration unknown or not installed (or
            all / none beside others), an output_dir whose final is a file, an
            optim whose package is not installed (:func:`_check_optimizer_installed`), NaN or inf in any
            number, a teacher,
            consistency or sampler head without frozen-base + efficient, a sampler head with
            ddp_find_unused_parameters true, init_adapter with mode full, an output_dir that is a
            file, dataloader_persistent_workers with workers, or DeepSpeed settings
            :func:`check_deepspeed` refuses, or a ``sources`` list naming no source; a non-zero
            label_smoothing_factor (HF's smoother never sees SAR-SFT's loss); neftune_noise_alpha in
            frozen-base; settings that train nothing (max_steps 0, or no epoch and no max_steps; in
            frozen-base, mask_prob 0, or mask_loss_weight and consistency_weight both 0);
            gradient_accumulation_steps or per_device_train_batch_size below 1; mode full with bf16 /
            fp16 weights and no DeepSpeed (no fp32 master copy: Adam's small updates round away).
        FileNotFoundError: a resume_from_checkpoint that is not a checkpoint folder.

    Warns (UserWarning) of a setting the run ignores, set away from its default: LoRA settings or
    mask_chunk_rows in mode full, mask_chunk_rows in lora, teacher_topk with mask_target token,
    sampler_width without sampler_head; learning_rate 0 (nothing changes: a way to compare
    initializations, never a trained model).
    """
    SpaceSettings.from_args(model_args, mask_args, train_args)
    # an empty list failed only after the model loaded, and said that no sample fit max_length
    if not data_lists(data_args.datasets, data_args.sources)[0]:
        raise ValueError(f"datasets={data_args.datasets!r} names no dataset")
    for name, value, minimum in (("spans_per_sample", mask_args.spans_per_sample, 1),
                                 ("limit", data_args.limit, 1), ("max_length", data_args.max_length, 2),
                                 ("lora_r", model_args.lora_r, 1),
                                 ("max_train_minutes", getattr(train_args, "max_train_minutes", 0), 0),
                                 *((name, getattr(train_args, name), 0) for name in
                                   ("learning_rate", "weight_decay", "num_train_epochs", "max_grad_norm"))):
        check_number(name, value, minimum)  # NaN and inf too: they pass every comparison below
    check_number("sampler_width", mask_args.sampler_width, 0)
    # the trainer's own check came after the model loaded and the data was tokenized, as a bare traceback
    report = [r for r in getattr(train_args, "report_to", None) or [] if r not in ("all", "none")]
    if report and len(report) < len(train_args.report_to):  # HF takes all / none alone, and refused them late
        raise ValueError(f"report_to {train_args.report_to}: all and none stand alone, not beside other integrations")
    if report:
        from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                                 get_available_reporting_integrations)

        installed = get_available_reporting_integrations()
        unknown = sorted(set(report) - set(INTEGRATION_TO_CALLBACK))
        if unknown:
            raise ValueError(f"report_to {unknown}: no such integration (transformers has "
                             f"{sorted(INTEGRATION_TO_CALLBACK)}; installed here: {installed})")
        # HF's list of installed ones never names flyte, nor azure_ml beside mlflow: their callbacks decide
        missing = sorted(set(report) - set(installed) - {"flyte", "azure_ml"})
        if missing:
            raise ValueError(f"report_to {missing}: not installed here (installed: {installed}); install it, "
                             "or use report_to none")
    _check_optimizer_installed(train_args)
    # the optimizer's and loader's own checks ran only once training started, and named no option
    for name in ("adam_epsilon", "dataloader_num_workers"):
        check_number(name, getattr(train_args, name, 0), 0)
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(train_args, name, 0) < 1:  # False for NaN
            raise ValueError(f"{name} must lie in [0, 1), got {getattr(train_args, name)}")
    for name, value in (("mask_prob", mask_args.mask_prob), ("span_density", mask_args.span_density),
                        ("lora_dropout", model_args.lora_dropout)):
        if not 0 <= value <= 1:  # False for NaN
            raise ValueError(f"{name} must lie in [0, 1], got {value}")
    if model_args.lora_dropout == 1:
        raise ValueError("lora_dropout must lie in [0, 1), got 1 (it would drop every LoRA input)")
    check_number("lora_alpha", model_args.lora_alpha)
    if model_args.lora_alpha <= 0:
        raise ValueError(f"lora_alpha must be > 0, got {model_args.lora_alpha}")
    if mask_args.sampler_head and (model_args.mode != "frozen-base" or mask_args.layout != "efficient"):
        raise ValueError("sampler_head needs mode frozen-base and layout efficient (the two-pass step feeds it "
                         "the true token before each mask's target)")
    if mask_args.sampler_head and getattr(train_args, "ddp_find_unused_parameters", None):
        raise ValueError("sampler_head needs ddp_find_unused_parameters false (the head runs outside the "
                         "DDP-wrapped forward, so DDP's search would mark its weights ready twice)")
    if model_args.init_adapter is not None and model_args.mode == "full":
        raise ValueError("init_adapter needs mode lora or frozen-base (a full run starts from its model path)")
    if os.path.exists(train_args.output_dir) and not os.path.isdir(train_args.output_dir):
        raise ValueError(f"output_dir {train_args.output_dir} is a file; pass a folder")
    final = os.path.join(train_args.output_dir, "final")
    if os.path.lexists(final) and not os.path.isdir(final):  # the save after the whole training failed on it
        raise ValueError(f"{final} is a file where the run saves its artifact (a folder); move it, or use another "
                         "output_dir")
    # settings this run ignores, set away from their defaults: said, not refused (a sweep's arm in mode full
    # inherits its base config's LoRA settings)
    defaults = {f.name: f.default for cls in (ModelArgs, MaskArgs) for f in dataclasses.fields(cls)}
    ignored = {"full": ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "mask_chunk_rows"),
               "lora": ("mask_chunk_rows",)}.get(model_args.mode, ())
    ignored += ("teacher_topk",) if mask_args.mask_target == "token" else ()
    ignored += ("sampler_width",) if not mask_args.sampler_head else ()
    set_ = [n for n in ignored if getattr(model_args, n, getattr(mask_args, n, None)) != defaults[n]]
    if set_:
        warnings.warn(f"{', '.join(set_)} set, but mode {model_args.mode} with mask_target {mask_args.mask_target}"
                      f"{'' if mask_args.sampler_head else ' and no sampler_head'} never reads "
                      f"{'it' if len(set_) == 1 else 'them'}: this run ignores {'it' if len(set_) == 1 else 'them'}",
                      stacklevel=2)
    if getattr(train_args, "neftune_noise_alpha", None) and model_args.mode == "frozen-base":
        raise ValueError("neftune_noise_alpha with mode frozen-base: HF's NEFTune noises the embedding output of the "
                         "frozen real pass too (its KV cache and the teacher), which decoding never sees; drop it")
    _check_trains_something(model_args, mask_args, train_args)
    if getattr(train_args, "label_smoothing_factor", 0):
        raise ValueError("label_smoothing_factor is not supported: SAR-SFT's loss is its own (space.train.loss), "
                         "which HF's label smoother never sees; set it to 0")
    resume = getattr(train_args, "resume_from_checkpoint", None)
    if resume and not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise FileNotFoundError(f"resume_from_checkpoint {resume}: not a checkpoint folder (no trainer_state.json); "
                                f"a run resumes from the last checkpoint in its output_dir on its own")
    if getattr(train_args, "dataloader_persistent_workers", False) and getattr(train_args, "dataloader_num_workers", 0):
        raise ValueError("dataloader_persistent_workers needs to be false: the collator draws each epoch's mask spans "
                         "from the epoch the main process sets, which persistent workers never see (they would "
                         "keep epoch 0's spans)")
    check_deepspeed(getattr(train_args, "deepspeed", None), mask_args)


def _check_optimizer_installed(train_args) -> None:
    """Refuse an ``optim`` whose package is not installed (bitsandbytes' 8-bit Adam, GaLore, LOMO,
    schedule-free: an ImportError from transformers; GrokAdamW, AnyPrecision: a ValueError), or
    whose settings its lookup refuses (GaLore without ``optim_target_modules``): HF's Trainer found
    out only when it built the optimizer, after the model loaded and the data was tokenized. A
    lookup that asks for the model (GaLore, APOLLO, LOMO, installed) passes: the Trainer checks the
    rest. A DeepSpeed config with its own ``optimizer`` section replaces HF's optimizer, so then
    nothing is checked (:func:`check_train_args`).

    Raises:
        ValueError: naming the optim and what to install or set (transformers' message).
    """
    deepspeed = getattr(train_args, "deepspeed", None)
    if deepspeed:
        from accelerate.utils.deepspeed import HfDeepSpeedConfig

        if "optimizer" in HfDeepSpeedConfig(deepspeed).config:
            return
    from transformers import Trainer

    try:  # the class lookup the Trainer does when it builds the optimizer; it builds nothing
        Trainer.get_optimizer_cls_and_kwargs(train_args)
    except (ImportError, ValueError) as e:
        if isinstance(e, ValueError) and re.search(r"pass a `?model", str(e)):
            return  # installed, and the lookup wants the model (GaLore, APOLLO, LOMO): the Trainer's to check
        optim = getattr(train_args.optim, "value", train_args.optim)
        raise ValueError(f"optim {optim}: {e}") from None


def _check_trains_something(model_args, mask_args, train_args) -> None:
    """Refuse settings under which a run exits 0 with an artifact that no step trained (each wrote
    a final/ whose LoRA B were all still zero), or trained with updates rounded away; warn of a
    learning rate of 0 (:func:`check_train_args`)."""
    for name in ("gradient_accumulation_steps", "per_device_train_batch_size"):
        value = getattr(train_args, name, 1)
        if not isinstance(value, int) or value < 1:  # 0 failed after the model loaded (a ZeroDivisionError)
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    max_steps = getattr(train_args, "max_steps", -1)
    if max_steps == 0 or (max_steps < 0 and getattr(train_args, "num_train_epochs", 1) == 0):
        raise ValueError(f"max_steps {max_steps} with num_train_epochs {getattr(train_args, 'num_train_epochs', 1)} "
                         "trains no step (the run would write an untrained artifact): set max_steps > 0 or "
                         "num_train_epochs > 0")
    if model_args.mode == "frozen-base":  # only the masks train: without them nothing does
        if mask_args.mask_prob == 0:
            raise ValueError("mask_prob 0 in mode frozen-base: no sample gets mask groups, and frozen-base trains "
                             "only the masks (the run would write an untrained adapter)")
        if mask_args.mask_loss_weight == 0 and mask_args.consistency_weight == 0:
            raise ValueError("mask_loss_weight 0 (and no consistency_weight) in mode frozen-base: no loss reaches the "
                             "masks (the run would write an untrained adapter)")
    half = str(model_args.dtype).removeprefix("torch.") in ("bfloat16", "bf16", "float16", "fp16", "half")
    if model_args.mode == "full" and half and not getattr(train_args, "deepspeed", None):
        raise ValueError(f"mode full with dtype {model_args.dtype} and no DeepSpeed: the trained weights are "
                         f"{model_args.dtype} with no fp32 master copy, and Adam's small updates round away (43 % "
                         "of a tiny model's weights unchanged after 2 steps at lr 5e-5); load with dtype float32 "
                         "and bf16: true (autocast), or give a deepspeed config (fp32 master weights)")
    if getattr(train_args, "learning_rate", 1) == 0:
        warnings.warn("learning_rate 0: no weight changes (the artifact is the initialization, not a trained model)",
                      stacklevel=3)


def check_deepspeed(deepspeed, mask_args) -> None:
    """Refuse, before training, DeepSpeed settings that would fail only later.

    Args:
        deepspeed: ``TrainingArguments.deepspeed``: None, a JSON file's path, its dict, or its
            text as JSON or base64 (what transformers accepts).

    Raises:
        ValueError: mask_chunk_rows > 0 (each DeepSpeed backward also steps, so a batch cannot be
            back-propagated chunk by chunk), or ZeRO-3 without
            ``stage3_gather_16bit_weights_on_model_save: true`` (the final save gathers the
            partitioned weights; without it, it fails after the whole training), or a config that
            is neither (accelerate's message).
    """
    if not deepspeed:
        return
    if mask_args.mask_chunk_rows > 0:
        raise ValueError("mask_chunk_rows > 0 does not work with DeepSpeed (each backward also steps): set it to 0")
    from accelerate.utils.deepspeed import HfDeepSpeedConfig  # reads a path, a dict, JSON or base64 as HF does

    zero = HfDeepSpeedConfig(deepspeed).config.get("zero_optimization", {})
    if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        raise ValueError(f"{deepspeed if not isinstance(deepspeed, dict) else 'the DeepSpeed config'}: ZeRO-3 needs "
                         "zero_optimization.stage3_gather_16bit_weights_on_model_save true, else the artifact "
                         "cannot be saved at the end of training")
