"""Which schedule runs a call, and its budget: the one place the fused op's memory defaults live.

``Chunks`` (``chunks.py``, the default): pair-aligned token chunks, three products per token, one ``[tokens, V]``
logits buffer. ``Slabs`` (``slabs.py``, ``memory="lean"`` with a trainable head): vocabulary slabs over every token,
the logits computed twice, no fp32 weight-gradient accumulator. Both are decided here once per call, with the
gradients the call needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# Trainable: 1.5 GiB (6,278 Llama-3 tokens) puts a 40%-masked B = 16 batch in one GEMM (whole_batch_tokens): measured
# 47.9 against 49.6 ms at 1 GiB, 3.61 GiB peak; the full B = 16 batch runs 3 chunks instead of 4, same time, 3.68 GiB.
DEFAULT_CHUNK_BYTES_TRAINABLE = 3 << 29
# Frozen: a pair may be split at little cost (chunks.py). 384 MiB (1,569 tokens of Llama-3 logits) holds a masked
# T=1024 pair whole and halves a full one: measured faster than 256 MiB, and 0.44 GiB at B=16 where 512 MiB is 0.65.
DEFAULT_CHUNK_BYTES_FROZEN = 384 << 20
DEFAULT_CHUNK_BYTES_NO_GRAD = 1 << 30  # eval keeps no gradients: larger GEMMs, fewer launches
DEFAULT_SLAB_BYTES = 1 << 28  # memory="lean": 256 MiB of logits per vocabulary slab (8,192 columns at 16k tokens)
MemoryMode = Literal["fast", "lean"]
MEMORY_MODES = ("fast", "lean")


@dataclass(frozen=True)
class NeedGrads:
    """Which inputs get a gradient in this call (none under ``torch.no_grad()``)."""

    hidden: bool
    weight: bool
    bias: bool

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias

    @property
    def frozen_head(self) -> bool:
        """Only hidden needs a gradient: the frozen-head path (``chunks.py``), which skips the dW product."""
        return self.hidden and not (self.weight or self.bias)

    @classmethod
    def of(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> NeedGrads:
        grad = torch.is_grad_enabled()
        return cls(
            grad and hidden.requires_grad,
            grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad,
        )


@dataclass(frozen=True)
class Chunks:
    """The default schedule: pair-aligned token chunks of at most ``max_tokens``.

    The one-GEMM exception, stated here only: a batch of at most ``whole_batch_tokens`` labelled tokens is one GEMM
    whatever ``max_tokens`` says (one chunk writes dW in the weight dtype, with no fp32 accumulator, so its logits
    may use the accumulator's memory: ``whole_batch_tokens``); None: no such exception (no trainable head).
    """

    max_tokens: int
    whole_batch_tokens: int | None

    def chunk_tokens(self, num_tokens: int) -> int:
        """Tokens per chunk for a batch of ``num_tokens`` labelled tokens (known after the plan's sync)."""
        if self.whole_batch_tokens is not None and num_tokens <= self.whole_batch_tokens:
            return max(self.max_tokens, num_tokens)
        return self.max_tokens

    def first_slice_bound(self, num_positions: int) -> int:
        """The most tokens the first slice can hold whatever the labelled count: its rows are gathered before the
        plan's sync."""
        return min(num_positions, max(self.max_tokens, self.whole_batch_tokens or 0))


@dataclass(frozen=True)
class Slabs:
    """The memory-lean schedule (``slabs.py``): every token, vocabulary slabs of at most ``slab_bytes`` of logits.

    Under ``memory="lean"`` the ``chunk_bytes`` knob is ``slab_bytes``: the logits of one slab over all tokens."""

    slab_bytes: int

    def chunk_tokens(self, num_tokens: int) -> int:
        """Every labelled token in one group: each GEMM takes them all (and one slab of the vocabulary)."""
        return max(1, num_tokens)


def check_budget(chunk_bytes: int | None, memory: str) -> None:
    """The knobs' own checks, shared by the functional and ``FusedCPOConfig.__post_init__``."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory={memory!r} is not one of {MEMORY_MODES}.")
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)):
        raise TypeError(f"chunk_bytes must be an int number of bytes or None; got {chunk_bytes!r}.")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}.")


def max_chunk_tokens(vocab: int, dtype: torch.dtype, chunk_bytes: int | None, need: NeedGrads) -> int:
    """Tokens per logits buffer for a byte budget (or the default for this mode)."""
    if chunk_bytes is None:
        if not need.any:
            chunk_bytes = DEFAULT_CHUNK_BYTES_NO_GRAD
        else:
            chunk_bytes = DEFAULT_CHUNK_BYTES_FROZEN if need.frozen_head else DEFAULT_CHUNK_BYTES_TRAINABLE
    return max(1, chunk_bytes // (vocab * torch.finfo(dtype).bits // 8))


def whole_batch_tokens(vocab: int, hidden_size: int, dtype: torch.dtype, max_tokens: int) -> int:
    """Labelled tokens up to which a trainable head's batch is one GEMM: in the same memory as the chunked path.

    Several chunks need an fp32 dW accumulator (4 bytes per weight) beside the budget's buffer; one chunk writes
    dW in the weight dtype directly and needs no accumulator, so its logits may use the difference: at Llama-3 8B
    the default 1.5 GiB budget (6,278 tokens) becomes 2.5 GiB (10,374 tokens: the 40%-masked B = 16 batch of the
    benchmark), and one GEMM skips the fp32 pass.
    """
    itemsize = torch.finfo(dtype).bits // 8
    if itemsize >= 4:
        return max_tokens  # fp32 weights: dW is fp32 either way
    spare = vocab * hidden_size * (4 - itemsize)
    return max_tokens + spare // (vocab * itemsize)


def choose_schedule(weight: torch.Tensor, chunk_bytes: int | None, memory: str, need: NeedGrads) -> Chunks | Slabs:
    """``Slabs`` for ``memory="lean"`` (unless only hidden needs a gradient: a frozen head has no accumulator to
    save), else ``Chunks``."""
    check_budget(chunk_bytes, memory)
    if memory == "lean" and not need.frozen_head:
        return Slabs(DEFAULT_SLAB_BYTES if chunk_bytes is None else chunk_bytes)
    vocab, hidden_size = weight.shape
    max_tokens = max_chunk_tokens(vocab, weight.dtype, chunk_bytes, need)
    whole = whole_batch_tokens(vocab, hidden_size, weight.dtype, max_tokens) if need.weight else None
    return Chunks(max_tokens, whole)
