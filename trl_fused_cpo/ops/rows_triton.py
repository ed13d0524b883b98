"""Triton row passes and plan kernels, the same interface as ``rows_torch``: one kernel file per concern."""

from .logsumexp_kernel import logsumexp_target
from .plan_kernels import compact_labels, label_counts
from .softmax_grad_kernel import softmax_grad_

__all__ = ["compact_labels", "label_counts", "logsumexp_target", "softmax_grad_"]
