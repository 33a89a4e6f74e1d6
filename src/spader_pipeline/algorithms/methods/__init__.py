"""The RL methods, one module each, read by both trainers (native and verl).

Each method module defines its typed options (a frozen dataclass, defaults = the paper's or
released script's values), its reward layout (token rewards ``[B, T]``) and its advantage estimator,
and registers them with :func:`~.base.register_method`; importing this package imports them all.
The native trainer (:mod:`spader_pipeline.native.batch`) calls :func:`method_rewards` and
:func:`method_advantages`; on verl the ``spader`` reward manager calls the same
:func:`method_rewards` and :mod:`spader_pipeline.verl_plugin.estimators` registers each method's
estimator under its ``estimator`` name.

| method | reward layout (token rewards) | estimator | paper |
|---|---|---|---|
| ``grpo`` | outcome on the answer step's last token | ``grpo`` | DeepSeekMath, arXiv 2402.03300 |
| ``spader`` | exploration reward on each step's last token, outcome added on the answer step | ``spa`` | SPADER, arXiv 2606.00593 |
| ``calibadv`` | outcome on the answer step, silver-document score ``q_t`` on each search step | ``calibadv`` | CalibAdv, arXiv 2604.18235 |
| ``tspo`` | outcome (exact match) on the answer step, latent reward on the first-occurrence step | ``tspo`` | TSPO, arXiv 2601.22776 (proposal) |

The **outcome** is the shared final-answer term ``w_F·score`` (``−format_penalty`` on a format
error) minus the tool cost, :func:`~spader_pipeline.algorithms.rewards.outcome_reward`; the score is
the method's :attr:`~.base.Method.answer_score` (F1 unless the method says otherwise). The last run
of model tokens is always the answer step.

**Tool cost** is a per-method setting, ``SpaderRewardConfig.tool_round_cost``: SPADER charges
``c_eff·Count_t/|GT|`` on each step (its paper); the other methods, which have no step rewards,
charge ``c_eff·ΣCount/|GT|`` on the outcome. Their papers have no tool cost, so their configs set 0.
Adding a method: docs/algorithms.md, "Adding a method".
"""

from __future__ import annotations

from .base import (
    METHODS,
    Method,
    MethodRewards,
    RewardInputs,
    answer_score,
    default_methods,
    estimator_names,
    get_method,
    method_advantages,
    method_names,
    method_rewards,
    on_register,
    options_from_mapping,
    register_method,
    registered,
    reward_config_from_mapping,
    split_outcome_and_steps,
    unregister_method,
)

# importing a method module registers it; this order is method_names()'s
from .grpo import GrpoOptions  # isort: skip
from .spader import SpaOptions  # isort: skip
from .calibadv import CalibAdvOptions  # isort: skip
from .tspo import TspoOptions  # isort: skip

__all__ = [
    "METHODS",
    "CalibAdvOptions",
    "GrpoOptions",
    "Method",
    "MethodRewards",
    "RewardInputs",
    "SpaOptions",
    "TspoOptions",
    "answer_score",
    "default_methods",
    "estimator_names",
    "get_method",
    "method_advantages",
    "method_names",
    "method_rewards",
    "on_register",
    "options_from_mapping",
    "register_method",
    "registered",
    "reward_config_from_mapping",
    "split_outcome_and_steps",
    "unregister_method",
]
