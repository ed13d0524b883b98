"""The launcher's parser and data loading refuse bad input by name, before anything loads.

Recipe values of the wrong type (the key and the recipe file named), unknown or abbreviated flags (with the closest
flag), bad choices on the command line (two lines, not the usage), the help (``--config`` listed, short by default),
and local data files that are empty, not UTF-8 or not JSON lines (the file and line named).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from trl_fused_cpo.cli import CPOScriptArguments, RecipeError, make_parser
from trl_fused_cpo.data import load_preference_dataset
from trl_fused_cpo.toy import load_toy_preferences

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "dev" / "tiny_cpo.yaml"


def _recipe(tmp_path: Path, **changes) -> str:
    recipe = yaml.safe_load(TINY.read_text())
    recipe.update(changes)
    path = tmp_path / "my_recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _parse(*argv: str):
    return make_parser("trl-fused-cpo").parse_args_and_config(list(argv))


def _field(parsed, key: str):
    return next(getattr(obj, key) for obj in parsed if hasattr(obj, key))


# ------------------------------------------------------------------------------------------- recipe value types


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("beta", True, "beta=True is a boolean, but beta takes a number"),  # trained with beta = 1 before
        ("beta", [0.1, 0.2], "beta=[0.1, 0.2] is a list, but beta takes a number"),
        ("beta", None, "beta=None is null, but beta takes a number"),
        ("beta", "abc", "beta='abc' is a string that does not parse as a number"),
        ("max_steps", 2.5, "max_steps=2.5 is a float, but max_steps takes an integer"),
        ("max_steps", 2.0, "max_steps=2.0 is a float, but max_steps takes an integer"),  # as --max_steps 2.0
        ("learning_rate", {"peak": 1e-3}, "learning_rate={'peak': 0.001} is a mapping, but learning_rate takes"),
        ("use_cpu", 1, "use_cpu=1 is an integer, but use_cpu takes true or false"),
        ("max_train_samples", "all", "max_train_samples='all' is a string that does not parse as an integer"),
        ("lora_target_modules", 3, "lora_target_modules=3 is an integer, but lora_target_modules takes a list"),
        ("output_dir", 3, "output_dir=3 is an integer, but output_dir takes a string or null"),
        # YAML 1.1 reads an unquoted `no` as False: a str field says to quote it.
        ("dataset_test_split", False, "dataset_test_split=False is a boolean (YAML reads unquoted yes/no/on/off as"),
        ("activation_policy", True, "quote it), but activation_policy takes a string or an integer"),
    ],
)
def test_recipe_value_of_the_wrong_type_is_refused_by_key(tmp_path, key, value, says):
    path = _recipe(tmp_path, **{key: value})
    with pytest.raises(RecipeError, match=re.escape(says)) as err:
        _parse("--config", path)
    assert path in str(err.value), "the message names the recipe file"


@pytest.mark.parametrize(
    "key, value, parsed",
    [
        ("learning_rate", 3, 3.0),  # an int for a float field is the float, as --learning_rate 3 gives
        ("warmup_steps", 5, 5.0),
        ("learning_rate", "3e-4", 3e-4),  # YAML 1.1 reads 3e-4 (no dot) as a string; argparse converts it
        ("max_steps", "7", 7),
        ("use_cpu", "true", True),
        ("max_train_samples", None, None),  # Optional[int] takes null
        ("lora_target_modules", ["q_proj", "v_proj"], ["q_proj", "v_proj"]),
        ("lora_target_modules", "all-linear", "all-linear"),  # one item: PEFT's special string
        ("gradient_checkpointing_kwargs", {"use_reentrant": False}, {"use_reentrant": False}),
        ("activation_policy", 8, "8"),  # "a number k" (its help): YAML's integer, refused as "takes a string" before
        ("activation_policy", "8", "8"),
    ],
)
def test_recipe_value_of_the_right_type_is_parsed_as_the_command_line_would(tmp_path, key, value, parsed):
    result = _field(_parse("--config", _recipe(tmp_path, **{key: value})), key)
    assert result == parsed and type(result) is type(parsed), (result, type(result))


def test_bad_choice_in_a_recipe_names_the_closest_choice(tmp_path):
    with pytest.raises(RecipeError, match=r"loss_type='sigmod' is not one of .* \(did you mean 'sigmoid'\?\)"):
        _parse("--config", _recipe(tmp_path, loss_type="sigmod"))


# ---------------------------------------------------------------------------------------------- command line


def test_misspelled_flag_names_the_closest_flag():
    with pytest.raises(RecipeError, match=r"--lerning_rate \(did you mean '--learning_rate'\?\)"):
        _parse("--config", str(TINY), "--lerning_rate", "1e-3")
    with pytest.raises(RecipeError, match=r"--bta \(did you mean '--beta'\?\)"):
        _parse("--config", str(TINY), "--bta=0.2")


def test_abbreviated_flag_is_refused_not_guessed():
    # argparse would take --max_step as --max_steps (and --lora as ambiguous); a recipe key must be exact, so a flag.
    with pytest.raises(RecipeError, match=r"--max_step \(did you mean '--max_steps'\?\)"):
        _parse("--config", str(TINY), "--max_step", "5")


def test_bad_choice_on_the_command_line_is_two_lines(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse("--config", str(TINY), "--loss_type", "sigmod")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2, err  # the usage line and the error, not the 150-line usage
    assert "--loss_type" in err[-1] and "'sigmod'" in err[-1] and "did you mean 'sigmoid'" in err[-1]
    assert "sigmoid, hinge, ipo, simpo" in err[-1]


def test_cli_main_prints_one_error_line_and_exits_2(capsys):
    from trl_fused_cpo.train import cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main(["--config", str(TINY), "--lerning_rate", "1e-3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--learning_rate" in err[0], err


def test_help_lists_config_and_the_cpo_knobs_briefly(capsys):
    with pytest.raises(SystemExit):
        _parse("--help")
    short = capsys.readouterr().out
    for flag in ("--config", "--beta", "--loss_type", "--cpo_alpha", "--use_fused_loss", "--fused_backend"):
        assert flag in short, flag
    assert "--help-all" in short and "--adam_beta1" not in short
    assert len(short.splitlines()) < 250, len(short.splitlines())

    with pytest.raises(SystemExit):
        _parse("--help-all")
    full = capsys.readouterr().out
    assert "--config" in full and "--adam_beta1" in full and "--fused_chunk_bytes" in full


def test_help_with_a_recipe_shows_the_recipe_values(capsys):
    with pytest.raises(SystemExit):
        _parse("--config", str(TINY), "--help")
    assert "(default: toy-llama3)" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------------------ data files


def _pairs(n: int = 3) -> list[str]:
    return [json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) for r in load_toy_preferences("train")[:n]]


def _load(path: Path):
    return load_preference_dataset(CPOScriptArguments(dataset_name=str(path)))


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_empty_jsonl_names_the_file(tmp_path, content):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path} is empty"):  # a bare StopIteration before
        _load(path)


def test_non_utf8_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [line.encode() for line in _pairs()]
    lines[1] = '{"prompt": "name some drinks :", "chosen": " caf\xe9", "rejected": " red"}'.encode("latin-1")
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=rf"{path}, line 2: not UTF-8 .*caf\\xe9"):
        _load(path)


def test_malformed_json_line_names_the_file_line_and_problem(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = _pairs()
    lines[2] = lines[2][:-1]  # the closing brace lost
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path}, line 3: malformed JSON \(Expecting ',' delimiter"):
        _load(path)


def test_json_line_that_is_not_an_object_names_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join([*_pairs(2), '["a", "b"]']) + "\n")
    with pytest.raises(ValueError, match=rf"{path}, line 3: a JSON list, expected an object"):
        _load(path)


def test_empty_file_in_a_folder_names_the_file(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(_pairs()) + "\n")
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'test.jsonl'} is empty"):
        _load(tmp_path)


@pytest.mark.parametrize(
    "flags, value",
    [
        ([], True),  # absent: TRL's default
        (["--gradient_checkpointing"], True),  # a bare flag, as with TRL's CPOConfig
        (["--gradient_checkpointing", "false"], False),
        (["--no_gradient_checkpointing"], False),  # TRL's CPOConfig has it (its default is True)
        (["--no-gradient-checkpointing"], False),
    ],
)
def test_gradient_checkpointing_flags_parse_as_with_trls_cpo_config(tmp_path, flags, value):
    """FusedCPOConfig's gradient_checkpointing defaults to None (so activation_policy auto can tell it was unset);
    HfArgumentParser then gave no bare flag and no --no_ form, which CPOConfig's True default has."""
    recipe = yaml.safe_load(TINY.read_text())
    del recipe["gradient_checkpointing"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    parsed = _parse("--config", str(path), *flags)
    assert _field(parsed, "gradient_checkpointing") is value
    assert _field(parsed, "_gradient_checkpointing_explicit") is bool(flags)
