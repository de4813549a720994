"""`generate` seeds and devices: out-of-range values are one line, numpy integers work like ints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selfdraft.errors import UserError
from selfdraft.inference import SelfDraftModel
from selfdraft.scripts import cli

from tiny_models import random_heads, tiny_target


@pytest.fixture(scope="module")
def model():
    target = tiny_target("llama")
    return SelfDraftModel(target, None, random_heads(target, "eagle", 0), tree="chain-2")


PROMPT = torch.tensor([[4, 8, 15, 16, 23]])


@pytest.mark.parametrize("seed", [2**70, -1, 2**63, [1, 2**64]], ids=["2**70", "-1", "2**63", "a row's 2**64"])
def test_a_seed_out_of_range_is_a_user_error(model, seed):
    prompts = [PROMPT[0]] * (len(seed) if isinstance(seed, list) else 1)
    with pytest.raises(UserError, match="out of range"):
        model.generate(prompts if isinstance(seed, list) else PROMPT, 4, temperature=1.0, seed=seed)


def test_a_batch_whose_last_row_seed_overflows_is_refused(model):
    with pytest.raises(UserError, match="out of range"):
        model.generate([PROMPT[0]] * 3, 4, temperature=1.0, seed=2**63 - 2)


def test_numpy_seeds_draw_what_the_same_ints_draw(model):
    a = model.generate(PROMPT, 8, temperature=1.0, seed=np.int64(3)).tokens
    assert a == model.generate(PROMPT, 8, temperature=1.0, seed=3).tokens
    rows = model.generate([PROMPT[0]] * 2, 8, temperature=1.0, seed=[np.int32(5), None])
    assert rows[0].tokens == model.generate(PROMPT, 8, temperature=1.0, seed=5).tokens


def test_cli_seed_out_of_range_is_one_line(capsys):
    argv = ["generate", "--prompt", "hi", "--seed", "99999999999999999999999", "--temperature", "1"]
    assert cli.main([*argv, "--target", "smollm2-135m-instruct", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out of range" in err


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tree": 123}, "list of rank paths"),
        ({"tree": "missing.yaml"}, "tree file missing.yaml does not exist"),
        ({"dtype": torch.int8}, "is not one selfdraft computes in"),
        ({"draft_dtype": torch.int8}, "is not one selfdraft computes in"),
        ({"draft_dtype": "int4"}, "use auto, int8 or one of"),
        ({"device": "banana"}, "is not a device"),
    ],
    ids=["tree=123", "tree=missing.yaml", "dtype=int8", "draft_dtype=int8", "draft_dtype=int4", "device=banana"],
)
def test_api_arguments_that_cannot_work_are_user_errors(tmp_path, kwargs, words):
    from tiny_models import save_tiny_llama_with_real_tokenizer

    folder = tmp_path / "t"
    if "device" not in kwargs:
        save_tiny_llama_with_real_tokenizer(folder)
    with pytest.raises(UserError, match=words):
        SelfDraftModel.from_pretrained(str(folder), heads=None, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU, so device='cuda' is valid here")
def test_cuda_without_a_gpu_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no CUDA GPU"):
        SelfDraftModel.from_pretrained(str(tmp_path), heads=None, device="cuda")


def test_a_prompts_file_with_a_bom_reads_and_a_gzip_one_says_so(tmp_path):
    import gzip

    from selfdraft.bench.prompts import read_prompt_rows

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n{"prompt": "there"}\n')
    assert [r["prompt"] for r in read_prompt_rows(bom)] == ["hi", "there"]
    packed = tmp_path / "p.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"prompt": "hi"}\n'))
    with pytest.raises(UserError, match="gzip-compressed.*gunzip it"):
        read_prompt_rows(packed)


def test_a_heads_folder_of_another_kind_than_head_kind_is_refused(tmp_path):
    from selfdraft.heads import save_heads

    target = tiny_target("llama")
    folder = save_heads(random_heads(target, "medusa", 0), tmp_path / "medusa")
    with pytest.raises(UserError, match="holds medusa heads"):
        SelfDraftModel.with_heads(target, None, str(folder), head_kind="eagle")
    assert SelfDraftModel.with_heads(target, None, str(folder)).heads.config.head_kind == "medusa"


def test_repeated_prompt_ids_warn_once(tmp_path, capsys):
    from selfdraft.scripts.generate import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n{"prompt": "z"}\n')
    assert [r["prompt"] for r in read_prompts_file(str(path))] == ["x", "y", "z"]
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "repeats the ids a;" in err


def test_a_bad_prompt_in_a_batch_is_named_from_one(model):
    with pytest.raises(UserError, match="prompt 2 of the batch: input_ids is empty"):
        model.generate([PROMPT[0], torch.tensor([], dtype=torch.long)], 4)
