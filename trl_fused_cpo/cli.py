"""Recipe plumbing for ``scripts/train_cpo.py``: script arguments, the strict YAML parser, data and model loading.

The script owns the lifecycle (parse, load, validate, train, evaluate, save); this module owns the pieces it is made
of, so tests can exercise them without launching a run:

- :class:`CPOScriptArguments` (TRL's ``ScriptArguments`` plus the toy model and sample caps) and :func:`make_parser`:
  ``TrlParser((CPOScriptArguments, FusedCPOConfig, ModelConfig))`` that refuses unknown or misspelled recipe keys and
  out-of-range choices *by name*, before anything loads.
- :func:`load_preference_dataset`: a hub name, a local jsonl/json/parquet file or folder, or ``toy`` (shipped data).
- :func:`validate_preference_dataset`: the checks CPOTrainer does not make (missing columns, empty completions,
  conversational data without a chat template), each failing with the column, the example index or the fix.
- :func:`load_model_and_tokenizer`: the embedded toy model, or ``from_pretrained`` with dtype and (Q)LoRA settings.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser

from .config import FusedCPOConfig
from .toy import TOY_MODEL_NAME, load_toy_preferences, toy_model, toy_tokenizer

TOY_DATASET_NAME = "toy"  # recipes name the shipped preference data by this
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class CPOScriptArguments(ScriptArguments):
    """TRL's ``ScriptArguments`` (dataset name/config/splits) plus what the CPO launcher adds."""

    dataset_name: str | None = field(
        default=TOY_DATASET_NAME,
        metadata={
            "help": "Preference data: a hub dataset name, a local .jsonl/.json/.parquet file, a folder of them "
            "(split names from file names: train.jsonl, test.jsonl), a folder written by save_to_disk, or 'toy' "
            "for the shipped toy data (splits 'train' and 'test')."
        },
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only the first N training pairs (None = all). For smoke tests and quick demos."},
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only the first N evaluation pairs (None = all)."},
    )
    tie_word_embeddings: bool = field(
        default=False,
        metadata={
            "help": f"Toy model only ({TOY_MODEL_NAME}): tie lm_head to embed_tokens, as Llama-3.2-1B/3B do. "
            "Ignored for pretrained models, whose config decides."
        },
    )


class RecipeParser(TrlParser):
    """``TrlParser`` that names the offending key when a recipe has an unknown key or an out-of-range choice.

    Stock ``TrlParser`` collects unknown keys into a ``--key value`` list and, for a value outside a field's
    ``choices``, accepts it silently (argparse never checks defaults against choices). Both are refused here, with
    the file, the key and the closest known key.
    """

    _config_path: str | None = None

    def parse_args_and_config(self, args: Iterable[str] | None = None, *pargs, **kwargs):
        import sys

        argv = list(args) if args is not None else sys.argv[1:]
        if "--config" in argv and argv.index("--config") + 1 < len(argv):
            self._config_path = argv[argv.index("--config") + 1]
        return super().parse_args_and_config(argv, *pargs, **kwargs)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        actions = {a.dest: a for a in self._actions if not isinstance(a, argparse._SubParsersAction)}
        where = f"Recipe {self._config_path}" if self._config_path else "Recipe"
        unknown = [key for key in kwargs if key not in actions]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, list(actions), n=1, cutoff=0.6)
                hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(hints)}. Every recipe key must be a field of "
                "CPOScriptArguments, FusedCPOConfig or ModelConfig (see `python scripts/train_cpo.py --help`)."
            )
        for key, value in kwargs.items():
            choices = actions[key].choices
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{where}: {key}={value!r} is not one of {list(choices)}.")
        return super().set_defaults_with_config(**kwargs)


def make_parser(prog: str | None = None) -> RecipeParser:
    """The launcher's parser: ``--config recipe.yaml`` sets the defaults, ``--key value`` overrides them.

    ``make_parser().parse_args_and_config(argv)`` returns ``(CPOScriptArguments, FusedCPOConfig, ModelConfig)``.
    """
    return RecipeParser((CPOScriptArguments, FusedCPOConfig, ModelConfig), prog=prog)


# --------------------------------------------------------------------------------------------------------- data


def load_preference_dataset(script_args: CPOScriptArguments):
    """``DatasetDict`` of preference pairs named by ``script_args.dataset_name`` (see its help for the forms)."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    name = script_args.dataset_name
    if not name:
        raise ValueError("dataset_name is required: a hub name, a local file or folder, or 'toy'.")
    if script_args.dataset_streaming:
        raise ValueError(
            "dataset_streaming=True is not supported: CPOTrainer tokenizes the whole dataset before training. "
            "Set dataset_streaming: false (and max_train_samples to cap the size)."
        )
    if name == TOY_DATASET_NAME:
        return DatasetDict({split: Dataset.from_list(load_toy_preferences(split)) for split in ("train", "test")})
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower()
        if ext not in _LOCAL_FORMATS:
            raise ValueError(f"dataset_name={name!r}: local files must be one of {sorted(_LOCAL_FORMATS)}.")
        return load_dataset(_LOCAL_FORMATS[ext], data_files=name)  # one split: "train"
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(
            os.path.join(name, "dataset_info.json")
        ):
            loaded = load_from_disk(name)
            return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
        return load_dataset(name, name=script_args.dataset_config)
    return load_dataset(name, name=script_args.dataset_config)


def _text(value: Any) -> str | None:
    """The text of a standard completion (a string) or a conversational one (a list of messages); None if neither."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for message in value:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
                content = " ".join(str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
            parts.append("" if content is None else str(content))
        return " ".join(parts)
    return None


def validate_preference_dataset(dataset, tokenizer=None, *, split: str = "train") -> None:
    """Refuse data CPOTrainer would mis-train on, naming the problem; pass through anything TRL accepts.

    Checks, in order: ``chosen`` and ``rejected`` columns exist (else the columns present are listed); conversational
    data has a tokenizer with a ``chat_template``; no example has an empty chosen or rejected completion (after
    TRL's implicit-prompt extraction when there is no ``prompt`` column), which would give a 0/0 = NaN sequence
    log-prob under the mean-normalised losses and an empty pair under the others.

    Args:
        dataset: a ``datasets.Dataset`` (one split) in a TRL preference format: standard or conversational, explicit
            (``prompt`` column) or implicit prompt.
        tokenizer: the tokenizer the trainer will use (for the chat-template check); None skips that check.
        split: the split's name, for the messages.
    """
    from trl.data_utils import extract_prompt, is_conversational

    columns = list(dataset.column_names)
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise ValueError(
            f"The {split!r} split has no {' or '.join(repr(c) for c in missing)} column: CPO needs 'chosen' and "
            f"'rejected' (and optionally 'prompt'). Columns present: {columns}. Rename them, e.g. "
            "dataset.rename_columns({'response_a': 'chosen', 'response_b': 'rejected'})."
        )
    if len(dataset) == 0:
        raise ValueError(f"The {split!r} split is empty.")
    conversational = is_conversational(dataset[0])
    if conversational and tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"The {split!r} split is conversational (lists of {{'role', 'content'}} messages), but the tokenizer "
            f"({type(tokenizer).__name__}) has no chat_template to render them with. Use an instruct/chat "
            "tokenizer, set tokenizer.chat_template, or convert the data to the standard (plain text) format."
        )
    has_prompt = "prompt" in columns
    if has_prompt:  # as maybe_extract_prompt: a prompt column in the other format than chosen is re-extracted
        first = dataset[0]
        has_prompt = is_conversational({"prompt": first["prompt"]}) == is_conversational({"chosen": first["chosen"]})
    for index, row in enumerate(dataset.select_columns(["chosen", "rejected"])):
        for key in ("chosen", "rejected"):
            if row[key] is None:
                raise ValueError(f"Example {index} of the {split!r} split has no {key!r} value (None).")
        _check_completions(row, index, split, "")
        if not has_prompt:
            # The prompt is implicit: TRL takes the shared prefix of chosen and rejected. When one is a prefix of the
            # other, its completion is empty, and TRL's extract_prompt (off by one there) silently trains on the
            # prompt's last character or message instead.
            chosen, rejected = row["chosen"], row["rejected"]
            for key, a, b in (("chosen", chosen, rejected), ("rejected", rejected, chosen)):
                if len(a) <= len(b) and b[: len(a)] == a:
                    raise ValueError(
                        f"Example {index} of the {split!r} split has an empty {key!r} completion once the shared "
                        f"prompt prefix is removed ({key} is a prefix of the other side, or equal to it). Drop or fix "
                        "that example, or give the prompt in its own 'prompt' column."
                    )
            _check_completions(
                extract_prompt({"chosen": chosen, "rejected": rejected}),
                index,
                split,
                " once the shared prompt prefix is removed",
            )


def _check_completions(row: dict, index: int, split: str, where: str) -> None:
    for key in ("chosen", "rejected"):
        text = _text(row[key])
        if text is None:
            raise ValueError(
                f"Example {index} of the {split!r} split: {key!r} is a {type(row[key]).__name__}, expected a "
                "string (standard format) or a list of {'role', 'content'} messages (conversational)."
            )
        if not text.strip():
            raise ValueError(
                f"Example {index} of the {split!r} split has an empty {key!r} completion{where}: its sequence "
                "log-prob would be 0/0. Drop or fix that example."
            )


# -------------------------------------------------------------------------------------------------------- model


def kbit_device_map() -> dict[str, int] | None:
    """One whole quantized model per process (trl < 1.0 shipped this as ``get_kbit_device_map``)."""
    import torch
    from accelerate import PartialState

    return {"": PartialState().local_process_index} if torch.cuda.is_available() else None


def _dtype(name: str | None):
    import torch

    if name in (None, "auto"):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={name!r} is not a torch dtype: use auto, bfloat16, float16 or float32.")
    return dtype


def load_model_and_tokenizer(script_args: CPOScriptArguments, training_args: FusedCPOConfig, model_args: ModelConfig):
    """``(model, tokenizer)``: the embedded toy model for ``toy-llama3``, else ``from_pretrained``.

    LoRA is not applied here: the trainer receives ``get_peft_config(model_args)`` and wraps the model itself (after
    preparing a k-bit base for training). QLoRA loads the base with ``get_quantization_config(model_args)``.
    """
    name = model_args.model_name_or_path
    if not name:
        raise ValueError(f"model_name_or_path is required: a hub name, a local folder, or {TOY_MODEL_NAME!r}.")
    quantized = model_args.load_in_4bit or model_args.load_in_8bit
    if quantized and not model_args.use_peft:
        raise ValueError(
            "load_in_4bit/load_in_8bit freeze the base weights, so only an adapter can train: set use_peft: true."
        )
    if name == TOY_MODEL_NAME:
        if quantized:
            raise ValueError(f"{TOY_MODEL_NAME} is built in fp32 in-process and cannot be quantized.")
        dtype = _dtype(model_args.dtype)
        model = toy_model(
            tie_word_embeddings=script_args.tie_word_embeddings,
            seed=training_args.seed,
            **({} if dtype in (None, "auto") else {"dtype": dtype}),
        )
        return model, toy_tokenizer()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_quantization_config

    kwargs: dict[str, Any] = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
    )
    if model_args.dtype is not None:
        kwargs["dtype"] = _dtype(model_args.dtype)
    if quantized:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                "load_in_4bit/load_in_8bit (QLoRA) need bitsandbytes, which is not installed: "
                "pip install 'trl_fused_cpo[qlora]' (or pip install bitsandbytes)."
            )
        kwargs["quantization_config"] = get_quantization_config(model_args)
        kwargs["device_map"] = kbit_device_map()
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(
        name, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    if tokenizer.pad_token is None:  # Llama-3 base ships none; CPOTrainer would do the same
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
