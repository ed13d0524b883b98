"""Recipes, accelerate configs and the launcher's data/model checks: everything that must fail before a GPU is paid for.

Every recipe parses through the launcher's own parser into the three dataclasses; a misspelled key or an
out-of-range choice is refused by name; every accelerate config loads through accelerate's own config classes and
uses only keys ``accelerate launch`` knows; the dataset checks name the column, the example or the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from trl_fused_cpo.cli import CPOScriptArguments, make_parser
from trl_fused_cpo.config import FusedCPOConfig
from trl_fused_cpo.data import load_preference_dataset, validate_preference_dataset
from trl_fused_cpo.models import load_model_and_tokenizer
from trl_fused_cpo.toy import TOY_MODEL_NAME, toy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
EXPECTED_RECIPES = {
    "recipes/dev/tiny_cpo.yaml",
    "recipes/llama3_2/1B_full_cpo_single_device.yaml",
    "recipes/llama3_2/3B_lora_cpo_single_device.yaml",
    "recipes/llama3/8B_lora_cpo_single_device.yaml",
    "recipes/llama3/8B_full_cpo_fsdp2.yaml",
    "recipes/llama3/8B_full_cpo_zero3.yaml",
    "recipes/llama3_1/70B_qlora_cpo_single_device.yaml",
    "recipes/llama3/8B_lora_simpo_single_device.yaml",
    "recipes/llama3_1/8B_lora_cpo_long_context_single_device.yaml",
}
EXPECTED_CONFIGS = {
    "configs/single_gpu.yaml",
    "configs/multi_gpu.yaml",
    "configs/fsdp2.yaml",
    "configs/deepspeed_zero2.yaml",
    "configs/deepspeed_zero3.yaml",
    "configs/multi_node_example.yaml",
}


def _hardware_overrides() -> list[str]:
    """GPU recipes ask for bf16/tf32, which TrainingArguments refuses on a CPU-only machine: parse them as CPU."""
    return [] if torch.cuda.is_available() else ["--use_cpu", "true", "--tf32", "false"]


def parse(recipe: str, *overrides: str):
    argv = ["--config", str(ROOT / recipe), *_hardware_overrides(), *overrides]
    return make_parser().parse_args_and_config(argv)


# ------------------------------------------------------------------------------------------------------ recipes


def test_all_recipes_present():
    assert EXPECTED_RECIPES <= set(RECIPES), f"missing: {EXPECTED_RECIPES - set(RECIPES)}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_parses_into_the_three_dataclasses(recipe):
    from trl import ModelConfig

    script_args, training_args, model_args = parse(recipe)
    assert isinstance(script_args, CPOScriptArguments)
    assert isinstance(training_args, FusedCPOConfig)
    assert isinstance(model_args, ModelConfig)
    assert model_args.model_name_or_path and script_args.dataset_name
    assert training_args.loss_type in {"sigmoid", "hinge", "ipo", "simpo"}
    assert training_args.use_fused_loss
    assert training_args.report_to in ([], ["none"], "none")
    assert training_args.output_dir.startswith("outputs/")
    # Every key is parsed to its declared type (YAML scientific notation without a dot is a string, for one).
    raw = yaml.safe_load((ROOT / recipe).read_text())
    for key, value in raw.items():
        parsed = next(getattr(obj, key) for obj in (script_args, training_args, model_args) if hasattr(obj, key))
        if isinstance(value, float) and key != "warmup_steps":
            assert isinstance(parsed, float) and parsed == pytest.approx(value), key


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_names_its_launch_command(recipe):
    text = (ROOT / recipe).read_text()
    header = text.split("\n\n", 1)[0]
    assert header.startswith("# "), "a recipe opens with a comment header"
    assert f"--config {recipe}" in header, "the header gives the exact launch command with this file"
    assert "Override" in header and "Sized for" in header
    # Measurements live in the results index, under a heading per recipe; a header keeps no dated run.
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|Measured", header), f"{recipe}: move the measurement to docs/results"
    if not recipe.startswith("recipes/dev/"):
        assert "accelerate launch --config_file configs/" in header
        launch_config = header.split("--config_file ", 1)[1].split()[0]
        assert launch_config in CONFIGS, f"{recipe} launches with {launch_config}, which is not in configs/"


RECIPE_NAME = re.compile(
    r"recipes/[a-z0-9_]+/\d+B_(full|lora|qlora)_(cpo|simpo)(_long_context)?_(single_device|fsdp2|zero3)\.yaml"
)


def test_recipe_names_follow_one_pattern():
    """``<family>/<size>_<full|lora|qlora>_<cpo|simpo>[_long_context]_<topology>.yaml``, as torchtune names its
    configs (one optional qualifier between the method and the topology)."""
    odd = [r for r in RECIPES if not r.startswith("recipes/dev/") and not RECIPE_NAME.fullmatch(r)]
    assert not odd, f"recipes outside the naming pattern: {odd}"


def test_recipe_measurements_are_in_the_results_index():
    headings = set((ROOT / "docs/results/README.md").read_text().splitlines())
    missing = [recipe for recipe in RECIPES if f"### `{recipe}`" not in headings]
    assert not missing, f"recipes without a heading in docs/results/README.md, 'Recipes': {missing}"


def test_real_recipes_point_at_hub_models_and_public_data():
    for recipe in RECIPES:
        if recipe.startswith("recipes/dev/"):
            continue
        script_args, training_args, model_args = parse(recipe)
        assert model_args.model_name_or_path.startswith("meta-llama/"), recipe
        assert "/" in script_args.dataset_name, recipe
        assert training_args.bf16 and training_args.gradient_checkpointing, recipe


def test_method_recipes_say_what_their_name_says():
    _, simpo, simpo_model = parse("recipes/llama3/8B_lora_simpo_single_device.yaml")
    assert simpo.loss_type == "simpo" and simpo.cpo_alpha == 0.0 and simpo_model.use_peft
    _, qlora, qlora_model = parse("recipes/llama3_1/70B_qlora_cpo_single_device.yaml")
    assert qlora_model.load_in_4bit and qlora_model.use_peft and qlora_model.lora_target_modules == "all-linear"
    for recipe in RECIPES:
        _, args, model_args = parse(recipe)
        assert model_args.use_peft == ("lora" in recipe), recipe
        if "lora" in recipe:
            assert "lm_head" not in (model_args.lora_target_modules or []), "the fused loss refuses a LoRA lm_head"


# Single-GPU Llama recipes: run on one GPU with the packed layout (docs/benchmarks.md). The multi-GPU ones keep
# TRL's layout until flex_attention under FSDP2 / ZeRO-3 has run on several GPUs.
PACKED_RECIPES = {
    "recipes/llama3_2/1B_full_cpo_single_device.yaml",
    "recipes/llama3_2/3B_lora_cpo_single_device.yaml",
    "recipes/llama3/8B_lora_cpo_single_device.yaml",
    "recipes/llama3/8B_lora_simpo_single_device.yaml",
    "recipes/llama3_1/70B_qlora_cpo_single_device.yaml",
    "recipes/llama3_1/8B_lora_cpo_long_context_single_device.yaml",
}


def test_recipes_pick_the_packed_layout_on_flex_and_their_padded_opt_out_parses():
    """Packed rows need flex_attention's block-sparse mask on a GPU (sdpa would get a dense [N, N] one); the opt-out
    a header names gives TRL's layout as written."""
    opt_out = re.compile(r"TRL's own layout: (--batch_layout \S+ --attn_implementation \S+)\.")
    for recipe in RECIPES:
        _, args, model_args = parse(recipe)
        chosen = (args.batch_layout, model_args.attn_implementation)
        if recipe not in PACKED_RECIPES:
            assert args.batch_layout == "padded", recipe
            continue
        assert chosen == ("prefix_shared", "flex_attention"), recipe
        found = opt_out.search((ROOT / recipe).read_text())
        assert found, recipe
        _, padded, padded_model = parse(recipe, *found.group(1).split())
        assert (padded.batch_layout, padded_model.attn_implementation) == ("padded", "sdpa"), recipe


def test_recipes_keep_the_columns_cpo_collates():
    # CPOTrainer's collator reads prompt/chosen/rejected columns; with true it sets false itself and warns.
    for recipe in RECIPES:
        assert parse(recipe)[1].remove_unused_columns is False, recipe


def test_tiny_recipe_is_the_cpu_demo():
    script_args, args, model_args = parse("recipes/dev/tiny_cpo.yaml")
    assert model_args.model_name_or_path == TOY_MODEL_NAME and script_args.dataset_name == "toy"
    assert not args.bf16 and args.use_cpu and not args.gradient_checkpointing
    assert args.eval_strategy == "steps" and args.max_steps > 0


def test_cli_overrides_the_recipe():
    script_args, args, model_args = parse(
        "recipes/dev/tiny_cpo.yaml", "--beta", "0.3", "--max_steps", "7", "--tie_word_embeddings", "true"
    )
    assert args.beta == 0.3 and args.max_steps == 7 and script_args.tie_word_embeddings


def _write_recipe(tmp_path: Path, **changes) -> str:
    recipe = yaml.safe_load((ROOT / "recipes/dev/tiny_cpo.yaml").read_text())
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_misspelled_key_is_refused_by_name(tmp_path):
    path = _write_recipe(tmp_path, lerning_rate=0.1)
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'lerning_rate' \(did you mean 'learning_rate'\?\)"):
        make_parser().parse_args_and_config(["--config", path])


def test_unknown_key_is_refused_by_name(tmp_path):
    path = _write_recipe(tmp_path, flux_capacitor=True)
    with pytest.raises(ValueError, match="'flux_capacitor'") as err:
        make_parser().parse_args_and_config(["--config", path])
    assert path in str(err.value), "the message names the recipe file"


@pytest.mark.parametrize(
    "key, value", [("loss_type", "sigmoidd"), ("fused_backend", "cuda"), ("dtype", "bf16"), ("lr_scheduler_type", "x")]
)
def test_out_of_range_choice_is_refused_by_name(tmp_path, key, value):
    # argparse checks choices on the command line only; a recipe default would otherwise pass silently.
    path = _write_recipe(tmp_path, **{key: value})
    with pytest.raises(ValueError, match=rf"{key}='{value}' is not one of"):
        make_parser().parse_args_and_config(["--config", path])


def test_misspelled_cli_flag_is_refused():
    with pytest.raises(ValueError, match="--bta"):
        make_parser().parse_args_and_config(["--config", str(ROOT / "recipes/dev/tiny_cpo.yaml"), "--bta", "0.1"])


# ----------------------------------------------------------------------------------------- accelerate configs


def test_all_accelerate_configs_present():
    assert EXPECTED_CONFIGS <= set(CONFIGS), f"missing: {EXPECTED_CONFIGS - set(CONFIGS)}"


@pytest.mark.parametrize("config", CONFIGS)
def test_accelerate_config_loads(config):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    cfg = load_config_from_file(str(ROOT / config))  # refuses unknown top-level keys
    assert isinstance(cfg, ClusterConfig)
    assert cfg.num_processes >= 1 and cfg.num_machines >= 1
    assert cfg.mixed_precision == ("no" if config.endswith("cpu_ddp.yaml") else "bf16")  # fp32 on CPU
    # Nested blocks are copied onto `accelerate launch` flags (fsdp_config.x -> --fsdp_x): each must be a real flag.
    flags = {action.dest for action in launch_command_parser()._actions}
    for key in cfg.fsdp_config:
        assert key in flags or f"fsdp_{key}" in flags, f"{config}: unknown fsdp_config key {key!r}"
    for key in cfg.deepspeed_config:
        assert key in flags, f"{config}: unknown deepspeed_config key {key!r}"
    header = (ROOT / config).read_text().split("\ncompute_environment", 1)[0]
    assert header.startswith("# Accelerate config:") and "accelerate launch" in header


def test_accelerate_configs_are_the_topologies_their_names_say():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    def load(name):
        return load_config_from_file(str(ROOT / "configs" / name))

    single = load("single_gpu.yaml")
    assert single.distributed_type == DistributedType.NO and single.num_processes == 1
    assert load("multi_gpu.yaml").distributed_type == DistributedType.MULTI_GPU
    fsdp = load("fsdp2.yaml")
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.fsdp_config["fsdp_version"] == 2
    for stage in (2, 3):
        ds = load(f"deepspeed_zero{stage}.yaml")
        assert ds.distributed_type == DistributedType.DEEPSPEED and ds.deepspeed_config["zero_stage"] == stage
        # The recipe owns gradient accumulation; a second value here could disagree with it.
        assert "gradient_accumulation_steps" not in ds.deepspeed_config
    node = load("multi_node_example.yaml")
    assert node.num_machines == 2 and node.num_processes % 2 == 0 and node.main_process_ip and node.main_process_port


# ------------------------------------------------------------------------------------------------------- data


def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


STANDARD = [
    {"prompt": "name some fruits :", "chosen": " apple pear", "rejected": " red blue"},
    {"prompt": "name some colors :", "chosen": " red", "rejected": " cat"},
]
CONVERSATIONAL = [
    {
        "chosen": [{"role": "user", "content": "name some fruits"}, {"role": "assistant", "content": "apple"}],
        "rejected": [{"role": "user", "content": "name some fruits"}, {"role": "assistant", "content": "red"}],
    }
]


def test_valid_standard_data_passes():
    validate_preference_dataset(_dataset(STANDARD), toy_tokenizer())
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in STANDARD]
    validate_preference_dataset(_dataset(implicit), toy_tokenizer())


def test_missing_columns_are_named_with_the_columns_present():
    data = _dataset([{"prompt": "p", "response_a": "a", "response_b": "b"}])
    with pytest.raises(ValueError, match=r"no 'chosen' or 'rejected' column.*\['prompt', 'response_a', 'response_b'\]"):
        validate_preference_dataset(data, toy_tokenizer(), split="train")
    with pytest.raises(ValueError, match=r"no 'rejected' column"):
        validate_preference_dataset(_dataset([{"chosen": "a", "other": "b"}]), toy_tokenizer())


@pytest.mark.parametrize("key", ["chosen", "rejected"])
@pytest.mark.parametrize("empty", ["", "   "])
def test_empty_completion_names_the_example(key, empty):
    rows = [dict(r) for r in STANDARD]
    rows[1][key] = empty
    with pytest.raises(ValueError, match=rf"Example 1 of the 'test' split has an empty '{key}' completion"):
        validate_preference_dataset(_dataset(rows), toy_tokenizer(), split="test")


def test_empty_completion_after_implicit_prompt_extraction():
    # No prompt column: TRL takes the shared prefix as the prompt, leaving this chosen empty.
    # (TRL's extract_prompt would instead train on the prompt's last character, ':').
    good = {"chosen": "name some fruits : apple", "rejected": "name some fruits : red"}
    prefix = {"chosen": "name some fruits :", "rejected": "name some fruits : apple"}
    with pytest.raises(ValueError, match="Example 1 .* empty 'chosen' completion once the shared prompt prefix"):
        validate_preference_dataset(_dataset([good, prefix]), toy_tokenizer())
    same = {"chosen": "name some fruits : apple", "rejected": "name some fruits : apple"}
    with pytest.raises(ValueError, match="Example 2 .* empty 'chosen' completion once"):
        validate_preference_dataset(_dataset([good, good, same]), toy_tokenizer())
    empty = {"chosen": "", "rejected": "name some fruits : apple"}  # TRL's extract_prompt raises UnboundLocalError
    with pytest.raises(ValueError, match="Example 0 .* empty 'chosen' completion"):
        validate_preference_dataset(_dataset([empty]), toy_tokenizer())
    turns = [{"role": "user", "content": "name some fruits"}]
    answer = [{"role": "assistant", "content": "apple"}]
    with pytest.raises(ValueError, match="Example 0 .* empty 'rejected' completion once"):
        validate_preference_dataset(_dataset([{"chosen": turns + answer, "rejected": turns}]), None)


def test_empty_conversational_completion_names_the_example():
    rows = [dict(CONVERSATIONAL[0]), dict(CONVERSATIONAL[0])]
    rows[1] = {**rows[1], "rejected": [rows[1]["rejected"][0], {"role": "assistant", "content": ""}]}
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with pytest.raises(ValueError, match="Example 1 .* empty 'rejected'"):
        validate_preference_dataset(_dataset(rows), tokenizer)


def test_conversational_data_needs_a_chat_template():
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = None  # the toy tokenizer has one: take it away
    with pytest.raises(ValueError, match="conversational .* no chat_template"):
        validate_preference_dataset(_dataset(CONVERSATIONAL), tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    validate_preference_dataset(_dataset(CONVERSATIONAL), tokenizer)


def test_toy_and_local_datasets_load(tmp_path):
    toy = load_preference_dataset(CPOScriptArguments(dataset_name="toy"))
    assert set(toy) == {"train", "test"} and len(toy["train"]) > len(toy["test"]) > 0
    validate_preference_dataset(toy["train"], toy_tokenizer())

    path = tmp_path / "pairs.jsonl"
    toy["test"].select(range(4)).to_json(str(path))
    local = load_preference_dataset(CPOScriptArguments(dataset_name=str(path)))
    assert list(local) == ["train"] and local["train"].column_names == ["prompt", "chosen", "rejected"]

    folder = tmp_path / "folder"
    folder.mkdir()
    toy["train"].select(range(4)).to_json(str(folder / "train.jsonl"))
    toy["test"].select(range(2)).to_json(str(folder / "test.jsonl"))
    split = load_preference_dataset(CPOScriptArguments(dataset_name=str(folder)))
    assert len(split["train"]) == 4 and len(split["test"]) == 2

    with pytest.raises(ValueError, match="streaming"):
        load_preference_dataset(CPOScriptArguments(dataset_name="toy", dataset_streaming=True))


# ------------------------------------------------------------------------------------------------------ model


def test_toy_model_loads_and_ties_on_request():
    script_args, args, model_args = parse("recipes/dev/tiny_cpo.yaml", "--tie_word_embeddings", "true")
    model, tokenizer = load_model_and_tokenizer(script_args, args, model_args)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.vocab_size == len(tokenizer) and tokenizer.pad_token_id is not None
    script_args, args, model_args = parse("recipes/dev/tiny_cpo.yaml")
    model, _ = load_model_and_tokenizer(script_args, args, model_args)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and model.dtype == torch.float32


def test_quantized_base_needs_lora_and_bitsandbytes():
    import importlib.util

    script_args, args, model_args = parse("recipes/llama3_1/70B_qlora_cpo_single_device.yaml", "--use_peft", "false")
    with pytest.raises(ValueError, match="set use_peft: true"):
        load_model_and_tokenizer(script_args, args, model_args)
    if importlib.util.find_spec("bitsandbytes") is None:
        script_args, args, model_args = parse("recipes/llama3_1/70B_qlora_cpo_single_device.yaml")
        with pytest.raises(ImportError, match=r"need bitsandbytes.*trl_fused_cpo\[qlora\]"):
            load_model_and_tokenizer(script_args, args, model_args)


def test_missing_model_name_is_refused():
    script_args, args, model_args = parse("recipes/dev/tiny_cpo.yaml")
    model_args.model_name_or_path = None
    with pytest.raises(ValueError, match="model_name_or_path is required"):
        load_model_and_tokenizer(script_args, args, model_args)


def test_lora_config_from_recipe_excludes_lm_head():
    from trl import get_peft_config

    _, _, model_args = parse("recipes/llama3/8B_lora_cpo_single_device.yaml")
    peft_config = get_peft_config(model_args)
    assert peft_config.r == 16 and peft_config.target_modules == "all-linear"
