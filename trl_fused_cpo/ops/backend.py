"""The two backends of the fused op, one interface: ``torch_backend`` (the spec, any device) and ``kernels`` (Triton).

A backend is a module exporting ``BACKEND_FUNCTIONS``, with the torch backend's signatures
(``tests/test_architecture.py`` checks both): a new backend is one more module and one more branch of
``backend_module``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Literal

import torch

from . import torch_backend

Backend = Literal["auto", "torch", "triton"]

BACKEND_FUNCTIONS = (
    # row passes over one [C, V] logits chunk
    "logsumexp_target",
    "token_logps_",
    "softmax_grad_",
    "shifted_exp_",
    "frozen_dx_",
    # the token plan's label ops
    "label_counts",
    "compact_labels",
    # the per-sequence tail
    "pair_tail_",
    "finish_",
)


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


def backend_module(name: str) -> ModuleType:
    """The module of a resolved backend: ``torch_backend`` or ``kernels`` (imported on first use: it needs triton)."""
    if name == "torch":
        return torch_backend
    from . import kernels

    return kernels
