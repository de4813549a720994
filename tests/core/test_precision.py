"""Draft dtype choice, ulps, the near-tie diagnostic, and exactness with bf16 heads on a float32 target."""

import copy
import itertools

import pytest
import torch
from torch import nn

from selfdraft import precision
from selfdraft.bench.divergence import first_divergence, float32_reference, own_gap_spread, ulp
from selfdraft.bench.report import identical_cell
from selfdraft.bench.run import mark_divergences
from selfdraft.errors import UserError
from selfdraft.heads.int8 import Int8Linear, has_int8_weights, heads_dtype, int8_weights
from selfdraft.inference import SelfDraftModel
from selfdraft.precision import cpu_kind, native_bf16, parse_dtype, resolve_draft_dtype

from tiny_models import greedy_reference, random_heads, tiny_target


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        parse_dtype("int8")


def test_auto_target_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert parse_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert parse_dtype("AUTO") is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert parse_dtype("auto") is torch.bfloat16


def test_native_bf16_flags():
    sapphire = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
    zen4 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    avx2 = "flags\t\t: fpu sse4_2 avx avx2 fma\n"
    graviton3 = "Features\t: fp asimd sve bf16 i8mm\n"
    assert native_bf16(sapphire, "x86_64") and native_bf16(zen4, "x86_64")
    assert not native_bf16(avx2, "x86_64") and not native_bf16("", "x86_64")
    assert native_bf16(graviton3, "aarch64") and not native_bf16("Features\t: fp asimd\n", "aarch64")
    kinds = [cpu_kind(sapphire, "x86_64"), cpu_kind(zen4, "x86_64"), cpu_kind(avx2, "x86_64")]
    assert kinds == ["cpu-amx", "cpu-avx512bf16", "cpu"]
    assert cpu_kind(graviton3, "aarch64") == "cpu-armbf16"
    assert (
        precision.machine_kind("cpu") == precision.this_cpu_kind()
        and precision.machine_kind("cuda") == "cuda"
    )


def test_resolve_draft_dtype(monkeypatch):
    target = tiny_target("llama")
    assert resolve_draft_dtype(None, target) is torch.float32
    assert resolve_draft_dtype("bfloat16", target) is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_draft_dtype("auto", target) is torch.bfloat16
    assert resolve_draft_dtype("auto", target.to(torch.float16)) is torch.float16  # never upcasts
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_draft_dtype("auto", target.to(torch.float32)) is torch.float32


def test_auto_drafts_with_int8_weights_only_in_bf16_on_native_cpus(monkeypatch):
    target = tiny_target("llama")
    assert precision.draft_weights_int8("int8", target) and precision.draft_weights_int8("INT8", target)
    assert not precision.draft_weights_int8("bfloat16", target)
    assert not precision.draft_weights_int8(None, target) and not precision.draft_weights_int8(
        torch.float32, target
    )
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.draft_weights_int8("auto", target)  # fp32 target -> bf16 heads -> int8 weights
    assert not precision.draft_weights_int8("auto", target.to(torch.float16))  # fp16 heads: not measured
    model = SelfDraftModel.with_heads(target.to(torch.float32), None, None, head_kind="eagle")
    assert has_int8_weights(model.heads) and heads_dtype(model.heads) is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert not precision.draft_weights_int8("auto", target.to(torch.float32))
    model = SelfDraftModel.with_heads(target, None, None, head_kind="eagle")
    assert not has_int8_weights(model.heads) and heads_dtype(model.heads) is torch.float32
    # auto never fails for want of int8: heads with no layer the kernel can read stay as they are
    narrow = nn.Sequential(nn.Linear(24, 8))
    assert int8_weights(narrow, torch.float32, strict=False) is narrow and isinstance(narrow[0], nn.Linear)


def test_ulp():
    assert ulp(torch.bfloat16, 18.0) == 0.125  # bf16 keeps 8 significant bits: 16..32 step 2**-3
    assert ulp(torch.bfloat16, -1.5) == 2.0**-7
    assert ulp(torch.float32, 1.0) == 2.0**-23


def test_first_divergence_measures_the_targets_own_gap():
    target = tiny_target("llama")
    prompt = torch.tensor([[5, 9, 11]])
    ref = greedy_reference(target, prompt, 8)
    assert first_divergence(target, prompt, ref, list(ref)) is None
    assert first_divergence(target, prompt, ref, ref[:5]) is None  # a prefix is no divergence
    other = ref[:4] + [(ref[4] + 1) % 96] + ref[5:]
    found = first_divergence(target, prompt, ref, other)
    with torch.no_grad():
        logits = target(torch.tensor([prompt[0].tolist() + ref[:4]])).logits[0, -1]
    assert found.position == 4 and (found.token_a, found.token_b) == (ref[4], other[4])
    assert found.gap == pytest.approx(float(logits[ref[4]] - logits[other[4]]), abs=1e-6)
    assert found.gap > 0  # ref[4] is the argmax
    assert found.gap_ulps == pytest.approx(found.gap / ulp(torch.float32, float(logits[ref[4]])))
    assert not found.near_tie  # a token the target clearly ranks lower is no tie at float32


def test_low_precision_divergence_is_measured_in_float32():
    """A bf16 target's gap is computed by a float32 copy and counted in bf16 ulps."""
    target = tiny_target("llama")
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    reference = float32_reference(bf16)
    assert reference is not bf16 and reference.dtype is torch.float32 and bf16.dtype is torch.bfloat16
    assert float32_reference(target) is target
    prompt = torch.tensor([[5, 9, 11]])
    ref = greedy_reference(target, prompt, 6)
    other = ref[:3] + [(ref[3] + 1) % 96] + ref[4:]
    found = first_divergence(bf16, prompt, ref, other)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt[0].tolist() + ref[:3]])).logits[0, -1]
    la, lb = float(logits[ref[3]]), float(logits[other[3]])
    assert found.gap == pytest.approx(abs(la - lb), abs=1e-6)
    assert found.gap_ulps == pytest.approx(abs(la - lb) / ulp(torch.bfloat16, max(abs(la), abs(lb))))
    # the spread is the target's own, in its dtype: float32 logits hardly move with the block size
    ids = torch.tensor([prompt[0].tolist() + ref[:3]])
    assert found.spread == pytest.approx(own_gap_spread(bf16, ids, ref[3], other[3])) and found.spread >= 0
    assert own_gap_spread(target, ids, ref[3], other[3]) < 1e-4


def test_near_tie_threshold_is_the_measured_spread():
    """A gap of 5.9 ulps is a near-tie when the target's own gap moves by more across block sizes."""
    from selfdraft.bench.divergence import Divergence

    assert Divergence(3, 1, 2, gap=0.1, gap_ulps=5.9, spread=0.125).near_tie
    assert not Divergence(3, 1, 2, gap=0.1, gap_ulps=5.9, spread=0.05).near_tie
    assert Divergence(3, 1, 2, gap=0.01, gap_ulps=1.5).near_tie


def test_spread_blocks_cover_every_shipped_tree_size():
    """The near-tie spread samples block sizes no more than 4 apart up to the largest block a shipped
    tree verifies: the target's own gap does not move monotonically with the block size."""
    import yaml

    from selfdraft.bench.divergence import BLOCK_SIZES
    from selfdraft.inference.model import shipped_heads_path
    from selfdraft.tree_syntax import MACHINE_SEP, read_tree_file

    tree_file = shipped_heads_path("smollm2-135m-instruct", "eagle") / "tree.yaml"
    largest = 0
    for key in yaml.safe_load(tree_file.read_text()):
        dtype, _, machine = key.partition(MACHINE_SEP)
        for sampling in (False, True):
            shape = read_tree_file(tree_file, dtype, sampling=sampling, machine=machine or None)
            largest = max(largest, shape.max_tokens)
    assert largest >= 13  # the dynamic + lookup + extension trees
    assert BLOCK_SIZES[0] == 1 and max(BLOCK_SIZES) >= largest
    assert all(b - a <= 4 for a, b in itertools.pairwise(BLOCK_SIZES))


def test_bench_marks_divergences_and_counts_them():
    target = tiny_target("llama")
    prompt = torch.tensor([[5, 9, 11]])
    ref = greedy_reference(target, prompt, 8)
    wrong = ref[:2] + [(ref[2] + 3) % 96] + ref[3:]
    rows = [
        {"prompt": "p", "method": "baseline", "temperature": 0.0, "repeat": 0, "tokens": ref},
        {"prompt": "p", "method": "m", "temperature": 0.0, "repeat": 0, "tokens": wrong},
        {"prompt": "p", "method": "m", "temperature": 1.0, "repeat": 0, "tokens": wrong},
    ]
    mark_divergences(target, rows, {"p": prompt})
    assert rows[1]["divergence"]["position"] == 2 and "divergence" not in rows[2]
    found = rows[1]["divergence"]
    assert found["near_tie"] == (found["gap_ulps"] <= 2 or found["gap"] <= found["spread"])
    record = {"identical_to_baseline": False, "identical_prompts": 4, "n": 6, "near_tie_prompts": 2}
    assert identical_cell(record) == "4/6 (2 near-tie)"
    assert identical_cell({**record, "near_tie_prompts": 1}) == "4/6 (1 near-tie) NO"
    assert identical_cell({"identical_to_baseline": True}) == "yes"


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_bf16_heads_on_fp32_target_stay_exact(kind):
    target = tiny_target("llama")
    heads = random_heads(target, kind, 3, draft_vocab_size=64 if kind == "eagle" else None)
    model = SelfDraftModel(target, None, heads.to(torch.bfloat16), tree="small")
    assert heads_dtype(model.heads) is torch.bfloat16 and target.dtype is torch.float32
    for seed in range(3):
        prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        out = model.generate(prompt, 24, stop_token_ids=[])
        assert out.tokens == greedy_reference(target, prompt, 24)
        assert out.stats.tree_passes >= 1


def test_draft_dtype_reaches_loaded_heads(tmp_path):
    """with_heads(draft_dtype=...) casts fresh heads, and borrowed fp32 projections still work."""
    target = tiny_target("llama")
    model = SelfDraftModel.with_heads(target, None, None, head_kind="medusa", draft_dtype="bfloat16", tree="small")
    assert heads_dtype(model.heads) is torch.bfloat16
    prompt = torch.tensor([[1, 2, 3, 4]])
    assert model.generate(prompt, 10, stop_token_ids=[]).tokens == greedy_reference(target, prompt, 10)


def test_smollm_bf16_target_parts_from_generate_only_at_near_ties(smollm):
    """A bfloat16 target with the shipped heads: every greedy text equals `generate`'s or parts from it
    where float32 puts the two tokens within 2 bf16 ulps. A verification error (a wrong mask, a stale
    cache row) would part where the target's choice is clear."""
    target, tokenizer = smollm
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    model = SelfDraftModel.with_heads(bf16, tokenizer, target_name="smollm2-135m-instruct")
    assert heads_dtype(model.heads) is torch.bfloat16
    taus = []
    for prompt in ("Write a Python function that reverses a list.", "Name three planets and one fact each."):
        ids = model.chat_ids(prompt)
        ref = bf16.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=model.default_stop_ids())
        ref = ref[0, ids.shape[1] :].tolist()
        out = model.generate(ids, 48)
        taus.append(out.stats.mean_accepted)
        found = first_divergence(bf16, ids, ref, out.tokens, reference=target)  # target: float32
        assert found is None or found.near_tie, found
    assert max(taus) > 1.5  # the trained heads really drafted accepted blocks


def test_int8_linear_is_the_float_linear_up_to_rounding():
    """Per-row int8 weights: the product stays within 1% of the float layer's; layers whose input
    width the kernel cannot read stay as they were."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 37)
    x = torch.randn(2, 5, 64)
    for dtype in (torch.float32, torch.bfloat16):
        out = Int8Linear(linear, dtype)(x.to(dtype)).float()
        ref = linear(x.to(dtype).float())
        assert out.shape == (2, 5, 37)
        assert ((out - ref).norm() / ref.norm()) < 0.01
    mixed = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 8))
    int8_weights(mixed, torch.bfloat16)
    assert [type(m).__name__ for m in mixed] == ["Int8Linear", "Int8Linear", "Linear"]
    assert mixed[2].weight.dtype is torch.bfloat16
    with pytest.raises(UserError, match="nothing to shrink"):
        int8_weights(nn.Sequential(nn.Linear(24, 8)), torch.float32)


def test_int8_heads_are_never_saved_as_a_checkpoint(tmp_path):
    """Rounded drafting weights would make an unloadable (or silently worse) checkpoint: refused."""
    from selfdraft.heads import save_heads

    model = SelfDraftModel.with_heads(tiny_target("llama"), None, None, head_kind="eagle", draft_dtype="int8")
    with pytest.raises(UserError, match="draft_dtype=None"):
        save_heads(model.heads, tmp_path / "heads")
    assert not (tmp_path / "heads").exists()


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_int8_heads_keep_greedy_output_identical(kind):
    target = tiny_target("llama")
    model = SelfDraftModel.with_heads(target, None, None, head_kind=kind, tree="small", draft_dtype="int8")
    assert has_int8_weights(model.heads) and heads_dtype(model.heads) in (torch.float32, torch.bfloat16)
    for seed in range(3):
        prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        out = model.generate(prompt, 24, stop_token_ids=[])
        assert out.tokens == greedy_reference(target, prompt, 24)


def test_smollm_int8_heads_stay_exact_and_still_draft(smollm):
    """The shipped heads with int8 weights on the float32 target: token-identical to `generate`, and
    rounding the weights did not break drafting (accepted blocks of 1.5+ tokens per pass)."""
    target, tokenizer = smollm
    model = SelfDraftModel.with_heads(
        target, tokenizer, target_name="smollm2-135m-instruct", draft_dtype="int8"
    )
    ids = model.chat_ids("Write a Python function that reverses a list.")
    ref = target.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=model.default_stop_ids())
    out = model.generate(ids, 48)
    assert out.tokens == ref[0, ids.shape[1] :].tolist()
    assert out.stats.mean_accepted > 1.5
