"""Pure algorithms core: answer matching, step segmentation, rewards and advantage estimators.

Only numpy, torch, pyahocorasick and the standard library are imported here (no verl, Ray, Kedro or
HTTP), so the native trainer and the VERL plugin share exactly one implementation; each RL method is
defined once, in its own module of :mod:`.methods`.
"""

from .advantages import (
    calibadv_advantage,
    calibadv_step_scores,
    grpo_outcome_advantage,
    spa_advantage,
    tspo_advantage,
)
from .entity_search import EntityMatcher
from .matching import AnswerScore, normalize_answer, score_answers
from .methods import METHODS, RewardInputs, get_method, method_advantages, method_rewards
from .rewards import (
    SpaderRewardConfig,
    discover_entities,
    exploration_step_rewards,
    final_answer_reward,
    first_occurrence_steps,
    spader_rewards,
    tool_cost_coefficient,
)
from .steps import StepLayout, segment_steps

__all__ = [
    "AnswerScore",
    "EntityMatcher",
    "METHODS",
    "RewardInputs",
    "SpaderRewardConfig",
    "StepLayout",
    "calibadv_advantage",
    "calibadv_step_scores",
    "discover_entities",
    "exploration_step_rewards",
    "final_answer_reward",
    "first_occurrence_steps",
    "get_method",
    "grpo_outcome_advantage",
    "method_advantages",
    "method_rewards",
    "normalize_answer",
    "score_answers",
    "segment_steps",
    "spa_advantage",
    "spader_rewards",
    "tool_cost_coefficient",
    "tspo_advantage",
]
