"""Triton row passes, the same interface as ``rows_torch``: one kernel file each."""

from .logsumexp_kernel import logsumexp_target
from .softmax_grad_kernel import softmax_grad_

__all__ = ["logsumexp_target", "softmax_grad_"]
