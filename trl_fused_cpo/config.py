"""FusedCPOConfig(CPOConfig): TRL's CPO config plus the fused-loss knobs, each a field with help text."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.cpo import CPOConfig


@dataclass
class FusedCPOConfig(CPOConfig):
    """``CPOConfig`` plus the knobs of the fused loss. A plain ``CPOConfig`` works too: these are its defaults."""

    use_fused_loss: bool = field(
        default=True,
        metadata={"help": "Compute the CPO loss with the fused linear-CPO op (False: TRL's stock path, for A/B)."},
    )
    fused_backend: str = field(
        default="auto",
        metadata={
            "help": "Fused-loss backend: 'triton' (CUDA kernels), 'torch' (chunked torch ops, any device) or "
            "'auto' (triton on CUDA, torch elsewhere).",
            "choices": ["auto", "triton", "torch"],
        },
    )
    fused_chunk_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Bytes of the one [tokens, vocab] logits buffer alive at a time (default 1.5 GiB with a "
            "trainable head, 384 MiB frozen, 1 GiB in eval). Lower = less memory; far lower = slower GEMMs."
        },
    )
    fused_memory: str = field(
        default="fast",
        metadata={
            "help": "'fast' (three products per token; an fp32 weight-gradient accumulator once a batch needs several "
            "chunks: 2 GiB at Llama-3 8B) or 'lean' (vocabulary slabs, logits computed twice, no accumulator: "
            "about 4/3 of the products, for a trainable head). A frozen head always runs 'fast'.",
            "choices": ["fast", "lean"],
        },
    )


def fused_options(args) -> dict:
    """The fused knobs of ``args``, a ``FusedCPOConfig`` or a plain ``CPOConfig`` (then the defaults)."""
    return {
        "use_fused_loss": getattr(args, "use_fused_loss", True),
        "backend": getattr(args, "fused_backend", "auto"),
        "chunk_bytes": getattr(args, "fused_chunk_bytes", None),
        "memory": getattr(args, "fused_memory", "fast"),
    }
