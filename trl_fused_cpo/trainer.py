"""FusedCPOTrainer(CPOTrainer): the same trainer, config, data and metric keys; the loss never builds the logits.

The one seam overridden is ``get_batch_loss_metrics`` (train via ``compute_loss``, eval via ``prediction_step``):
it calls the wrapped model with ``fused_cpo_labels`` so the backbone and the fused head run inside the wrapper's
forward (distributed.py), then logs TRL's metrics from the ``CPOLossOutput``. Anything the fused path cannot do
exactly is refused in ``__init__``, or falls back to ``super()`` with one logged line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from trl.experimental.cpo import CPOTrainer

from .activations import decoder_layers, install_plan, plan_for_training, plan_line
from .attention import FLEX_BLOCK_SIZE, packed_model_inputs
from .collator import PACKED_KEY, PackingCollator
from .config import fused_options
from .context_length import max_length_refusal
from .distributed import install_fused_forward
from .loss import CPOLossOutput, fused_linear_cpo_loss, fused_linear_cpo_loss_packed
from .ops.grad_scale import GradScaleGuess
from .packing import PADDED, PackedBatch
from .support import check_model_runs_exactly, packing_unsupported_reason, unsupported_reason, unwrap_causal_lm
from .tiled_mlp import apply_tiled_mlp
from .varlen_attention import TABLES_KWARG

logger = logging.getLogger(__name__)


@dataclass
class FusedHead:
    """The fused head's loss: ``fused_linear_cpo_loss`` with the trainer's settings, on the head's weight and bias.

    Kept on the model (``distributed.install_fused_forward``), whose patched forward calls it through the head
    (``distributed.call_through_head``, also the one torch.compile graph break), so it holds settings only, never
    the trainer: the trainer and its optimizer are freed with it, and the model deep-copies and pickles as a plain
    one. Its ``GradScaleGuess`` remembers this trainer's incoming gradient (``1 / gradient_accumulation_steps``, a
    loss scale) to save a pass over dW; it cannot change a result (``ops/grad_scale.py``).
    """

    loss_kwargs: dict
    grad_scale_guess: GradScaleGuess = field(default_factory=GradScaleGuess)

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor | PackedBatch
    ) -> CPOLossOutput:
        """``labels``: ``[2B, T]`` shifted labels of TRL's padded batch, or the ``PackedBatch`` of a packed one."""
        if isinstance(labels, PackedBatch):
            return fused_linear_cpo_loss_packed(
                hidden[0], weight, **labels.loss_arguments(), bias=bias, grad_scale_guess=self.grad_scale_guess,
                **self.loss_kwargs,
            )  # fmt: skip
        return fused_linear_cpo_loss(
            hidden, weight, labels, bias=bias, grad_scale_guess=self.grad_scale_guess, **self.loss_kwargs
        )


class FusedCPOTrainer(CPOTrainer):
    """Drop-in ``CPOTrainer`` whose loss is ``fused_linear_cpo_loss`` (takes a ``CPOConfig`` or ``FusedCPOConfig``)."""

    _tag_names = ["trl", "cpo", "trl-fused-cpo"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refusal = max_length_refusal(self.model, self.max_length)
        if refusal is not None:
            raise ValueError(refusal)
        tiled_mlp_tokens = getattr(self.args, "tiled_mlp_tokens", None)  # a plain CPOConfig has none
        if tiled_mlp_tokens is not None:  # the backbone's memory, under either loss: before the fallbacks
            apply_tiled_mlp(self.model, tiled_mlp_tokens)
        self._apply_activation_policy()
        options = fused_options(self.args)
        self.use_fused_loss = options["use_fused_loss"]
        self.batch_layout = options["batch_layout"]
        self._fused_head = FusedHead(
            dict(
                beta=self.beta,
                loss_type=self.loss_type,
                label_smoothing=self.label_smoothing,
                cpo_alpha=self.cpo_alpha,
                simpo_gamma=getattr(self, "simpo_gamma", 0.5),
                alpha=self.alpha,
                backend=options["backend"],
                chunk_bytes=options["chunk_bytes"],
                memory=options["memory"],
            )
        )
        if not self.use_fused_loss:
            self._refuse_packing_without_the_fused_loss("use_fused_loss=False")
            logger.info("FusedCPOTrainer: use_fused_loss=False, running TRL's stock CPO loss.")
            return
        if self.is_encoder_decoder or self.aux_loss_enabled:
            why = "an encoder-decoder model" if self.is_encoder_decoder else "router aux loss (MoE)"
            self._refuse_packing_without_the_fused_loss(why)
            logger.warning(f"FusedCPOTrainer: {why} is not fused; falling back to TRL's stock CPO loss.")
            self.use_fused_loss = False
            return
        reason = unsupported_reason(self.model) or packing_unsupported_reason(
            self.model, self.batch_layout, max_length=self.max_length, max_row_tokens=self._max_row_tokens()
        )
        if reason is not None:
            raise ValueError(reason)
        # Before any weight changes: the fused head and the packed row proven on the model's own forward.
        check_model_runs_exactly(
            self.model, self.batch_layout, pad_token_id=self.pad_token_id, implementation=self._attn_implementation()
        )
        self._ensure_fused_forward(self.model)
        if self.batch_layout != PADDED:
            self._packing = PackingCollator(
                self.data_collator, self.batch_layout, self.pad_token_id, self._attn_implementation()
            )
            self.data_collator = self._packing
        if self.args.use_liger_kernel:
            self._liger_backbone_only()

    def _apply_activation_policy(self) -> None:
        """``activation_policy`` (activations.py): which decoder layers recompute, decided once with the model on its
        device and before the optimizer state exists; ``Trainer.train`` then finds gradient_checkpointing off unless
        the plan leaves it to transformers."""
        sharded = bool(getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False))
        self.activation_plan = plan_for_training(
            self.model, self.args, max_length=self.max_length, sharded=sharded, dataset=self.train_dataset
        )
        install_plan(self.model, self.args, self.activation_plan)
        logger.info(plan_line(self.activation_plan, len(decoder_layers(self.model))))

    def _refuse_packing_without_the_fused_loss(self, why: str) -> None:
        if self.batch_layout != PADDED:
            raise ValueError(
                f"batch_layout={self.batch_layout!r} needs the fused loss, which {why} turns off: TRL's stock loss "
                "reads a padded batch. Set batch_layout: padded."
            )

    def _max_row_tokens(self) -> int | None:
        """The longest packed row: every pair of the larger micro-batch at ``max_length`` twice, plus flex's tail."""
        if self.batch_layout == PADDED or self.max_length is None:
            return None
        pairs = max(self.args.per_device_train_batch_size, self.args.per_device_eval_batch_size)
        tail = FLEX_BLOCK_SIZE - 1 if self._attn_implementation() == "flex_attention" else 0
        return pairs * 2 * self.max_length + tail

    def _unwrapped_lm(self, model: nn.Module) -> nn.Module:
        """The ``*ForCausalLM`` inside ``model``'s wrappers. ``keep_torch_compile=False``: patching torch.compile's
        wrapper ran the backbone uncompiled, and its forward then called the compiled model, which called it again
        (RecursionError on any call without labels)."""
        return unwrap_causal_lm(self.accelerator.unwrap_model(model, keep_torch_compile=False))

    def _attn_implementation(self) -> str:
        return getattr(self._unwrapped_lm(self.model).config, "_attn_implementation", None) or "eager"

    def _liger_backbone_only(self) -> None:
        """``use_liger_kernel``: Liger's backbone kernels (RMSNorm, SwiGLU, RoPE) under the fused CPO head.

        ``Trainer.train`` applies Liger after ``__init__``; its default ``fused_linear_cross_entropy`` replaces the
        model's forward with Liger's own (an SFT loss that CPO never reaches: it passes no labels) and so drops the
        fused forward, which the next batch reinstalls above Accelerate's autocast wrapper: bf16 mixed precision
        then ran the backbone in fp32. Off, Liger patches the modules only and the fused forward stays in place.
        """
        config = dict(self.args.liger_kernel_config or {})
        if config.get("fused_linear_cross_entropy"):
            logger.warning(
                "FusedCPOTrainer: Liger's fused_linear_cross_entropy is turned off; the fused CPO head is the loss."
            )
        self.args.liger_kernel_config = {**config, "fused_linear_cross_entropy": False}
        logger.info(
            "FusedCPOTrainer: use_liger_kernel: Liger's backbone kernels (RMSNorm, SwiGLU, RoPE where the model has "
            f"them; liger_kernel_config={self.args.liger_kernel_config}) with the fused CPO head for the loss."
        )

    def _ensure_fused_forward(self, model: nn.Module) -> None:
        """Patch the causal LM's forward: at ``__init__``, and per batch on the model the batch runs on (``model_init``
        or a hyperparameter search may have rebuilt it; an unpickled model comes back unpatched). Cheap once done."""
        install_fused_forward(self._unwrapped_lm(model), self._fused_head)

    def get_batch_loss_metrics(
        self, model, batch: dict[str, list | torch.LongTensor], train_eval: Literal["train", "eval"] = "train"
    ):
        """TRL's loss and metrics (same keys and definitions) from the fused op."""
        if not self.use_fused_loss:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        self._ensure_fused_forward(model)
        out = self._packed_forward(model, batch) if self.batch_layout != PADDED else self._padded_forward(model, batch)
        gather = self.accelerator.gather_for_metrics
        accuracies = (out.chosen_rewards > out.rejected_rewards).float()
        prefix = "eval_" if train_eval == "eval" else ""
        metrics = {
            f"{prefix}rewards/chosen": gather(out.chosen_rewards).mean().item(),
            f"{prefix}rewards/rejected": gather(out.rejected_rewards).mean().item(),
            f"{prefix}rewards/accuracies": gather(accuracies).mean().item(),
            f"{prefix}rewards/margins": gather(out.chosen_rewards - out.rejected_rewards).mean().item(),
            f"{prefix}logps/rejected": gather(out.rejected_logps).mean().item(),
            f"{prefix}logps/chosen": gather(out.chosen_logps).mean().item(),
            f"{prefix}logits/rejected": gather(out.rejected_logits_mean).mean().item(),
            f"{prefix}logits/chosen": gather(out.chosen_logits_mean).mean().item(),
            f"{prefix}nll_loss": gather(out.nll_loss).mean().item(),
        }
        return out.loss, metrics

    def _padded_forward(self, model, batch) -> CPOLossOutput:
        """TRL's layout: ``[chosen; rejected]`` padded to one length, the fused head on its ``[2B, T]`` positions."""
        concatenated = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self.pad_token_id, device=self.accelerator.device
        )
        labels = concatenated["concatenated_labels"]
        # Position t predicts token t+1 (TRL shifts logits[:, :-1] against labels[:, 1:]); the last position keeps
        # no label but still counts in TRL's logits/* means, so hidden stays [2B, T] and the labels get a pad.
        shifted_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        return model(
            concatenated["concatenated_input_ids"],
            attention_mask=concatenated["concatenated_attention_mask"],
            use_cache=False,
            fused_cpo_labels=shifted_labels,
        )

    def _packed_forward(self, model, batch) -> CPOLossOutput:
        """A packed layout (``packing.py``): one row, no padding (and each prompt once with ``prefix_shared``), the
        attention kept inside each pair (and rejected off chosen) by the mask ``attention.py`` builds."""
        packed = batch.get(PACKED_KEY)
        if packed is None:  # a batch that did not come through the trainer's collator: pack it as that would
            packed = self._packing.pack(batch)
        packed = packed.to(self.accelerator.device)
        embeddings = self._unwrapped_lm(model).get_input_embeddings()
        inputs = packed_model_inputs(
            packed, dtype=embeddings.weight.dtype, implementation=self._attn_implementation(),
            tables=batch.get(TABLES_KWARG),
        )  # fmt: skip
        return model(**inputs, fused_cpo_labels=packed)
