"""Whether a model can run the fused loss and the packed layouts exactly, and how: the one owner of that question."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import (
    DENSE_IMPLEMENTATIONS,
    FUSED_VARLEN_IMPLEMENTATION,
    VARLEN_IMPLEMENTATIONS,
    _varlen_refusal,
    packed_model_inputs,
)
from .collator import PackingCollator
from .packing import PADDED, PADDING_FREE

logger = logging.getLogger(__name__)

# Config keys of a final tanh softcap on the logits (Gemma-2/3: final_logit_softcapping; RecurrentGemma).
_SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap")

# Model types that build their attention mask or bias from a 2D attention_mask, so a packed 4D mask or BlockMask
# crashes them (openai-gpt: "permute(sparse_coo)", seen at transformers 5.25).
_2D_MASK_MODEL_TYPES = frozenset({"openai-gpt"})

# Model types whose layers carry state along the row (state-space, linear attention, convolutions) or attend in
# windows/chunks: a packed row would leak across pairs or lose the prompt. layer_types catches most of these too.
_STATEFUL_MODEL_TYPES = frozenset(
    "mamba mamba2 falcon_mamba falcon_h1 jamba zamba zamba2 bamba rwkv recurrent_gemma lfm2 lfm2_vl qwen3_next "
    "granitemoehybrid nemotron_h xlstm minimax plamo2".split()
)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside DDP/compile/PEFT wrappers (or the model itself)."""
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
    lm = unwrap_causal_lm(model)
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
    if getattr(lm, "base_model", lm) is lm:
        return (
            f"{type(lm).__name__}.base_model is the model itself (its base_model_prefix names no submodule), so "
            "the fused forward cannot run the backbone alone to read its hidden states. "
            "Set use_fused_loss=False for this model."
        )
    text_config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    softcap = next((k for k in _SOFTCAP_KEYS if getattr(text_config, k, None) is not None), None)
    if softcap is not None:
        return (
            f"{text_config.model_type} applies a final logit softcap ({softcap}={getattr(text_config, softcap)}), "
            "which the fused loss does not apply. "
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


def _takes_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def packing_unsupported_reason(
    model: nn.Module, layout: str, *, max_length: int | None = None, max_row_tokens: int | None = None
) -> str | None:
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
        max_row_tokens: the longest packed row the trainer can build (micro-batch x 2 x ``max_length``, plus the
            tail padding), for models with a fixed-size causal buffer.
    """
    if layout == PADDED:
        return _packed_only_refusal(model)
    lm = unwrap_causal_lm(model)
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
    family = _family_refusal(lm, text, layout, max_length=max_length, max_row_tokens=max_row_tokens)
    if family is not None:
        return f"{name}: {family} {fix}"
    base = getattr(lm, getattr(lm, "base_model_prefix", ""), None) if hasattr(lm, "base_model_prefix") else None
    for module in (lm, base):
        if isinstance(module, nn.Module) and not _takes_position_ids(module):
            return (
                f"{type(module).__name__}.forward takes no position_ids; a packed row needs each segment's own "
                f"positions (the rejected branch continues the prompt's). {fix}"
            )
    return _implementation_refusal(config, layout, fix)


def _packed_only_refusal(model: nn.Module) -> str | None:
    """``fused_cpo_varlen`` attends through the packed row's segment tables: a padded batch has none."""
    config = getattr(unwrap_causal_lm(model), "config", None)
    if getattr(config, "_attn_implementation", None) != FUSED_VARLEN_IMPLEMENTATION:
        return None
    return (
        f"attn_implementation={FUSED_VARLEN_IMPLEMENTATION!r} runs packed rows only (its segment tables come from "
        "the packed batch), and batch_layout is 'padded'. Set batch_layout: prefix_shared (or padding_free), or "
        "load the model with attn_implementation='sdpa' for the padded layout."
    )


def _implementation_refusal(config, layout: str, fix: str) -> str | None:
    """Why ``config``'s attention implementation cannot take ``layout``'s packed mask, else None."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation in VARLEN_IMPLEMENTATIONS:
        return None if layout == PADDING_FREE else _varlen_refusal(implementation)
    if implementation not in DENSE_IMPLEMENTATIONS + ("flex_attention", FUSED_VARLEN_IMPLEMENTATION):
        return (
            f"attn_implementation={implementation!r} is not one packing can pass a mask to (eager, sdpa, "
            "flex_attention, fused_cpo_varlen; flash-attention varlen for padding_free): transformers builds no mask for custom "
            "kernels, so packed pairs would attend to each other. Load the model with attn_implementation="
            f"'flex_attention', or {fix[0].lower()}{fix[1:]}"
        )
    return None


def _family_refusal(
    lm: nn.Module, text, layout: str, *, max_length: int | None, max_row_tokens: int | None
) -> str | None:
    """What a family does by row index or from a 2D mask that a packed row would break (``None``: nothing known).

    The probe (``check_model_runs_exactly``) catches what this list misses; these give the better message.
    """
    model_type = getattr(text, "model_type", "")
    if model_type in _2D_MASK_MODEL_TYPES:
        return f"model_type {model_type!r} builds its attention mask from a 2D attention_mask, not a packed mask."
    if getattr(text, "alibi", False):
        return "config.alibi=True builds its ALiBi bias from a 2D attention_mask, not from the packed position ids."
    local = [t for t in _flat_attention_layers(text) if t == "local"]
    window = getattr(text, "window_size", None)
    # A packed group spans one sequence (padding_free) or prompt + chosen + rejected (prefix_shared, < 2 max_length).
    span = None if max_length is None else (max_length if layout == PADDING_FREE else 2 * max_length)
    if local and (window is None or span is None or span > window):
        return (
            f"{len(local)} layer(s) attend locally (config.attention_layers, window_size={window}) by index in the "
            f"row, and a packed group spans up to {span} positions: the window would cut the rejected branch off its "
            "prompt."
        )
    capacity = _causal_buffer_size(lm)
    if capacity is not None and (max_row_tokens is None or max_row_tokens > capacity):
        return (
            f"its attention slices a fixed causal buffer of {capacity} positions by the row's length, and a packed "
            f"row can reach {max_row_tokens} tokens (micro-batch x 2 x max_length). Lower the micro-batch or "
            "max_length so that the row fits."
        )
    if _positions_from_padding(lm):
        return (
            "its embeddings number positions from padding_idx + 1 and skip pad tokens (RoBERTa's convention), which "
            "the packed row's position ids (0 per sequence) do not follow."
        )
    return None


def _flat_attention_layers(text) -> list[str]:
    """GPT-Neo's ``attention_layers`` (one type per layer), or ``[]``."""
    layers = getattr(text, "attention_layers", None)
    return [t for t in layers if isinstance(t, str)] if isinstance(layers, (list, tuple)) else []


def _causal_buffer_size(lm: nn.Module) -> int | None:
    """The side of a fixed ``[1, 1, P, P]`` causal buffer some attentions keep (GPT-Neo's ``bias``), else None."""
    for name, buffer in lm.named_buffers():
        if name.rpartition(".")[2] == "bias" and buffer.dim() == 4 and buffer.dtype == torch.bool:
            return buffer.shape[-1]
    return None


def _positions_from_padding(lm: nn.Module) -> bool:
    """Whether the base model's embeddings derive position ids from ``padding_idx`` (RoBERTa and its kin)."""
    base = getattr(lm, "base_model", None)
    embeddings = getattr(base, "embeddings", None)
    return getattr(embeddings, "padding_idx", None) is not None and hasattr(embeddings, "position_embeddings")


# ------------------------------------------------------------------------------------------------ the head's input


def head_transform(lm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model applies to the backbone's last hidden state before the output embedding, or None.

    A prediction head whose parent holds a transform before its ``decoder`` (BERT's ``cls.predictions.transform``:
    dense, activation, LayerNorm; RoBERTa's ``lm_head``: dense, gelu, ``layer_norm``). The fused loss runs it on the
    hidden states so its parameters train as in the model's own forward. Looked up per call (cheap: the head is a
    few modules deep) so that a copied or re-wrapped model uses its own modules. Anything else between the backbone
    and the head is caught by ``check_model_runs_exactly``.
    """
    head = lm.get_output_embeddings()
    parent = _head_parent(lm, head)
    if parent is None:
        return None
    transform = getattr(parent, "transform", None)
    if isinstance(transform, nn.Module):
        return transform
    dense, norm = getattr(parent, "dense", None), getattr(parent, "layer_norm", None)
    if isinstance(dense, nn.Module) and isinstance(norm, nn.Module):
        return lambda hidden: norm(F.gelu(dense(hidden)))  # RobertaLMHead.forward, before its decoder
    return None


def _head_parent(lm: nn.Module, head: nn.Module) -> nn.Module | None:
    """The module holding ``head`` when it is not ``lm`` itself (up to three levels down, the backbone skipped)."""
    base = getattr(lm, "base_model", None)
    frontier = [child for child in lm.children() if child is not base]
    if any(child is head for child in frontier):
        return None
    for _ in range(3):
        for module in frontier:
            if any(child is head for child in module.children()):
                return module
        frontier = [child for module in frontier for child in module.children()]
    return None


# ------------------------------------------------------------------------------------------------------ the probe

# (prompt, chosen, rejected) lengths of the probe's two pairs: 30 tokens on the padded path's 4 rows of 9 positions,
# a packed row of 24 (prefix_shared, groups of 13 and 11) or 30 (padding_free). Ragged on purpose: padding, a
# rejected branch longer than its chosen one.
PROBE_PAIRS = ((5, 4, 3), (3, 2, 5))
# Largest |difference| accepted, relative to 1 + |the model's value|: a dtype's noise between two exact computations
# (bf16: the packed row's attention runs another kernel, ~1e-2 on a random-init 8B), far below a wrong position or
# mask (differences of order 1 on the toy models, tests/test_support.py).
PROBE_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def probe_skip_reason(lm: nn.Module) -> str | None:
    """Why the probe cannot run ``lm`` at construction (sharded, meta or spread weights), else None."""
    devices = set()
    for param in lm.parameters():
        if param.is_meta or hasattr(param, "ds_id") or type(param).__name__ == "DTensor" or param.numel() == 0:
            return "its weights are sharded (ZeRO-3 / FSDP) or not materialised (meta device)"
        devices.add(param.device)
    if len(devices) > 1:
        return f"it is spread over {len(devices)} devices"
    return None


def _probe_rows(vocab: int, pad_token_id: int | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The probe's pairs as CPOTrainer's collator gives them: right-padded ``chosen_*`` / ``rejected_*``, labels -100
    on the prompt. Token ids deterministic, below ``vocab``, never the pad token."""
    avoid = {pad_token_id} if pad_token_id is not None else set()
    tokens = [t for t in ((7 * i + 3) % vocab for i in range(4 * vocab)) if t not in avoid]
    rows: dict[str, list[list[int]]] = {"chosen": [], "rejected": []}
    labels: dict[str, list[list[int]]] = {"chosen": [], "rejected": []}
    at = 0
    for prompt, *completions in PROBE_PAIRS:
        shared = tokens[at : at + prompt]
        at += prompt
        for side, n in zip(rows, completions, strict=True):
            rows[side].append(shared + tokens[at : at + n])
            labels[side].append([-100] * prompt + tokens[at : at + n])
            at += n
    pad = pad_token_id if pad_token_id is not None else 0
    batch = {}
    for side in rows:
        batch[f"{side}_input_ids"] = _right_padded(rows[side], pad)
        batch[f"{side}_attention_mask"] = _right_padded([[1] * len(s) for s in rows[side]], 0)
        batch[f"{side}_labels"] = _right_padded(labels[side], -100)
    return {k: v.to(device) for k, v in batch.items()}


def _right_padded(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, seqs))
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs])


def _padded(batch: dict[str, torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``concatenated_inputs`` of the probe: ``[chosen; rejected]`` ids and mask, padded to one width."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    ids, mask = [], []
    for side in ("chosen", "rejected"):
        extra = width - batch[f"{side}_input_ids"].shape[1]
        ids.append(F.pad(batch[f"{side}_input_ids"], (0, extra), value=pad))
        mask.append(F.pad(batch[f"{side}_attention_mask"], (0, extra), value=0))
    return torch.cat(ids), torch.cat(mask)


def _token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want| / (1 + |want|)``."""
    return ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()


def _check_head(lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor, tol: float) -> None:
    """(a) the fused head's logits (backbone, ``head_transform``, weight, bias) equal the model's own."""
    head = lm.get_output_embeddings()
    try:  # as distributed._fused_forward runs it
        hidden = lm.base_model(ids, attention_mask=mask, use_cache=False).last_hidden_state.to(head.weight.device)
    except Exception as err:  # the model's own error, attached
        raise ValueError(
            f"{type(lm).__name__}: the fused forward runs the backbone (model.base_model) alone and reads its "
            f"last_hidden_state, which fails on a probe batch: {type(err).__name__}: {err}. Set use_fused_loss=False."
        ) from err
    transform = head_transform(lm)
    if transform is not None:
        hidden = transform(hidden)
    fused = F.linear(hidden, head.weight, getattr(head, "bias", None))
    real = mask.bool()
    worst = _worst(fused[real], logits[real])
    if worst > tol:
        raise ValueError(
            f"{type(lm).__name__}: the fused head's logits (the backbone's last hidden state"
            f"{', the head transform' if transform is not None else ''} times get_output_embeddings().weight, plus "
            f"its bias) differ from the model's own logits by {worst:.3g} (relative; {tol:g} allowed for "
            f"{head.weight.dtype}) on a probe batch: the model applies something between the backbone and its output "
            "embedding that the fused loss does not (a transform, a scale, a softcap). Set use_fused_loss=False."
        )


def _check_packed(lm, batch, ids, logits, *, layout: str, pad_token_id: int, implementation: str, tol: float) -> None:
    """(b) each probe sequence's per-token log-probs in the packed row equal those of its padded row."""
    packed = PackingCollator(None, layout, pad_token_id, implementation).pack(batch).to(ids.device)
    fix = f"Use batch_layout: padded for this model (or report it: batch_layout={layout!r} should refuse it earlier)."
    try:
        inputs = packed_model_inputs(
            packed, dtype=lm.get_input_embeddings().weight.dtype, implementation=implementation
        )
        row = lm(**inputs).logits[0]
    except Exception as err:  # the model's own error, attached: it says what the packed call broke
        raise ValueError(
            f"{type(lm).__name__} fails on a packed probe row (batch_layout={layout!r}, attn_implementation="
            f"{implementation!r}): {type(err).__name__}: {err}. {fix}"
        ) from err
    labelled = packed.labels != -100
    got = _token_logps(row[labelled], packed.labels[labelled])
    seq, pos = packed.sequence[labelled], packed.position_ids[0][labelled]
    want = _token_logps(logits[seq, pos], ids[seq, pos + 1])
    worst = _worst(got, want)
    if worst > tol:
        raise ValueError(
            f"{type(lm).__name__}: per-token log-probs of the probe's sequences in a packed row (batch_layout="
            f"{layout!r}, attn_implementation={implementation!r}) differ from the same sequences run alone by "
            f"{worst:.3g} (relative; {tol:g} allowed): the model treats the packed row's positions, mask or length "
            f"differently (position ids, an attention window or bias by row index, a fixed-size buffer). {fix}"
        )


@contextlib.contextmanager
def _padded_attention(lm: nn.Module, implementation: str):
    """The probe's padded reference rows on sdpa where ``implementation`` runs packed rows only (``fused_cpo_varlen``
    needs segment tables): the same attention, dense; restored after."""
    if implementation != FUSED_VARLEN_IMPLEMENTATION:
        yield
        return
    # transformers' setter writes a config's value into all its sub-configs: keep each one's own (parents first)
    saved = [(c, c._attn_implementation) for c in _configs_parents_first(lm.config)]
    for config in {id(c): c for c in (lm.config, lm.config.get_text_config())}.values():
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for config, value in saved:
            config._attn_implementation = value


def _configs_parents_first(config) -> list:
    """``config`` and its sub-configs (``config.sub_configs``), recursively, each parent before its children."""
    out = [config]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out += _configs_parents_first(sub)
    return out


def check_model_runs_exactly(model: nn.Module, layout: str, *, pad_token_id: int | None, implementation: str) -> None:
    """The probe: raise ``ValueError`` (what differs, the fix) unless ``model`` gives the fused head and ``layout``
    exactly its own results on a tiny batch (``PROBE_PAIRS``).

    (a) the fused head's logits equal the model's own (head transform, bias, scale, softcap all included); (b) for
    a packed layout, each probe sequence's per-token log-probs in the packed row (packed and masked as the trainer
    does) equal those of its padded row; a crash there is a refusal with the model's exception attached. One forward
    per check, in eval mode (dropout off: modes restored after), without gradients, the global RNG untouched. A model
    that cannot run here (``probe_skip_reason``) is skipped with one warning: the static checks still hold.
    """
    lm = unwrap_causal_lm(model)
    skip = probe_skip_reason(lm)
    if skip is not None:
        logger.warning(f"FusedCPOTrainer: the construction probe is skipped because {skip}; static checks only.")
        return
    embeddings = lm.get_input_embeddings()
    device, tol = embeddings.weight.device, PROBE_TOLERANCE.get(embeddings.weight.dtype, 5e-2)
    pad = pad_token_id if pad_token_id is not None else 0
    modes = {m: m.training for m in lm.modules()}
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
            lm.eval()
            batch = _probe_rows(embeddings.num_embeddings, pad_token_id, device)
            ids, mask = _padded(batch, pad)
            with _padded_attention(lm, implementation):
                logits = lm(ids, attention_mask=mask, use_cache=False).logits
                _check_head(lm, ids, mask, logits, tol)
            if layout != PADDED:
                _check_packed(lm, batch, ids, logits, layout=layout, pad_token_id=pad, implementation=implementation,
                              tol=tol)  # fmt: skip
    finally:
        for module, training in modes.items():
            module.training = training
