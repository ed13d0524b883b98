"""trl_fused_cpo: TRL's CPOTrainer with a fused linear-CPO loss that never builds the [2B, T, V] logits."""

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPOTrainer lives in trl.experimental since trl 0.29

from .loss import CPOLossOutput, fused_linear_cpo_loss, fused_linear_cpo_loss_packed  # noqa: E402

__all__ = [
    "CPOLossOutput",
    "FusedCPOConfig",
    "FusedCPOTrainer",
    "fused_linear_cpo_loss",
    "fused_linear_cpo_loss_packed",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The trainer pulls in trl and transformers; keep `import trl_fused_cpo` light for users of the loss alone.
    if name == "FusedCPOTrainer":
        from .trainer import FusedCPOTrainer

        return FusedCPOTrainer
    if name == "FusedCPOConfig":
        from .config import FusedCPOConfig

        return FusedCPOConfig
    raise AttributeError(f"module 'trl_fused_cpo' has no attribute {name!r}")
