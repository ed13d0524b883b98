"""The fused linear-CPO op: reference (spec), token plan, row passes (torch, Triton), autograd Function, dispatch."""
