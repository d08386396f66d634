"""The :class:`Budget` object: one per prune (or derive), built by one parser (:func:`edgeprune.budget.parse`).

A budget is a kind (a registered cost model: ``flops``, ``params``, ``latency``, ...), a value (``0 < v <= 1`` a
fraction of the dense model; else an absolute count, or milliseconds for a kind with a unit) and, for a kind that
needs one, the path of its table. It owns its cost model: :meth:`Budget.cost_model` builds the kind's model once
per model shape (the allocator, its check, the candidate selection and the record all ask it; before issue 39 the
cost model was rebuilt about 12 times per prune).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from edgeprune.anatomy import ViTAnatomy
from edgeprune.budget.base import CostModel
from edgeprune.budget.registry import dense_dims, get_cost_model, kind_attr, list_cost_models, total_cost
from edgeprune.errors import UserError


def _shape_key(anatomy: ViTAnatomy, query_tokens: dict[int, int] | None) -> tuple:
    """What a cost model depends on: the model object, its widths, tokens and per-block dims (and query tokens)."""
    return (id(anatomy.model), anatomy.embed_dim, anatomy.num_tokens,
            tuple((b.index, b.query_tokens, *dense_dims(b).values()) for b in anatomy.blocks),
            tuple(sorted((query_tokens or {}).items())))


@dataclasses.dataclass(frozen=True, eq=False)
class Budget:
    """A budget (module doc).

    Attributes:
        kind: a registered budget kind (:func:`edgeprune.budget.registry.list_cost_models`).
        value: > 0, finite: a fraction of the dense model when <= 1 and no ``unit``; else absolute (FLOPs per image
            = 2 x MACs, parameters, or ``unit``s such as ms per batch of a latency table's batch size).
        unit: the kind's unit when the value is absolute in it (``"ms"``), else None.
        table: the path of the kind's table (kinds whose cost model ``needs_table``), else None.
        tokens_merge: the token-merging schedule a cost model with a token axis prices (``CorpConfig.tokens_merge``,
            set by the config's check: ``edgeprune.pruning.config.check_tokens_settings``); not in the record form.

    Raises:
        UserError: (on construction) an unknown kind, a value that is not a finite number > 0, a fraction > 1 of a
            kind with a unit, a unit that is not the kind's, a table missing or given where it does not belong.
    """

    kind: str
    value: float
    unit: str | None = None
    table: str | None = None
    tokens_merge: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = list_cost_models()
        if self.kind not in kinds:
            raise UserError(f"unknown budget kind {self.kind!r} (choose from {', '.join(kinds)})")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
            raise UserError(f"the {self.kind} budget must be > 0, got {v!r}")
        object.__setattr__(self, "value", float(v))
        unit = kind_attr(self.kind, "unit")
        if self.unit is not None and self.unit != unit:
            raise UserError(f"the {self.kind} budget's unit must be {unit!r}, got {self.unit!r}")
        if self.unit is None and unit is not None and self.value > 1:
            raise UserError(f"the {self.kind} budget {v!r} is a fraction (<= 1) unless it names its unit "
                            f"({{'unit': {unit!r}}})")
        needs = bool(kind_attr(self.kind, "needs_table", False))
        if needs and not self.table:
            raise UserError(kind_attr(self.kind, "missing_table", f"the {self.kind} budget needs a table"))
        if self.table is not None and not needs:
            raise UserError(f"a table goes with a budget that is priced by one, not with --{self.kind}")
        if self.table is not None and not isinstance(self.table, str):
            raise UserError(f"the {self.kind} budget's table must be a path, got {self.table!r}")
        object.__setattr__(self, "_models", {})

    def __eq__(self, other: object) -> bool:
        """Equal to a budget, or to its record form (a dict), with the same kind, value, unit and table."""
        if isinstance(other, Budget):
            return self.to_dict() == other.to_dict()
        if isinstance(other, dict):
            return self.to_dict() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.kind, self.value, self.unit, self.table))

    def __deepcopy__(self, memo: dict) -> "Budget":
        return dataclasses.replace(self)  # immutable; the copy builds its own cost models

    @classmethod
    def from_dict(cls, d: Any) -> "Budget":
        """A budget from its record form ``{"kind", "value"[, "unit"][, "table"]}`` (or a Budget, returned as is).

        Raises:
            UserError: not such a dict, or as the constructor.
        """
        if isinstance(d, Budget):
            return d
        kinds = list_cost_models()
        if not isinstance(d, dict) or "kind" not in d or set(d) - {"kind", "value", "unit", "table"}:
            raise UserError(f"budget must be {{'kind': {' | '.join(repr(k) for k in kinds)}, 'value': v}}, got {d!r}")
        return cls(d["kind"], d.get("value"), d.get("unit"), d.get("table"))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """The record form: ``{"kind", "value"}`` plus ``unit`` / ``table`` where set."""
        out: dict[str, Any] = {"kind": self.kind, "value": self.value}
        if self.unit is not None:
            out["unit"] = self.unit
        if self.table is not None:
            out["table"] = self.table
        return out

    @property
    def model_class(self) -> Any:
        """The kind's registered cost-model class (its class attributes: unit, needs_table, allocates_heads ...)."""
        return get_cost_model(self.kind)

    def cost_model(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None, *,
                   kind: str | None = None) -> CostModel:
        """The kind's cost model of ``anatomy``'s model (``query_tokens``: blocks computing their first T tokens
        only), built once per model shape and reused. ``kind``: another kind that needs no table, priced beside
        this budget (the allocation report's FLOPs and params), cached the same way.

        Raises:
            UserError: the cost model's own errors (a missing or malformed table, a table of another model), or
                another ``kind`` that needs a table.
        """
        kind = kind or self.kind
        key = (kind, *_shape_key(anatomy, query_tokens))
        models: dict = self._models  # type: ignore[attr-defined]
        if key not in models:
            factory = get_cost_model(kind)
            needs = kind_attr(kind, "needs_table", False)
            if needs and kind != self.kind:
                raise UserError(f"the {kind} cost model needs its own budget's table")
            extra = {"budget": self} if needs else {}
            models[key] = factory(anatomy, query_tokens, **extra) if query_tokens else factory(anatomy, **extra)
        return models[key]

    def check_inputs(self) -> None:
        """The kind's check of its inputs (a latency table: found, readable, well-formed) before any model is built.

        Raises:
            UserError: one line naming the file and the problem.
        """
        self.model_class.check_inputs(self)

    def dense_cost(self, anatomy: ViTAnatomy) -> float:
        """The cost of ``anatomy``'s model as it is (every block at its own dims and token counts: a budget's
        ``tokens_merge`` is the pruned model's, not the dense one's)."""
        plain = self if self.tokens_merge is None else dataclasses.replace(self, tokens_merge=None)
        return total_cost(plain.cost_model(anatomy), anatomy, [dense_dims(b) for b in anatomy.blocks])

    @property
    def is_fraction(self) -> bool:
        """Whether the value is a fraction of the dense model (<= 1, no unit) rather than absolute."""
        return self.unit is None and self.value <= 1.0

    def target(self, dense_cost: float) -> float:
        """The absolute budget: ``value * dense_cost`` for a fraction, else ``value``."""
        return self.value * dense_cost if self.is_fraction else self.value

    def exceeds(self, dense_cost: float) -> bool:
        """Whether the budget asks for at least the dense model's cost (nothing has to be pruned)."""
        return self.target(dense_cost) >= dense_cost

    def absolute(self, dense_cost: float) -> "Budget":
        """The same budget as an absolute value of a model whose dense cost is ``dense_cost``."""
        return dataclasses.replace(self, value=float(self.target(dense_cost)))

    def describe(self) -> str:
        """``"flops 0.5"`` / ``"params 2.3e+07"`` / ``"latency 12ms"`` (logs, run directory names)."""
        return f"{self.kind} {self.value:g}{self.unit or ''}"

    def option(self) -> str:
        """``"flops0.5"`` / ``"latency12ms"``: the budget as the CLI prints it in one word."""
        return f"{self.kind}{self.value:g}{self.unit or ''}"
