"""Configuration of the native (single-process) RL trainer.

One dataclass, one docstring per field, and ``__post_init__`` checks that reject inconsistent
settings with a message that says what to change (TRL's ``GRPOConfig`` habit). The defaults are
the SPADER paper's policy-optimisation settings (docs/training.md) scaled down for a CPU; the Kedro
parameters in ``conf/base/parameters_training.yml`` override them per method. The method itself
(its reward layout, estimator and options) is defined once in
:mod:`spader_pipeline.algorithms.methods`, shared with the verl plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from spader_pipeline.agent.engines import check_engine
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.algorithms.methods import get_method, options_from_mapping, reward_config_from_mapping
from spader_pipeline.algorithms.rewards import SpaderRewardConfig
from spader_pipeline.typed_config import SettingsError, from_mapping, method_settings, typed_block

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2")


@dataclass
class NativeTrainerConfig:
    """Everything one native RL run needs besides the model, data and search backend."""

    # ---- method ------------------------------------------------------------------------------
    method: str = "spader"
    """a method of :mod:`spader_pipeline.algorithms.methods`: ``grpo``, ``spader``, ``calibadv`` or
    ``tspo`` (docs/algorithms.md)"""
    reward: SpaderRewardConfig | Mapping[str, Any] = field(default_factory=dict)
    """:class:`~spader_pipeline.algorithms.SpaderRewardConfig` (a mapping is converted; exploration is
    the method's, not a setting)"""
    options: Any = field(default_factory=dict)
    """the method's options dataclass (e.g. ``SpaOptions``; a mapping is converted)"""

    # ---- schedule ----------------------------------------------------------------------------
    total_steps: int = 100
    """optimizer steps of the run (each step = one rollout batch)"""
    max_seconds: float | None = None
    """wall-clock budget: the run ends (validating and saving its final model) before a step that
    would not end within it, judged by its longest step so far (the first step always runs), even
    before ``total_steps``; ``None`` = no budget. With a budget the number of steps depends on the
    machine, so leave it ``None`` where runs must be step-for-step reproducible"""
    prompts_per_step: int = 4
    """distinct questions per step"""
    group_size: int = 8
    """rollouts per question (``n``); group statistics need at least 2"""
    micro_batch_size: int = 8
    """trajectories per forward/backward pass at most; gradients accumulate over the batch"""
    micro_batch_max_tokens: int | None = None
    """padded tokens per forward/backward pass at most (rows × the longest row, at least one row);
    ``None`` = ``micro_batch_size`` rows whatever their length. Long trajectories then come in
    fewer rows per pass: less padding, and attention's cost grows with the square of the longest
    row. The gradient does not change (the loss is a token-weighted sum over the whole batch);
    verl's counterpart is ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``"""
    ppo_epochs: int = 1
    """passes over each rollout batch (1 = on-policy, the SPADER setting)"""
    ppo_mini_batches: int = 1
    """optimiser steps per pass: the step's groups split into this many mini-batches of whole groups,
    one clipped step each against the rollout policy's log-probs (verl's ``ppo_mini_batch_size`` =
    ``prompts_per_step / ppo_mini_batches``; 1 = the SPADER setting, one step per rollout batch). A
    rollout batch costs about as much to decode at 256 rows as at 1,024 on a GPU (docs/gpu.md): more
    mini-batches turn a wider batch into more optimiser steps"""
    rollout_kv_cache_budget_mb: float | None = None
    """MiB the rollout's KV caches may take at their longest (``max_prompt_tokens`` +
    ``rollout.max_response_tokens`` per row, :mod:`spader_pipeline.modeling.memory_budget`): the
    step's groups are then decoded in several passes of whole groups, each pass keeping its cache
    between turns. ``None`` = the whole step in one pass (fastest on a CPU, largest footprint)"""

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
    """bf16 autocast for rollouts and the training forward pass (``auto``: on for CUDA; on a CPU
    decided by its flags, :mod:`spader_pipeline.modeling.precision`)"""
    trainable_layers: int | None = None
    """train only the top this-many decoder blocks (+ final norm); ``None`` = the whole model.
    Lower blocks and embeddings stay frozen, so the backward pass stops early (CPU speed)"""
    rollout_weights: str = "model"
    """what the rollout decodes with: ``model`` (the trained model, under bf16 autocast when ``bf16``)
    or ``bf16`` (a bf16 copy of its weights, refreshed after every optimiser step: no cast of a weight
    at every decoding step, the way a served bf16 checkpoint samples). The update and validation keep
    the trained model; with ``bf16`` the rollout captures no boundary states (they would come from
    the copy's bf16 blocks), so the update runs the frozen blocks itself. A GPU option: on a CPU with
    bf16 units the copy decoded 1.12× faster than autocast (docs/gpu.md)"""
    reuse_rollout_states: bool = True
    """with ``trainable_layers`` below the model's depth: the rollout keeps the last frozen block's
    output at every token and the update runs only the trained blocks from it, instead of running
    the frozen blocks again (same loss and gradients up to float reassociation; docs/training.md).
    ``false``: the update runs the whole model"""
    shared_prefix: bool | str = "auto"
    """whether the update's passes encode the prompt instruction every row starts with once, the rows
    continuing from its keys and values, instead of in every row: ``"auto"`` = on a CPU (saved
    arithmetic), not on a GPU (a forward there costs its launches, and the shared prefix runs every
    block twice); the same loss and gradients up to float reassociation
    (:func:`~spader_pipeline.modeling.shared_prefix.use_shared_prefix`)"""

    # ---- rollout -----------------------------------------------------------------------------
    rollout: RolloutConfig | Mapping[str, Any] = field(
        default_factory=lambda: RolloutConfig(max_turns=4, max_response_tokens=1024, topk=3, max_observation_chars=1500)
    )
    """trajectory limits and search settings (:class:`~spader_pipeline.agent.rollout.RolloutConfig`;
    a mapping is converted)"""
    engine: str = "hf"
    """the rollout engine that decodes the rollouts and validation (:mod:`spader_pipeline.agent.engines`;
    ``hf``: the in-process decoder). With an engine that captures no boundary states the update runs
    the frozen blocks itself, as with ``rollout_weights: bf16``"""
    max_new_tokens: int = 64
    """most tokens per assistant turn"""
    max_prompt_tokens: int = 1024
    """prompts longer than this are left-truncated with a warning (VERL's ``data.max_prompt_length``)"""
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
    """continue from the newest checkpoint in the output directory if there is one; when it was
    written with other settings or another start model the run stops and lists them. ``false``:
    start afresh, the output directory's checkpoints moved aside whole (never deleted) to
    ``checkpoints.superseded-<time>/`` with their run's config (docs/reliability.md)"""
    log_samples_every: int = 25
    """write sample trajectories as an MLflow artifact every this many steps (0 = never)"""
    num_samples_logged: int = 4
    """trajectories per sample artifact"""

    def __post_init__(self) -> None:
        get_method(self.method)  # unknown methods: the error lists the registered ones
        if isinstance(self.reward, Mapping):
            self.reward = reward_config_from_mapping(self.method, self.reward)
        if isinstance(self.options, Mapping):
            self.options = options_from_mapping(self.method, self.options)
        if isinstance(self.rollout, Mapping):
            self.rollout = from_mapping(RolloutConfig, self.rollout, where="rollout")
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
        if self.micro_batch_max_tokens is not None and self.micro_batch_max_tokens < 1:
            raise ValueError("micro_batch_max_tokens must be >= 1 or null")
        if self.rollout_kv_cache_budget_mb is not None and self.rollout_kv_cache_budget_mb <= 0:
            raise ValueError("rollout_kv_cache_budget_mb must be > 0 or null")
        check_engine(self.engine)  # unknown engines: the error lists the registered ones
        if self.shared_prefix not in (True, False, "auto"):
            raise ValueError(f"shared_prefix={self.shared_prefix!r}: use true, false or 'auto'")
        if self.rollout_weights not in ("model", "bf16"):
            raise ValueError(f"rollout_weights={self.rollout_weights!r}: use 'model' or 'bf16'")
        if self.ppo_epochs < 1:
            raise ValueError("ppo_epochs must be >= 1")
        if self.ppo_mini_batches < 1 or self.prompts_per_step % self.ppo_mini_batches:
            raise ValueError(
                f"ppo_mini_batches={self.ppo_mini_batches} must be >= 1 and divide prompts_per_step="
                f"{self.prompts_per_step} (mini-batches of whole groups)"
            )
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
        if self.rollout.max_turns < 1 or self.max_new_tokens < 1 or self.rollout.max_response_tokens <= self.max_new_tokens:
            raise ValueError(
                "need rollout.max_turns >= 1, max_new_tokens >= 1 and rollout.max_response_tokens > max_new_tokens"
            )
        if self.max_prompt_tokens < 1 or (self.trainable_layers is not None and self.trainable_layers < 1):
            raise ValueError("max_prompt_tokens must be >= 1 and trainable_layers >= 1 or null")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        self.betas = tuple(self.betas)  # YAML gives lists

    @property
    def batch_size(self) -> int:
        """Trajectories per step (``prompts_per_step × group_size``)."""
        return self.prompts_per_step * self.group_size

    def rollout_rows(self, model_config: Any) -> int:
        """Trajectories decoded together: the whole step, or as many whole groups as the KV budget
        holds (fewer rows than a group only when one group does not fit)."""
        if self.rollout_kv_cache_budget_mb is None:
            return self.batch_size
        from spader_pipeline.modeling.memory_budget import rows_within_budget

        tokens = self.max_prompt_tokens + self.rollout.max_response_tokens
        rows = rows_within_budget(model_config, tokens, self.rollout_kv_cache_budget_mb, limit=self.batch_size)
        return rows if rows < self.group_size else rows - rows % self.group_size

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_ratio * self.total_steps)

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> NativeTrainerConfig:
        """Build from a (Kedro parameter) mapping; unknown keys are an error."""
        return from_mapping(cls, params, where="native trainer")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trainer_config(native: Mapping[str, Any] | None, method: Mapping[str, Any] | None = None, *,
                   reward: Mapping[str, Any] | None = None, where: str = "training.native",
                   method_where: str = "the method block", **overrides: Any) -> NativeTrainerConfig:
    """The one construction of the trainer's configuration from settings blocks.

    ``native``: the trainer settings every method shares (``training.native``), or a whole
    configuration (``python -m spader_pipeline.native``'s ``run.json``); ``reward``: the shared reward
    settings (``training.reward``; ``None``: ``native``'s own ``reward``); ``method``: the method's block
    (``train_<method>.method``), laid over both (:func:`~spader_pipeline.typed_config.method_settings`);
    ``overrides``: set last (the device, a time budget). An unknown key is named with its block's
    path (``where``, ``method_where``), a value of the wrong kind or a rejected one too
    (:class:`~spader_pipeline.typed_config.SettingsError`).
    """
    known = {f.name for f in fields(NativeTrainerConfig) if f.init}
    for block, path in ((native, where), (method, method_where)):
        unknown = sorted(set(block or {}) - known)
        if unknown:
            paths = ", ".join(f"{path}.{key}" for key in unknown)
            raise SettingsError(f"unknown {path} settings {unknown} ({paths}); known: {sorted(known)}")
    shared_reward = reward if reward is not None else (native or {}).get("reward")
    values = method_settings({"native": native, "reward": shared_reward}, method or {}, "native")
    values.update(overrides)
    block = where if method is None else f"{where} with {method_where}"
    # the nested blocks typed here, so that an error names where each comes from
    values["reward"], values["options"] = method_blocks(values.get("method", NativeTrainerConfig.method),
                                                        values["reward"], values.get("options"), method_where=method_where)
    if isinstance(values.get("rollout"), Mapping):
        values["rollout"] = from_mapping(RolloutConfig, values["rollout"], where=f"{where}.rollout", check_types=True)
    return typed_block(block, lambda: from_mapping(NativeTrainerConfig, values, where=block, check_types=True))


def method_blocks(method: str, reward: Mapping[str, Any] | None, options: Mapping[str, Any] | None, *,
                  method_where: str = "the method block") -> tuple[SpaderRewardConfig, Any]:
    """The method's reward settings (the shared ones with the method's laid over them) and options,
    typed as the method registry defines them (:mod:`spader_pipeline.algorithms.methods`), what both
    backends read; an error names the block (``method_where``: ``train_<method>.method``)."""
    spec = typed_block(f"{method_where}.method", lambda: get_method(method))
    typed_reward = from_mapping(SpaderRewardConfig, {"tool_round_cost": spec.tool_round_cost, **dict(reward or {})},
                                where=f"{method_where}.reward (over training.reward)", check_types=True,
                                enable_exploration=spec.exploration)
    return typed_reward, from_mapping(spec.options, options, where=f"{method_where}.options", check_types=True)
