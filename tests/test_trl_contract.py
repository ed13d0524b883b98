"""The parts of TRL's CPOTrainer that FusedCPOTrainer relies on: a TRL upgrade that moves them fails here first."""

from __future__ import annotations

import inspect

import trl
from packaging.version import Version
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer


def test_trl_version_is_in_the_tested_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17")


def test_overridden_seam_keeps_its_signature():
    stock = inspect.signature(CPOTrainer.get_batch_loss_metrics)
    ours = inspect.signature(FusedCPOTrainer.get_batch_loss_metrics)
    assert list(stock.parameters) == list(ours.parameters) == ["self", "model", "batch", "train_eval"]
    # compute_loss and prediction_step still route through it (we do not override them).
    for caller in (CPOTrainer.compute_loss, CPOTrainer.prediction_step):
        assert "get_batch_loss_metrics" in inspect.getsource(caller)
    assert "compute_loss" not in FusedCPOTrainer.__dict__ and "prediction_step" not in FusedCPOTrainer.__dict__


def test_helpers_and_attributes_we_read_exist():
    params = inspect.signature(CPOTrainer.concatenated_inputs).parameters
    assert {"batch", "is_encoder_decoder", "padding_value", "device"} <= set(params)
    init = inspect.getsource(CPOTrainer.__init__)
    for attr in (
        "beta",
        "label_smoothing",
        "loss_type",
        "cpo_alpha",
        "alpha",
        "aux_loss_enabled",
        "is_encoder_decoder",
        "pad_token_id",
        "simpo_gamma",
    ):
        assert f"self.{attr} =" in init, attr


def test_metric_keys_match_trl_source():
    source = inspect.getsource(CPOTrainer.get_batch_loss_metrics)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/rejected",
        "logps/chosen",
        "logits/rejected",
        "logits/chosen",
        "nll_loss",
    ):
        assert f'{{prefix}}{key}"' in source, key


def test_fused_config_is_a_cpo_config_with_the_alphapo_rewrite():
    assert issubclass(FusedCPOConfig, CPOConfig)
    cfg = FusedCPOConfig(output_dir="/tmp/x", loss_type="alphapo", use_cpu=True, bf16=False, report_to=[])
    assert (cfg.loss_type, cfg.cpo_alpha) == ("simpo", 0.0)
