"""Triton row passes, plan kernels and the per-sequence tail, the same interface as ``rows_torch``: one kernel file
per concern."""

from .frozen_grad_kernels import frozen_dx_, shifted_exp_
from .logsumexp_kernel import logsumexp_target, token_logps_
from .plan_kernels import compact_labels, label_counts
from .sequence_kernels import finish_, pair_tail_
from .softmax_grad_kernel import softmax_grad_

__all__ = [
    "compact_labels",
    "finish_",
    "frozen_dx_",
    "label_counts",
    "logsumexp_target",
    "pair_tail_",
    "shifted_exp_",
    "softmax_grad_",
    "token_logps_",
]
