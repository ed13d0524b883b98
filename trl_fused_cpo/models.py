"""The launcher's model and tokenizer: the embedded toy model, or ``from_pretrained`` with dtype and (Q)LoRA settings."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from .errors import LauncherError, MissingPackageError
from .toy import TOY_MODEL_NAME, toy_model, toy_tokenizer

if TYPE_CHECKING:  # annotations only
    from trl import ModelConfig

    from .cli import CPOScriptArguments
    from .config import FusedCPOConfig


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
        raise LauncherError(f"dtype={name!r} is not a torch dtype: use auto, bfloat16, float16 or float32.")
    return dtype


def load_model_and_tokenizer(script_args: CPOScriptArguments, training_args: FusedCPOConfig, model_args: ModelConfig):
    """``(model, tokenizer)``: the embedded toy model for ``toy-llama3``, else ``from_pretrained``.

    LoRA is not applied here: the trainer receives ``get_peft_config(model_args)`` and wraps the model itself (after
    preparing a k-bit base for training). QLoRA loads the base with ``get_quantization_config(model_args)``.
    """
    name = model_args.model_name_or_path
    if not name:
        raise LauncherError(f"model_name_or_path is required: a hub name, a local folder, or {TOY_MODEL_NAME!r}.")
    quantized = model_args.load_in_4bit or model_args.load_in_8bit
    if quantized and not model_args.use_peft:
        raise LauncherError(
            "load_in_4bit/load_in_8bit freeze the base weights, so only an adapter can train: set use_peft: true."
        )
    if name == TOY_MODEL_NAME:
        model, tokenizer = _toy_model_and_tokenizer(script_args, training_args, model_args, quantized)
    else:
        model, tokenizer = _pretrained_model_and_tokenizer(name, training_args, model_args, quantized)
    if script_args.chat_template:
        tokenizer.chat_template = read_chat_template(script_args.chat_template)
    return model, tokenizer


def read_chat_template(value: str) -> str:
    """The ``chat_template`` setting: the Jinja text itself, or the path of a file holding it."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if value.endswith((".jinja", ".j2", ".txt")) or ("{" not in value and os.sep in value):
        raise LauncherError(
            f"chat_template={value!r}: no such file (from {os.getcwd()}). Give an existing template file or the "
            "Jinja template text itself, e.g. \"{% for message in messages %}{{ message['content'] }}\\n{% endfor %}\"."
        )
    return value


def _toy_model_and_tokenizer(script_args, training_args, model_args, quantized: bool):
    """The embedded toy model, honouring dtype and attn_implementation (refusing one transformers cannot run)."""
    if quantized:
        raise LauncherError(
            f"{TOY_MODEL_NAME} is built in fp32 in-process and cannot be quantized: set load_in_4bit: false "
            "(and load_in_8bit: false)."
        )
    dtype = _dtype(model_args.dtype)
    kwargs: dict[str, Any] = {} if dtype in (None, "auto") else {"dtype": dtype}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    try:
        model = toy_model(tie_word_embeddings=script_args.tie_word_embeddings, seed=training_args.seed, **kwargs)
    except (ImportError, ValueError) as err:  # transformers' own check of the attention
        raise LauncherError(
            f"attn_implementation={model_args.attn_implementation!r} cannot run here: {err} "
            "Use sdpa or eager (any device), or flex_attention on a CUDA GPU."
        ) from err
    return model, toy_tokenizer()


def _pretrained_model_and_tokenizer(name: str, training_args, model_args, quantized: bool):
    """``from_pretrained`` with the recipe's dtype, attention and quantization; a name that does not load (no such
    folder, a hub name offline or misspelled) is refused with what transformers said."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_quantization_config

    from .varlen_attention import register

    register()  # attn_implementation: fused_cpo_varlen must be known to transformers before from_pretrained

    kwargs: dict[str, Any] = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
    )
    if model_args.dtype is not None:
        kwargs["dtype"] = _dtype(model_args.dtype)
    if quantized:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise MissingPackageError(
                "load_in_4bit/load_in_8bit (QLoRA) need bitsandbytes, which is not installed: "
                "pip install 'trl_fused_cpo[qlora]' (or pip install bitsandbytes)."
            )
        kwargs["quantization_config"] = get_quantization_config(model_args)
        kwargs["device_map"] = kbit_device_map()
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
        )
    except OSError as err:  # transformers' "is not a local folder and is not a valid model identifier ..."
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LauncherError(
            f"model_name_or_path={name!r} did not load: {first_line} Give a local folder, a hub name (logged in "
            f"with `hf auth login` for gated models such as Llama), or {TOY_MODEL_NAME!r}."
        ) from err
    if tokenizer.pad_token is None:  # Llama-3 base ships none; CPOTrainer would do the same
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
