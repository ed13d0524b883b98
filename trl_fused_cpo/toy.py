"""The embedded default: a toy Llama-3-architecture model, a word-level tokenizer and shipped preference data.

Everything is built in-process (no hub): the demo, the tests and the CPU benchmarks run on any machine. The data
(``data/tiny_preferences.jsonl``, made by ``scripts/make_tiny_data.py``) asks for words of a category; the chosen
completion stays on topic and the rejected one does not, so reward accuracy on held-out pairs rises as CPO learns.
"""

from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TOY_MODEL_NAME = "toy-llama3"  # recipes name the embedded model by this
TOY_DATASET_NAME = "toy"  # recipes name the shipped preference data by this
CATEGORIES: dict[str, list[str]] = {
    "fruits": "apple pear plum grape mango lemon lime peach cherry melon kiwi fig".split(),
    "animals": "cat dog horse sheep goat mouse tiger lion bear wolf fox owl".split(),
    "colors": "red blue green yellow purple orange black white pink brown grey teal".split(),
    "tools": "hammer saw drill wrench chisel pliers file rake shovel axe level clamp".split(),
    "drinks": "tea coffee water juice milk soda cocoa cider lemonade broth kefir tonic".split(),
}
PROMPT_WORDS = "name some please list a few give me".split() + list(CATEGORIES) + [":"]
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Conversational data on the toy tokenizer: each message's content and a space (the word-level vocabulary has no role
# tokens; the tokenizer splits on whitespace). A prompt's rendering is a prefix of the rendering with its answer, as
# TRL's chat-template step requires, with or without add_generation_prompt.
TOY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] + ' ' }}{% endfor %}"


def toy_vocab() -> list[str]:
    words = [w for ws in CATEGORIES.values() for w in ws]
    return SPECIAL_TOKENS + sorted(set(PROMPT_WORDS + words))


def toy_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :func:`toy_vocab`, with Llama-3-style bos/eos, a pad token and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(toy_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = TOY_CHAT_TEMPLATE
    return tokenizer


def toy_config(vocab_size: int, *, tie_word_embeddings: bool = False, **overrides) -> LlamaConfig:
    """Llama-3 architecture (GQA, SwiGLU, RMSNorm, rope θ = 500k) at toy size."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,  # >= CPOConfig's default max_length (1024): the trainer refuses beyond it
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def toy_model(
    *, tie_word_embeddings: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> LlamaForCausalLM:
    """A random-init toy Llama-3 sized to :func:`toy_tokenizer`'s vocabulary.

    ``attn_implementation=...`` among ``overrides`` selects the attention as ``from_pretrained`` would (default sdpa);
    transformers refuses one it cannot run (``flash_attention_2`` without the package: ``ImportError``). The same seed
    gives the same weights whatever the attention.
    """
    torch.manual_seed(seed)
    config = toy_config(len(toy_vocab()), tie_word_embeddings=tie_word_embeddings, **overrides)
    return LlamaForCausalLM(config).to(dtype)


def load_toy_preferences(split: str = "train") -> list[dict[str, str]]:
    """The shipped preference pairs (``prompt``/``chosen``/``rejected``) of one split: ``train`` or ``test``."""
    text = resources.files("trl_fused_cpo").joinpath("data/tiny_preferences.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if split not in {r["split"] for r in rows}:
        raise ValueError(f"split={split!r}: the toy data has 'train' and 'test'.")
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows if r["split"] == split]
