"""Exported EAGLE-3 heads served by a real vLLM (marker `engine`; `make check-vllm` runs it in .venv-vllm).

Skipped where vLLM is not installed (the default `make test` environment). With fresh heads on the
embedded SmolLM2 target it checks that vLLM loads the export and stays lossless; with trained heads
named by SELFDRAFT_ENGINE_HEADS it also checks that vLLM accepts what selfdraft accepts (K = 3).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.usefixtures("vllm_in_process")]
pytest.importorskip("vllm", reason="vLLM is not installed here; `make check-vllm` builds .venv-vllm with it")

TARGET = "smollm2-135m-instruct"


def _fresh_heads(path):
    from selfdraft.heads import HeadsConfig, build_heads, save_heads
    from selfdraft.target import load_target

    target, _ = load_target(TARGET)
    config = HeadsConfig.for_target(
        target.config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=[2, 15, 27],
        draft_vocab_size=2048,
        eagle_fc_bias=False,
    )
    heads = build_heads(config).attach(target)
    d2t = torch.zeros(2048, dtype=torch.long)
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[:2048] = True
    heads.draft_vocab.set_maps(d2t, t2d)
    heads.init_projection_from_target()
    return save_heads(heads, path)


def test_vllm_serves_fresh_exported_heads_losslessly(tmp_path):
    from selfdraft.bench.engine_check import run_check

    heads = _fresh_heads(tmp_path / "heads")
    [result] = run_check(heads, TARGET, tmp_path / "out", "sharegpt:2", ks=[2], max_new_tokens=16)
    assert result.identical == result.prompts == 2
    assert result.vllm_acceptance_length is not None and result.vllm_acceptance_length >= 1.0
    assert result.selfdraft_tau >= 1.0


@pytest.mark.skipif(
    not os.environ.get("SELFDRAFT_ENGINE_HEADS"),
    reason="set SELFDRAFT_ENGINE_HEADS to trained EAGLE-3-layout heads to compare acceptance",
)
def test_vllm_accepts_what_selfdraft_accepts(tmp_path):
    from selfdraft.bench.engine_check import run_check

    [result] = run_check(os.environ["SELFDRAFT_ENGINE_HEADS"], TARGET, tmp_path, "sharegpt:8", ks=[3])
    assert result.identical == result.prompts == 8
    assert abs(result.vllm_acceptance_length - result.selfdraft_tau) <= 0.10 * result.selfdraft_tau
