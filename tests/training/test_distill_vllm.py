"""`selfdraft distill --generator vllm`: vLLM writes the same rows as the target's own generate.

Marker `engine`: skipped where vLLM is not installed (the default `make test` environment); run with
`.venv-vllm/bin/python -m pytest -m engine tests/training/test_distill_vllm.py` after `make check-vllm`
has built that venv. vLLM runs its own kernels, so greedy answers may part from transformers' where
the target's two best logits are a near-tie (`bench/divergence.py`); anywhere else is an error.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.usefixtures("vllm_in_process")]
pytest.importorskip("vllm", reason="vLLM is not installed here; `make check-vllm` builds .venv-vllm with it")

TARGET = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def served():
    from selfdraft.training.data.distill import load_vllm_target

    return load_vllm_target(TARGET, torch.float32)


def _until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def test_greedy_answers_equal_the_targets_own_up_to_near_ties(served, smollm):
    from selfdraft.bench.divergence import first_divergence
    from selfdraft.bench.prompts import load_prompt_set
    from selfdraft.inference import SelfDraftModel
    from selfdraft.training.data.distill import stop_ids, target_answers, vllm_answers

    target, tokenizer = smollm
    base = SelfDraftModel.with_heads(target, tokenizer, None)
    prompts = [base.prompt_ids(p.text, p.chat)[0].tolist() for p in load_prompt_set("sharegpt:8")]
    stops = set(stop_ids(target, tokenizer))
    seeds = [0] * len(prompts)
    ours = vllm_answers(served, tokenizer)(prompts, 48, seeds)
    # one prompt per call: the target's batched generate pads, which moves its own near-ties
    theirs = [target_answers(target, tokenizer)([p], 48, [0])[0] for p in prompts]
    same, ties = 0, 0
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        a, b = _until_stop(a, stops), _until_stop(b, stops)
        if a == b:
            same += 1
            continue
        div = first_divergence(target, torch.tensor([prompt]), a, b)
        assert div is not None and div.near_tie, f"vLLM parts from generate at {div}, not a near-tie"
        ties += 1
    assert same + ties == len(prompts) and same >= len(prompts) // 2, (same, ties)


def test_sampled_rows_do_not_depend_on_the_batch_and_a_rerun_resumes(tmp_path):
    from selfdraft.scripts import cli

    def distill(out, batch):
        argv = ["distill", "--generator", "vllm", "--source", "sharegpt:6", "--first-turns", "--out", str(out)]
        argv += ["--max-new-tokens", "24", "--temperature", "1", "--seed", "3", "--batch-size", str(batch)]
        argv += ["--precision", "fp32"]
        assert cli.main(argv) == 0

    def rows(path):
        return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}

    distill(tmp_path / "a.jsonl", 6)
    distill(tmp_path / "b.jsonl", 2)
    a, b = rows(tmp_path / "a.jsonl"), rows(tmp_path / "b.jsonl")
    assert a == b and len(a) >= 5
    before = (tmp_path / "a.jsonl").read_bytes()
    distill(tmp_path / "a.jsonl", 6)  # every id is done: nothing is appended
    assert (tmp_path / "a.jsonl").read_bytes() == before
