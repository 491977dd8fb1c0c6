"""The job file's training tables: what is trained and how.

``[model]`` (the policy), ``[train]`` with its ``lora`` table (the trainer and its optimizer),
``[algorithm]`` (the loss pipeline), ``[critic]`` (the value model), ``[[teachers]]``
(distillation teachers) and ``[sft]`` (supervised fine-tuning). Each table is an attrs class whose
fields carry the validators of :mod:`.fields`; :class:`~.job.JobConfig` gathers them into a job.
"""

from __future__ import annotations

from typing import Any

import attrs

from loongsage_hookspecs import LORA_ALL_LINEAR

from .fields import (
    Args,
    RangeError,
    at_least_one,
    component,
    in_range,
    non_negative,
    optional_at_least_one,
    positive,
    two_betas,
    unit_interval,
    valid_seed,
)

INFRA_FAILURE_MODES = ("exclude", "zero_reward")
"""What ``[algorithm] infra_failures`` may say to do with trajectories that infrastructure failed."""


@attrs.define
class ModelConfig:
    """The policy model: a local Hugging Face directory (``path``) or, for tests and tiny models,
    a ``config`` table (a transformers config dict with ``model_type``) plus a ``tokenizer``
    directory or tokenizer.json file."""

    path: str | None = None
    """A local Hugging Face model directory (relative to the job file)."""
    config: Args = attrs.field(factory=dict)
    """An inline transformers config (with ``model_type``) for a randomly initialised model, used without ``path``."""
    tokenizer: str | None = None
    """A tokenizer directory or ``tokenizer.json`` file (default: the one in ``path``)."""
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "bfloat16", "float16")))
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16`` (16-bit training keeps float32 master weights)."""
    fp32_lm_head: bool = False
    """Compute the output layer in float32 under a 16-bit ``dtype``."""
    seed: int = attrs.field(default=0, validator=valid_seed)
    """Seed of the weights of a model built from ``config``."""


def _target_modules(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An attrs validator: ``"all-linear"`` alone, or a non-empty list of module names."""
    if not value or not all(isinstance(v, str) and v for v in value):
        raise RangeError(f"must be \"{LORA_ALL_LINEAR}\" or a non-empty list of module names, got {value!r}",
                         attribute.name)
    if LORA_ALL_LINEAR in value and len(value) > 1:
        raise RangeError(f"\"{LORA_ALL_LINEAR}\" stands alone (it already names every linear layer), got {value!r}",
                         attribute.name)


@attrs.define
class LoraConfig:
    """``[train] lora``: train a low-rank adapter instead of the whole model (LoRA).

    ``rank`` is the adapter's rank r, ``alpha`` its scale (the update is ``alpha / rank * B @ A``),
    ``dropout`` the dropout on the adapter's input while training, ``target_modules`` the linear
    layers that get an adapter: module names (``["q_proj", "v_proj"]``) or ``"all-linear"`` (every
    linear layer but the output layer). Only the adapter's weights train, are checkpointed and are
    sent to the engines; the KL reference is the base model with the adapter disabled."""

    rank: int = attrs.field(default=8, validator=at_least_one)
    """The adapter's rank r."""
    alpha: float = attrs.field(default=16.0, validator=positive)
    """The adapter's scale: the update is ``alpha / rank * B @ A``."""
    dropout: float = attrs.field(default=0.0, validator=in_range(ge=0, lt=1))
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = attrs.field(factory=lambda: [LORA_ALL_LINEAR], validator=_target_modules)
    """Linear layers that get an adapter: module names (``["q_proj", "v_proj"]``) or ``"all-linear"`` (every linear
    layer but the output layer)."""

    @property
    def all_linear(self) -> bool:
        """Whether ``target_modules`` is ``"all-linear"``."""
        return self.target_modules == [LORA_ALL_LINEAR]


@attrs.define
class TrainConfig:
    """Trainer settings. ``mini_batch_size`` rows per optimizer step, split into micro-batches of
    ``micro_batch_size`` rows; the loss denominator is global to the mini-batch.

    ``max_bad_steps``: a step whose loss, gradient norm or weights are not finite is skipped, and so
    is one that trains no row; this many such steps in a row end the run with an error naming
    the cause.

    ``max_tokens_per_micro_batch``: padding-free micro-batches packed up to this many tokens
    (instead of ``micro_batch_size`` rows), for training and the scoring passes; data-parallel
    ranks then get near-equal token counts (backends without packing ignore it).

    ``peak_tflops``: one trainer device's peak the ``perf/mfu_*`` metrics divide by (default: a
    table of accelerators, or a matmul probe on a CPU; :mod:`loongsage_core.flops`).

    ``lora`` (a :class:`LoraConfig` table, unset by default): train a LoRA adapter instead of
    every weight."""

    backend: str = component("train_backend", default="torch")
    """The train backend component (``torch``, ``megatron``)."""
    num_workers: int = attrs.field(default=1, validator=at_least_one)
    """Trainer ranks (data parallel; with model parallelism, every rank of the layout)."""
    lr: float = attrs.field(default=1e-5, validator=positive)
    """Learning rate (AdamW)."""
    lr_schedule: str = attrs.field(default="constant", validator=attrs.validators.in_(("constant", "linear", "cosine")))
    """``constant``, ``linear`` or ``cosine``, after ``lr_warmup_steps`` of linear warmup."""
    lr_warmup_steps: int = attrs.field(default=0, validator=in_range(ge=0))
    """Optimizer steps of linear warmup."""
    min_lr_ratio: float = attrs.field(default=0.0, validator=unit_interval)
    """Where ``linear`` and ``cosine`` schedules end, as a fraction of ``lr``."""
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)
    """AdamW weight decay."""
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999], validator=two_betas)
    """AdamW betas, two numbers in [0, 1)."""
    eps: float = attrs.field(default=1e-8, validator=positive)
    """AdamW epsilon."""
    grad_clip: float = attrs.field(default=1.0, validator=non_negative)
    """Gradient-norm clipping (0: none)."""
    total_steps: int = attrs.field(default=50, validator=in_range(ge=0))
    """Training steps of the run."""
    mini_batch_size: int = attrs.field(default=16, validator=at_least_one)
    """Rows per optimizer step (the loss denominator is global to it)."""
    micro_batch_size: int = attrs.field(default=4, validator=at_least_one)
    """Rows per forward/backward pass."""
    max_tokens_per_micro_batch: int | None = attrs.field(default=None,
                                                         validator=attrs.validators.optional(at_least_one))
    """Padding-free micro-batches of at most this many tokens instead of ``micro_batch_size`` rows (backends without
    packing ignore it)."""
    ppo_epochs: int = attrs.field(default=1, validator=at_least_one)
    """Passes over each step's rows."""
    max_bad_steps: int = attrs.field(default=3, validator=at_least_one)
    """Bad steps in a row (non-finite loss, gradients or weights, or nothing trained) that end the run."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    peak_tflops: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """One trainer device's peak TFLOP/s for the ``perf/mfu_*`` metrics (default: a table of accelerators, or a
    matmul probe on a CPU)."""
    backend_args: Args = attrs.field(factory=dict)
    """Arguments of the train backend (see its plugin's README)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (unset: full fine-tuning)."""


@attrs.define
class AlgorithmConfig:
    """Loss pipeline choices (corrections, advantages, policy loss, aggregation, KL). Each ``*_args``
    table is passed as keyword arguments to the named component.

    Distillation (rows of sources with a ``teacher``): with ``distill_kl`` unset the teachers
    stand in for the reference model and feed ``kl`` / ``kl_coef`` / ``kl_in_reward``; with
    ``distill_kl`` set (a ``kl`` component, e.g. ``opd_topk_kl``) it is a term of its own,
    ``distill_coef * aggregate(term)`` in the loss (or subtracted from the token rewards with
    ``distill_in_reward``), next to an ordinary reference KL. ``distill_topk`` is how many
    teacher top-k entries per token are computed when the term ``requires = "topk"``.

    Router Replay (R3, mixture-of-experts policies): ``router_replay`` asks the engines for the
    experts they routed each token to and makes every policy forward (old log-probs, training, a
    LoRA run's reference) use them, gating weights still from the current router. With
    ``router_replay_compare`` (default) the old-log-prob pass (then always run) also scores the
    rows without replay, for ``train/router_agreement[_no_replay]`` and
    ``train/is_approx_k3_kl_no_replay``.

    Failed trajectories (``Trajectory.failure``): the policy's own failures (``agent``: over the
    context, an agent raising ``AgentFailure``) are trained on with reward 0, like a wrong answer.
    Infrastructure failures (a sandbox, a CLI crash or timeout, an engine, a reward that broke)
    say nothing about the policy: ``infra_failures = "exclude"`` (default) leaves them out of
    their group's statistics and of the loss, ``"zero_reward"`` trains them with reward 0. A
    group-relative estimator's group left with fewer than two samples is not trained."""

    advantage: str = component("advantage", args="advantage_args", default="grpo")
    """The advantage estimator (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``,
    ``gae``, ...)."""
    advantage_args: Args = attrs.field(factory=dict)
    """Arguments of the advantage estimator."""
    policy_loss: str = component("policy_loss", args="policy_loss_args", default="ppo_clip")
    """The policy loss (``ppo_clip``, ``gspo``, ``cispo``, ``reinforce``, ...)."""
    policy_loss_args: Args = attrs.field(factory=dict)
    """Arguments of the policy loss."""
    loss_agg: str = component("loss_aggregation", args="loss_agg_args", default="token_mean")
    """How token losses become one number (``token_mean``, ``seq_mean_token_sum``, ``seq_mean_token_mean``,
    ``seq_mean_token_sum_norm``)."""
    loss_agg_args: Args = attrs.field(factory=dict)
    """Arguments of the loss aggregation."""
    kl: str | None = component("kl", args="kl_args", default=None)
    """A KL term against the reference model (``k1``, ``k2``, ``k3``, ``low_var_kl``); unset: none."""
    kl_args: Args = attrs.field(factory=dict)
    """Arguments of the KL term."""
    kl_coef: float = attrs.field(default=0.0, validator=non_negative)
    """Weight of the KL term (in the loss, or in the reward with ``kl_in_reward``)."""
    kl_in_reward: bool = False
    """Subtract ``kl_coef * KL`` from the token rewards instead of adding it to the loss."""
    ref_update_every: int = attrs.field(default=0, validator=in_range(ge=0))
    """Steps between copies of the policy into the reference model (0: the reference stays the starting model)."""
    entropy_coef: float = attrs.field(default=0.0, validator=in_range())
    """Weight of an entropy term in the loss."""
    recompute_old_logprobs: bool = True
    """Score the rows with the trainer's weights for the old log-probs (``false``: use the engine's rollout
    log-probs)."""
    force_old_logprob_pass: bool = False
    """Always run the separate old-log-prob pass, even where the training forward's own log-probs would do."""
    corrections: list[str] = component("correction", args="correction_args", factory=list)
    """Train-inference corrections (``tis``, ``m2po``, ``opsm``), applied in list order."""
    correction_args: dict[str, Args] = attrs.field(factory=dict)
    """Arguments per correction: ``{ tis = { ... } }``."""
    filters: list[str] = component("filter", args="filter_args", factory=list)
    """Group filters (``dynamic_sampling``, ``overlong``, ``status``), applied in list order."""
    filter_args: dict[str, Args] = attrs.field(factory=dict)
    """Arguments per filter."""
    max_filter_retries: int = attrs.field(default=0, validator=in_range(ge=0))
    """Times a step draws fresh prompts to refill the groups its filters dropped."""
    distill_kl: str | None = component("kl", args="distill_kl_args", default=None)
    """A distillation term of its own (a ``kl`` component, e.g. ``opd_topk_kl``); unset: the teachers stand in for
    the reference model."""
    distill_kl_args: Args = attrs.field(factory=dict)
    """Arguments of the distillation term."""
    distill_coef: float = attrs.field(default=1.0, validator=non_negative)
    """Weight of the distillation term."""
    distill_in_reward: bool = False
    """Subtract ``distill_coef * term`` from the token rewards instead of adding it to the loss (``"logprobs"``
    terms only)."""
    distill_topk: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    """Teacher top-k entries per token computed for terms that require ``"topk"``."""
    router_replay: bool = False
    """Mixture-of-experts policies: the engines return each token's experts and every policy forward uses them
    (Router Replay)."""
    router_replay_compare: bool = True
    """With ``router_replay``: also score the rows without replay, for ``train/router_agreement_no_replay`` and
    ``train/is_approx_k3_kl_no_replay``."""
    infra_failures: str = attrs.field(default="exclude", validator=attrs.validators.in_(INFRA_FAILURE_MODES))
    """Trajectories the infrastructure failed (a sandbox, an agent CLI, an engine, a reward): ``"exclude"`` leaves
    them out of their group's statistics and the loss, ``"zero_reward"`` trains them with reward 0."""


@attrs.define
class CriticConfig:
    """The value model (critic) that advantage estimators with ``needs_critic`` (``gae``) use.

    It is the policy's transformer backbone plus a scalar value head, in Ray actors of its own,
    trained after the policy on each step's rows with a clipped value loss aggregated like the
    policy loss (``[algorithm] loss_agg``); it is checkpointed with the run. Unset values fall back
    to the policy's: ``path`` to ``[model] path`` (or the inline ``[model] config``), ``lr`` to
    ``[train] lr``, ``mini_batch_size`` / ``micro_batch_size`` / ``ppo_epochs`` to ``[train]``'s.
    ``value_clip`` bounds how far a value may move from its rollout-time value before the clipped
    term takes over (``0`` disables clipping); ``loss_coef`` scales the value loss. ``num_workers``
    data-parallel critic ranks reserve ``cpus`` / ``gpus`` each. Jobs whose advantage needs no
    critic ignore this table."""

    path: str | None = None
    """The critic's starting model (default: ``[model] path``, or the inline ``[model] config``)."""
    lr: float | None = attrs.field(default=None, validator=in_range(gt=0, optional=True))
    """The critic's learning rate (default: ``[train] lr``)."""
    value_clip: float = attrs.field(default=0.2, validator=non_negative)
    """How far a value may move from its rollout-time value before the clipped term takes over (0: no clipping)."""
    loss_coef: float = attrs.field(default=1.0, validator=positive)
    """Scale of the value loss."""
    mini_batch_size: int | None = attrs.field(default=None, validator=optional_at_least_one)
    """Rows per critic optimizer step (default: ``[train]``'s)."""
    micro_batch_size: int | None = attrs.field(default=None, validator=optional_at_least_one)
    """Rows per critic forward/backward (default: ``[train]``'s)."""
    ppo_epochs: int | None = attrs.field(default=None, validator=optional_at_least_one)
    """Critic passes over each step's rows (default: ``[train]``'s)."""
    num_workers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Data-parallel critic ranks."""
    cpus: float = attrs.field(default=1.0, validator=non_negative)
    """CPUs each critic rank reserves."""
    gpus: float = attrs.field(default=0.0, validator=non_negative)
    """GPUs each critic rank reserves."""


@attrs.define
class TeacherConfig:
    """A distillation teacher: a name data sources refer to, a model and a teacher backend."""

    name: str
    """The name ``[[data]] teacher`` refers to."""
    path: str | None = None
    """The teacher's Hugging Face model directory (relative to the job file)."""
    backend: str = component("teacher", args="args", default="torch")
    """The teacher component (``torch``, ``megatron``)."""
    args: Args = attrs.field(factory=dict)
    """Arguments of the teacher component."""


@attrs.define
class SftConfig:
    """Supervised fine-tuning (``loongsage sft``): how the ``[[data]]`` conversations become steps.

    Each row's ``messages_key`` column holds a chat (a list of ``{"role", "content"}`` messages,
    optionally with ``tool_calls``; ``tools_key`` may name a column of tool schemas). It is rendered
    with the model's chat template by the AgentFlow router's own code, and the loss is on the
    assistant turns only (``loss_on = "assistant"``) or on every token after the first (``"all"``).
    A step trains ``[train] mini_batch_size`` conversations; ``packing`` lays a step's
    conversations into rows of at most ``max_seq_len`` tokens, each attending only to itself with
    restarting position ids, which gives the same loss as one row per conversation. Conversations
    longer than ``max_seq_len`` are cut to it. ``eval_rows`` (a count) or ``eval_fraction`` of the
    rows are held back and their loss is reported as ``sft/eval_loss`` every ``eval_every`` steps
    (0: at the end only). The run trains ``epochs`` passes over the rest (``max_steps`` > 0 stops
    earlier); ``[train] total_steps`` is not used."""

    epochs: int = attrs.field(default=1, validator=at_least_one)
    """Passes over the training rows."""
    max_steps: int = attrs.field(default=0, validator=in_range(ge=0))
    """Stop after this many steps (0: after ``epochs``)."""
    packing: bool = True
    """Lay several conversations into one row, each attending only to itself."""
    max_seq_len: int = attrs.field(default=2048, validator=in_range(ge=2))
    """Row length in tokens; longer conversations are cut to it."""
    loss_on: str = attrs.field(default="assistant", validator=attrs.validators.in_(("assistant", "all")))
    """``"assistant"``: loss on the assistant turns only; ``"all"``: on every token but the first."""
    messages_key: str = "messages"
    """The column holding each row's chat (OpenAI-style messages)."""
    tools_key: str | None = None
    """A column of tool schemas rendered with the chat (unset: none)."""
    eval_rows: int = attrs.field(default=0, validator=in_range(ge=0))
    """Rows held back for ``sft/eval_loss`` (a count; when set, ``eval_fraction`` is not used)."""
    eval_fraction: float = attrs.field(default=0.0, validator=in_range(ge=0, lt=1))
    """Share of the rows held back for ``sft/eval_loss``."""
    eval_every: int = attrs.field(default=0, validator=in_range(ge=0))
    """Steps between evaluations (0: after the last step only)."""
    shuffle: bool = True
    """Shuffle the rows each epoch."""
