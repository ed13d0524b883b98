"""Every model family, every layout: FusedCPOTrainer equals stock CPOTrainer on the same batch, or refuses at
construction with a fix. Never a crash in the first step, never a silent difference.

Tiny random-init configs of transformers' own causal-LM classes (2 layers, hidden 32, vocab 128, every dropout 0,
fp32, no hub). Stock CPOTrainer runs each family once; the fused trainer runs it in each layout.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as T
from test_trainer import NOT_LOGITS, loss_metrics_grads, make_trainer
from trl.experimental.cpo import CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer

LAYOUTS = ["padded", "padding_free", "prefix_shared"]
PACKED = ("padding_free", "prefix_shared")
ALL = tuple(LAYOUTS)
TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, head_dim=8, max_position_embeddings=512, pad_token_id=0)  # fmt: skip
GPT2_LIKE = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=512)
FALCON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2)
# family: (model class, config class, config kwargs over TINY, layouts expected to be refused)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, ()),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, ()),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}, ()),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None), ()),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {}, ()),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(num_key_value_heads=4), ()),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(sliding_window=None), ()),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}, ()),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", {}, ()),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {}, ()),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(sliding_window=None), ()),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, sliding_window=None), ()),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        (),
    ),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}, ()),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", GPT2_LIKE, ()),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(GPT2_LIKE, rotary_dim=4), ()),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(GPT2_LIKE, rotary_dim=4, n_ctx=512), ()),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(FALCON, new_decoder_architecture=True), ()),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32), ()),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", GPT2_LIKE, ()),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {}, ()),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", {}, ()),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", {}, ()),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}, ()),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2), ()),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {}, ()),
    "helium": ("HeliumForCausalLM", "HeliumConfig", {}, ()),
    "biogpt": ("BioGptForCausalLM", "BioGptConfig", {}, ()),
    "xglm": ("XGLMForCausalLM", "XGLMConfig", dict(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64), ()),
    "persimmon": ("PersimmonForCausalLM", "PersimmonConfig", {}, ()),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", {}, ()),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        (),
    ),  # fmt: skip
    "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", {}, ()),
    "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig", {}, ()),
    "arcee": ("ArceeForCausalLM", "ArceeConfig", {}, ()),
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", {}, ()),
    "glm": ("GlmForCausalLM", "GlmConfig", {}, ()),
    "hunyuan_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", {}, ()),
    "moshi": ("MoshiForCausalLM", "MoshiConfig", {}, ()),
    "ctrl": ("CTRLLMHeadModel", "CTRLConfig", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, dff=64), ()),
    "megatron_bert": ("MegatronBertForCausalLM", "MegatronBertConfig", dict(is_decoder=True), ()),
    "ernie": ("ErnieForCausalLM", "ErnieConfig", dict(is_decoder=True), ()),
    # Refused where they differ: softcap / logit scale (every layout), no position_ids or positions from padding_idx,
    # state-carrying or chunked layers (packed layouts).
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {}, ALL),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", dict(lru_width=32), ALL),
    "cohere": ("CohereForCausalLM", "CohereConfig", {}, ALL),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {}, ALL),
    "mpt": ("MptForCausalLM", "MptConfig", dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2), PACKED),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=2, n_head=4), PACKED),
    "xlm_roberta": ("XLMRobertaForCausalLM", "XLMRobertaConfig", dict(is_decoder=True), PACKED),
    "camembert": ("CamembertForCausalLM", "CamembertConfig", dict(is_decoder=True), PACKED),
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(state_size=4), PACKED),
    "jamba": (
        "JambaForCausalLM",
        "JambaConfig",
        dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2),
        PACKED,
    ),  # fmt: skip
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", dict(num_local_experts=2), PACKED),
    # Electra's generator head sits beside its decoder, not above it: refused by the probe alone (no static rule
    # names it). Llama4ForCausalLM's base_model_prefix names no submodule (the backbone cannot run alone): refused.
    "electra": ("ElectraForCausalLM", "ElectraConfig", dict(is_decoder=True, embedding_size=32), ALL),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(num_local_experts=2, intermediate_size_mlp=64), ALL),
    # The five of issue #37: BERT/RoBERTa's head transform runs (every layout equals stock but RoBERTa packed,
    # refused: positions from padding_idx); GPT-Neo's local window and fixed buffer, Falcon's ALiBi and OpenAI-GPT's
    # 2D mask are refused for packed rows.
    "bert": ("BertLMHeadModel", "BertConfig", dict(is_decoder=True), ()),
    "roberta": ("RobertaForCausalLM", "RobertaConfig", dict(is_decoder=True), PACKED),
    "gpt_neo_local": (
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(num_layers=2, num_heads=4, window_size=8, attention_types=[[["global", "local"], 1]]),
        PACKED,
    ),  # fmt: skip
    "gpt_neo_short_buffer": (
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(num_layers=2, num_heads=4, max_position_embeddings=64, attention_types=[[["global"], 2]]),
        PACKED,
    ),  # fmt: skip
    "falcon_alibi": ("FalconForCausalLM", "FalconConfig", dict(FALCON, alibi=True), PACKED),
    "openai_gpt": ("OpenAIGPTLMHeadModel", "OpenAIGPTConfig", GPT2_LIKE, PACKED),
}


def tiny_model(family: str) -> torch.nn.Module:
    model_name, config_name, extra, _ = FAMILIES[family]
    base = {} if {"n_embd", "num_kv_heads"} & extra.keys() else TINY  # GPT-2 / Falcon style: their own names
    kwargs = dict(base, **extra)
    config = getattr(T, config_name)(**kwargs)
    for key, value in vars(config).items():  # every dropout 0: stock and fused must see the same network
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(T, model_name)(config).float()


@functools.cache
def stock_result(family: str, tmp_path_str: str):
    return loss_metrics_grads(make_trainer(CPOTrainer, tmp_path_str, model=tiny_model(family)))


def assert_equal_to_stock(stock, fused, layout: str) -> None:
    """Loss, every metric (but packed logits/*), every gradient to 1e-4 of its norm (a floor of 1e-4 of the largest
    gradient: BERT's key biases get a gradient of exactly 0 in exact arithmetic, fp32 noise in each trainer)."""
    torch.testing.assert_close(fused[0], stock[0], rtol=1e-5, atol=1e-6)
    keep = (lambda m: m) if layout == "padded" else NOT_LOGITS
    assert fused[1].keys() == stock[1].keys()
    for key, value in keep(stock[1]).items():
        assert fused[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert fused[2].keys() == stock[2].keys()  # every parameter that trains in stock trains here (head transform too)
    floor = 1e-4 * max(g.norm() for g in stock[2].values())
    for name, g in stock[2].items():
        err = ((fused[2][name] - g).norm() / torch.clamp(g.norm(), min=floor)).item()
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_equals_stock_or_is_refused(tmp_path_factory, family, layout):
    tmp = tmp_path_factory.getbasetemp() / "families"
    refused = layout in FAMILIES[family][3]
    build = lambda: make_trainer(  # noqa: E731
        FusedCPOTrainer, tmp, model=tiny_model(family), config_cls=FusedCPOConfig, batch_layout=layout
    )
    if refused:
        with pytest.raises(ValueError, match="batch_layout: padded|layout 'padded'|use_fused_loss=False"):
            build()
        return
    assert_equal_to_stock(stock_result(family, str(tmp)), loss_metrics_grads(build()), layout)
