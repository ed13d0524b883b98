"""The launcher's model and tokenizer: the embedded toy model, or ``from_pretrained`` with dtype and (Q)LoRA settings."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

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
