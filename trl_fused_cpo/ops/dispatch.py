"""Backend choice and the assembly of ``CPOLossOutput`` around the fused op."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from ..loss import CPOHyperparams, CPOLossOutput
from . import rows_torch
from .function import Chunks, LinearCPOFunction, Slabs
from .grad_scale import GradScaleGuess

# Trainable: 1.5 GiB (6,278 Llama-3 tokens) puts a 40%-masked B = 16 batch in one GEMM (whole_batch_tokens): measured
# 47.9 against 49.6 ms at 1 GiB, 3.61 GiB peak; the full B = 16 batch runs 3 chunks instead of 4, same time, 3.68 GiB.
DEFAULT_CHUNK_BYTES_TRAINABLE = 3 << 29
# Frozen: a pair may be split at little cost (function.py). 384 MiB (1,569 tokens of Llama-3 logits) holds a masked
# T=1024 pair whole and halves a full one: measured faster than 256 MiB, and 0.44 GiB at B=16 where 512 MiB is 0.65.
DEFAULT_CHUNK_BYTES_FROZEN = 384 << 20
DEFAULT_CHUNK_BYTES_NO_GRAD = 1 << 30  # eval keeps no gradients: larger GEMMs, fewer launches
DEFAULT_SLAB_BYTES = 1 << 28  # memory="lean": 256 MiB of logits per vocabulary slab (8,192 columns at 16k tokens)
MEMORY_MODES = ("fast", "lean")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → ``triton`` on CUDA when Triton imports, else ``torch``; float64 always ``torch``: the Triton
    kernels compute in float32, and a float64 caller asked for more."""
    if backend == "auto":
        use_triton = device.type == "cuda" and dtype != torch.float64 and _triton_available()
        return "triton" if use_triton else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'torch', 'triton'.")
    if backend == "triton":
        if dtype == torch.float64:
            raise ValueError(
                "backend='triton' computes in float32 and would silently lose float64's accuracy; use "
                "backend='torch' (or 'auto') for float64 inputs."
            )
        if not _triton_available():
            raise ImportError("backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' runs on CUDA tensors (got {device.type}); use backend='torch', or set "
                "TRITON_INTERPRET=1 to run the kernels on the CPU through Triton's interpreter (tiny shapes only)."
            )
    return backend


def row_ops(backend: str) -> ModuleType:
    """The row passes and plan ops of a resolved backend: ``rows_torch`` or ``rows_triton`` (the same functions)."""
    if backend == "torch":
        return rows_torch
    from . import rows_triton

    return rows_triton


def max_chunk_tokens(
    vocab: int, dtype: torch.dtype, chunk_bytes: int | None, *, grad: bool, weight_trainable: bool
) -> int:
    """Tokens per logits buffer for a byte budget (or the default for this mode)."""
    if chunk_bytes is None:
        if not grad:
            chunk_bytes = DEFAULT_CHUNK_BYTES_NO_GRAD
        else:
            chunk_bytes = DEFAULT_CHUNK_BYTES_TRAINABLE if weight_trainable else DEFAULT_CHUNK_BYTES_FROZEN
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}.")
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


def choose_schedule(weight: torch.Tensor, chunk_bytes: int | None, memory: str, *, grad: bool) -> Chunks | Slabs:
    """``Chunks`` (the default) or ``Slabs`` (``memory="lean"``, unless the head is frozen: nothing to save there)."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory={memory!r} is not one of {MEMORY_MODES}.")
    trainable = weight.requires_grad and grad
    if memory == "lean" and (trainable or not grad):
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}.")
        return Slabs(DEFAULT_SLAB_BYTES if chunk_bytes is None else chunk_bytes)
    vocab, hidden_size = weight.shape
    max_tokens = max_chunk_tokens(vocab, weight.dtype, chunk_bytes, grad=grad, weight_trainable=weight.requires_grad)
    return Chunks(max_tokens, whole_batch_tokens(vocab, hidden_size, weight.dtype, max_tokens))


def linear_cpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    hp: CPOHyperparams,
    *,
    ignore_index: int,
    backend: str,
    chunk_bytes: int | None,
    memory: str = "fast",
    grad_guess: GradScaleGuess | None = None,
) -> CPOLossOutput:
    resolved = resolve_backend(backend, hidden.device, hidden.dtype)
    grad_on = torch.is_grad_enabled()
    schedule = choose_schedule(weight, chunk_bytes, memory, grad=grad_on)
    if resolved == "triton" and not weight.is_contiguous():  # the kernels read rows of W; torch.mm takes any strides
        weight = weight.contiguous()
    loss, chosen_logps, rejected_logps, chosen_rewards, rejected_rewards, nll, chosen_mean, rejected_mean = (
        LinearCPOFunction.apply(
            hidden, weight, bias, labels, hp, ignore_index, schedule, row_ops(resolved), grad_on, grad_guess
        )
    )
    return CPOLossOutput(
        loss=loss,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        nll_loss=nll,
        chosen_logits_mean=chosen_mean,
        rejected_logits_mean=rejected_mean,
    )
