"""The Triton backend: the same interface as ``ops/torch_backend.py`` (``ops/backend.py``), one file per kernel, each
a private ``_*_kernel`` and the public launcher that owns its checks. ``backward_scale`` serves ``ops/grad_scale.py``.
"""

from .frozen_grad import frozen_dx_, shifted_exp_
from .logsumexp import logsumexp_target, token_logps_
from .plan import compact_labels, label_counts
from .sequence import finish_, pair_tail_
from .softmax_grad import softmax_grad_

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
