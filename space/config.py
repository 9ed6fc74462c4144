"""Training configuration: dataclasses (the only source of defaults), YAML, CLI overrides.

``parse_train_args(["--config", "configs/train/x.yaml", "--learning_rate", "1e-4"])``: the YAML
sets values, command-line flags override them (``HfArgumentParser`` over ModelArgs, DataArgs,
MaskArgs and ``transformers.TrainingArguments``). Unknown YAML keys and missing required keys
raise ValueError.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import yaml
from transformers import HfArgumentParser, TrainingArguments


@dataclass
class ModelArgs:
    model_name_or_path: str = field(default="smollm2-135m-instruct", metadata={"help": "alias or local HF directory"})
    mode: str = field(default="frozen-base", metadata={"help": "full | lora | frozen-base (DESIGN §3.6)"})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: str = field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    dtype: str = field(default="float32", metadata={"help": "weights dtype when loading (bf16 is slower on CPU)"})


@dataclass
class DataArgs:
    datasets: str = field(default="mbpp", metadata={"help": "comma list of registered names (mbpp, lima) or .json/.jsonl paths"})
    data_root: str | None = field(default=None, metadata={"help": "shared data folder (default ../shared/data or $SPACE_DATA)"})
    max_length: int = field(default=512, metadata={"help": "tokens per sample, prompt included"})
    limit: int | None = field(default=None, metadata={"help": "rows per dataset (smoke runs)"})


@dataclass
class MaskArgs:
    mask_num: int = field(default=5, metadata={"help": "k: masks per group = candidates per step"})
    mask_diff: bool = field(default=False, metadata={"help": "a distinct mask token per offset j"})
    mask_prob: float = field(default=1.0, metadata={"help": "probability that a sample gets mask groups per epoch"})
    mask_loss_weight: float = field(default=1.0, metadata={"help": "lambda in CE(AR) + lambda * CE(mask)"})
    spans_per_sample: int = field(default=4, metadata={"help": "G: mask groups per sample (efficient layout)"})
    layout: str = field(default="efficient", metadata={"help": "efficient | truncate (the paper's)"})


ARG_CLASSES = (ModelArgs, DataArgs, MaskArgs, TrainingArguments)


def parse_train_args(argv: list[str] | None = None):
    """Returns (ModelArgs, DataArgs, MaskArgs, TrainingArguments).

    Raises:
        ValueError: unknown key in the YAML, or a required key (output_dir) missing.
        FileNotFoundError: the config file does not exist.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(ARG_CLASSES, description="SAR-SFT training for SPACE (python -m space.train).")
    parser.add_argument("--config", help="YAML file; command-line flags override its keys")
    values = {}
    if known.config:
        with open(known.config) as f:
            values = yaml.safe_load(f) or {}
        fields = {f.name for cls in ARG_CLASSES for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{known.config}: unknown config keys {unknown}")
        parser.set_defaults(**values)
    wants_help = any(a in ("-h", "--help") for a in rest)
    if not wants_help and "output_dir" not in values and not any(a.startswith("--output_dir") for a in rest):
        raise ValueError("missing config key: output_dir (set it in the YAML or pass --output_dir)")
    return tuple(parser.parse_args_into_dataclasses(rest)[:4])
