"""Backend choice and the assembly of ``CPOLossOutput`` around the fused op."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from ..loss import CPOHyperparams, CPOLossOutput, cpo_pair_losses
from . import rows_torch
from .function import LinearCPOFunction

DEFAULT_CHUNK_BYTES_TRAINABLE = 1 << 30  # with the fp32 dW accumulator (2 GiB at Llama-3 8B) this keeps B=16 < 4 GiB
DEFAULT_CHUNK_BYTES_FROZEN = 1 << 29  # a whole T=1024 pair (2 x 1023 tokens x 128,256 x 2 B) is 0.49 GiB
DEFAULT_CHUNK_BYTES_NO_GRAD = 1 << 30  # eval keeps no gradients: larger GEMMs, fewer launches


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` → ``triton`` on CUDA when Triton imports, else ``torch``."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'torch', 'triton'.")
    if backend == "triton":
        if not _triton_available():
            raise ImportError("backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' runs on CUDA tensors (got {device.type}); use backend='torch', or set "
                "TRITON_INTERPRET=1 to run the kernels on the CPU through Triton's interpreter (tiny shapes only)."
            )
    return backend


def row_ops(backend: str) -> ModuleType:
    """The row-pass implementation for a resolved backend: a module with logsumexp_target and softmax_grad_."""
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


@torch.no_grad()
def logits_means(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows_per_step: int = 4096
) -> torch.Tensor:
    """``[2B]`` mean over the vocabulary and all T positions of each row's logits, without the logits.

    The mean of one position's logits is ``(h · Σ_v w_v + Σ_v b_v) / V``: one pass over W, one mat-vec.
    """
    num_rows, seq_len, hidden_size = hidden.shape
    vocab = weight.shape[0]
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    # No cache across calls: under FSDP2 / ZeRO-3 the gathered head can reuse an address without a version bump.
    w_sum = weight.sum(0, dtype=acc)
    b_sum = bias.sum(dtype=acc) if bias is not None else 0.0
    x = hidden.reshape(num_rows * seq_len, hidden_size)
    out = torch.empty(num_rows * seq_len, device=hidden.device, dtype=acc)
    for s in range(0, x.shape[0], rows_per_step):  # fp32 copies of a few thousand rows at a time
        out[s : s + rows_per_step] = x[s : s + rows_per_step].to(acc) @ w_sum
    return ((out + b_sum) / vocab).view(num_rows, seq_len).mean(-1).float()


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
) -> CPOLossOutput:
    resolved = resolve_backend(backend, hidden.device)
    grad_on = torch.is_grad_enabled()
    # Queued before the op's one host sync, so the GPU has this to do while the host plans the chunks.
    row_means = logits_means(hidden.detach(), weight.detach(), None if bias is None else bias.detach())
    max_tokens = max_chunk_tokens(
        weight.shape[0], weight.dtype, chunk_bytes, grad=grad_on, weight_trainable=weight.requires_grad
    )
    loss, chosen_logps, rejected_logps, nll = LinearCPOFunction.apply(
        hidden, weight, bias, labels, hp, ignore_index, max_tokens, row_ops(resolved), grad_on
    )
    # float64: AlphaPO's exp(-alpha * s) overflows float32 at alpha * |s| > 88
    _, chosen_rewards, rejected_rewards = cpo_pair_losses(chosen_logps.double(), rejected_logps.double(), hp)
    num_pairs = hidden.shape[0] // 2
    return CPOLossOutput(
        loss=loss,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        chosen_rewards=chosen_rewards.float(),
        rejected_rewards=rejected_rewards.float(),
        nll_loss=nll,
        chosen_logits_mean=row_means[:num_pairs].mean(),
        rejected_logits_mean=row_means[num_pairs:].mean(),
    )
