"""The decoder MLP tiled along the sequence: its ``[N, intermediate]`` tensors never exist whole, forward or backward.

A gated MLP ``down(act(gate(x)) * up(x))`` acts on each position alone, so it can run over tiles of ``tile_tokens``
positions. The autograd Function below runs the tiles without autograd in the forward (keeping only the input ``x``,
``[N, H]``) and, in the backward, recomputes one tile at a time and takes its gradients: the live intermediates are
three ``[tile, intermediate]`` tensors instead of three ``[N, intermediate]`` ones (Llama-3-8B at N = 64k:
5.6 GB untiled, 0.7 GB in tiles of 8k). The cost is one more MLP forward a step (a third of the MLP's FLOPs), on
top of what gradient checkpointing already recomputes. ALST's TiledMLP (Arctic Long Sequence Training) does the same.

Exact: the tiled output and every gradient equal the untiled MLP's up to the order of the weight-gradient sums
(tests/test_tiled_mlp.py: fp64 and fp32, LoRA adapters included). The RNG state is replayed in the backward, so a
dropout inside (LoRA's) draws the same masks in the recompute as in the forward.

Applied per module by patching the instance's ``forward`` (as ``distributed.install_fused_forward`` does): the
state dict, the module tree and PEFT's view of it stay the model's own.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from torch import nn

GATED_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # Llama, Mistral, Qwen2/3, Gemma (+ Liger's SwiGLU)


class TiledMLPFunction(torch.autograd.Function):
    """``mlp_forward`` over ``x`` ``[N, H]`` in tiles of ``tile_tokens`` rows; recomputed per tile in the backward.

    ``params``: the tensors ``mlp_forward`` reads that need a gradient (held on ``ctx``: leaves of the model, so
    holding them costs nothing; ``save_for_backward`` keeps ``x`` only).
    """

    @staticmethod
    def forward(ctx, mlp_forward: Callable, tile_tokens: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp_forward, ctx.tile_tokens, ctx.params = mlp_forward, tile_tokens, params
        ctx.rng = _rng_state(x.device)
        ctx.autocast = _autocast_state(x.device)
        ctx.save_for_backward(x)
        return torch.cat([mlp_forward(tile) for tile in x.split(tile_tokens)])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_needs_grad = ctx.needs_input_grad[2]
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[3:], strict=True) if needed]
        grad_x = torch.empty_like(x) if x_needs_grad else None
        # fp32 accumulators for low-precision weights: the untiled GEMM sums every position in fp32, bf16 sums of
        # the tiles' gradients would not (transient: one MLP's trainable weights in fp32 at a time).
        acc = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
        start = 0
        with _replayed_rng(x.device, ctx.rng), torch.enable_grad(), torch.autocast(**ctx.autocast):
            for x_tile, g_tile in zip(x.split(ctx.tile_tokens), grad_out.split(ctx.tile_tokens), strict=True):
                x_tile = x_tile.detach().requires_grad_(x_needs_grad)
                out = ctx.mlp_forward(x_tile)
                grads = torch.autograd.grad(out, ([x_tile] if x_needs_grad else []) + params, g_tile, allow_unused=True)
                if x_needs_grad:
                    grad_x[start : start + len(x_tile)] = grads[0]
                for a, g in zip(acc, grads[int(x_needs_grad) :], strict=True):
                    if g is not None:  # a parameter this tile did not reach
                        a.add_(g)
                start += len(x_tile)
        param_grads = iter(a.to(p.dtype) for a, p in zip(acc, params, strict=True))
        # None: mlp_forward and tile_tokens take no gradient, nor the parameters that need none
        return None, None, grad_x, *(next(param_grads) if needed else None for needed in ctx.needs_input_grad[3:])


def _autocast_state(device: torch.device) -> dict:
    """The forward's autocast, replayed in the backward's recompute (autograd runs the backward outside it)."""
    kind = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
    return {
        "device_type": kind,
        "enabled": torch.is_autocast_enabled(kind),
        "dtype": torch.get_autocast_dtype(kind),
    }


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _replayed_rng:
    """The forward's RNG state during the recompute, the caller's restored after (as torch.utils.checkpoint does):
    a dropout in the MLP (LoRA's) then draws in the recompute the masks it drew in the forward."""

    def __init__(self, device: torch.device, state: tuple):
        self.device, self.state = device, state

    def __enter__(self):
        self.saved = _rng_state(self.device)
        _set_rng_state(self.device, self.state)

    def __exit__(self, *exc):
        _set_rng_state(self.device, self.saved)


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def tiled_mlp(mlp_forward: Callable, x: torch.Tensor, params: Sequence[torch.Tensor], *, tile_tokens: int):
    """``mlp_forward(x)`` over ``x`` ``[..., H]`` in tiles of ``tile_tokens`` positions (all leading dims flattened).

    Args:
        mlp_forward: the position-wise function, ``[n, H] -> [n, H_out]``.
        x: the input, ``[..., H]``.
        params: every tensor ``mlp_forward`` reads that needs a gradient (the MLP's trainable parameters).
        tile_tokens: positions per tile; ``x`` with no more positions runs untiled (no recompute).
    """
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= tile_tokens:
        return mlp_forward(x)
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        with torch.no_grad():
            out = torch.cat([mlp_forward(tile) for tile in flat.split(tile_tokens)])
    else:
        out = TiledMLPFunction.apply(mlp_forward, tile_tokens, flat, *[p for p in params if p.requires_grad])
    return out.view(*x.shape[:-1], out.shape[-1])


def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The patched ``mlp.forward``: the class's own forward, over tiles of ``self._tiled_mlp_tokens`` positions."""
    original = types.MethodType(type(self).forward, self)
    params = [p for p in self.parameters() if p.requires_grad]
    return tiled_mlp(original, x, params, tile_tokens=self._tiled_mlp_tokens)


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a position-wise gated MLP this file can tile (gate/up/down projections, no router)."""
    has_projections = all(isinstance(getattr(module, n, None), nn.Module) for n in GATED_MLP_PROJECTIONS)
    routed = any(hasattr(module, n) for n in ("experts", "router", "gate"))
    return has_projections and not routed


def apply_tiled_mlp(model: nn.Module, tile_tokens: int | None) -> int:
    """Tile every decoder MLP of ``model`` (``*.mlp`` modules that :func:`is_gated_mlp`); ``None`` undoes it.

    Args:
        model: a causal LM, bare or inside PEFT (the LoRA layers inside the projections are tiled with them).
        tile_tokens: positions per tile (e.g. 8192), or None to restore the plain forward.

    Returns:
        How many MLPs are now tiled (0 after ``None``).

    Raises:
        ValueError: a bad ``tile_tokens``; or no MLP recognised (a mixture of experts, an unknown MLP), which would
            otherwise leave the memory it was asked to save.
    """
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int)):
        raise TypeError(f"tiled_mlp_tokens must be a positive integer or None; got {tile_tokens!r}.")
    if tile_tokens is not None and tile_tokens < 1:
        raise ValueError(f"tiled_mlp_tokens={tile_tokens} must be a positive integer (e.g. 8192) or None (off).")
    mlps = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp" and is_gated_mlp(m)]
    if tile_tokens is None:
        for m in mlps:
            if "_tiled_mlp_tokens" in m.__dict__:
                del m.forward, m._tiled_mlp_tokens
        return 0
    if not mlps:
        names = sorted({type(m).__name__ for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"})
        raise ValueError(
            f"tiled_mlp_tokens={tile_tokens}: {type(model).__name__} has no decoder MLP with "
            f"{'/'.join(GATED_MLP_PROJECTIONS)} projections and no router (its mlp modules: {names or 'none'}), "
            "so nothing would be tiled. Set tiled_mlp_tokens: null for this model."
        )
    for m in mlps:
        m._tiled_mlp_tokens = tile_tokens
        m.forward = types.MethodType(forward, m)
    return len(mlps)
