"""Floating-point choices: which dtype the heads draft in, and telling a near-tie from a bug.

Heads only decide which tokens the target is asked to verify, so they may compute in a cheaper dtype
than the target without changing a single output token. The target's own dtype is the user's choice:
in float32 greedy output is token-identical to `target.generate`; in bfloat16 the target's argmax
itself depends on how many tokens one forward holds, and `first_divergence` is how a benchmark shows
that a divergence is one of those ties (float32 puts the two tokens within the target dtype's
rounding step) and not a verification error.
"""

from __future__ import annotations

import copy
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
AUTO = "auto"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or fp32/bf16/fp16, or a torch.dtype) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(set(DTYPES))}") from None


def native_bf16(cpuinfo: str, machine: str) -> bool:
    """Whether a CPU multiplies bf16 natively, from /proc/cpuinfo text and `platform.machine()`:
    x86 AVX512-BF16 or AMX-BF16, Arm BF16. Without it oneDNN emulates bf16, slower than float32."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    if machine.lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, so stay with float32
        return False
    return native_bf16(text, platform.machine())


def resolve_draft_dtype(draft_dtype: str | torch.dtype | None, target: torch.nn.Module) -> torch.dtype:
    """The heads' dtype: explicit, the target's (None), or 'auto'.

    auto: bfloat16 when the target computes in float32 on a CPU with native bf16 (drafting is then
    about twice as fast and the output is unchanged), else the target's dtype.
    """
    weight = target.get_input_embeddings().weight
    if draft_dtype is None:
        return weight.dtype
    if isinstance(draft_dtype, str) and draft_dtype.lower() == AUTO:
        native = weight.device.type == "cpu" and cpu_has_native_bf16()
        return torch.bfloat16 if weight.dtype == torch.float32 and native else weight.dtype
    return parse_dtype(draft_dtype)


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of `dtype` numbers at |magnitude| (the rounding step of a value that large)."""
    x = torch.tensor(abs(magnitude), dtype=dtype)
    return float(torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)).float() - x.float())


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs first differ, and how close the two tokens are for the target.

    gap: |logit(a) - logit(b)| computed in float32 by one plain forward over prompt + common prefix
    (float32 stands in for exact arithmetic); gap_ulps: that gap in units of the target dtype's
    spacing at that magnitude. Within 2 ulps, the target's own rounding can order the two tokens
    either way, and a 1-token and a many-token forward do; a larger gap means a real error.
    """

    position: int
    token_a: int
    token_b: int
    gap: float
    gap_ulps: float

    @property
    def near_tie(self) -> bool:
        return self.gap_ulps <= 2.0


def float32_reference(target: torch.nn.Module) -> torch.nn.Module:
    """The target itself when it computes in float32, else a float32 copy (same weights, upcast)."""
    if target.get_input_embeddings().weight.dtype == torch.float32:
        return target
    return copy.deepcopy(target).to(torch.float32)


@torch.no_grad()
def first_divergence(
    target,
    prompt_ids: torch.Tensor,
    a: list[int],
    b: list[int],
    reference: torch.nn.Module | None = None,
) -> Divergence | None:
    """prompt_ids: [1, T]; a, b: generated token lists. None when one is a prefix of the other.

    reference: `float32_reference(target)`, passed in to build it once for many calls.
    """
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None:
        return None
    reference = reference if reference is not None else float32_reference(target)
    prefix = torch.tensor([a[:k]], dtype=torch.long, device=prompt_ids.device)
    logits = reference(input_ids=torch.cat([prompt_ids, prefix], dim=1)).logits[0, -1].float()
    la, lb = float(logits[a[k]]), float(logits[b[k]])
    gap = abs(la - lb)
    step = ulp(target.get_input_embeddings().weight.dtype, max(abs(la), abs(lb)))
    return Divergence(position=k, token_a=a[k], token_b=b[k], gap=gap, gap_ulps=gap / step)
