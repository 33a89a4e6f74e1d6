"""Advantage estimators: pure torch, batch-vectorised, shapes in each docstring.

| name | function | paper |
|---|---|---|
| ``grpo`` | :func:`grpo_outcome_advantage` | DeepSeekMath, arXiv 2402.03300 (verl's own on the VERL path) |
| ``spa`` | :func:`spa_advantage` | SPADER, arXiv 2606.00593 |
| ``calibadv`` | :func:`calibadv_advantage` | CalibAdv, arXiv 2604.18235 |
| ``tspo`` | :func:`tspo_advantage` | TSPO, arXiv 2601.22776 (PROPOSAL: only the abstract is public) |
"""

from .calibadv import NOT_CORRECT, calibadv_advantage, calibadv_step_scores, word_similarity
from .grpo import grpo_outcome_advantage, grpo_scalar_advantage
from .spa import discounted_step_returns, spa_advantage, spa_step_advantage
from .tspo import tspo_advantage

__all__ = [
    "NOT_CORRECT",
    "calibadv_advantage",
    "calibadv_step_scores",
    "discounted_step_returns",
    "grpo_outcome_advantage",
    "grpo_scalar_advantage",
    "spa_advantage",
    "spa_step_advantage",
    "tspo_advantage",
    "word_similarity",
]
