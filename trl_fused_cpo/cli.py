"""The launcher's command line (:mod:`trl_fused_cpo.train`): script arguments and the strict recipe parser.

:class:`CPOScriptArguments` (TRL's ``ScriptArguments`` plus the toy model and sample caps) and :func:`make_parser`:
``TrlParser((CPOScriptArguments, FusedCPOConfig, ModelConfig))`` that refuses unknown or misspelled recipe keys and
flags, recipe values of the wrong type and out-of-range choices *by name*, before anything loads; a short ``--help``
(``--help-all`` for every field). The data and the model it names load in ``data.py`` and ``models.py``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import enum
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from transformers.hf_argparser import string_to_bool
from trl import ModelConfig, ScriptArguments, TrlParser

from .config import FusedCPOConfig
from .cpu_smoke import SMOKE_FLAG, cpu_smoke_overrides, gpu_settings, smoke_requested
from .errors import LauncherError
from .toy import TOY_DATASET_NAME, TOY_MODEL_NAME


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
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "A chat template for conversational data: the Jinja text, or the path of a file holding it. Set on "
            "the tokenizer (replacing its own), for tokenizers without one, such as base models'. The toy tokenizer "
            "has one (each message's content, space-separated)."
        },
    )
    cpu_smoke: bool = field(
        default=False,
        metadata={
            "help": f"Run the recipe on CPU at toy size, to check a recipe and your data before renting a GPU: the "
            f"{TOY_MODEL_NAME} model in fp32, no bf16/tf32/4-bit, sdpa for flex_attention, the toy data for a hub "
            "dataset (a local --dataset_name is kept), 2 steps at max_length 64; the recipe's loss, LoRA and batch "
            "layout are kept. Flags on the command line still override it."
        },
    )


class RecipeError(LauncherError):
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


# str fields that also take an integer (their help says "a number"): the config stores it as its digits.
_TEXT_OR_INTEGER_FIELDS = frozenset({"activation_policy"})


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
    _smoke: bool | None = None  # --cpu_smoke on the command line (None: absent, the recipe's value counts)
    _argv: list[str] = []

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("usage", _USAGE)
        kwargs.setdefault("allow_abbrev", False)  # a recipe key must be exact; so must a flag (--lora is not --lora_r)
        super().__init__(*args, **kwargs)
        self._add_no_gradient_checkpointing()

    def _add_no_gradient_checkpointing(self) -> None:
        """``--no_gradient_checkpointing``, which TRL's CPOConfig has (its default is True): FusedCPOConfig's default
        is None (unset, so activation_policy auto may replace it), for which HfArgumentParser adds no ``--no_`` form."""
        flags = {s for action in self._actions for s in action.option_strings}
        if "--gradient_checkpointing" in flags and "--no_gradient_checkpointing" not in flags:
            self.add_argument(
                "--no_gradient_checkpointing", "--no-gradient-checkpointing", action="store_false",
                dest="gradient_checkpointing", default=argparse.SUPPRESS, help="gradient_checkpointing: false",
            )  # fmt: skip

    def parse_args_and_config(self, args: Iterable[str] | None = None, *pargs, **kwargs):
        import sys

        argv = list(args) if args is not None else sys.argv[1:]
        if "--help-all" in argv:
            self._help_all = True
            argv = [a if a != "--help-all" else "--help" for a in argv]
        if "--config" in argv:
            if argv.index("--config") + 1 >= len(argv):
                raise RecipeError("--config needs a recipe file: --config recipes/dev/tiny_cpo.yaml")
            self._config_path = argv[argv.index("--config") + 1]
            _check_recipe_file(self._config_path)
        self._smoke = smoke_requested(argv)
        self._argv = argv
        known = {s for action in self._actions for s in action.option_strings} | {"--config"}
        unknown = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
        if unknown and not kwargs.get("return_remaining_strings") and not (pargs and pargs[0]):
            hints = [flag + did_you_mean(flag, known) for flag in unknown]
            raise RecipeError(
                f"Unknown flag(s) {', '.join(hints)}. Every flag is a field of CPOScriptArguments, FusedCPOConfig "
                "or ModelConfig (--help lists the main ones, --help-all all)."
            )
        if self._config_path is None and self._smoke:
            self.set_defaults_with_config()  # no recipe: --cpu_smoke still replaces the defaults
        return super().parse_args_and_config(argv, *pargs, **kwargs)

    def parse_args_into_dataclasses(self, args=None, *pargs, **kwargs):
        # Before the dataclasses are built: TrainingArguments refuses a GPU setting on a CPU machine with a message
        # about use_cpu; here the refusal names the recipe's settings and the command that runs it on CPU.
        namespace, _ = self.parse_known_args(args=args)
        _refuse_gpu_recipe_without_cuda(vars(namespace), self._config_path, self._argv)
        where = f"Recipe {self._config_path}" if self._config_path else "The command line"
        try:
            return super().parse_args_into_dataclasses(args, *pargs, **kwargs)
        except LauncherError:
            raise
        except ValueError as err:  # a config's __post_init__ refusal (FusedCPOConfig, TrainingArguments, ...)
            raise RecipeError(f"{where}: {' '.join(str(err).split())}") from err

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        if self._smoke or (self._smoke is None and kwargs.get("cpu_smoke") is True):
            kwargs = {**kwargs, **cpu_smoke_overrides(kwargs)}
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
        for key in _TEXT_OR_INTEGER_FIELDS.intersection(hints):
            hints[key] = hints[key] | int
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


def _check_recipe_file(path: str) -> None:
    """The recipe exists and is a YAML mapping; else one message with the file (and line) and the fix."""
    import os

    import yaml

    if not os.path.isfile(path):
        raise RecipeError(
            f"Recipe {path}: no such file (from {os.getcwd()}). The shipped recipes are under recipes/ in a checkout "
            "of the repository, e.g. --config recipes/dev/tiny_cpo.yaml (CPU)."
        )
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(
            f"Recipe {path}{at}: not valid YAML ({problem}). A recipe is flat `key: value` lines."
        ) from None
    if not isinstance(recipe, dict):
        raise RecipeError(
            f"Recipe {path}: a YAML {type(recipe).__name__}, expected a mapping of `key: value` lines "
            "(every key a field; --help-all lists them)."
        )


def _refuse_gpu_recipe_without_cuda(values: dict[str, Any], config_path: str | None, argv: list[str]) -> None:
    """A GPU setting on a machine without CUDA: say so, and print the command that runs the recipe on CPU."""
    import shlex

    import torch

    needs = gpu_settings(values)
    if not needs or torch.cuda.is_available():
        return
    what = f"Recipe {config_path}" if config_path else "This command line"
    kept = [
        a
        for i, a in enumerate(argv)
        if not a.startswith(SMOKE_FLAG) and (i == 0 or argv[i - 1] != SMOKE_FLAG or a.startswith("--"))
    ]
    command = shlex.join(["trl-fused-cpo", *kept, SMOKE_FLAG, "true"])
    raise RecipeError(
        f"{what} needs a CUDA GPU ({', '.join(needs)}) and this machine has none. To check the recipe and your data "
        f"on CPU at toy size: {command}"
    )


def make_parser(prog: str | None = None) -> RecipeParser:
    """The launcher's parser: ``--config recipe.yaml`` sets the defaults, ``--key value`` overrides them.

    ``make_parser().parse_args_and_config(argv)`` returns ``(CPOScriptArguments, FusedCPOConfig, ModelConfig)``.
    """
    return RecipeParser((CPOScriptArguments, FusedCPOConfig, ModelConfig), prog=prog)
