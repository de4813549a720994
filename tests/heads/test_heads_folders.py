"""What a folder that is not heads gets told: a model folder, weights without their config, an empty
folder, a file, or heads that need no conversion; one line each."""

from __future__ import annotations

import pytest

from selfdraft.errors import UserError
from selfdraft.heads import load_heads, save_heads
from selfdraft.heads.convert import convert_heads

from tiny_models import random_heads, save_tiny_llama_with_real_tokenizer, tiny_target


@pytest.fixture
def heads_dir(tmp_path):
    return save_heads(random_heads(tiny_target("llama"), "eagle", 0), tmp_path / "heads")


def test_a_model_folder_passed_as_heads_says_pass_it_as_the_target(tmp_path):
    model = save_tiny_llama_with_real_tokenizer(tmp_path / "model")
    for call in (lambda: load_heads(model), lambda: convert_heads(model, tmp_path / "out")):
        with pytest.raises(UserError) as err:
            call()
        assert "holds a model (llama), not draft heads" in str(err.value) and "--target" in str(err.value)
        assert "\n" not in str(err.value)


def test_weights_without_their_config_say_restore_it(heads_dir):
    (heads_dir / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json.*restore it beside the weights"):
        load_heads(heads_dir)


def test_convert_says_what_the_source_is(tmp_path, heads_dir):
    with pytest.raises(UserError, match="already holds selfdraft heads.*nothing to convert"):
        convert_heads(heads_dir, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is empty"):
        convert_heads(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(UserError, match="is a file"):
        convert_heads(heads_dir / "model.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()
