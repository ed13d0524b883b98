"""The public functional: ``fused_linear_cpo_loss(hidden, weight, labels, ...)`` → ``CPOLossOutput``.

It checks the inputs, normalises the hyperparameters as TRL does, applies the caller's autocast as ``lm_head``
would, and hands over to the fused op (``ops/function.py``). The CPO math itself is ``ops/cpo_math.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Literal

import torch

from .ops.cpo_math import CPOHyperparams, CPOLossOutput, LossType
from .ops.function import Backend, linear_cpo
from .ops.grad_scale import GradScaleGuess
from .ops.rows import PackedRows, PaddedRows

__all__ = ["CPOLossOutput", "fused_linear_cpo_loss", "fused_linear_cpo_loss_packed"]


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None, *, rows_even=True
):
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [2B, T, H]; got shape {tuple(hidden.shape)}.")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[2]}; got shape {tuple(weight.shape)}."
        )
    if labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"labels must be [2B, T] = {tuple(hidden.shape[:2])} (the shape of hidden without H); "
            f"got shape {tuple(labels.shape)}."
        )
    if rows_even and (hidden.shape[0] % 2 != 0 or hidden.shape[0] == 0):
        raise ValueError(
            f"hidden has {hidden.shape[0]} rows; expected an even, non-zero number: B chosen rows then B rejected."
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 (or int32); got {labels.dtype}.")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point; got {hidden.dtype} and {weight.dtype}.")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype.")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be [V] = [{weight.shape[0]}] of dtype {weight.dtype}; "
            f"got shape {tuple(bias.shape)}, dtype {bias.dtype}."
        )
    tensors = {"hidden": hidden, "weight": weight, "labels": labels} | ({"bias": bias} if bias is not None else {})
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device; got {devices}.")


def _autocast_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The inputs as autocast would give them to ``lm_head``: floating tensors but float64 in the autocast dtype.

    Llama's final norm returns float32 under autocast and a mixed-precision head weight is float32: without the
    cast the op met mixed dtypes (``index_copy_(): ... Float and BFloat16``)."""
    device_type = hidden.device.type
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or not t.is_floating_point() or t.dtype == torch.float64 else t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def _autocast_off(device_type: str):
    """Autocast off inside the op (its GEMMs choose their own dtypes); a no-op where autocast does not exist."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def fused_linear_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
    memory: Literal["fast", "lean"] = "fast",
    grad_scale_guess: GradScaleGuess | None = None,
) -> CPOLossOutput:
    """CPO loss straight from the final hidden states and the ``lm_head`` weight; the logits never exist whole.

    Args:
        hidden: ``[2B, T, H]`` final hidden states, the B chosen rows first; ``hidden[:, t]`` predicts
            ``labels[:, t]``.
        weight: ``[V, H]`` lm_head weight (same dtype as ``hidden``).
        labels: ``[2B, T]`` int64 targets, already shifted; ``ignore_index`` marks positions without a label.
        bias: optional ``[V]`` lm_head bias.
        beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha: as in TRL's ``CPOConfig``.
        ignore_index: label value of unlabelled positions.
        backend: ``"triton"`` (fused kernels, CUDA), ``"torch"`` (chunked torch ops, any device) or ``"auto"``.
        chunk_bytes: budget for the one ``[tokens, V]`` logits buffer that exists at a time (default: 1.5 GiB
            with a trainable weight, 1 GiB under ``torch.no_grad()``, 384 MiB with a frozen one). Smaller saves
            memory; much smaller costs speed. A pair longer than the budget has its logits computed twice. With
            ``memory="lean"``: the logits of one vocabulary slab over all tokens (default 256 MiB).
        memory: ``"fast"`` (three products per token; past one chunk, an fp32 accumulator for the weight
            gradient: 2 GiB at Llama-3 8B) or ``"lean"`` (vocabulary slabs, the logits computed twice, no
            accumulator: about 4/3 of the products for less memory with a trainable head; a frozen head always
            runs ``"fast"``, which needs no accumulator).
        grad_scale_guess: an ``ops.grad_scale.GradScaleGuess`` the caller keeps across calls (the trainer does):
            it remembers the incoming gradient (``1/gradient_accumulation_steps``, a loss scale) to save the
            backward a pass over the weight gradient. It cannot change a result; None costs that pass whenever the
            incoming gradient is not 1.

    Under the caller's ``torch.autocast`` the op computes as ``lm_head(hidden)`` would: hidden, weight and bias are
    cast (differentiably) to the autocast dtype, and the op runs with autocast off.

    Returns:
        A :class:`CPOLossOutput`. Gradients of ``loss`` reach ``hidden``, ``weight`` and ``bias`` where they
        require grad; a frozen weight's gradient is never computed.
    """
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    _check_inputs(hidden, weight, labels, bias)
    hp = _hyperparams(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha)
    with _autocast_off(hidden.device.type):
        rows = PaddedRows(labels, ignore_index)
        return linear_cpo(
            hidden, weight, rows, bias, hp, backend=backend, chunk_bytes=chunk_bytes, memory=memory,
            grad_guess=grad_scale_guess,
        )  # fmt: skip


def fused_linear_cpo_loss_packed(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    sequence: torch.Tensor,
    *,
    row_lengths: torch.Tensor,
    shared_pair: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_bytes: int | None = None,
    memory: Literal["fast", "lean"] = "fast",
    grad_scale_guess: GradScaleGuess | None = None,
) -> CPOLossOutput:
    """``fused_linear_cpo_loss`` on a packed batch (``trl_fused_cpo.packing``): no padding, and with
    ``prefix_shared`` each pair's prompt once. The same loss, log-probs, rewards and NLL as the padded call on the
    same pairs; ``chosen_logits_mean``/``rejected_logits_mean`` are over the positions each half's sequences have
    (a padded batch also averages its padding).

    Args:
        hidden: ``[N, H]`` (or ``[1, N, H]``) final hidden states of the packed row.
        weight, bias: the lm_head's, as in ``fused_linear_cpo_loss``.
        labels: ``[N]`` int64, already shifted: the token position ``t`` predicts in its own sequence, or
            ``ignore_index``.
        sequence: ``[N]`` int64, the row whose sequence position ``t``'s label scores, in TRL's order: ``i`` for
            the chosen completion of pair ``i``, ``B + i`` for its rejected one; ``-1`` where there is none.
        row_lengths: ``[2B]`` int64, the positions of each of those sequences (its prompt included).
        shared_pair: ``[N]`` int64, the pair whose prompt position ``t`` is when both sequences of a pair share it
            (``prefix_shared``); ``-1`` elsewhere. None: nothing is shared (``padding_free``).
        beta, ..., grad_scale_guess: as in ``fused_linear_cpo_loss``.
    """
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    x = hidden.reshape(-1, hidden.shape[-1])
    shared_pair = torch.full_like(sequence, -1) if shared_pair is None else shared_pair
    _check_packed_inputs(x, weight, labels, sequence, row_lengths, shared_pair, bias)
    hp = _hyperparams(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha)
    with _autocast_off(hidden.device.type):
        rows = PackedRows.create(labels, sequence, shared_pair, row_lengths.to(labels.device), ignore_index)
        return linear_cpo(
            hidden, weight, rows, bias, hp, backend=backend, chunk_bytes=chunk_bytes, memory=memory,
            grad_guess=grad_scale_guess,
        )  # fmt: skip


def _hyperparams(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha) -> CPOHyperparams:
    hp = CPOHyperparams.create(
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        cpo_alpha=cpo_alpha,
        simpo_gamma=simpo_gamma,
        alpha=alpha,
    )
    if hp.loss_type in ("hinge", "ipo") and hp.label_smoothing > 0:
        warnings.warn(f"label_smoothing is ignored by loss_type={hp.loss_type!r} (as in TRL).", stacklevel=3)
    return hp


def _check_packed_inputs(x, weight, labels, sequence, row_lengths, shared_pair, bias) -> None:
    n = x.shape[0]
    for name, t in (("labels", labels), ("sequence", sequence), ("shared_pair", shared_pair)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [N] = [{n}] (one entry per packed position); got {tuple(t.shape)}.")
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64; got {t.dtype}.")
    if row_lengths.dim() != 1 or row_lengths.numel() % 2 or row_lengths.numel() == 0:
        raise ValueError(f"row_lengths must be [2B] (chosen rows then rejected); got {tuple(row_lengths.shape)}.")
    _check_inputs(x[None], weight, labels[None], bias, rows_even=False)
