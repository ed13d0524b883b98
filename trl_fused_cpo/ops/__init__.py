"""The fused linear-CPO op, top to bottom: ``function`` (the autograd Function and its options) → ``schedule``
(``chunks`` | ``slabs``, the budgets) → ``plan`` (the labelled tokens in pair order), ``sequence`` (per-sequence
math), ``gemm``, ``grad_scale`` → ``backend`` (``torch_backend``, the spec, or ``kernels``, Triton) → ``cpo_math``
(the CPO losses and the output type). ``reference`` is the materialised-logits spec every path is tested against."""
