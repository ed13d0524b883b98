"""FusedCPOConfig refuses a bad knob when it is built, as TRL's configs do, not at the first forward."""

from __future__ import annotations

import warnings

import pytest
from transformers import TrainingArguments

from trl_fused_cpo import FusedCPOConfig
from trl_fused_cpo.config import fused_options

# Newer transformers renamed gradient_checkpointing* to activation_checkpointing*; older 5.x releases have only the old.
needs_activation_checkpointing = pytest.mark.skipif(
    "activation_checkpointing" not in TrainingArguments.__dataclass_fields__,
    reason="this transformers has no activation_checkpointing: gradient_checkpointing is the only name",
)


def _config(**knobs) -> FusedCPOConfig:
    return FusedCPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to=[], **knobs)


@pytest.mark.parametrize(
    "knobs, error, match",
    [
        (dict(fused_chunk_bytes=0), ValueError, "fused_chunk_bytes must be positive"),
        (dict(fused_chunk_bytes=-(1 << 20)), ValueError, "fused_chunk_bytes must be positive"),
        (dict(fused_chunk_bytes=1.5e9), TypeError, "fused_chunk_bytes must be an int"),
        (dict(fused_chunk_bytes=True), TypeError, "fused_chunk_bytes must be an int"),
        (dict(fused_memory="tiny"), ValueError, "fused_memory='tiny'"),
        (dict(fused_backend="cuda"), ValueError, "fused_backend='cuda'"),
        (dict(use_fused_loss="yes"), TypeError, "use_fused_loss"),
        (dict(batch_layout="packed"), ValueError, "batch_layout='packed'"),
        (dict(batch_layout="prefix_shared", use_fused_loss=False), ValueError, "needs use_fused_loss"),
    ],
)
def test_bad_knobs_fail_at_construction(knobs, error, match):
    with pytest.raises(error, match=match):
        _config(**knobs)


def test_defaults_live_in_one_place_and_a_plain_cpo_config_gets_them():
    from trl.experimental.cpo import CPOConfig

    plain = CPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to=[])
    assert fused_options(plain) == fused_options(_config())
    assert fused_options(_config(fused_chunk_bytes=1 << 28, fused_memory="lean")) == {
        "use_fused_loss": True,
        "backend": "auto",
        "chunk_bytes": 1 << 28,
        "memory": "lean",
        "batch_layout": "padded",
    }


@needs_activation_checkpointing
@pytest.mark.parametrize("value", [True, False])
def test_gradient_checkpointing_reaches_the_renamed_field_without_a_warning(tmp_path, value):
    """Newer transformers renamed gradient_checkpointing (a FutureWarning on the old name, which TRL sets by default
    and older 5.x releases still need): the value must arrive under the new name, and nothing is printed."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}} if value else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = FusedCPOConfig(
            output_dir=str(tmp_path), gradient_checkpointing=value, report_to=[], use_cpu=True, bf16=False, **kwargs
        )
    assert args.activation_checkpointing is value and args.gradient_checkpointing is value
    if value:
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}


@needs_activation_checkpointing
def test_an_explicit_activation_checkpointing_wins(tmp_path):
    args = FusedCPOConfig(
        output_dir=str(tmp_path), gradient_checkpointing=True, activation_checkpointing=False, use_cpu=True, bf16=False
    )
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False
