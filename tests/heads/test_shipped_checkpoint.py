"""The heads shipped in checkpoints/ for the embedded SmolLM2 target: loadable in one line, lossless,
and a regression guard on their acceptance length (not a timing)."""

from pathlib import Path

import yaml
from safetensors.torch import load_file

from selfdraft.heads.folder import read_heads_config
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.model import shipped_heads_dir
from selfdraft.training.config import load_run_config
from selfdraft.training.release.publish import CARD_LIMIT, FOLDER_FILES

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle"
PROMPTS = [
    "How do I make a cup of tea?",
    "Write a Python function that returns the largest element of a list.",
    "What is the difference between a list and a tuple in Python?",
]
# With its tuned tree (dynamic, plus a prompt-lookup branch) the shipped checkpoint reached tau 2.52 on
# these prompts when it was published (1.91 / 3.25 / 2.41); the floor sits below so only a real
# regression (broken drafting, loading or tree file) trips it. The previous heads scored ~1.4 here.
TAU_FLOOR = 2.0


def test_folder_is_a_model_card_checkpoint():
    assert shipped_heads_dir("smollm2-135m-instruct") == SHIPPED
    # the Hub shape `selfdraft publish` writes: five files, no stage copies or studies
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted(FOLDER_FILES)
    assert len((SHIPPED / "README.md").read_bytes()) <= CARD_LIMIT
    run = load_run_config(SHIPPED / "training_config.yaml")
    heads = read_heads_config(SHIPPED)
    assert (run.heads.kind, run.heads.layout) == (heads.head_kind, heads.eagle_layout)
    assert run.heads.feature_layers == heads.feature_layers
    assert (SHIPPED / "model.safetensors").stat().st_size < 32 * 2**20
    state = load_file(SHIPPED / "model.safetensors")
    assert not any(
        name.startswith(("model.", "lm_head.weight")) and v.shape[0] == 49152 for name, v in state.items()
    )
    card = (SHIPPED / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert (
        header["library_name"] == "selfdraft"
        and header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert header["license"] and header["datasets"]
    for fact in ("selfdraft train --config", " steps, world size", "tau", "speedup", "loads these heads by default"):
        assert fact in card


def test_shipped_heads_are_default_lossless_and_accept(smollm):
    target, tokenizer = smollm
    model = SelfDraftModel.from_pretrained("smollm2-135m-instruct")  # no heads= -> the shipped heads
    assert model.heads.config.head_kind == "eagle"
    taus = []
    for prompt in PROMPTS:
        ids = model.chat_ids(prompt)
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
        out = model.generate(ids, 40)
        assert out.tokens == ref
        taus.append(out.stats.mean_accepted)
    assert sum(taus) / len(taus) >= TAU_FLOOR, taus
    fresh = SelfDraftModel.from_pretrained("smollm2-135m-instruct", heads=None)  # None still means fresh
    assert fresh.heads.config.draft_vocab_size is None
