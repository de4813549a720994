"""The EAGLE-3 head (layout "eagle3", the one selfdraft trains by default and engines serve), and the
published EAGLE-1 head that shares its decoder-layer code (layout "eagle1", for converted checkpoints):
both run as `PublishedEagleHead`, exactly as the projects that publish them compute them.

Our older EAGLE head (`selfdraft.heads.eagle.module.EagleHead`, layout "selfdraft") is a one-layer body
of the target's own class, with that class's input norm and final norm; the published heads are
different networks (same interface: `fuse_features`, `forward`, `logits`, `attach`, `drafter`, `config`,
`draft_vocab`, `init_projection_from_target`).

EAGLE-1 / EAGLE-2 (layout "eagle1", SafeAILab/EAGLE `cnets1.py`):
    f_t = the target's last hidden state AFTER its final norm (the tensor its lm_head reads, which is
          `output_hidden_states[-1]` in transformers: feature_layers = [-1])
    x   = fc(cat(embed(x_{t+1}), f_t))                       fc: 2h -> h, bias optional
    f'  = x + attn(x);  f_{t+1} = f' + mlp(post_attention_layernorm(f'))   (no input_layernorm, no
          final norm; an `input_layernorm` is applied only when the checkpoint has one)
    logits = target.lm_head(f_{t+1})
EAGLE-3 (layout "eagle3", SafeAILab/EAGLE `cnets.py`, SGLang `LlamaForCausalLMEagle3`, vLLM/speculators
`Eagle3Speculator`):
    g_t = fc(cat(hidden_states[i] for i in feature_layers))  fc: n*h_target -> h; done once, in
          `fuse_features`; the head's own outputs are fed back as g without fc
    r   = g_t (or hidden_norm(g_t) when norm_before_residual)
    a   = attn(cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t)))   q/k/v read 2h
    g_{t+1} = (r + a) + mlp(post_attention_layernorm(r + a))
    logits = lm_head(norm(g_{t+1})) over the draft vocabulary (d2t / t2d maps)
    EAGLE-3.1 `norm_output` (speculators / vLLM option): the head feeds back norm(g_{t+1}) instead of
    g_{t+1} (vLLM `llama_eagle3.py` LlamaModel.forward returns the post-norm state as the next step's
    hidden state when `config.norm_output`), and the logits are lm_head of that same post-norm state
    (no second norm): `forward` returns norm(g_{t+1}) and `logits` skips `norm`.
    feature_layers index transformers' `output_hidden_states` tuple: entry i is the input of decoder
    layer i, i.e. pre-norm, exactly what the EAGLE-3 reference and the engines capture.

Exact: every formula above, RMSNorm in float32 as Llama does, softmax in float32, grouped-query
attention, RoPE from transformers' own `LlamaRotaryEmbedding` for the head's config (default, linear,
llama3, yarn, dynamic scalings as transformers implements them; the reference EAGLE-1 code has its own
"dynamic" variant, which may differ for positions beyond max_position_embeddings).
Losslessness never depends on any of this: the target verifies every token. The head only decides how
many drafted tokens are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle.drafter import EagleRows
from selfdraft.heads.vocab import BorrowingModule, DraftVocab

# Keys of HeadsConfig.eagle_layer_config (the published decoder layer's own dimensions).
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope",  # LlamaConfig RoPE kwargs: rope_theta / rope_scaling, or rope_parameters
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "input_layernorm",  # eagle1 only: the checkpoint has an input_layernorm (the reference has none)
    "norm_before_residual",  # eagle3 only: residual taken after hidden_norm (speculators option)
    "norm_output",  # eagle3 only: EAGLE-3.1, the post-norm state is fed back (speculators option)
)
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")


def rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a Llama-style config dict, as LlamaConfig keyword arguments."""
    return {k: config[k] for k in _ROPE_KEYS if config.get(k) is not None}


def layer_config_from_target(target_config: dict[str, Any]) -> dict[str, Any]:
    """A published-style head layer with the target's dimensions (for fresh eagle1/eagle3 heads)."""
    h, nh = target_config["hidden_size"], target_config["num_attention_heads"]
    return {
        "hidden_size": h,
        "intermediate_size": target_config["intermediate_size"],
        "num_attention_heads": nh,
        "num_key_value_heads": target_config.get("num_key_value_heads") or nh,
        "head_dim": target_config.get("head_dim") or h // nh,
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "hidden_act": target_config.get("hidden_act", "silu"),
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "rope": rope_kwargs(target_config),
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
        "input_layernorm": False,
        "norm_before_residual": False,
        "norm_output": False,
    }


def eagle3_default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default fused layers {2, L//2, L-3} as `output_hidden_states` indices (layer inputs)."""
    return [2, num_layers // 2, num_layers - 3]


class RMSNorm(nn.Module):
    """Llama RMSNorm: weight * (x / rms(x)), computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Rope:
    """transformers' rotary embedding for the head's config; a plain attribute, not a submodule, so
    `.to(dtype)` never rounds its inverse frequencies and nothing of it is saved."""

    def __init__(self, layer: dict[str, Any]) -> None:
        config = LlamaConfig(
            hidden_size=layer["hidden_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"],
            head_dim=layer["head_dim"],
            max_position_embeddings=layer["max_position_embeddings"],
            **layer.get("rope", {}),
        )
        self.module = LlamaRotaryEmbedding(config)

    def __call__(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: [B, T] -> cos, sin: [B, T, head_dim] in like.dtype."""
        if self.module.inv_freq.device != like.device:
            self.module.to(like.device)
        return self.module(like, position_ids.to(like.device))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def causal_mask(q_len: int, k_len: int, like: torch.Tensor) -> torch.Tensor:
    """Additive causal mask [1, 1, q_len, k_len] for q_len new positions after k_len - q_len cached."""
    past = k_len - q_len
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).tril(diagonal=past)
    mask = torch.zeros(q_len, k_len, dtype=like.dtype, device=like.device)
    return mask.masked_fill(~allowed, torch.finfo(like.dtype).min)[None, None]


class Attention(nn.Module):
    """Llama grouped-query attention whose q/k/v read `in_features` (h for EAGLE-1, 2h for EAGLE-3)."""

    def __init__(self, layer: dict[str, Any], in_features: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        self.head_dim = layer["head_dim"]
        qkv_bias = bool(layer.get("qkv_bias"))
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        o_bias = bool(layer.get("o_bias"))
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, layer["hidden_size"], bias=o_bias)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        """x: [B, T, in]; cos/sin: [B, T, d]; mask: additive [B, 1, T, past + T] or None; cache: a
        transformers DynamicCache (this layer is its layer 0) or None."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, 0)
        if mask is None:
            mask = causal_mask(t, k.shape[2], q)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) * self.head_dim**-0.5 + mask.to(device=q.device, dtype=q.dtype)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, layer: dict[str, Any]) -> None:
        super().__init__()
        h, i, bias = layer["hidden_size"], layer["intermediate_size"], bool(layer.get("mlp_bias"))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACT2FN[layer.get("hidden_act", "silu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PublishedLayer(nn.Module):
    """The single decoder layer of an EAGLE-1 or EAGLE-3 head (formulas in the module docstring)."""

    def __init__(self, layer: dict[str, Any], layout: str) -> None:
        super().__init__()
        h, eps = layer["hidden_size"], layer["rms_norm_eps"]
        self.eagle3 = layout == "eagle3"
        self.norm_before_residual = bool(layer.get("norm_before_residual"))
        self.self_attn = Attention(layer, 2 * h if self.eagle3 else h)
        self.mlp = MLP(layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps) if self.eagle3 or layer.get("input_layernorm") else None
        self.hidden_norm = RMSNorm(h, eps) if self.eagle3 else None

    def forward(self, hidden, embeds, cos, sin, mask, cache) -> torch.Tensor:
        """hidden: [B, T, h] (eagle1: fc output; eagle3: fused or own feature); embeds: eagle3 only."""
        if self.eagle3:
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual, normed = hidden, hidden
            else:
                residual, normed = hidden, self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = hidden
            x = self.input_layernorm(hidden) if self.input_layernorm is not None else hidden
        hidden = residual + self.self_attn(x, cos, sin, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class PublishedEagleHead(BorrowingModule):
    """An EAGLE-1 or EAGLE-3 head with the published architecture (config.eagle_layout)."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        layout = config.eagle_layout
        if layout not in ("eagle1", "eagle3"):
            raise ValueError(f"PublishedEagleHead builds eagle1/eagle3 layouts, not {layout!r}")
        if config.eagle_layer_config is None and not config.target_config:
            raise ValueError(f"an {layout} head needs HeadsConfig.eagle_layer_config or target_config")
        layer = config.eagle_layer_config or layer_config_from_target(config.target_config)
        self.config = config
        h, h_target, n = layer["hidden_size"], config.target_hidden_size, config.num_feature_layers
        if layout == "eagle1":
            if n != 1 or h != h_target:
                raise ValueError(
                    f"an eagle1 head reads one feature of the target's width; got {n} feature layers, "
                    f"head width {h}, target width {h_target}"
                )
            self.fc = nn.Linear(2 * h, h, bias=config.eagle_fc_bias)  # fc(cat(embedding, feature))
            self.norm = None
        else:
            self.fc = nn.Linear(n * h_target, h, bias=config.eagle_fc_bias)  # fuses the target's layers
            self.norm = RMSNorm(h, layer["rms_norm_eps"])
        # EAGLE-3.1: forward returns norm(g_{t+1}), which is both fed back and read by logits.
        self.norm_output = layout == "eagle3" and bool(layer.get("norm_output"))
        self.layer = PublishedLayer(layer, layout)
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h) if config.eagle_own_embedding else None
        if config.draft_vocab_size:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.draft_vocab = DraftVocab(config.draft_vocab_size, config.target_vocab_size)
        else:
            self.lm_head = None
            self.draft_vocab = None
        self._rope = _Rope(layer)

    @property
    def layout(self) -> str:
        return self.config.eagle_layout

    def drafter(self, rows: int) -> EagleRows:
        return EagleRows(self, rows)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens if self.embed_tokens is not None else self._need().embed
        return embed(input_ids)

    def fuse_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's `output_hidden_states` tuple -> the head's input feature: [B, T, h]."""
        chosen = [hidden_states[i] for i in self.config.feature_layers]
        if self.layout == "eagle1":
            return chosen[0]
        return self.fc(torch.cat(chosen, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """input_ids: [B, T] tokens x_{t+1}; features: [B, T, h] features f_t (fused target features or
        the head's own); position_ids: [B, T]; attention_mask: additive float [B, 1, T, past + T] or None
        (causal); cache: a transformers DynamicCache or None. Returns the next features [B, T, h]."""
        embeds = self._embed(input_ids).to(features.dtype)
        cos, sin = self._rope(features, position_ids)
        if self.layout == "eagle1":
            x = self.fc(torch.cat([embeds, features], dim=-1))
            return self.layer(x, None, cos, sin, attention_mask, cache)
        out = self.layer(features, embeds, cos, sin, attention_mask, cache)
        return self.norm(out) if self.norm_output else out

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., h] -> logits [..., V'] (V' = draft vocab size when one is used)."""
        if self.norm is not None and not self.norm_output:  # norm_output: `forward` already normed
            features = self.norm(features)
        return self.project(features)
