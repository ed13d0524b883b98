"""Packed attention as one flash varlen call: segment tables built once per batch on the host, an attention
function registered with transformers under ``attn_implementation="fused_cpo_varlen"``.

The packed row (packing.py) is cut into segments, each causal over its own keys:

- ``padding_free``: every sequence is a segment, queries = keys (``cu_seqlens_q == cu_seqlens_k``).
- ``prefix_shared``: per pair, segment ``[shared | chosen]`` over itself, and segment ``[rejected]`` whose keys
  and values are gathered as ``[shared | rejected]``. The rejected segment has fewer queries than keys; its causal
  diagonal is aligned bottom-right (query ``j`` of ``Lq`` sees key ``i`` of ``Lk`` iff ``i <= j + Lk - Lq``), the
  convention of FlashAttention >= 2.1 varlen: query ``j`` then sees the whole prompt and rejected ``0..j``, never
  chosen. tests/test_varlen_attention.py checks the tables against attention.dense_visibility, and
  tests/gpu/test_varlen_attention_cuda.py the kernel's alignment.
- Tail padding (``pad_to_multiple_of``) is a segment of its own.

The queries are the unique positions; only the prompt's keys and values are read twice (``key_index``), and the
gather's backward (index_select's) sums their two gradients. The tables travel to the attention function as the
model's forward kwarg ``fused_cpo_varlen=`` (transformers passes ``**kwargs`` down to the attention interface); no
mask is built (the implementation is not in transformers' mask interface, so ``create_causal_mask`` returns None
without looking at the position ids). On CUDA in fp16/bf16 the kernel is PyTorch's flash varlen
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10); elsewhere (CPU, fp32/fp64) a per-segment sdpa
reference over the same tables, the spec the CUDA kernel is tested against.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packing import REJECTED, SHARED, PackedBatch, map_tensor_fields

logger = logging.getLogger(__name__)

IMPLEMENTATION = "fused_cpo_varlen"  # attn_implementation= name registered with transformers
TABLES_KWARG = "fused_cpo_varlen"  # the model forward kwarg (and batch key) carrying the VarlenTables
# max_seqlen_* are rounded up to this: an upper bound is all the kernels need (grid size), and a few distinct
# values keep cuDNN's graph cache and torch.compile's guards from seeing a new shape every batch.
SEQLEN_BUCKET = 128


@dataclass
class VarlenTables:
    """The varlen segments of one packed row.

    Attributes:
        cu_seqlens_q: ``[S + 1]`` int32, segment ``s``'s queries are row positions ``cu_seqlens_q[s]..[s+1]-1``.
        cu_seqlens_k: ``[S + 1]`` int32, offsets of segment ``s``'s keys in the gathered key sequence.
        max_seqlen_q: the longest segment's query count rounded up to ``SEQLEN_BUCKET`` (a host int: no device
            sync to read it).
        max_seqlen_k: the longest segment's key count, rounded up likewise.
        key_index: ``[N_k]`` int64 row position of every gathered key, or None when the keys are the row itself
            (``padding_free``: ``cu_seqlens_k == cu_seqlens_q``).
        square_out_index: ``[N]`` int64, for the square-segment form (queries gathered like the keys, so every
            segment is ``Lk x Lk``): where each row position's own output sits in it; None where ``key_index`` is.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    key_index: torch.Tensor | None = None
    square_out_index: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = True) -> VarlenTables:
        """A copy on ``device`` (asynchronous from pinned memory: the DataLoader pins through :meth:`pin_memory`)."""
        return map_tensor_fields(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self, device: torch.device | str | None = None) -> VarlenTables:
        """Page-locked copy; the DataLoader's ``pin_memory=True`` calls this on objects that have it."""
        return map_tensor_fields(self, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def _segments(group: torch.Tensor, branch: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start, end, group start)`` per segment: a segment starts where the group changes or where its rejected
    branch starts. Checks the layout the tables assume: contiguous groups, branches in order within each."""
    n = len(group)
    same_group = group[1:] == group[:-1]
    out_of_order = bool(((branch[1:] < branch[:-1]) & same_group).any())
    if out_of_order or len(torch.unique_consecutive(group)) != len(torch.unique(group)):
        raise ValueError(
            "The packed row is not laid out [shared | chosen | rejected] per contiguous group (packing.pack_pairs's "
            "layout), so its varlen segments cannot be read off it. Pack the batch with pack_pairs."
        )
    rejected = branch == REJECTED
    cut = torch.ones(n, dtype=torch.bool)
    cut[1:] = ~same_group | (rejected[1:] & ~rejected[:-1])
    group_cut = torch.ones(n, dtype=torch.bool)
    group_cut[1:] = ~same_group
    first = torch.cummax(torch.where(group_cut, torch.arange(n), 0), 0).values  # each position's group start
    starts = cut.nonzero().flatten().tolist()
    return [(s, e, int(first[s])) for s, e in zip(starts, starts[1:] + [n], strict=True)]


def varlen_tables(packed: PackedBatch) -> VarlenTables:
    """The :class:`VarlenTables` of ``packed`` (either layout), on the CPU: build them in the collator, off the
    training step (a few host ops per segment)."""
    group, branch = packed.group.cpu(), packed.branch.cpu()
    q_lens, k_lens, pieces = [], [], []
    for start, end, group_start in _segments(group, branch):
        # A rejected segment reads its group's shared prefix first (shared positions lead the group).
        shared = int((branch[group_start:start] == SHARED).sum()) if branch[start] == REJECTED else 0
        q_lens.append(end - start)
        k_lens.append(end - start + shared)
        pieces += [torch.arange(group_start, group_start + shared), torch.arange(start, end)]
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(torch.int32)  # noqa: E731
    bound = lambda lens: -(-max(lens) // SEQLEN_BUCKET) * SEQLEN_BUCKET  # noqa: E731
    if k_lens == q_lens:
        return VarlenTables(cu(q_lens), cu(k_lens), bound(q_lens), bound(k_lens))
    # A segment's own queries are the last Lq of its Lk square positions.
    ends = cu(k_lens).tolist()[1:]
    square_out = torch.cat([torch.arange(end - q, end) for end, q in zip(ends, q_lens, strict=True)])
    return VarlenTables(cu(q_lens), cu(k_lens), bound(q_lens), bound(k_lens), torch.cat(pieces), square_out)


def gather_keys(key: torch.Tensor, value: torch.Tensor, tables: VarlenTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N_k, H_kv, D]`` keys and values of the segments (index_select: its backward sums the prompt's two
    gradients); the row itself for ``padding_free``."""
    if tables.key_index is None:
        return key, value
    return key.index_select(0, tables.key_index), value.index_select(0, tables.key_index)


def varlen_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: VarlenTables, *, scale: float | None = None
) -> torch.Tensor:
    """The spec: per segment, sdpa with the causal diagonal aligned bottom-right, in the inputs' dtype.

    ``query`` ``[N, H, D]``; ``key``/``value`` ``[N, H_kv, D]`` (the row's own, gathered here); returns
    ``[N, H, D]``. One sdpa call per segment with its ``[Lq, Lk]`` mask: for the CPU and the tests.
    """
    key, value = gather_keys(key, value, tables)
    groups = query.shape[1] // key.shape[1]
    cu_q, cu_k = tables.cu_seqlens_q.tolist(), tables.cu_seqlens_k.tolist()
    outs = []
    for s in range(len(cu_q) - 1):
        q = query[cu_q[s] : cu_q[s + 1]].transpose(0, 1)
        k, v = (t[cu_k[s] : cu_k[s + 1]].transpose(0, 1).repeat_interleave(groups, 0) for t in (key, value))
        lq, lk = q.shape[1], k.shape[1]
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # bottom-right
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@functools.cache
def _varlen_attn_parameters() -> frozenset[str] | None:
    """The keyword parameters of torch's ``varlen_attn`` (changed across releases), None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tables: VarlenTables,
    *,
    scale: float | None = None,
    gqa: str = "auto",
) -> torch.Tensor:
    """PyTorch's flash varlen over the gathered keys, causal (bottom-right). Shapes as
    :func:`varlen_attention_reference`.

    ``gqa``: ``"auto"`` passes ``enable_gqa`` where the release takes it (2.12+) and expands the key/value heads
    where it does not; ``"native"`` hands FA2 the unexpanded heads either way (its kernels take ``H % H_kv == 0``;
    scripts/benchmark_attention.py checks and times it); ``"expand"`` always expands.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_attn_parameters()
    key, value = gather_keys(key, value, tables)
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # 2.10: is_causal=
    if query.shape[1] != key.shape[1]:
        if gqa == "expand" or (gqa == "auto" and "enable_gqa" not in params):
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        elif "enable_gqa" in params:
            kwargs["enable_gqa"] = True
    if scale is not None and "scale" not in params:  # 2.10 has no scale=: fold it into the queries
        query = query * (scale * query.shape[-1] ** 0.5)
    elif scale is not None:
        kwargs["scale"] = scale
    t = tables
    return varlen_attn(query, key, value, t.cu_seqlens_q, t.cu_seqlens_k, t.max_seqlen_q, t.max_seqlen_k, **kwargs)


def cudnn_varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: VarlenTables, *, scale: float | None = None
) -> torch.Tensor:
    """cuDNN's ragged attention (``aten._cudnn_attention_forward``, a private op, with its registered backward)
    over square segments: a rejected segment's queries re-include its prompt's (their outputs dropped), so plain
    top-left causal is the bottom-right rule, at the price of each prompt's ``P^2 / 2`` pairs once more. The key/value
    heads are expanded (GQA on the ragged path is not relied on). Shapes as :func:`varlen_attention_reference`."""
    if tables.key_index is not None:
        query = query.index_select(0, tables.key_index)
    key, value = gather_keys(key, value, tables)
    if query.shape[1] != key.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    cu, longest = tables.cu_seqlens_k, tables.max_seqlen_k
    query, key, value = (t.contiguous() for t in (query, key, value))  # ragged offsets assume the THD layout
    out = torch.ops.aten._cudnn_attention_forward(
        query, key, value, None, cu, cu, longest, longest, True, 0.0, True, False, scale=scale
    )[0]
    return out if tables.square_out_index is None else out.index_select(0, tables.square_out_index)


CUDA_KERNELS = {"flash": flash_varlen_attention, "cudnn": cudnn_varlen_attention}
CUDA_KERNEL = "flash"  # the default on CUDA: set from scripts/benchmark_attention.py's measurement


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tables: VarlenTables,
    *,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """``CUDA_KERNELS[kernel or CUDA_KERNEL]`` on CUDA in fp16/bf16, the reference elsewhere. Shapes as
    :func:`varlen_attention_reference`."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        if _varlen_attn_parameters() is not None:
            return CUDA_KERNELS[kernel or CUDA_KERNEL](query, key, value, tables, scale=scale)
        _warn_once(f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10+): {IMPLEMENTATION} runs "
                   "the per-segment reference, correct but slow. Upgrade torch, or use flex_attention.")  # fmt: skip
    return varlen_attention_reference(query, key, value, tables, scale=scale)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def fused_cpo_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: ``query`` ``[1, H, N, D]``, ``key``/``value`` ``[1, H_kv, N, D]``
    -> ``([1, N, H, D], None)``, the segments from ``kwargs["fused_cpo_varlen"]`` (a :class:`VarlenTables`)."""
    tables = kwargs.get(TABLES_KWARG)
    if not isinstance(tables, VarlenTables):
        raise ValueError(
            f"attn_implementation={IMPLEMENTATION!r} got no segment tables: it runs packed rows only, with "
            f"{TABLES_KWARG}=varlen_tables(packed) passed to the model's forward (FusedCPOTrainer does this for "
            "batch_layout padding_free / prefix_shared). For padded batches or generation switch the model back, "
            "e.g. model.set_attn_implementation('sdpa')."
        )
    if query.shape[0] != 1 or dropout:
        raise ValueError(
            f"{IMPLEMENTATION} takes one packed row without attention dropout; got batch {query.shape[0]} and "
            f"dropout={dropout}. Pack the batch into one row (pack_pairs) and set attention_dropout=0."
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{IMPLEMENTATION} applies no logit softcap or attention sinks; load this model with sdpa.")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
    return varlen_attention(q, k, v, tables, scale=scaling)[None], None


def register() -> None:
    """Register :func:`fused_cpo_varlen_attention` as ``attn_implementation="fused_cpo_varlen"`` (idempotent).
    Not in the mask interface on purpose: transformers then builds no mask (and runs no packed-sequence check)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, fused_cpo_varlen_attention)


register()
