"""Dtype policy: dtype names, whether this CPU computes bf16 natively, and which dtype heads draft in.

Heads only decide which tokens the target is asked to verify, so they may compute in a cheaper dtype
than the target without changing a single output token. The target's own dtype is the user's choice;
what a low-precision target does to greedy identity is explained once, in `selfdraft.bench.divergence`.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

import torch

from selfdraft.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
AUTO = "auto"
INT8 = "int8"  # the draft dtype that asks for int8 weights (`selfdraft.heads.int8`)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the names tree files and reports use)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or fp32/bf16/fp16, or a torch.dtype) -> torch.dtype; 'auto'
    -> bfloat16 where it is fast (a CUDA GPU that supports it, or a CPU with native bf16), else float32."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise UserError(f"dtype {name} is not one selfdraft computes in; use {sorted(set(DTYPES))} or auto")
        return name
    if not isinstance(name, str):
        raise UserError(f"dtype {name!r} is neither a name nor a torch dtype; use auto or {sorted(set(DTYPES))}")
    if name.lower() == AUTO:
        fast = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_native_bf16()
        return torch.bfloat16 if fast else torch.float32
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}: use auto or one of {sorted(set(DTYPES))}") from None


def _cpu_flags(cpuinfo: str) -> set[str]:
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def native_bf16(cpuinfo: str, machine: str) -> bool:
    """Whether a CPU multiplies bf16 natively, from /proc/cpuinfo text and `platform.machine()`:
    x86 AVX512-BF16 or AMX-BF16, Arm BF16. Without it oneDNN emulates bf16, slower than float32."""
    return cpu_kind(cpuinfo, machine) != "cpu"


def cpu_kind(cpuinfo: str, machine: str) -> str:
    """The class of matrix units a CPU multiplies with, which sets what a bigger verification block
    costs: "cpu-amx" (AMX tiles: a 32-token bf16 pass costs about a 1-token one), "cpu-avx512bf16"
    (AVX512-BF16 without AMX: the cost grows with the block), "cpu-armbf16", or "cpu" (no bf16 units)."""
    flags = _cpu_flags(cpuinfo)
    if machine.lower() in ("aarch64", "arm64"):
        return "cpu-armbf16" if "bf16" in flags else "cpu"
    if "amx_bf16" in flags:
        return "cpu-amx"
    return "cpu-avx512bf16" if "avx512_bf16" in flags else "cpu"


@lru_cache(maxsize=1)
def this_cpu_kind() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, so stay with float32
        return "cpu"
    return cpu_kind(text, platform.machine())


def cpu_has_native_bf16() -> bool:
    return this_cpu_kind() != "cpu"


def machine_kind(device: torch.device | str = "cpu") -> str:
    """The kind of machine a model on `device` runs on, as tree files key their per-machine entries:
    "cuda" for a GPU, else this CPU's kind (see `cpu_kind`)."""
    return "cuda" if torch.device(device).type == "cuda" else this_cpu_kind()


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
    if isinstance(draft_dtype, str) and draft_dtype.lower() not in DTYPES:
        raise UserError(
            f"unknown draft dtype {draft_dtype!r}: use auto, int8 or one of {sorted(set(DTYPES))}"
        )
    return parse_dtype(draft_dtype)


def draft_weights_int8(draft_dtype: str | torch.dtype | None, target: torch.nn.Module) -> bool:
    """Whether the heads keep int8 weights: asked for ("int8"), or by "auto" where it was measured to
    pay: heads computing in bfloat16 on a CPU with native bf16 (a draft step there streams the head's
    weights; int8 cut the SmolLM2 head's chain-3 draft by about a third on an AVX512-BF16 CPU)."""
    if not isinstance(draft_dtype, str):
        return False
    if draft_dtype.lower() == INT8:
        return True
    if draft_dtype.lower() != AUTO:
        return False
    on_cpu = target.get_input_embeddings().weight.device.type == "cpu"
    return on_cpu and cpu_has_native_bf16() and resolve_draft_dtype(AUTO, target) is torch.bfloat16
