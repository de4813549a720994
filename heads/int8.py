"""Int8 weights for drafting: every linear layer the heads own keeps one int8 weight per entry and one
scale per output channel, and multiplies through torch's weight-only int8 kernel.

Why: a draft step multiplies a handful of vectors by the head's matrices, so it streams weights, and
on a CPU that time follows the bytes read. Int8 halves bf16's bytes (measured on a 2-core AVX512-BF16
CPU: the SmolLM2 EAGLE head's eight body linears 0.81 -> 0.38 ms a pass with cold caches, its 8k-token
projection 0.28 -> 0.15 ms). Drafts only choose what the target verifies, so rounded weights can cost
acceptance, never exactness. The target's own modules (borrowed embeddings and lm_head) stay as they
are: they are not the heads'.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from selfdraft.errors import UserError
from selfdraft.precision import dtype_name

# torch's CPU kernel reads the input dimension in blocks of 16 (bfloat16 inputs of another width
# crashed the process, torch 2.13); narrower layers keep their floating weights.
K_BLOCK = 16


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 [N, K] and a per-row scale s [N]: W ~= s[:, None] * W_int8.

    Symmetric per-output-channel rounding: s = max|W_row| / 127. Computes in `dtype` (the activations'
    dtype: bfloat16, float16 or float32)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.in_features % K_BLOCK:
            raise ValueError(
                f"int8 weights need an input width divisible by {K_BLOCK}, got {linear.in_features}"
            )
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype).contiguous()
        y = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def _owned_linears(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.in_features % K_BLOCK == 0
    ]


def int8_weights(heads: nn.Module, dtype: torch.dtype, strict: bool = True) -> nn.Module:
    """`heads` with every nn.Linear it owns (input width a multiple of K_BLOCK) replaced in place by an
    `Int8Linear` computing in `dtype`; everything else (norms, embeddings it owns) is cast to `dtype`.
    For inference only: int8 weights take no gradient. strict=False (the "auto" choice): heads with
    nothing to shrink, or a device without the kernel, keep their floating weights instead of failing."""
    heads.to(dtype)
    linears = _owned_linears(heads)
    if not linears:
        if not strict:
            return heads
        raise UserError(
            f"these heads own no linear layer with an input width divisible by {K_BLOCK}: int8 drafting "
            "has nothing to shrink; use draft_dtype='auto' (--draft-dtype auto)"
        )
    device = linears[0][2].weight.device
    try:  # the kernel exists for CPUs and recent GPUs, not for every device and dtype
        probe = Int8Linear(nn.Linear(32, 16, bias=False).to(device), dtype)
        probe(torch.zeros(1, 32, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as err:
        if not strict:
            return heads
        raise UserError(
            f"int8 drafting is not available for {dtype} on {device.type} ({str(err).splitlines()[0]}); "
            "use draft_dtype='auto' (--draft-dtype auto)"
        ) from None
    for parent, name, linear in linears:
        setattr(parent, name, Int8Linear(linear, dtype))
    return heads


def has_int8_weights(heads: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in heads.modules())


def heads_dtype(heads: torch.nn.Module) -> torch.dtype:
    """The floating dtype the heads compute in; it may differ from the target's (see `draft_dtype`).
    Buffers count too: heads with int8 weights keep their scales there."""
    for t in itertools.chain(heads.parameters(), heads.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def heads_precision(heads: torch.nn.Module) -> str:
    """How the heads draft, for reports: their compute dtype, and whether they hold int8 weights."""
    return dtype_name(heads_dtype(heads)) + (" (int8 weights)" if has_int8_weights(heads) else "")
