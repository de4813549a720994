"""Inference: target loading, trees, drafting, verification, acceptance and the generate loop."""

from importlib import import_module

# Resolved lazily so that `selfdraft.heads` can use `selfdraft.inference.kv` without an import cycle.
_EXPORTS = {
    "SelfDraftModel": "selfdraft.inference.model",
    "SamplingParams": "selfdraft.inference.sampling",
    "load_target": "selfdraft.inference.target",
    "TreeSpec": "selfdraft.inference.tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'selfdraft.inference' has no attribute {name!r}")
