"""Targets with large vocabularies (Qwen's 151,936 tokens): the full-vocabulary argmax in bounded
memory, the coverage measurement that sizes a draft vocabulary, and code prompts kept off the
benchmarks' HumanEval tasks."""

import re
from pathlib import Path

import torch
import yaml
from torch.overrides import TorchFunctionMode

from selfdraft.corpora.sources import HUMANEVAL_FIRST_TRAINING_TASK, load_source
from selfdraft.heads.objective import projected_argmax
from selfdraft.heads.vocab import build_draft_vocab
from selfdraft.training.data.vocab_coverage import spread, top_k_coverage
from selfdraft.training.output_head import OutputHead

ROOT = Path(__file__).resolve().parents[2]


class MatmulSizes(TorchFunctionMode):
    """Records the number of elements of every matmul result computed under it."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("__matmul__", "matmul"):
            self.sizes.append(out.numel())
        return out


def test_projected_argmax_is_exact_in_bounded_chunks():
    torch.manual_seed(0)
    features, weight = torch.randn(2, 11, 16), torch.randn(50, 16)
    expected = (features @ weight.T).argmax(-1)
    with MatmulSizes() as sizes:
        got = projected_argmax(features, OutputHead(weight), chunk_elements=150)  # 3 rows of 50 logits per chunk
    assert torch.equal(got, expected) and got.shape == (2, 11)
    assert max(sizes.sizes) <= 150 and sum(sizes.sizes) == 22 * 50
    assert torch.equal(projected_argmax(features, OutputHead(weight), chunk_elements=10), expected)  # 1 row at least
    assert torch.equal(projected_argmax(features[0, :0], OutputHead(weight)), torch.empty(0, dtype=torch.long))


def test_top_k_coverage_measures_the_vocabulary_a_run_builds():
    fit = torch.tensor([5, 0, 9, 9, 1, 0])
    held = torch.tensor([1, 2, 3, 4, 0, 10])
    coverage = top_k_coverage(fit, held, [1, 2, 3, 6])
    # tokens by fit frequency, ties to the lower id: 2, 3, 0, 4, 1, 5 (as build_draft_vocab picks)
    assert coverage == {1: 3 / 20, 2: 7 / 20, 3: 8 / 20, 6: 1.0}
    _, t2d = build_draft_vocab(fit, 3)
    assert float(held[t2d].sum()) / float(held.sum()) == coverage[3]
    assert top_k_coverage(fit, torch.zeros(6, dtype=torch.long), [2]) == {2: 0.0}


def test_spread_samples_evenly_across_a_sorted_list():
    assert spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert spread([1, 2], 5) == [1, 2]


def _humaneval_tasks_in(spec: str) -> range:
    """Task numbers a `humaneval:N[:skip=K]` prompt set uses (bench.prompts.load_prompt_set)."""
    match = re.fullmatch(r"humaneval(?::(\d+))?(?::skip=(\d+))?", spec)
    assert match, spec
    skip = int(match.group(2) or 0)
    return range(skip, skip + int(match.group(1) or 164))


def test_humaneval_training_prompts_skip_every_benchmarked_task():
    """The code-completion prompts that `selfdraft distill` answers for training are HumanEval tasks
    no prompt set of the project benchmarks or selects on: every humaneval spec in a bench config or
    a training config's comments ends before HUMANEVAL_FIRST_TRAINING_TASK."""
    records = load_source("humaneval-train")
    numbers = [int(r["id"].rsplit("/", 1)[1]) for r in records]
    assert numbers == list(range(HUMANEVAL_FIRST_TRAINING_TASK, 164))
    assert load_source("humaneval-train:3") == records[:3]
    first = records[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[1]["content"] == ""
    assert "```python\ndef " in first[0]["content"] or "```python\n\ndef " in first[0]["content"]
    used = []
    for path in [*ROOT.glob("configs/bench/*.yaml"), *ROOT.glob("configs/train/**/*.yaml")]:
        text = path.read_text()
        used += re.findall(r"humaneval:\d+(?::skip=\d+)?", text)  # prompt specs in commands and comments
        config = yaml.safe_load(text) or {}
        listed = config.get("prompts", []) + (config.get("data") or {}).get("sources", [])
        used += [p for p in listed if re.fullmatch(r"humaneval(:.*)?", p)]  # a bare `humaneval` is all 164
    assert used, "no benchmark prompt set found"
    assert max(max(_humaneval_tasks_in(spec), default=0) for spec in set(used)) < HUMANEVAL_FIRST_TRAINING_TASK
