"""FusedCPOConfig(CPOConfig): TRL's CPO config plus the fused-loss knobs, each a field with help text, checked at
construction as TRL checks its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl.experimental.cpo import CPOConfig

from .activations import check_policy
from .ops.schedule import (
    DEFAULT_CHUNK_BYTES_FROZEN,
    DEFAULT_CHUNK_BYTES_NO_GRAD,
    DEFAULT_CHUNK_BYTES_TRAINABLE,
    DEFAULT_SLAB_BYTES,
    MEMORY_MODES,
    check_budget,
)
from .packing import BATCH_LAYOUTS, PADDED

BACKENDS = ("auto", "triton", "torch")


def _mib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n >> 20} MiB"


@dataclass
class FusedCPOConfig(CPOConfig):
    r"""``CPOConfig`` plus the knobs of the fused loss. A plain ``CPOConfig`` works too: these are its defaults.

    Every field is also a recipe key and a ``--flag`` of the launcher (``trl-fused-cpo --help`` prints each with its
    help text); values are checked when the config is built, each refusal naming the field and the fix.

    Parameters:
        use_fused_loss (`bool`, *optional*, defaults to `True`):
            Compute the CPO loss with the fused linear-CPO op, from the final hidden states and the `lm_head`
            weight, without the `[2B, T, V]` logits. `False` runs TRL's stock loss (for A/B runs); it needs
            `batch_layout="padded"`.
        fused_backend (`str`, *optional*, defaults to `"auto"`):
            Which implementation of the op runs: `"triton"` (the CUDA kernels), `"torch"` (chunked torch ops, any
            device; the spec of the kernels) or `"auto"` (triton on CUDA, torch elsewhere and for float64).
        fused_chunk_bytes (`int` or `None`, *optional*, defaults to `None`):
            Bytes of the one `[tokens, vocab]` logits buffer alive at a time. `None` picks the op's default for the
            call: 1.5 GiB with a trainable head, 384 MiB with a frozen one, 1 GiB in eval. Lower means less memory,
            far lower slower GEMMs. Under `fused_memory="lean"` (unless the head is frozen) it is the bytes of one
            vocabulary slab's logits instead, `None` meaning 256 MiB.
        fused_memory (`str`, *optional*, defaults to `"fast"`):
            `"fast"`: three products per token, and an fp32 weight-gradient accumulator once a batch needs several
            chunks (2 GiB at Llama-3 8B's head). `"lean"`: vocabulary slabs, the logits computed twice and no
            accumulator, about 4/3 of the products. A frozen head always runs `"fast"`.
        batch_layout (`str`, *optional*, defaults to `"padded"`):
            How a micro-batch reaches the backbone: `"padded"` (TRL's: chosen and rejected padded to one length,
            every prompt twice), `"padding_free"` (every sequence once, packed in one row) or `"prefix_shared"` (each
            pair once as `[prompt | chosen | rejected]`, rejected never attending to chosen). The same losses,
            log-probs, rewards and gradients in all three; a packed layout's `logits/chosen` and `logits/rejected`
            average only the positions the sequences have. Packed layouts need `attn_implementation`
            `"flex_attention"` or `"fused_cpo_varlen"` (GPU) or `"sdpa"` / `"eager"` (a dense mask: CPU and tests).
        activation_policy (`str`, *optional*, defaults to `"auto"`):
            Which decoder layers recompute their forward in the backward (the same gradients in every policy):
            `"none"`, `"full"` (TRL's `gradient_checkpointing`, every layer), a number `k` (the first `k` layers),
            `"offload"` (every layer, the saved layer inputs in pinned host memory) or `"auto"` (on CUDA, the fewest
            checkpointed layers whose estimated activations fit the card, else `"offload"`; elsewhere, and whenever
            `gradient_checkpointing` is set explicitly, `gradient_checkpointing` decides). `activations.py` holds
            the policies and the estimate.
        tiled_mlp_tokens (`int` or `None`, *optional*, defaults to `None`):
            Run each decoder MLP over tiles of this many positions when a row is longer, each tile recomputed in the
            backward, so its `[N, intermediate_size]` tensors never exist whole (`tiled_mlp.py`). `None`: off.
    """

    use_fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute the CPO loss with the fused linear-CPO op (False: TRL's stock path, for A/B)."},
    )
    fused_backend: str = field(
        default="auto",
        metadata={
            "help": "Fused-loss backend: 'triton' (CUDA kernels), 'torch' (chunked torch ops, any device) or "
            "'auto' (triton on CUDA, torch elsewhere and for float64).",
            "choices": list(BACKENDS),
        },
    )
    fused_chunk_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Bytes of the one [tokens, vocab] logits buffer alive at a time (default "
            f"{_mib(DEFAULT_CHUNK_BYTES_TRAINABLE)} with a trainable head, {_mib(DEFAULT_CHUNK_BYTES_FROZEN)} frozen, "
            f"{_mib(DEFAULT_CHUNK_BYTES_NO_GRAD)} in eval). Lower = less memory; far lower = slower GEMMs. Under "
            "fused_memory 'lean' with a trainable head: the bytes of one vocabulary slab's logits over all tokens "
            f"(default {_mib(DEFAULT_SLAB_BYTES)})."
        },
    )
    fused_memory: str = field(
        default="fast",
        metadata={
            "help": "'fast' (three products per token; an fp32 weight-gradient accumulator once a batch needs several "
            "chunks: 2 GiB at Llama-3 8B) or 'lean' (vocabulary slabs, logits computed twice, no accumulator: "
            "about 4/3 of the products, for a trainable head). A frozen head always runs 'fast'.",
            "choices": list(MEMORY_MODES),
        },
    )

    batch_layout: str = field(
        default=PADDED,
        metadata={
            "help": "How a micro-batch reaches the backbone: 'padded' (TRL's layout: chosen and rejected padded to "
            "one length, every prompt twice), 'padding_free' (every sequence once, packed in one row, no padding) "
            "or 'prefix_shared' (each pair once: [prompt | chosen | rejected], rejected attending to the prompt "
            "but never to chosen). Same loss, log-probs, rewards and gradients in all three; in a packed layout "
            "logits/chosen and logits/rejected are the mean over the positions the sequences have, where TRL's "
            "padded mean also averages the padding. Packed layouts need attn_implementation 'flex_attention' "
            "or 'fused_cpo_varlen' (GPU; flash varlen over segment tables) or 'sdpa'/'eager' (a dense mask: CPU "
            "and tests).",
            "choices": list(BATCH_LAYOUTS),
        },
    )

    tiled_mlp_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Run each decoder MLP over tiles of this many positions (e.g. 8192) when a row is longer, "
            "recomputing each tile in the backward, so its [N, intermediate_size] tensors never exist whole "
            "(tiled_mlp.py; long pairs). Costs one more MLP forward a step. None = off (the model's own MLP)."
        },
    )
    activation_policy: str = field(
        default="auto",
        metadata={
            "help": "Which decoder layers recompute their forward in the backward (all exact: the same gradients): "
            "'none' (keep every activation), 'full' (every layer, TRL's gradient_checkpointing), a number k (the "
            "first k layers), 'offload' (every layer, the saved layer inputs in pinned host memory) or 'auto' (on "
            "CUDA: none when the estimated activations of the largest micro-batch (the training set's longest "
            "pairs, at most 2 x batch x max_length positions) fit 85 percent of the card after weights and optimizer "
            "state, else the fewest layers that fit, else offload; elsewhere, and "
            "whenever gradient_checkpointing is set explicitly, gradient_checkpointing decides). A named policy or "
            "a number wins over gradient_checkpointing. One logged line says what was chosen and why.",
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's blanket activation checkpointing (unset: True, TRL's default, and activation_policy "
            "'auto' may replace it; set explicitly, 'auto' keeps it).",
            # a bare --gradient_checkpointing means True, as with CPOConfig's bool field (cli.py adds its --no_ form)
            "nargs": "?",
            "const": True,
        },
    )

    def __post_init__(self):
        self.activation_policy = check_policy(self.activation_policy)
        # auto acts only on a default it may replace; the newer transformers name counts as explicit too
        self._gradient_checkpointing_explicit = (
            self.gradient_checkpointing is not None or getattr(self, "activation_checkpointing", None) is not None
        )
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = True
        if not isinstance(self.use_fused_loss, bool):
            raise TypeError(f"use_fused_loss must be true or false; got {self.use_fused_loss!r}.")
        if self.fused_backend not in BACKENDS:
            raise ValueError(f"fused_backend={self.fused_backend!r} is not one of {list(BACKENDS)}.")
        if self.batch_layout not in BATCH_LAYOUTS:
            raise ValueError(f"batch_layout={self.batch_layout!r} is not one of {list(BATCH_LAYOUTS)}.")
        if self.batch_layout != PADDED and not self.use_fused_loss:
            raise ValueError(
                f"batch_layout={self.batch_layout!r} needs use_fused_loss=True: TRL's stock loss reads a padded batch."
            )
        _check_tiled_mlp(self)
        try:
            check_budget(self.fused_chunk_bytes, self.fused_memory)
        except (TypeError, ValueError) as err:  # name the config's fields, not the functional's arguments
            message = str(err).replace("chunk_bytes", "fused_chunk_bytes").replace("memory=", "fused_memory=")
            raise type(err)(message) from None
        _adopt_activation_checkpointing(self)
        super().__post_init__()


def _check_tiled_mlp(args) -> None:
    tokens = args.tiled_mlp_tokens
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"tiled_mlp_tokens must be a positive integer (e.g. 8192) or None (off); got {tokens!r}.")
    if tokens is not None and args.use_liger_kernel:
        raise ValueError(
            "tiled_mlp_tokens with use_liger_kernel: Liger replaces every MLP's forward with its SwiGLU when "
            "training starts, which would drop the tiling silently. Set one of them: tiled_mlp_tokens: null, or "
            "use_liger_kernel: false."
        )


def _adopt_activation_checkpointing(args) -> None:
    """Hand ``gradient_checkpointing*`` to the ``activation_checkpointing*`` names of newer transformers, quietly.

    Newer transformers renamed them and warns on the old names (a FutureWarning on every run: TRL's CPOConfig sets
    ``gradient_checkpointing=True`` by default). The new names do not exist in older 5.x releases, so the recipes and
    the command line keep the old ones, which every supported transformers reads; a warning no user of the supported
    range can act on is noise. A new name set explicitly wins, as in transformers.
    """
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if hasattr(args, new) and getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))


_FUSED_FIELDS = {f.name: f.default for f in fields(FusedCPOConfig) if f.name not in {g.name for g in fields(CPOConfig)}}


def fused_options(args) -> dict:
    """The fused knobs of ``args``, a ``FusedCPOConfig`` or a plain ``CPOConfig`` (then ``FusedCPOConfig``'s
    defaults), as the functional's keywords."""
    value = {name: getattr(args, name, default) for name, default in _FUSED_FIELDS.items()}
    return {
        "use_fused_loss": value["use_fused_loss"],
        "backend": value["fused_backend"],
        "chunk_bytes": value["fused_chunk_bytes"],
        "memory": value["fused_memory"],
        "batch_layout": value["batch_layout"],
    }
