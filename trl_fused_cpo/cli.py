"""Recipe plumbing for the launcher (:mod:`trl_fused_cpo.train`): script arguments, the strict parser, data and model.

The launcher owns the lifecycle (parse, load, validate, train, evaluate, save); this module owns the pieces it is made
of, so tests can exercise them without launching a run:

- :class:`CPOScriptArguments` (TRL's ``ScriptArguments`` plus the toy model and sample caps) and :func:`make_parser`:
  ``TrlParser((CPOScriptArguments, FusedCPOConfig, ModelConfig))`` that refuses unknown or misspelled recipe keys and
  flags, recipe values of the wrong type and out-of-range choices *by name*, before anything loads; a short
  ``--help`` (``--help-all`` for every field).
- :func:`load_preference_dataset`: a hub name, a local jsonl/json/parquet file or folder, or ``toy`` (shipped data);
  a local file that is empty, not UTF-8 or not JSON lines fails with its path and line.
- :func:`validate_preference_dataset`: the checks CPOTrainer does not make (missing columns, empty completions,
  conversational data without a chat template), each failing with the column, the example index or the fix.
- :func:`load_model_and_tokenizer`: the embedded toy model, or ``from_pretrained`` with dtype and (Q)LoRA settings.
"""

from __future__ import annotations

import argparse
import codecs
import copy
import dataclasses
import difflib
import enum
import importlib.util
import json
import os
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from transformers.hf_argparser import string_to_bool
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


class RecipeError(ValueError):
    """A recipe or command line the launcher refuses before anything loads; the CLI prints it without a traceback."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``""``: one hint for recipe keys, flags and choices."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Mismatch(Exception):
    pass


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` as a field typed ``hint`` takes it, converted as the command line would; raises ``_Mismatch``.

    The rules, strict where YAML's guesses go wrong silently: a bool is not a number (``beta: true``) and a number is
    not a bool; an int field takes integers only (``max_steps: 2.5`` and ``2.0`` are refused, as ``--max_steps 2.0``
    is); a float field takes ints too (``learning_rate: 3`` becomes 3.0); a string converts to the field's number or
    bool type when it parses as one (YAML 1.1 reads ``3e-4``, without a dot, as a string, and ``--beta 3e-4`` parses
    it too); a str field takes strings only (``save_strategy: no`` is YAML's boolean False); a list field takes a
    list of its items or one item (``lora_target_modules: all-linear``); ``None`` only where the type is Optional.
    Types the launcher cannot reason about (``ParallelismConfig``, ``Any``) take anything.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return _coerce(value, member)
            except _Mismatch:
                pass
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is typing.Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise _Mismatch
    if origin is list or hint is list:
        item = args[0] if args else Any
        if isinstance(value, list):
            return [_coerce(v, item) for v in value]
        return _coerce(value, item)  # one item: PEFT reads lora_target_modules: all-linear as a string
    if origin is dict or hint is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return string_to_bool(value)
            except argparse.ArgumentTypeError:
                pass
        raise _Mismatch
    if hint in (int, float):
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                raise _Mismatch from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch
        if hint is int and not isinstance(value, int):
            raise _Mismatch
        return hint(value)
    if hint is str or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        if isinstance(value, str):
            return value  # an enum's choices are checked by name before this
        raise _Mismatch
    return value


def _describe(hint: Any) -> str:
    """``hint`` in words for a message: ``an integer``, ``a number``, ``a list of strings or null``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = list(dict.fromkeys(_describe(a) for a in args if a is not type(None)))
        text = " or ".join(words)
        return f"{text} or null" if type(None) in args else text
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list or hint is list:
        return f"a list of {_describe(args[0])}s" if args else "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "a string"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _yaml_type(value: Any) -> str:
    """What YAML made of a value, with its article: ``a boolean``, ``an integer``."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a mapping"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


def _field_hints(dataclass_types: Iterable[type]) -> dict[str, Any]:
    """Field name -> resolved type hint, over the parser's dataclasses (the first one to declare a name wins)."""
    hints: dict[str, Any] = {}
    for dataclass_type in dataclass_types:
        resolved = typing.get_type_hints(dataclass_type)
        for f in dataclasses.fields(dataclass_type):
            if f.init:
                hints.setdefault(f.name, resolved.get(f.name, Any))
    return hints


_USAGE = "%(prog)s --config RECIPE.yaml [--FIELD VALUE ...]   (--help: the main flags; --help-all: every flag)"
_CONFIG_HELP = (
    "A flat YAML recipe (see recipes/): every key is a field below, and sets its default; a --FIELD VALUE on the "
    "command line overrides it. Unknown keys, values of the wrong type and out-of-range choices are refused by name."
)
# The fields a recipe most often changes; --help lists these (and every data and fused-loss field), --help-all all.
_COMMON_TRAINING = (
    "output_dir max_steps num_train_epochs learning_rate lr_scheduler_type warmup_steps per_device_train_batch_size "
    "per_device_eval_batch_size gradient_accumulation_steps gradient_checkpointing bf16 use_cpu optim seed "
    "logging_steps eval_strategy eval_steps eval_on_start save_strategy save_steps report_to resume_from_checkpoint"
).split()
_CPO_OBJECTIVE = (
    "loss_type beta cpo_alpha simpo_gamma alpha label_smoothing max_length max_completion_length disable_dropout"
).split()
_COMMON_MODEL = (
    "model_name_or_path dtype attn_implementation use_peft lora_r lora_alpha lora_dropout lora_target_modules "
    "load_in_4bit"
).split()


def _first_sentence(text: str | None) -> str | None:
    if not text:
        return text
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]


class RecipeParser(TrlParser):
    """``TrlParser`` that refuses a bad recipe or command line *by name*, before anything loads.

    Stock ``TrlParser`` collects unknown recipe keys into a ``--key value`` list, accepts any YAML value whatever the
    field's type (``beta: true`` trains with beta = 1) and, for a value outside a field's ``choices``, accepts it
    silently (argparse never checks defaults against choices); an unknown flag is a ``ValueError`` traceback and a bad
    choice on the command line comes after the 150-line usage. Here each is refused with the file, the key or flag,
    the closest known name (:func:`did_you_mean`) and, for values, the type expected (:func:`_coerce` has the rules).
    ``--help`` lists ``--config`` and the CPO, fused-loss, data, model and common training flags; ``--help-all`` all.
    """

    _config_path: str | None = None
    _help_all: bool = False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("usage", _USAGE)
        kwargs.setdefault("allow_abbrev", False)  # a recipe key must be exact; so must a flag (--lora is not --lora_r)
        super().__init__(*args, **kwargs)

    def parse_args_and_config(self, args: Iterable[str] | None = None, *pargs, **kwargs):
        import sys

        argv = list(args) if args is not None else sys.argv[1:]
        if "--help-all" in argv:
            self._help_all = True
            argv = [a if a != "--help-all" else "--help" for a in argv]
        if "--config" in argv and argv.index("--config") + 1 < len(argv):
            self._config_path = argv[argv.index("--config") + 1]
        known = {s for action in self._actions for s in action.option_strings} | {"--config"}
        unknown = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
        if unknown and not kwargs.get("return_remaining_strings") and not (pargs and pargs[0]):
            hints = [flag + did_you_mean(flag, known) for flag in unknown]
            raise RecipeError(
                f"Unknown flag(s) {', '.join(hints)}. Every flag is a field of CPOScriptArguments, FusedCPOConfig "
                "or ModelConfig (--help lists the main ones, --help-all all)."
            )
        return super().parse_args_and_config(argv, *pargs, **kwargs)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        actions = {a.dest: a for a in self._actions if not isinstance(a, argparse._SubParsersAction)}
        where = f"Recipe {self._config_path}" if self._config_path else "Recipe"
        unknown = [key for key in kwargs if key not in actions]
        if unknown:
            hints = [repr(key) + did_you_mean(key, actions) for key in unknown]
            raise RecipeError(
                f"{where}: unknown key(s) {', '.join(hints)}. Every recipe key must be a field of CPOScriptArguments, "
                "FusedCPOConfig or ModelConfig (`python -m trl_fused_cpo.train --help-all` lists them)."
            )
        for key, value in kwargs.items():
            choices = actions[key].choices
            if choices is not None and value is not None and value not in choices:
                hint = did_you_mean(str(value), [str(c) for c in choices])
                if isinstance(value, bool):
                    hint += " (YAML reads unquoted yes/no/on/off as booleans: quote it, as save_strategy: 'no')"
                raise RecipeError(f"{where}: {key}={value!r} is not one of {list(choices)}{hint}.")
        hints = _field_hints(self.dataclass_types)
        converted = {}
        for key, value in kwargs.items():
            hint = hints.get(key, Any)
            try:
                converted[key] = _coerce(value, hint)
            except _Mismatch:
                expected = _describe(hint)
                what = _yaml_type(value)
                if isinstance(value, str):
                    what += f" that does not parse as {expected}"
                elif isinstance(value, bool) and "string" in expected:
                    what += " (YAML reads unquoted yes/no/on/off as booleans: quote it)"
                raise RecipeError(f"{where}: {key}={value!r} is {what}, but {key} takes {expected}.") from None
        return super().set_defaults_with_config(**converted)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's message, plus the closest choice: `--loss_type sigmod` names 'sigmoid'.
        if action.choices is not None and value not in action.choices:
            hint = did_you_mean(str(value), [str(c) for c in action.choices])
            choices = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}; choose from {choices}")

    def format_help(self) -> str:
        if self._help_all:
            formatter = self._get_formatter()
            formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
            formatter.start_section("recipe")
            formatter.add_argument(self._config_action())
            formatter.end_section()
            return formatter.format_help() + super().format_help().split("\n", 1)[1]
        return self._short_help()

    def _config_action(self) -> argparse.Action:
        return argparse.Action(
            ["--config"], dest="config", metavar="RECIPE.yaml", default=argparse.SUPPRESS, help=_CONFIG_HELP
        )

    def _short_help(self) -> str:
        from trl.experimental.cpo import CPOConfig

        by_dest: dict[str, argparse.Action] = {}
        for action in self._actions:
            by_dest.setdefault(action.dest, action)  # the field's own flag, not its --no_ complement
        fused_only = [n for n in FusedCPOConfig.__dataclass_fields__ if n not in CPOConfig.__dataclass_fields__]
        sections = [
            ("recipe", None),
            ("data (CPOScriptArguments)", list(CPOScriptArguments.__dataclass_fields__)),
            ("CPO objective (CPOConfig; --help-all for the rest)", _CPO_OBJECTIVE),
            ("fused loss (FusedCPOConfig)", fused_only),
            ("model and LoRA (ModelConfig; --help-all for the rest)", _COMMON_MODEL),
            ("training (TrainingArguments; --help-all for the rest)", _COMMON_TRAINING),
        ]
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [], [])
        formatter.add_text(
            "CPO training with FusedCPOTrainer from a flat YAML recipe. The main fields, with the first sentence of "
            "their help; --help-all gives the full text and every field."
        )
        shown = 0
        for title, names in sections:
            formatter.start_section(title)
            if names is None:
                formatter.add_argument(self._config_action())
            for name in names or []:
                if name in by_dest and by_dest[name].help != argparse.SUPPRESS:
                    action = copy.copy(by_dest[name])
                    action.option_strings = action.option_strings[:1]  # not the --dashed-alias
                    action.help = _first_sentence(action.help)
                    if action.choices is not None and len(",".join(map(str, action.choices))) > 60:
                        action.metavar = name.upper()  # the 40 optimizers stay in --help-all
                        action.help += " One of " + ", ".join(map(str, list(action.choices)[:4])) + ", ..."
                    formatter.add_argument(action)
                    shown += 1
            formatter.end_section()
        total = len({a.dest for a in self._actions if a.option_strings and a.dest != "help"})
        formatter.add_text(f"{shown} of {total} fields shown: --help-all lists them all.")
        return formatter.format_help()


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
        return _load_local([name], lambda: load_dataset(_LOCAL_FORMATS[ext], data_files=name))  # one split: "train"
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(
            os.path.join(name, "dataset_info.json")
        ):
            loaded = load_from_disk(name)
            return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(name)
            for f in names
            if os.path.splitext(f)[1].lower() in _LOCAL_FORMATS
        )
        return _load_local(files, lambda: load_dataset(name, name=script_args.dataset_config))
    return load_dataset(name, name=script_args.dataset_config)


def _load_local(paths: list[str], load):
    """``load()``, after checking ``paths`` are not empty and their JSON is UTF-8; a failure names the file and line.

    datasets reads an empty .jsonl as a bare ``StopIteration``, keeps a non-UTF-8 byte until a ``UnicodeDecodeError``
    deep in tokenization, and reports a malformed line as ``ArrowInvalid ... in row 1`` under a generic
    ``DatasetGenerationError``. The two cheap checks run first (one read at disk speed); the line-by-line JSON parse
    runs only when ``load()`` has failed, to say where.
    """
    for path in paths:
        _check_utf8_and_not_empty(path)
    try:
        return load()
    except Exception as err:  # DatasetGenerationError, ArrowInvalid, StopIteration, ...
        for path in paths:
            problem = _first_bad_json_line(path)
            if problem:
                raise ValueError(problem) from err
        raise


def _check_utf8_and_not_empty(path: str) -> None:
    json_file = os.path.splitext(path)[1].lower() in (".json", ".jsonl")
    decoder = codecs.getincrementaldecoder("utf-8")()
    has_content = False
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            has_content = has_content or bool(block.strip())
            if not json_file:
                break  # parquet is binary: only emptiness is ours to check
            try:
                decoder.decode(block)
            except UnicodeDecodeError:
                _raise_on_first_non_utf8_line(path)
    if json_file:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            _raise_on_first_non_utf8_line(path)
    if not has_content:
        raise ValueError(f"{path} is empty: it holds no preference pairs (prompt, chosen, rejected).")


def _raise_on_first_non_utf8_line(path: str) -> None:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 ({err.reason} at byte {err.start} of the line: "
                    f"{line[max(0, err.start - 20) : err.start + 20]!r}). Save the file as UTF-8, e.g. from Latin-1: "
                    f"`iconv -f latin1 -t utf-8 {os.path.basename(path)} > utf8.jsonl`."
                ) from None


def _first_bad_json_line(path: str) -> str | None:
    """``"<path>, line N: <what is wrong>"`` for the first line of a JSON-lines file that is not a JSON object."""
    if os.path.splitext(path)[1].lower() not in (".json", ".jsonl"):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.lower().endswith(".json"):
        try:
            json.loads(text)  # one JSON document (a list of pairs): datasets reads that too
            return None
        except json.JSONDecodeError:
            pass  # maybe JSON lines in a .json file: check line by line
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{path}, line {number}: malformed JSON ({err.msg} at column {err.colno}): {line[:120]!r}"
        if not isinstance(row, dict):
            return (
                f"{path}, line {number}: a JSON {type(row).__name__}, expected an object (one pair per line, as "
                f'{{"prompt": ..., "chosen": ..., "rejected": ...}}): {line[:120]!r}'
            )
    return None


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
