"""Field building blocks of the job-file schema: the free-form ``*_args`` table type and the
value-range validators.

The schema sections (:mod:`.training`, :mod:`.rollout`, :mod:`.job`) declare their fields with
these validators, so a bad value fails when the job file is loaded, naming its key: a validator
raises :class:`RangeError` with the attribute's name, and the structuring step
(:mod:`.structuring`) joins that name to the dotted key path in its :class:`ConfigError`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs

Args = dict[str, Any]
"""A free-form table (a component's ``*_args``): passed on as keyword arguments, not checked here."""


# --------------------------------------------------------------------------------------------
# Value ranges (attrs validators): a bad value fails at load time, naming its key
# --------------------------------------------------------------------------------------------

SEED_MAX = 2**31 - 1
"""Largest accepted seed: every consumer (Python, NumPy, torch, engines) takes it, plus ranks."""


class RangeError(ValueError):
    """A value outside its field's range; ``field`` names the attribute (joined to the key path)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")  # named when raised outside a job file (TrainConfig(...))
        self.message = message
        self.field = field


def _fmt(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def in_range(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
             lt: float | None = None, finite: bool = True, optional: bool = False, extra: tuple[Any, ...] = ()) -> Any:
    """An attrs validator: a (finite) number within the given bounds (``extra`` values also pass)."""
    bounds = [f"{op} {_fmt(b)}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]

    def check(_: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if value in extra and not isinstance(value, bool):
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        if ok and finite:
            ok = math.isfinite(value)
        if ok:
            ok = ((ge is None or value >= ge) and (gt is None or value > gt)
                  and (le is None or value <= le) and (lt is None or value < lt))
        if not ok:
            integer = "int" in str(attribute.type) and "float" not in str(attribute.type)
            wanted = "an integer" if integer else ("a finite number" if finite else "a number")
            wanted = " ".join([wanted, " and ".join(bounds)]).strip()
            if extra:
                wanted += " (or " + ", ".join(repr(e) for e in extra) + ")"
            raise RangeError(f"must be {wanted}, got {value!r}", attribute.name)

    return check


def two_betas(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An attrs validator: Adam's ``betas``, two finite numbers in ``[0, 1)``."""
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(b, (int, float)) and math.isfinite(b) and 0 <= b < 1 for b in value)):
        raise RangeError(f"must be two numbers in [0, 1), e.g. [0.9, 0.999], got {value!r}", attribute.name)


def custom_resources(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A table of custom Ray resources: names other than CPU/GPU, non-negative finite amounts."""
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            raise RangeError(f"must not name {name!r} (use the *_{name.lower()}s keys), got {value!r}",
                             attribute.name)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                or amount < 0:
            raise RangeError(f"must map resource names to finite numbers >= 0, got {name!r} = {amount!r}",
                             attribute.name)


positive = in_range(gt=0)
"""A finite number > 0."""
non_negative = in_range(ge=0)
"""A finite number >= 0."""
unit_interval = in_range(ge=0, le=1)
"""A finite number in ``[0, 1]``."""
at_least_one = in_range(ge=1)
"""A count: a number >= 1."""
valid_seed = in_range(ge=0, le=SEED_MAX)
"""A seed in ``[0, SEED_MAX]``."""
optional_at_least_one = attrs.validators.optional(attrs.validators.ge(1))
"""Unset (``None``: falls back to another table's value) or >= 1 (attrs' own ``ge`` message)."""


# --------------------------------------------------------------------------------------------
# Fields that name a component
# --------------------------------------------------------------------------------------------


@attrs.define(frozen=True)
class ComponentField:
    """What a schema field that names a component says about it (its attrs ``metadata``).

    ``kind``: the component kind (a word of ``loongsage_hookspecs.KINDS``); ``args``: the sibling
    field holding its arguments (a table, or one table per name when the field is a list of
    names); ``active(section, job)``: whether the job uses the component at all (a scheduler only
    in asynchronous runs), ``None``: whenever a name is set. The schema walker
    (:func:`~loongsage_core.config.components.component_refs`) reads every job's component
    references from these, so the schema is the one place that says which key names what."""

    kind: str
    args: str | None = None
    active: Callable[[Any, Any], bool] | None = None


def component(kind: str, *, args: str | None = None, active: Callable[[Any, Any], bool] | None = None,
              **field: Any) -> Any:
    """An attrs field that names a component of ``kind`` (see :class:`ComponentField`)."""
    metadata = dict(field.pop("metadata", {}))
    metadata["component"] = ComponentField(kind=kind, args=args, active=active)
    return attrs.field(metadata=metadata, **field)
