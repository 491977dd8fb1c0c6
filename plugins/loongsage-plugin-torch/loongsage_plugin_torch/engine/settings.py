"""Engine settings: ``[rollout] engine_args`` of the job file, validated with clear errors."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from loongsage_hookspecs import JobSettings

LORA_MODES = ("merged", "unmerged")
"""How the embedded engine applies a LoRA adapter (``[rollout] engine_args.lora_mode``)."""


ENGINE_DTYPES = ("float32", "bfloat16")
"""Precisions the embedded engine can run in apart from the trainer (``[rollout] engine_args.dtype``)."""


SPECULATIVE_METHODS = ("prompt_lookup",)
"""How the embedded engine drafts tokens for speculative decoding (``engine_args.speculative.method``)."""


class EngineConfigError(ValueError):
    """``[rollout] engine_args`` holds an unknown key or a bad value; the message names it."""


@attrs.define(frozen=True)
class SpeculativeSettings:
    """Speculative decoding (``[rollout] engine_args.speculative``), see :mod:`.speculative`.

    ``method``: where draft tokens come from; ``"prompt_lookup"`` matches the last ``ngram``
    tokens of a sequence against its own earlier tokens (prompt and output so far) and drafts
    the up to ``num_draft`` tokens that followed the latest match. The target model checks all
    drafts of a step in one forward and accepts them by the speculative-sampling rule, so the
    tokens follow the policy's distribution exactly and their log-probs are the policy's.
    """

    method: str = "prompt_lookup"
    num_draft: int = 4
    ngram: int = 3

    @classmethod
    def from_table(cls, table: Any) -> "SpeculativeSettings":
        """The settings of an ``engine_args.speculative`` table, or an :class:`EngineConfigError`
        naming the key at fault."""
        where = "[rollout] engine_args.speculative"
        if not isinstance(table, Mapping):
            raise EngineConfigError(f"{where} must be a table such as "
                                    f"{{ method = \"prompt_lookup\", num_draft = 4, ngram = 3 }}, got {table!r}")
        valid = [f.name for f in attrs.fields(cls)]
        for key, value in table.items():
            if key not in valid:
                raise EngineConfigError(f"{where}: unknown key '{key}'; valid keys: {', '.join(valid)}")
            if key == "method":
                if value not in SPECULATIVE_METHODS:
                    raise EngineConfigError(f"{where}.method must be one of "
                                            f"{', '.join(repr(m) for m in SPECULATIVE_METHODS)}, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{where}.{key} must be an integer >= 1, got {value!r}")
        return cls(**table)


@attrs.define(frozen=True)
class EngineSettings:
    """How the embedded engine runs.

    ``max_batch_size``: requests decoded together (KV slots). ``max_prefill_tokens``: new prompt
    tokens per prefill forward; longer prompts are prefilled in chunks of this size.
    ``prefix_cache_tokens``: positions of KV kept for prefix reuse (0 disables it).
    ``num_threads``: torch intra-op threads of the decode loop (unset: torch's default; on a
    shared CPU 1 is often fastest for small models). ``seed``: the random stream of requests that
    give no ``sampling_seed``. ``max_request_mb``: largest accepted HTTP body (weight updates).
    ``lora_mode`` (with ``[train] lora``): ``"merged"`` adds the adapter into the weights, so every
    request gets it and a decode step costs what it costs without LoRA; ``"unmerged"`` keeps the
    base weights and applies the adapter per request, to the requests whose ``lora_path`` names
    it (the others get the base model), at the cost of two small extra matrix products per
    adapted projection.
    ``packed_weights``: ``"auto"`` (the default) multiplies by weights packed for oneDNN on x86
    CPUs where that measured faster (every bfloat16 model, float32 models from 16M parameters;
    see :mod:`.packed_linear`), ``true`` always packs, ``false`` never; packing costs one extra
    copy of the weights, packed again after each weight update. Where the torch build cannot
    pack, the plain product is used.
    ``dtype``: the engine's own precision, ``"float32"`` or ``"bfloat16"`` (unset: ``[model]
    dtype``, the trainer's), as a production engine runs in bf16 next to an fp32 trainer; weight
    updates are cast to it.
    ``strict_priority`` (default on): a waiting request is not admitted while a running one has a
    larger ``priority`` (requests without one all have priority 0, so this changes nothing for
    them); off, priorities only order the waiting queue, as SGLang's priority scheduling does.
    ``speculative`` (unset: off): speculative decoding by prompt lookup, a
    :class:`SpeculativeSettings` table, e.g. ``{ method = "prompt_lookup", num_draft = 4, ngram = 3 }``.
    ``max_context_length`` comes from ``[rollout] max_context_length``.
    """

    max_context_length: int = 2048
    max_batch_size: int = 64
    max_prefill_tokens: int = 2048
    prefix_cache_tokens: int = 32768
    num_threads: int | None = None
    seed: int = 0
    max_request_mb: int = 4096
    lora_mode: str = "merged"
    packed_weights: bool | str = "auto"
    dtype: str | None = None
    speculative: SpeculativeSettings | None = None
    strict_priority: bool = True

    @classmethod
    def from_job(cls, job: JobSettings) -> "EngineSettings":
        rollout = job.rollout
        args: Mapping[str, Any] = dict(rollout.engine_args or {})
        valid = [f.name for f in attrs.fields(cls) if f.name != "max_context_length"]
        for key in args:
            if key not in valid:
                raise EngineConfigError(
                    f"[rollout] engine_args: unknown key '{key}' for the torch engine; valid keys: {', '.join(valid)}")
        values: dict[str, Any] = {"max_context_length": rollout.max_context_length, "seed": job.run.seed}
        for key, value in args.items():
            choices = {"lora_mode": LORA_MODES, "dtype": ENGINE_DTYPES}.get(key)
            if choices is not None:
                if value not in choices:
                    raise EngineConfigError(f"[rollout] engine_args.{key} must be one of "
                                            f"{', '.join(repr(c) for c in choices)}, got {value!r}")
                values[key] = value
                continue
            if key == "strict_priority":
                if not isinstance(value, bool):
                    raise EngineConfigError(
                        f"[rollout] engine_args.strict_priority must be true or false, got {value!r}")
                values[key] = value
                continue
            if key == "packed_weights":
                if not isinstance(value, bool) and value != "auto":
                    raise EngineConfigError(
                        f"[rollout] engine_args.packed_weights must be \"auto\", true or false, got {value!r}")
                values[key] = value
                continue
            if key == "speculative":
                values[key] = SpeculativeSettings.from_table(value)
                continue
            if key == "num_threads" and value is None:
                values[key] = None
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise EngineConfigError(f"[rollout] engine_args.{key} must be an integer, got {value!r}")
            minimum = 0 if key in ("prefix_cache_tokens", "seed") else 1
            if value < minimum:
                raise EngineConfigError(f"[rollout] engine_args.{key} must be >= {minimum}, got {value}")
            values[key] = value
        if values["max_context_length"] < 2:
            raise EngineConfigError(
                f"[rollout] max_context_length must be >= 2, got {values['max_context_length']}")
        return cls(**values)
