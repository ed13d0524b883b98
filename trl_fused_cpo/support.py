"""Whether a model can run the fused loss and the packed layouts exactly, and how: the one owner of that question."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .attention import DENSE_IMPLEMENTATIONS, VARLEN_IMPLEMENTATIONS, _varlen_refusal

# Model types whose layers carry state along the row (state-space, linear attention, convolutions) or attend in
# windows/chunks: a packed row would leak across pairs or lose the prompt. layer_types catches most of these too.
_STATEFUL_MODEL_TYPES = frozenset(
    "mamba mamba2 falcon_mamba falcon_h1 jamba zamba zamba2 bamba rwkv recurrent_gemma lfm2 lfm2_vl qwen3_next "
    "granitemoehybrid nemotron_h xlstm minimax plamo2".split()
)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the fused loss would train ``model`` wrongly, with the fix; None when it is fine."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict):
        for name, cfg in peft_config.items():
            if getattr(cfg, "is_prompt_learning", False):
                return (
                    f"PEFT adapter {name!r} is prompt learning ({type(cfg).__name__}), which prepends virtual tokens "
                    "and changes the sequence length the labels align to. Use LoRA, or set use_fused_loss=False."
                )
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return f"{type(lm).__name__} has no output embedding with a .weight to read. Set use_fused_loss=False."
    if not head.weight.is_floating_point():
        return (
            f"lm_head.weight is quantized ({type(head.weight).__name__}, {head.weight.dtype}); the fused loss reads it "
            "as a dense matrix. Keep lm_head unquantized (bitsandbytes skips it by default) or set use_fused_loss=False."
        )
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        return (
            "FusedCPOTrainer reads lm_head.weight directly, so a LoRA adapter on lm_head would never train. "
            "Remove 'lm_head' from the LoRA target modules (peft's 'all-linear' already leaves it out), or set "
            "use_fused_loss=False."
        )
    text_config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        return (
            f"{text_config.model_type} applies a final logit softcap, which the fused loss does not apply. "
            "Set use_fused_loss=False for this model."
        )
    for key in ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, key, None)
        if value is not None and value != 1:
            return (
                f"{text_config.model_type} scales its logits ({key}={value}), which the fused loss does not apply. "
                "Set use_fused_loss=False for this model."
            )
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside DDP/compile/PEFT wrappers."""
    for _ in range(4):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def _takes_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def packing_unsupported_reason(model: nn.Module, layout: str, *, max_length: int | None = None) -> str | None:
    """Why ``model`` cannot run ``layout`` exactly (what, why, the fix); ``None`` when it can or nothing is packed.

    Refused: encoder-decoders; layers other than full attention (linear attention, convolutions, state-space:
    they carry state along the row, across pairs); chunked attention; sliding-window attention unless
    ``max_length`` fits in the window (a prepared 4D mask or BlockMask replaces transformers' window mask, which
    is then a no-op exactly when no sequence is longer than the window); a causal LM or base model whose
    ``forward`` takes no ``position_ids``; attention implementations that cannot take the packed mask
    (``prefix_shared`` on flash-attention varlen, custom kernels).

    Args:
        model: the model the trainer runs (PEFT/DDP wrappers are looked through).
        layout: ``"padded"``, ``"padding_free"`` or ``"prefix_shared"``.
        max_length: the trainer's ``max_length`` (TRL truncates every sequence to it), for the window check.
    """
    if layout == "padded":
        return None
    lm = _unwrap(model)
    name = type(lm).__name__
    fix = "Use layout 'padded' (TRL's own batch) for this model."
    config = getattr(lm, "config", None)
    if config is None:
        return f"{name} has no .config, so its attention cannot be checked for packing. {fix}"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "") or getattr(config, "model_type", "")

    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder; packing lays out decoder-only rows [prompt | chosen | rejected]. {fix}"
    if not getattr(text, "is_causal", True):
        return f"{name} attends bidirectionally (config.is_causal=False); packed rows need causal attention. {fix}"
    layer_types = list(getattr(text, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        return (
            f"{name} has layers of type {other} (config.layer_types), not only full or sliding-window attention: "
            "recurrent, linear-attention and convolution layers carry state along the packed row, across pairs, "
            f"and chunked attention cuts the row at fixed offsets. {fix}"
        )
    window = getattr(text, "sliding_window", None)
    windowed = "sliding_attention" in layer_types or (window is not None and getattr(text, "use_sliding_window", True))
    if windowed and (window is None or max_length is None or max_length > window):
        return (
            f"{name} uses sliding-window attention (config.sliding_window={window}) and max_length={max_length} "
            "does not fit in it: the packed mask replaces transformers' window mask, so tokens farther apart than "
            f"the window would see each other. Set max_length <= {window}, or use layout 'padded'."
        )
    if getattr(text, "attention_chunk_size", None):
        return (
            f"{name} uses chunked attention (config.attention_chunk_size={text.attention_chunk_size}): tokens attend "
            f"only within fixed chunks of the row, which packing would shift. {fix}"
        )
    if model_type in _STATEFUL_MODEL_TYPES:
        return (
            f"{name} (model_type {model_type!r}) has state-space, linear-attention or convolution layers that carry "
            f"state along the row, so packed pairs would leak into each other. {fix}"
        )
    base = getattr(lm, getattr(lm, "base_model_prefix", ""), None) if hasattr(lm, "base_model_prefix") else None
    for module in (lm, base):
        if isinstance(module, nn.Module) and not _takes_position_ids(module):
            return (
                f"{type(module).__name__}.forward takes no position_ids; a packed row needs each segment's own "
                f"positions (the rejected branch continues the prompt's). {fix}"
            )
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation in VARLEN_IMPLEMENTATIONS:
        return None if layout == "padding_free" else _varlen_refusal(implementation)
    if implementation not in DENSE_IMPLEMENTATIONS + ("flex_attention",):
        return (
            f"attn_implementation={implementation!r} is not one packing can pass a mask to (eager, sdpa, "
            "flex_attention; flash-attention varlen for padding_free): transformers builds no mask for custom "
            "kernels, so packed pairs would attend to each other. Load the model with attn_implementation="
            f"'flex_attention', or {fix[0].lower()}{fix[1:]}"
        )
    return None
