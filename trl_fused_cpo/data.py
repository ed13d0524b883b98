"""Preference data for the launcher: load it (a hub name, a local file or folder, or the shipped toy data) and refuse
what CPOTrainer would mis-train on, naming the file and line, the column, the example or the fix.

- :func:`load_preference_dataset`: a hub name, a local jsonl/json/parquet file or folder, or ``toy`` (shipped data);
  a local file that is empty, not UTF-8 or not JSON lines fails with its path and line.
- :func:`validate_preference_dataset`: the checks CPOTrainer does not make (missing columns, empty completions,
  conversational data without a chat template), each failing with the column, the example index or the fix.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import TYPE_CHECKING, Any

from .errors import LauncherError
from .toy import TOY_DATASET_NAME, load_toy_preferences

if TYPE_CHECKING:  # annotations only: the launcher's arguments (cli.py imports nothing from here)
    from .cli import CPOScriptArguments

__all__ = ["TOY_DATASET_NAME", "load_preference_dataset", "validate_preference_dataset"]
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_preference_dataset(script_args: CPOScriptArguments):
    """``DatasetDict`` of preference pairs named by ``script_args.dataset_name`` (see its help for the forms)."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    name = script_args.dataset_name
    if not name:
        raise LauncherError("dataset_name is required: a hub name, a local file or folder, or 'toy'.")
    if script_args.dataset_streaming:
        raise LauncherError(
            "dataset_streaming=True is not supported: CPOTrainer tokenizes the whole dataset before training. "
            "Set dataset_streaming: false (and max_train_samples to cap the size)."
        )
    if name == TOY_DATASET_NAME:
        return DatasetDict({split: Dataset.from_list(load_toy_preferences(split)) for split in ("train", "test")})
    _refuse_missing_local_path(name)
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower()
        if ext not in _LOCAL_FORMATS:
            raise LauncherError(f"dataset_name={name!r}: local files must be one of {sorted(_LOCAL_FORMATS)}.")
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


def _refuse_missing_local_path(name: str) -> None:
    """A name that can only be a local file or folder (a data file's extension, or ./ ../ /) must exist: otherwise
    datasets takes it for a hub dataset and fails on the network or with a hub error that never names the file."""
    looks_local = os.path.splitext(name)[1].lower() in _LOCAL_FORMATS or name.startswith(("/", "./", "../"))
    if looks_local and not os.path.exists(name):
        raise LauncherError(
            f"dataset_name={name!r}: no such file or folder (from {os.getcwd()}). Give an existing .jsonl/.json/"
            f".parquet file or folder, a hub dataset name, or {TOY_DATASET_NAME!r} for the shipped toy data."
        )


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
                raise LauncherError(problem) from err
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
        raise LauncherError(f"{path} is empty: it holds no preference pairs (prompt, chosen, rejected).")


def _raise_on_first_non_utf8_line(path: str) -> None:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise LauncherError(
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
        raise LauncherError(
            f"The {split!r} split has no {' or '.join(repr(c) for c in missing)} column: CPO needs 'chosen' and "
            f"'rejected' (and optionally 'prompt'). Columns present: {columns}. Rename them, e.g. "
            "dataset.rename_columns({'response_a': 'chosen', 'response_b': 'rejected'})."
        )
    if len(dataset) == 0:
        raise LauncherError(f"The {split!r} split is empty.")
    conversational = is_conversational(dataset[0])
    if conversational and tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        raise LauncherError(
            f"The {split!r} split is conversational (lists of {{'role', 'content'}} messages), but the tokenizer "
            f"({type(tokenizer).__name__}) has no chat_template to render them with. Set one with --chat_template "
            "(a Jinja string or a .jinja file), use an instruct/chat tokenizer, or convert the data to the standard "
            "(plain text) format."
        )
    has_prompt = "prompt" in columns
    if has_prompt:  # as maybe_extract_prompt: a prompt column in the other format than chosen is re-extracted
        first = dataset[0]
        has_prompt = is_conversational({"prompt": first["prompt"]}) == is_conversational({"chosen": first["chosen"]})
    for index, row in enumerate(dataset.select_columns(["chosen", "rejected"])):
        for key in ("chosen", "rejected"):
            if row[key] is None:
                raise LauncherError(f"Example {index} of the {split!r} split has no {key!r} value (None).")
        _check_completions(row, index, split, "")
        if not has_prompt:
            # The prompt is implicit: TRL takes the shared prefix of chosen and rejected. When one is a prefix of the
            # other, its completion is empty, and TRL's extract_prompt (off by one there) silently trains on the
            # prompt's last character or message instead.
            chosen, rejected = row["chosen"], row["rejected"]
            for key, a, b in (("chosen", chosen, rejected), ("rejected", rejected, chosen)):
                if len(a) <= len(b) and b[: len(a)] == a:
                    raise LauncherError(
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
            raise LauncherError(
                f"Example {index} of the {split!r} split: {key!r} is a {type(row[key]).__name__}, expected a "
                "string (standard format) or a list of {'role', 'content'} messages (conversational)."
            )
        if not text.strip():
            raise LauncherError(
                f"Example {index} of the {split!r} split has an empty {key!r} completion{where}: its sequence "
                "log-prob would be 0/0. Drop or fix that example."
            )
