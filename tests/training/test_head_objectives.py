"""One objective per head kind, in the kind's own package (`heads/*/objective.py`): the heads registry
names it, `training/engine.py:objective_for` picks it from the run config, and the trainer's modules
never ask which kind of heads they hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from selfdraft.errors import UserError
from selfdraft.heads.eagle.objective import EagleObjective
from selfdraft.heads.eagle3.objective import Eagle3Objective
from selfdraft.heads.medusa.objective import MedusaObjective
from selfdraft.heads.objective import Objective
from selfdraft.heads.registry import HEAD_TYPES
from selfdraft.training.config import RunConfig
from selfdraft.training.engine import objective_for

ROOT = Path(__file__).resolve().parents[2]
KIND_FREE = ["training/train.py", "training/engine.py", "training/evaluation.py"]
HEAD_NAMES = {"medusa", "eagle", "eagle1", "eagle3", "selfdraft"}
HEAD_CLASSES = {"EagleHead", "MedusaHeads", "PublishedEagleHead"}


def _config(kind: str, layout: str) -> RunConfig:
    config = RunConfig()
    config.heads.kind, config.heads.layout = kind, layout
    return config


@pytest.mark.parametrize(
    ("kind", "layout", "objective"),
    [("medusa", "selfdraft", MedusaObjective), ("eagle", "selfdraft", EagleObjective),
     ("eagle", "eagle3", Eagle3Objective)],
)  # fmt: skip
def test_the_table_picks_one_objective_per_kind(kind, layout, objective):
    chosen = objective_for(_config(kind, layout))
    assert type(chosen) is objective and chosen.layout == layout


def test_every_trainable_layout_names_an_objective_of_its_own_package():
    """The registry's "module:Class" strings resolve (a typo fails here, not in a user's run), and each
    objective lives in the package of the kind it trains."""
    trainable = [t for t in HEAD_TYPES.values() if t.trains_with]
    assert {t.layout for t in trainable} == {"medusa", "selfdraft", "eagle3"}
    for t in trainable:
        objective = t.objective()
        assert isinstance(objective, Objective)
        package = "medusa" if t.kind == "medusa" else "eagle" if t.layout == "selfdraft" else t.layout
        assert type(objective).__module__ == f"selfdraft.heads.{package}.objective"


def test_a_kind_without_objective_is_refused_naming_the_known_ones():
    with pytest.raises(UserError, match=r"heads.kind 'eagle' with heads.layout 'eagle1'.*eagle/eagle3"):
        objective_for(_config("eagle", "eagle1"))
    assert type(objective_for(_config("medusa", "eagle3"))) is MedusaObjective  # Medusa has no layouts


def test_step_options_come_from_the_train_section():
    config = RunConfig()
    config.train.ttt_steps, config.train.medusa_decay = 3, 0.5
    eagle = objective_for(config).step_options(config.train)
    assert eagle["ttt_steps"] == 3 and eagle["feature_weight"] == config.train.feature_weight
    assert objective_for(config).step_options(config.train, depth=6)["ttt_steps"] == 6  # evaluation
    medusa = MedusaObjective().step_options(config.train, depth=6)
    assert medusa == {"decay": 0.5, "hard_labels": False}


@pytest.mark.parametrize("path", KIND_FREE)
def test_the_trainer_never_branches_on_the_head_kind(path):
    """No comparison with a kind or layout name and no isinstance on a head class: what differs
    between kinds belongs to their objective."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
            found += [f"line {node.lineno}: compares with {n!r}" for n in names if n in HEAD_NAMES]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            found += [f"line {node.lineno}: isinstance on {c}" for c in classes & HEAD_CLASSES]
        if isinstance(node, ast.Name) and node.id in HEAD_CLASSES:
            found.append(f"line {node.lineno}: names {node.id}")
    assert not found, f"{path} branches on the head kind: {found}"


def test_the_unroll_defaults_are_eagle3s():
    """ttt_steps 7 and decay 0.8 as EAGLE-3 trains (the reason is in `TrainSection`'s comments)."""
    train = RunConfig().train
    assert (train.ttt_steps, train.ttt_decay) == (7, 0.8)
