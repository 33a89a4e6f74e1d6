"""Strict typed settings and the one rule that lays a training method's block over the shared blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from spader_pipeline.typed_config import from_mapping, merge_settings, method_settings


@dataclass
class _Block:
    a: int = 1


def test_from_mapping_names_the_block_and_its_known_keys():
    assert from_mapping(_Block, {"a": 2}) == _Block(2)
    with pytest.raises(ValueError, match=r"unknown training.x settings \['b'\] \(training.x.b\); known: \['a'\]"):
        from_mapping(_Block, {"b": 1}, where="training.x")


def test_method_block_over_shared_reward_and_backend_block():
    training = {"reward": {"final_answer_weight": 1.0, "cost_free_steps": 100},
                "native": {"seed": 0, "total_steps": 2, "rollout": {"topk": 3, "max_turns": 3}}}
    method = {"method": "spader", "seed": 1, "reward": {"beta": 4.0, "cost_free_steps": 10}, "rollout": {"topk": 5}}
    assert method_settings(training, method) == {
        "reward": {"final_answer_weight": 1.0, "cost_free_steps": 10, "beta": 4.0}, "method": "spader", "seed": 1,
        "rollout": {"topk": 5}}
    native = method_settings(training, method, "native")
    assert native["seed"] == 1 and native["total_steps"] == 2 and native["rollout"] == {"topk": 5, "max_turns": 3}
    assert native["reward"]["cost_free_steps"] == 10
    assert training["native"]["rollout"] == {"topk": 3, "max_turns": 3}  # inputs are not modified
    assert merge_settings({"a": {"b": 1}}, None) == {"a": {"b": 1}}


def test_types_are_checked_when_asked_and_a_blocks_errors_carry_its_path():
    from spader_pipeline.typed_config import SettingsError, typed_block

    @dataclass
    class Typed:
        count: int = 1
        rate: float = 0.5
        name: str | None = None
        on: bool = True
        mode: Literal["a", "b"] = "a"

        def __post_init__(self):
            if self.count < 0:
                raise ValueError(f"count={self.count} must be >= 0")

    assert from_mapping(Typed, {"name": 2}) == Typed(name=2)  # unchecked by default
    assert from_mapping(Typed, {"rate": 1, "name": None}, check_types=True) == Typed(rate=1)
    for values, message in [({"count": "3"}, r"block.count='3': expected an integer$"),
                            ({"count": True}, "expected an integer"), ({"rate": "x"}, "expected a number"),
                            ({"name": 2}, "expected a string or null"), ({"on": "yes"}, "expected true or false"),
                            ({"mode": "c"}, r"use one of \['a', 'b'\]")]:
        with pytest.raises(SettingsError, match=message):
            from_mapping(Typed, values, where="block", check_types=True)
    with pytest.raises(SettingsError, match=r"^training.x: count=-1 must be >= 0$"):
        typed_block("training.x", lambda: from_mapping(Typed, {"count": -1}, where="training.x"))
