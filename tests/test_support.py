"""support.py: the five families of issue #37 (each failed at 24b6d07), and the construction probe's own contract."""

from __future__ import annotations

import logging

import pytest
import torch
from test_families import assert_equal_to_stock, tiny_model
from test_trainer import loss_metrics_grads, make_trainer
from trl.experimental.cpo import CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.toy import toy_model

PACKED = ["padding_free", "prefix_shared"]


def fused(tmp_path, model, layout="padded", **kw):
    return make_trainer(FusedCPOTrainer, tmp_path, model=model, config_cls=FusedCPOConfig, batch_layout=layout, **kw)


# ------------------------------------------------------------------------------------------ the five cases


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_bert_and_roberta_heads_run_their_transform(tmp_path, family):
    """1. The prediction head's dense + activation + LayerNorm run before the fused matmul, and train."""
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, model=tiny_model(family)))
    got = loss_metrics_grads(fused(tmp_path, tiny_model(family)))
    assert any("dense" in name for name in got[2] if "predictions" in name or "lm_head" in name)
    assert_equal_to_stock(stock, got, "padded")


@pytest.mark.parametrize("layout", PACKED)
def test_roberta_packed_is_refused_for_its_padding_positions(tmp_path, layout):
    """1. RoBERTa numbers positions from padding_idx + 1 (and skips pads): packed position ids would differ."""
    with pytest.raises(ValueError, match="padding_idx"):
        fused(tmp_path, tiny_model("roberta"), layout)


@pytest.mark.parametrize("layout", PACKED)
def test_gpt_neo_local_attention_is_refused_for_packed_rows(tmp_path, layout):
    """2. GPT-Neo's window (window_size 8, max_length 64) is by row index: the rejected branch would lose its prompt."""
    with pytest.raises(ValueError, match="attend locally"):
        fused(tmp_path, tiny_model("gpt_neo_local"), layout)


@pytest.mark.parametrize("layout", PACKED)
def test_gpt_neo_causal_buffer_shorter_than_the_row_is_refused(tmp_path, layout):
    """3. GPT-Neo slices a fixed [64, 64] causal buffer by the row's length; 4 pairs x 2 x 64 tokens exceed it."""
    with pytest.raises(ValueError, match="fixed causal buffer of 64"):
        fused(tmp_path, tiny_model("gpt_neo_short_buffer"), layout)


def test_gpt_neo_causal_buffer_that_fits_the_row_trains_like_stock(tmp_path):
    """3. Refused only when the row can exceed it: one pair at max_length 16 fits 64 positions, and equals stock."""
    kw = dict(per_device_train_batch_size=1, per_device_eval_batch_size=1, max_length=16)
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, model=tiny_model("gpt_neo_short_buffer"), **kw), [0])
    got = loss_metrics_grads(fused(tmp_path, tiny_model("gpt_neo_short_buffer"), "prefix_shared", **kw), [0])
    assert_equal_to_stock(stock, got, "prefix_shared")


@pytest.mark.parametrize("layout", PACKED)
def test_falcon_alibi_is_refused_for_packed_rows(tmp_path, layout):
    """4. Falcon builds its ALiBi bias from a 2D mask (it crashed on the packed one)."""
    with pytest.raises(ValueError, match="alibi"):
        fused(tmp_path, tiny_model("falcon_alibi"), layout)


@pytest.mark.parametrize("layout", PACKED)
def test_openai_gpt_is_refused_for_packed_rows(tmp_path, layout):
    """5. OpenAI-GPT expects a 2D mask (it crashed on the packed one)."""
    with pytest.raises(ValueError, match="2D attention_mask"):
        fused(tmp_path, tiny_model("openai_gpt"), layout)


# ------------------------------------------------------------------------------------------------ the probe


@pytest.mark.parametrize(
    "family, layout, match",
    [("gpt_neo_local", "prefix_shared", "differ from the same sequences run alone"),
     ("roberta", "padding_free", "differ from the same sequences run alone"),
     ("falcon_alibi", "prefix_shared", "fails on a packed probe row"),
     ("openai_gpt", "padding_free", "fails on a packed probe row")],
)  # fmt: skip
def test_the_probe_refuses_what_the_static_list_misses(tmp_path, monkeypatch, family, layout, match):
    """With the family list emptied, the probe alone refuses each case at construction; a crash keeps its cause."""
    import trl_fused_cpo.support as support

    monkeypatch.setattr(support, "_family_refusal", lambda *a, **k: None)
    with pytest.raises(ValueError, match=match) as info:
        fused(tmp_path, tiny_model(family), layout)
    assert "batch_layout: padded" in str(info.value)
    if "fails" in match:
        assert info.value.__cause__ is not None  # the model's own exception, attached


def test_the_probe_refuses_a_head_the_fused_loss_does_not_compute(tmp_path):
    """A scale the config does not declare (here a hook on lm_head) is found by comparing logits."""
    model = toy_model()
    model.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    with pytest.raises(ValueError, match="use_fused_loss=False"):
        fused(tmp_path, model)


def test_the_probe_keeps_modes_and_the_global_rng():
    from trl_fused_cpo.support import check_model_runs_exactly

    model = toy_model()
    model.train()
    model.model.layers[0].eval()  # a mixed state comes back as it was, not as model.train()
    modes = {name: m.training for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    check_model_runs_exactly(model, "prefix_shared", pad_token_id=0, implementation="sdpa")
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_probe_is_skipped_with_one_line_where_the_model_cannot_run(caplog):
    from trl_fused_cpo.support import check_model_runs_exactly

    with torch.device("meta"):
        model = toy_model()
    with caplog.at_level(logging.WARNING, logger="trl_fused_cpo.support"):  # a skipped check is shown by default
        check_model_runs_exactly(model, "prefix_shared", pad_token_id=0, implementation="sdpa")
    assert [r.message for r in caplog.records if "probe is skipped" in r.message] and len(caplog.records) == 1


def test_benchmark_probe_smoke(tmp_path):
    """scripts/benchmark_probe.py at the toy shape on CPU (the GPU command runs the Llama-3-8B shape)."""
    from conftest import load_script

    out = tmp_path / "probe.json"
    result = load_script("benchmark_probe").main(
        ["--shape", "toy", "--device", "cpu", "--dtype", "float32", "--implementations", "sdpa", "--repeats", "1",
         "--out", str(out)]
    )  # fmt: skip
    assert out.exists() and [r["layout"] for r in result["rows"]] == ["padded", "padding_free", "prefix_shared"]


def test_the_probes_sdpa_switch_restores_each_sub_configs_own_implementation():
    """fused_cpo_varlen's probe runs its padded reference on sdpa and switches back. transformers' setter writes a
    composite config's value into every sub-config, so restoring the top-level name alone gave the vision tower the
    text model's fused_cpo_varlen (a model left changed by the probe). Each config keeps its own value."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    from trl_fused_cpo.support import _padded_attention
    from trl_fused_cpo.varlen_attention import IMPLEMENTATION

    config = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=1), vision_config=CLIPVisionConfig())
    config._attn_implementation = {"": IMPLEMENTATION, "text_config": IMPLEMENTATION, "vision_config": "eager"}
    lm = torch.nn.Module()
    lm.config = config
    before = {
        name: c._attn_implementation
        for name, c in (("", config), *((k, getattr(config, k)) for k in config.sub_configs))
    }
    assert before["vision_config"] == "eager" and before["text_config"] == IMPLEMENTATION
    with pytest.raises(RuntimeError, match="inside"):
        with _padded_attention(lm, IMPLEMENTATION):
            assert config.get_text_config()._attn_implementation == "sdpa"
            raise RuntimeError("inside")
    after = {
        name: c._attn_implementation
        for name, c in (("", config), *((k, getattr(config, k)) for k in config.sub_configs))
    }
    assert after == before
