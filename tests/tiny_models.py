"""Tiny random-init targets of real architectures (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from selfdraft.heads import HeadsConfig, build_heads
from selfdraft.target import prepare_target

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "gemma": lambda: GemmaConfig(**COMMON, head_dim=8),
}


def tiny_target(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **config_overrides):
    """config_overrides: config attributes to change (e.g. max_position_embeddings for a short context)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    for name, value in config_overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    # Random init gives near-uniform logits; a larger scale makes argmax decisions well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return prepare_target(model)


def greedy_reference(target, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation (no EOS stop; explicit mask so pad ids are not masked)."""
    out = target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, prompt.shape[1] :].tolist()


# The heads tests build by name: "eagle" is our one-layer-of-the-target's-class layout (the tests
# were written for its acceptance rates), "eagle3" the default layout, "medusa" Medusa heads.
TEST_HEADS = {"medusa": ("medusa", None), "eagle": ("eagle", "selfdraft"), "eagle3": ("eagle", "eagle3")}


def random_heads(target, kind: str, seed: int, draft_vocab_size=None):
    """Heads with random (not zero) weights, so drafts are arbitrary but deterministic. kind: a
    TEST_HEADS name."""
    torch.manual_seed(seed)
    head_kind, layout = TEST_HEADS[kind]
    heads = build_heads(
        HeadsConfig.for_target(
            target.config, head_kind=head_kind, eagle_layout=layout, draft_vocab_size=draft_vocab_size
        )
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    return heads


def save_tiny_llama_with_real_tokenizer(path, **overrides):
    """A tiny random Llama (`COMMON` updated by `overrides`) saved into `path` with the real SmolLM2
    tokenizer, so chat templates and tokenization are real; returns `path`."""
    from transformers import AutoTokenizer

    from selfdraft.target import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{**COMMON, "vocab_size": len(tok), **overrides},
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
