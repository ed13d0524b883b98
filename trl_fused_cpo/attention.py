"""Attention masks for packed preference rows (packing.py), per attention implementation, and the models refused.

The rule, over the packed row: key ``k`` is visible to query ``q`` iff ``group[k] == group[q]``, ``k <= q``, and
not (``branch[q] == REJECTED`` and ``branch[k] == CHOSEN``).

What the model's ``attention_mask=`` gets (transformers 5.x, ``masking_utils._preprocess_mask_arguments``: a 4D
tensor or a ``BlockMask`` is used as it is, so the position ids only drive RoPE):

- ``eager`` / ``sdpa``: a dense additive ``[1, 1, N, N]`` mask (0 visible, dtype-min hidden). O(N²) memory and
  keeps sdpa off its flash kernel: the CPU/test path.
- ``flex_attention``: a ``BlockMask`` with ``Q_BLOCK = KV_BLOCK = 128``, built block-sparse from each query's
  visible key intervals (no ``[N, N]`` tensor; ``create_block_mask`` would evaluate the mask_mod over the whole
  grid unless compiled, and recompile for every new ``N``). Its ``mask_mod`` is the rule above over
  ``group``/``branch`` and is applied on the partial blocks only.
- ``flash_attention_*`` (varlen): ``None`` for ``padding_free``; the caller passes ``position_ids`` and
  transformers cuts the row where they restart at 0 (``prepare_fa_kwargs_from_position_ids``). ``prefix_shared``
  needs a mask varlen cannot express: refused.

Call the model as ``model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask,
use_cache=False)`` (as TRL does): with a cache, transformers also skips its own packed-sequence detection from
``position_ids``, so sdpa/eager/flex called with ``attention_mask=None`` would let the segments attend to each other
(tests/test_attention.py runs padding_free that way, exactly, only with ``use_cache=False``).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .packing import CHOSEN, REJECTED, PackedBatch
from .varlen_attention import IMPLEMENTATION as FUSED_VARLEN_IMPLEMENTATION

FLEX_BLOCK_SIZE = 128  # torch's default sparse block (flex_attention's kernels tile by it)
DENSE_IMPLEMENTATIONS = ("eager", "sdpa")
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")

# Model types whose layers carry state along the row (state-space, linear attention, convolutions) or attend in
# windows/chunks: a packed row would leak across pairs or lose the prompt. layer_types catches most of these too.
_STATEFUL_MODEL_TYPES = frozenset(
    "mamba mamba2 falcon_mamba falcon_h1 jamba zamba zamba2 bamba rwkv recurrent_gemma lfm2 lfm2_vl qwen3_next "
    "granitemoehybrid nemotron_h xlstm minimax plamo2".split()
)


def _visible(group: torch.Tensor, branch: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The rule, broadcast over query indexes ``q`` and key indexes ``k``."""
    return (group[q] == group[k]) & (k <= q) & ~((branch[q] == REJECTED) & (branch[k] == CHOSEN))


def dense_visibility(packed: PackedBatch) -> torch.Tensor:
    """``[N, N]`` bool, ``[q, k]`` True where key ``k`` is visible to query ``q``."""
    idx = torch.arange(packed.num_tokens, device=packed.group.device)
    return _visible(packed.group, packed.branch, idx[:, None], idx[None, :])


def packed_mask_mod(packed: PackedBatch):
    """flex_attention's ``mask_mod(b, h, q_idx, kv_idx)`` for ``packed`` (tensors captured on their device)."""
    group, branch = packed.group, packed.branch

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(group, branch, q_idx, kv_idx)

    return mask_mod


def _visible_intervals(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's visible keys as two half-open intervals ``[lo1, hi1) ∪ [lo2, hi2)`` of the row, ``[N]`` each.

    A group is contiguous and laid out ``shared, chosen, rejected``: a query sees ``[group start, q]``, except a
    rejected query, which skips its group's chosen branch ``[chosen start, chosen end)``.
    """
    group, branch = packed.group, packed.branch
    n = packed.num_tokens
    idx = torch.arange(n, device=group.device)
    starts = torch.ones(n, dtype=torch.bool, device=group.device)
    starts[1:] = group[1:] != group[:-1]
    group_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    is_chosen = branch == CHOSEN
    # Chosen start/end per position, carried forward within the group: the branch is contiguous in its group.
    chosen_start_here = is_chosen & (starts | ~torch.cat([starts.new_zeros(1), is_chosen[:-1]]))
    chosen_start = torch.cummax(torch.where(chosen_start_here, idx, -1), 0).values
    chosen_end = torch.cummax(torch.where(is_chosen, idx + 1, -1), 0).values
    skips = (branch == REJECTED) & (chosen_start >= group_start) & (chosen_end > chosen_start)
    lo1 = group_start
    hi1 = torch.where(skips, chosen_start, idx + 1)
    lo2 = torch.where(skips, chosen_end, idx + 1)
    hi2 = idx + 1
    return lo1, hi1, lo2, hi2


def packed_block_mask(packed: PackedBatch, *, block_size: int = FLEX_BLOCK_SIZE):
    """The flex_attention ``BlockMask`` of ``packed``: which ``block_size²`` tiles are empty, full or partial.

    Counts each tile's visible pairs from the per-query intervals (``[N, N / block_size]`` small integers, not
    ``[N, N]``): 0 -> skipped, all ``block_size²`` -> full (the kernel skips mask_mod), else partial (mask_mod
    applied).
    Equal to ``create_block_mask(packed_mask_mod(packed), 1, 1, N, N)`` (tests/test_attention.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = packed.num_tokens
    device = packed.group.device
    nb = -(-n // block_size)
    lo1, hi1, lo2, hi2 = (x.to(torch.int32) for x in _visible_intervals(packed))
    k_lo = torch.arange(nb, device=device, dtype=torch.int32) * block_size
    k_hi = (k_lo + block_size).clamp(max=n)

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (torch.minimum(hi[:, None], k_hi[None]) - torch.maximum(lo[:, None], k_lo[None])).clamp(min=0)

    per_query = overlap(lo1, hi1) + overlap(lo2, hi2)  # [N, nb] int32: 32 MiB at N = 32k
    per_query = torch.nn.functional.pad(per_query, (0, 0, 0, nb * block_size - n))
    counts = per_query.view(nb, block_size, nb).sum(1)  # [q block, kv block]
    # Tiles cut by the row's end are never full (torch pads them with hidden positions): the kernels apply
    # mask_mod there, as on create_block_mask's.
    full = counts == block_size * block_size
    partial = (counts > 0) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Listed blocks first, ascending (a stable sort of the 0/1 flags, descending).
        num = blocks.sum(-1).to(torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None], indices[None, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=packed_mask_mod(packed), seq_lengths=(n, n)
    )


def packed_attention_mask(packed: PackedBatch, *, dtype: torch.dtype, implementation: str):
    """What the model's ``attention_mask=`` must get to honour ``packed``'s layout under ``implementation``.

    Pass it with ``input_ids=packed.input_ids`` and ``position_ids=packed.position_ids`` (both ``[1, N]``).

    Args:
        packed: the packed batch (on the model's device).
        dtype: the attention's compute dtype (the model's dtype): the dense mask is additive in it.
        implementation: ``model.config._attn_implementation``.

    Returns:
        ``eager``/``sdpa``: ``[1, 1, N, N]`` ``dtype`` tensor, 0 visible and ``finfo(dtype).min`` hidden.
        ``flex_attention``: a ``BlockMask`` (see :func:`packed_block_mask`).
        ``flash_attention_*``: ``None`` for ``padding_free`` (varlen from ``position_ids``).
        ``fused_cpo_varlen``: ``None`` (the segments travel as ``varlen_attention.VarlenTables``).

    Raises:
        ValueError: ``prefix_shared`` with flash attention, or an implementation this module does not know.
    """
    if implementation in DENSE_IMPLEMENTATIONS:
        hidden = torch.finfo(dtype).min
        mask = torch.zeros((), dtype=dtype, device=packed.group.device).masked_fill(~dense_visibility(packed), hidden)
        return mask[None, None]
    if implementation == "flex_attention":
        return packed_block_mask(packed)
    if implementation == FUSED_VARLEN_IMPLEMENTATION:
        return None
    if implementation in VARLEN_IMPLEMENTATIONS:
        if packed.layout == "padding_free":
            return None
        raise ValueError(_varlen_refusal(implementation))
    raise ValueError(
        f"attn_implementation={implementation!r}: packed layouts need an attention that takes a prepared mask "
        f"({DENSE_IMPLEMENTATIONS + ('flex_attention',)}) or, for padding_free, flash-attention varlen. "
        "Load the model with attn_implementation='flex_attention' (or 'sdpa'), or use layout 'padded'."
    )


def _varlen_refusal(implementation: str) -> str:
    return (
        f"layout 'prefix_shared' cannot run on attn_implementation={implementation!r}: flash-attention varlen cuts "
        "the row into independent causal segments, but the rejected branch must see the shared prompt and skip "
        "the chosen branch before it. Load the model with attn_implementation='flex_attention', or use layout "
        "'padding_free'."
    )


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
    if implementation not in DENSE_IMPLEMENTATIONS + ("flex_attention", FUSED_VARLEN_IMPLEMENTATION):
        return (
            f"attn_implementation={implementation!r} is not one packing can pass a mask to (eager, sdpa, "
            "flex_attention; flash-attention varlen for padding_free): transformers builds no mask for custom "
            "kernels, so packed pairs would attend to each other. Load the model with attn_implementation="
            f"'flex_attention', or {fix[0].lower()}{fix[1:]}"
        )
    return None
