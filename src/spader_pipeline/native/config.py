"""Configuration of the native (single-process) RL trainer.

One dataclass, one docstring per field, and ``__post_init__`` checks that reject inconsistent
settings with a message that says what to change (TRL's ``GRPOConfig`` habit). The defaults are
the SPADER paper's policy-optimisation settings (spec §4.3) scaled down for a CPU; the Kedro
parameters in ``conf/base/parameters_training.yml`` override them per method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

METHODS = ("grpo", "spader", "calibadv", "tspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2")


@dataclass
class NativeTrainerConfig:
    """Everything one native RL run needs besides the model, data and search backend."""

    # ---- method ------------------------------------------------------------------------------
    method: str = "spader"
    """the RL method: ``grpo`` (outcome F1, verl's GRPO estimator), ``spader`` (exploration reward +
    step-wise peer advantage), ``calibadv`` or ``tspo`` (see docs/algorithms.md)"""
    reward: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of :class:`spader_pipeline.algorithms.SpaderRewardConfig` (alpha, beta, lam,
    tool_round_cost, cost_free_steps, cost_rampup_steps, final_answer_weight, format_penalty,
    enable_exploration)"""
    advantage: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the method's advantage estimator (e.g. ``gamma`` for spader,
    ``norm_adv_by_std_in_grpo`` for grpo, ``latent_reward`` for tspo, ``target_ratio`` for calibadv)"""

    # ---- schedule ----------------------------------------------------------------------------
    total_steps: int = 100
    """optimizer steps of the run (each step = one rollout batch)"""
    max_seconds: float | None = None
    """wall-clock budget: the run ends (and saves its final model) after the first step that
    passes it, even before ``total_steps``; ``None`` = no budget. With a budget the number of steps
    depends on the machine, so leave it ``None`` where runs must be step-for-step reproducible"""
    prompts_per_step: int = 4
    """distinct questions per step"""
    group_size: int = 8
    """rollouts per question (``n``); group statistics need at least 2"""
    micro_batch_size: int = 8
    """trajectories per forward/backward pass; gradients accumulate over the batch"""
    ppo_epochs: int = 1
    """passes over each rollout batch (1 = on-policy, the SPADER setting)"""

    # ---- optimisation ------------------------------------------------------------------------
    learning_rate: float = 1e-5
    """peak AdamW learning rate"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    warmup_ratio: float = 0.05
    """fraction of ``total_steps`` with a linear learning-rate warm-up (then constant)"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping threshold"""
    clip_ratio_low: float = 0.2
    """PPO clip ε below 1"""
    clip_ratio_high: float = 0.2
    """PPO clip ε above 1"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages (must be > 1)"""
    loss_agg_mode: str = "token-mean"
    """how verl's ``agg_loss`` reduces the token losses"""
    kl_coef: float = 0.001
    """coefficient of the KL loss to the reference (start) model; 0 disables the reference model"""
    kl_type: str = "low_var_kl"
    """verl ``kl_penalty`` estimator of the KL loss"""
    temperature: float = 1.0
    """sampling temperature; log-probabilities are computed at the same temperature"""
    bf16: bool | str = "auto"
    """bf16 autocast for the training forward pass (``auto``: CUDA only)"""

    # ---- rollout -----------------------------------------------------------------------------
    max_turns: int = 4
    """most assistant turns per trajectory"""
    max_new_tokens: int = 64
    """most tokens per assistant turn"""
    max_response_tokens: int = 1024
    """token budget of a whole response (model + observation tokens)"""
    topk: int = 3
    """documents per query"""
    max_observation_chars: int | None = 1500
    """cap on one observation's text"""
    prompt_template: str | None = None
    """prompt template text with ``{question}`` (``None``: the project's active template)"""

    # ---- bookkeeping -------------------------------------------------------------------------
    seed: int = 0
    """seeds prompt order, sampling and initialisation"""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto``"""
    checkpoint_every: int = 25
    """save a checkpoint every this many steps (and at the end); 0 = only at the end"""
    keep_checkpoints: int = 2
    """most recent checkpoints kept on disk"""
    resume: bool = True
    """continue from the latest checkpoint in the output directory if there is one"""
    log_samples_every: int = 25
    """write sample trajectories as an MLflow artifact every this many steps (0 = never)"""
    num_samples_logged: int = 4
    """trajectories per sample artifact"""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {METHODS}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size={self.group_size}: group-relative advantages need at least 2 rollouts per prompt"
            )
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError("max_seconds must be > 0 or null")
        if self.prompts_per_step < 1 or self.total_steps < 0:
            raise ValueError("prompts_per_step must be >= 1 and total_steps >= 0")
        batch = self.prompts_per_step * self.group_size
        if self.micro_batch_size < 1 or batch % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} must divide the batch of "
                f"prompts_per_step × group_size = {batch} trajectories"
            )
        if self.ppo_epochs < 1:
            raise ValueError("ppo_epochs must be >= 1")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError("warmup_ratio must be in [0, 1)")
        if self.learning_rate <= 0 or self.max_grad_norm <= 0:
            raise ValueError("learning_rate and max_grad_norm must be > 0")
        if not (0 < self.clip_ratio_low < 1 and self.clip_ratio_high > 0):
            raise ValueError("clip ratios must satisfy 0 < clip_ratio_low < 1 and clip_ratio_high > 0")
        if self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip PPO)")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
        if self.kl_coef < 0 or self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_coef must be >= 0 and kl_type one of {KL_TYPES}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 for RL sampling (greedy rollouts give identical groups)")
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.max_response_tokens <= self.max_new_tokens:
            raise ValueError("need max_turns >= 1, max_new_tokens >= 1 and max_response_tokens > max_new_tokens")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        if self.method == "grpo" and self.reward.get("enable_exploration", False):
            raise ValueError("method=grpo uses the outcome reward only; set reward.enable_exploration: false")
        self.betas = tuple(self.betas)  # YAML gives lists

    @property
    def batch_size(self) -> int:
        """Trajectories per step (``prompts_per_step × group_size``)."""
        return self.prompts_per_step * self.group_size

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_ratio * self.total_steps)

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> NativeTrainerConfig:
        """Build from a (Kedro parameter) mapping; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown native trainer settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(params))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
