"""The model's own context length, and the refusal of a ``max_length`` beyond it (checked at trainer construction).

TRL's CPO (trl 1.16, ``CPOTrainer.tokenize_row``) has one length knob, ``max_length`` (None -> 512): a completion is
cut to ``max_length - len(prompt)`` tokens; a prompt is never cut. Every position id the backbone sees, in the
padded and in both packed layouts, is an index into one such sequence, so ``max_length`` bounds them (a prompt that
alone exceeds it is TRL's own case: kept whole, with an empty completion). Nothing here changes that truncation;
this file only refuses a ``max_length`` the model's positions cannot reach.
"""

from __future__ import annotations

from torch import nn

# RoPE types whose config keeps max_position_embeddings at the pre-training length and extends it by `factor`
# (transformers: YaRN and dynamic NTK); llama3 and longrope configs already carry the extended length in it.
_EXTENDING_ROPE_TYPES = ("yarn", "dynamic")


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_parameters(config) -> dict:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs), as a dict (empty if none)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict):
            return value
    return {}


def model_context_length(model_or_config) -> int | None:
    """The longest sequence the model's position encoding is configured for, or None when its config names none.

    ``max_position_embeddings``, extended by ``factor`` for YaRN / dynamic NTK scaling over
    ``original_max_position_embeddings`` (e.g. Qwen2.5 with YaRN factor 4: 32,768 -> 131,072). Llama-3.1's config
    already reads 131,072 (its ``llama3`` scaling is counted in ``max_position_embeddings``).
    """
    config = _text_config(model_or_config)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type")) in _EXTENDING_ROPE_TYPES and rope.get("factor"):
        original = rope.get("original_max_position_embeddings") or limit
        limit = max(limit, int(original * float(rope["factor"])))
    return limit


def max_length_refusal(model: nn.Module, max_length: int | None) -> str | None:
    """Why ``max_length`` is beyond ``model``'s context (what, why, the fix); None when it fits or is unknown.

    Args:
        model: the trainer's model (PEFT wrappers are looked through by their ``config``).
        max_length: the trainer's ``max_length`` (``CPOTrainer`` turns None into 512 before this is asked).
    """
    limit = model_context_length(model)
    if max_length is None or limit is None or max_length <= limit:
        return None
    config = _text_config(model)
    return (
        f"max_length={max_length} is beyond the model's context: {getattr(config, 'model_type', type(model).__name__)}"
        f" is configured for {limit} positions (max_position_embeddings={config.max_position_embeddings}"
        f"{', with its RoPE scaling' if _rope_parameters(config).get('factor') else ''}), so positions past it would "
        f"get rotations it never trained on. Set max_length <= {limit}, or load a model (or RoPE scaling config) "
        "with a longer context."
    )
