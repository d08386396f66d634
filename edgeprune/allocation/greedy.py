"""Budgeted allocation: kept dims per block and module that meet a FLOPs / params budget.

METHODS.md §5 "Budgeted allocation". Units = (block, module) pairs the target selects (MLP
channels, Q/K dims, V dims, whole heads; Q/K and V tied in the fused layout). Each unit has an
error curve over its candidate kept sizes (``edgeprune.allocation.curves``, unit-free) and the
cost model (``edgeprune.budget``) prices every state. The proxy of an allocation is the
sum of its units' errors.

1. Greedy descent: from the dense model, repeatedly move the unit whose move to *any* smaller
   candidate adds the least error per unit of cost removed (looking past the next step copes with
   non-convex curves), until the total cost is within the budget.
2. Fill-back: while some unit can grow by a candidate step without exceeding the budget, grow the
   one with the largest error decrease per unit of cost added (this brings the cost to just under
   the budget: the last descent step may overshoot).
3. Uniform: the smallest uniform sparsity (one for every targeted module, rounded as
   ``--sparsity`` rounds) that fits, then the same fill-back.
4. Keep the better of 2 and 3 on the proxy. So at a budget uniform pruning meets exactly the
   allocation is never worse than uniform on the proxy.

The budget is never exceeded; the report says whether the achieved cost is within 1% under it.
"""

from __future__ import annotations

import dataclasses
import time

from edgeprune.budget import Budget, CostModel, total_cost
from edgeprune.allocation.curves import Curve, normalise, tie_curves
from edgeprune.allocation.rules import Grid, check_rules, heads_allocated, unit_grid
from edgeprune.allocation.unit_curves import raw_curve
from edgeprune.corp.steps import mlp_kept
from edgeprune.errors import UserError
from edgeprune.layers.class_token_block import class_token_plan
from edgeprune.plan import kept_dim, kept_heads, target_modules
from edgeprune.vo import attention_dims

TOLERANCE = 0.01  # the achieved cost should be within 1% under the budget


def allocation_modules(cfg) -> list[tuple[str, ...]]:
    """The allocation units' keys per block: the target's modules, Q/K and V tied when fused, and
    whole heads when :func:`edgeprune.allocation.rules.heads_allocated` (a latency budget)."""
    mods = list(target_modules(cfg.target))
    if cfg.layout == "fused" and ("qk" in mods or "v" in mods):
        mods = [m for m in mods if m not in ("qk", "v")] + ["qk+v"]
    if heads_allocated(cfg):
        mods.append("heads")
    return [tuple(m.split("+")) for m in mods]


def build_curves(anatomy, stats, cfg, qk_weight: float | None = None, grid: Grid | None = None) -> list[Curve]:
    """Error curves of every unit (block-major), from the calibration statistics; ``qk_weight``
    overrides ``errors.QK_WEIGHT``; ``grid`` the candidate sizes (default
    :func:`edgeprune.allocation.rules.unit_grid`: ``round_to``, or a latency table's rules).

    Raises:
        UserError: a statistic the target needs was not collected.
    """
    grid = unit_grid(cfg, anatomy) if grid is None else grid
    curves = []
    for b in anatomy.blocks:
        for keys in allocation_modules(cfg):
            if len(keys) == 1:
                curves.append(raw_curve(b, keys[0], stats, cfg, grid))
            else:  # fused: Q/K and V to the same kept dim
                qc, vc = raw_curve(b, "qk+v:qk", stats, cfg, grid), raw_curve(b, "qk+v:v", stats, cfg, grid)
                normalise([qc, vc], anatomy, stats, qk_weight)
                curves.append(tie_curves(qc, vc))
    normalise([c for c in curves if len(c.keys) == 1], anatomy, stats, qk_weight)
    return [grid.restrict(c) for c in curves]


def base_dims(anatomy, cfg) -> list[dict[str, int]]:
    """Per block the dims of the modules the allocator does not choose (sparsity / ``cfg.dims``)."""
    plain = dataclasses.replace(cfg, layout="default") if cfg.layout == "fused" else cfg
    out = []
    for b in anatomy.blocks:
        heads, qk, v = attention_dims(b, plain)
        out.append({"mlp": mlp_kept(b, cfg), "qk": qk, "v": v, "heads": heads})
    return out


class _State:
    """Current candidate index per unit, block dims and cost."""

    def __init__(self, anatomy, curves: list[Curve], base: list[dict], cost: CostModel, pos: list[int]):
        self.anatomy, self.curves, self.cost = anatomy, curves, cost
        self.pos = list(pos)
        self.dims = [dict(d) for d in base]
        for c, p in zip(curves, self.pos):
            for key in c.keys:
                self.dims[c.block][key] = c.ks[p]
        self.block_costs = [cost.block_cost(b, d) for b, d in zip(anatomy.blocks, self.dims)]
        self.total = cost.fixed_cost() + sum(self.block_costs)
        self.errs = [c.errors for c in curves]

    def delta(self, u: int, p: int) -> float:
        """Cost change of moving unit u to candidate p."""
        c = self.curves[u]
        d = dict(self.dims[c.block])
        for key in c.keys:
            d[key] = c.ks[p]
        return self.cost.block_cost(self.anatomy.blocks[c.block], d) - self.block_costs[c.block]

    def move(self, u: int, p: int) -> None:
        c = self.curves[u]
        self.pos[u] = p
        for key in c.keys:
            self.dims[c.block][key] = c.ks[p]
        new = self.cost.block_cost(self.anatomy.blocks[c.block], self.dims[c.block])
        self.total += new - self.block_costs[c.block]
        self.block_costs[c.block] = new

    @property
    def error(self) -> float:
        return sum(e[p] for e, p in zip(self.errs, self.pos))


def _descend(st: _State, target: float) -> None:
    """Greedy descent (module doc, step 1)."""
    by_block: dict[int, list[int]] = {}
    for u, c in enumerate(st.curves):
        by_block.setdefault(c.block, []).append(u)
    best: dict[int, tuple[float, float, int]] = {}

    def score(u: int) -> None:
        cur = st.pos[u]
        cand = None
        for p in range(cur):
            dc = -st.delta(u, p)
            if dc <= 0:
                continue
            r = (st.errs[u][p] - st.errs[u][cur]) / dc
            key = (r, -dc, p)
            if cand is None or key < cand:
                cand = key
        if cand is None:
            best.pop(u, None)
        else:
            best[u] = cand

    for u in range(len(st.curves)):
        score(u)
    while st.total > target and best:
        u = min(best, key=lambda v: (best[v], v))
        st.move(u, best[u][2])
        for v in by_block[st.curves[u].block]:
            score(v)


def _fill(st: _State, target: float) -> None:
    """Fill-back (module doc, step 2): grow units while the budget allows."""
    while True:
        cand = None
        for u, c in enumerate(st.curves):
            cur = st.pos[u]
            for p in range(cur + 1, len(c.ks)):
                dc = st.delta(u, p)
                if dc <= 0 or st.total + dc > target:
                    continue
                gain = st.errs[u][cur] - st.errs[u][p]
                key = (-gain / dc, dc, u, p)
                if cand is None or key < cand:
                    cand = key
        if cand is None:
            return
        st.move(cand[2], cand[3])


def _uniform_positions(anatomy, curves: list[Curve], cfg, base, cost, target,
                       grid: Grid | None = None) -> tuple[list[int], float] | None:
    """Candidate positions of the smallest uniform sparsity (0.001 grid) whose cost fits, or None.
    Whole heads allocated beside head dims (a latency budget) stay dense in it."""
    blocks = anatomy.blocks
    round_to = grid.round_to if grid is not None else {k: cfg.round_to for k in ("mlp", "qk", "v")}
    extra_heads = heads_allocated(cfg)
    last = None  # the positions of the sparsity before: the same positions cost the same (rounding to round_to)
    for i in range(0, 1000):
        s = i / 1000
        pos = []
        for c in curves:
            b = blocks[c.block]
            if c.keys == ("heads",):
                k = b.num_heads if extra_heads else kept_heads(b.num_heads, s)
            else:
                dense = min(getattr(b, {"mlp": "mlp_hidden", "qk": "qk_dim", "v": "v_dim"}[key]) for key in c.keys)
                try:
                    k = kept_dim(dense, s, round_to[c.keys[0]])
                except UserError:
                    return None
            if k not in c.ks:
                return None
            pos.append(c.ks.index(k))
        if pos == last:
            continue
        last = pos
        st = _State(anatomy, curves, base, cost, pos)
        if st.total <= target:
            return pos, s
    return None


def cheapest(anatomy, cfg) -> tuple[float, float, float]:
    """(cheapest reachable cost, dense cost, absolute target) of ``cfg.budget`` -- no statistics
    needed: every unit at its smallest candidate (``round_to`` dims, or 1 head; a latency table's
    rules and smallest measured sizes)."""
    cost = cfg.budget.cost_model(anatomy, class_token_plan(cfg, anatomy))
    grid = unit_grid(cfg, anatomy, cost)
    check_rules(cfg, grid)
    dims = base_dims(anatomy, cfg)
    for b, d in zip(anatomy.blocks, dims):
        for keys in allocation_modules(cfg):
            if keys == ("heads",):
                d["heads"] = max(1, grid.lower.get("heads", 1))
                continue
            attr = {"mlp": "mlp_hidden", "qk": "qk_dim", "v": "v_dim"}
            k = max(grid.sizes(key, min(getattr(b, attr[key2]) for key2 in keys))[0] for key in keys)
            for key in keys:
                d[key] = k
    dense = cfg.budget.dense_cost(anatomy)
    return total_cost(cost, anatomy, dims), dense, cfg.budget.target(dense)


def _amount(budget: Budget, x: float) -> str:
    """A cost in the budget's units for messages: ``12.345 ms`` with a unit, else ``1,234``."""
    unit = budget.model_class.unit
    return f"{x:.3f} {unit}" if unit else f"{x:,.0f}"


def check_budget(anatomy, cfg) -> None:
    """Raises UserError when ``cfg.budget`` is below the cheapest reachable allocation or above the
    dense model (call before the calibration pass; :func:`allocate` checks again)."""
    if cfg.budget is None:
        return
    floor, dense, target = cheapest(anatomy, cfg)
    b, kind = cfg.budget, cfg.budget.kind
    if target > dense * (1 + 1e-9):  # issue 32: nothing to prune (not a --round-to matter)
        raise UserError(f"the {kind} budget {b.value:g}{b.unit or ''} ({_amount(b, target)}) is above the "
                        f"dense model ({_amount(b, dense)} {kind}): nothing to prune (give a fraction < 1 or a "
                        "smaller count)")
    if floor > target:
        raise _below_floor(cfg, anatomy, floor, dense, target)


def _below_floor(cfg, anatomy, floor: float, dense: float, target: float) -> UserError:
    """The one-line error of a budget below the cheapest reachable allocation."""
    b, kind = cfg.budget, cfg.budget.kind
    grid = unit_grid(cfg, anatomy)
    how = f"with --round-to {cfg.round_to}" if not grid.rules else grid.where()
    return UserError(f"the {kind} budget {b.value:g}{b.unit or ''} ({_amount(b, target)}) is below the "
                     f"cheapest allocation for target {cfg.target} {how} "
                     f"({_amount(b, floor)} = {floor / dense:.3f} of the dense model)")


def allocate(anatomy, stats, cfg, *, qk_weight: float | None = None,
             only: str | None = None, curves: list[Curve] | None = None) -> tuple[list[dict], dict]:
    """Kept dims per block and module meeting ``cfg.budget`` at the least proxy error.

    ``qk_weight`` overrides ``errors.QK_WEIGHT``; ``only="greedy"`` / ``"uniform"`` returns that
    candidate instead of the one with the lower proxy (``edgeprune.allocation.select`` compares
    candidates by their measured output error); ``curves`` replaces the curves built from the
    statistics (:func:`build_curves`; ``select`` passes curves rescaled to measured errors).

    Args:
        anatomy: the model's anatomy (before pruning).
        stats: :class:`~edgeprune.calibration.collect.CalibrationStatistics` of the pass (MLP
            covariance, Q/K Grams, proj-input statistics as ``plan.pruned_modules(cfg)`` asks).
        cfg: :class:`~edgeprune.corp.CorpConfig` with ``budget`` set; ``target``, ``round_to``,
            ``layout``, ``compensation``, the criteria and ridge alphas are used.

    Returns:
        (dims, report): ``dims`` one dict per block with every module the target selects
        (``plan.MODULES`` keys, kept counts); ``report`` JSON-able: the budget, the cost model,
        dense / target / achieved costs (FLOPs and params, absolute and fraction), per-block dims
        and proxy errors, the greedy and uniform proxy totals and which was chosen.

    Raises:
        UserError: no budget, unknown kind, or a budget below the cheapest reachable allocation.
    """
    t0 = time.perf_counter()
    if cfg.budget is None:
        raise UserError("allocate needs a budget (--flops or --params)")
    plan = class_token_plan(cfg, anatomy)
    cost = cfg.budget.cost_model(anatomy, plan)  # the pruned model's cost (class-token last block included)
    grid = unit_grid(cfg, anatomy, cost)
    curves = build_curves(anatomy, stats, cfg, qk_weight, grid) if curves is None else curves
    base = base_dims(anatomy, cfg)
    dense_state = _State(anatomy, curves, base, cost, [len(c.ks) - 1 for c in curves])
    # the budget is a fraction of the model as given (not of its class-token variant)
    dense_cost = cfg.budget.dense_cost(anatomy)
    target = cfg.budget.target(dense_cost)
    floor = _State(anatomy, curves, base, cost, [0] * len(curves))
    if floor.total > target:
        raise _below_floor(cfg, anatomy, floor.total, dense_cost, target)
    candidates, uniform = _candidates(dense_state, anatomy, curves, cfg, base, cost, target, grid)
    if only is not None:
        if only not in candidates:
            raise UserError(f"no {only!r} allocation meets this budget")
        candidates = {only: candidates[only]}
    chosen = min(candidates, key=lambda k: (candidates[k].error, k != "greedy"))
    st = candidates[chosen]
    keys = [k for keys in allocation_modules(cfg) for k in keys]
    dims = [{k: int(d[k]) for k in keys} for d in st.dims]
    report = _report(anatomy, cfg, plan, cost, curves, candidates, chosen, dims, dense_cost, target, uniform, t0)
    measured = cost.record()
    if measured:  # a measured cost model (latency): its table, rules and prediction
        report[cost.name] = {**measured, **grid.describe(), "heads_allocated": heads_allocated(cfg),
                             "predicted": st.total, "target": target, "dense": dense_cost}
    return dims, report


def _candidates(greedy: _State, anatomy, curves: list[Curve], cfg, base, cost, target: float, grid: Grid | None = None
                ) -> tuple[dict[str, _State], tuple[float | None, float | None]]:
    """The allocations :func:`allocate` chooses from: ``greedy`` (the dense state, descended to the
    budget, then filled back to it) and, where one meets the budget, the uniform one (filled).

    Returns:
        ``({"greedy": ..., ["uniform": ...]}, (uniform sparsity, uniform proxy error before the
        fill))``, the pair ``(None, None)`` without a uniform candidate.
    """
    _descend(greedy, target)
    _fill(greedy, target)
    candidates = {"greedy": greedy}
    uni = _uniform_positions(anatomy, curves, cfg, base, cost, target, grid)
    uniform_sparsity = None
    uniform_plain_error = None
    if uni is not None:
        pos, uniform_sparsity = uni
        st = _State(anatomy, curves, base, cost, pos)
        uniform_plain_error = st.error
        _fill(st, target)
        candidates["uniform"] = st
    return candidates, (uniform_sparsity, uniform_plain_error)


def _report(anatomy, cfg, plan: dict, cost, curves: list[Curve], candidates: dict[str, _State], chosen: str,
            dims: list[dict], dense_cost: float, target: float, uniform: tuple, t0: float) -> dict:
    """:func:`allocate`'s JSON-able report of the ``chosen`` candidate (see there); ``uniform`` as
    :func:`_candidates` returns it, ``t0`` the ``perf_counter`` at the start."""
    st = candidates[chosen]
    bud = cfg.budget  # its cost models, built once per model shape (edgeprune.budget.Budget.cost_model)
    fc, pc = bud.cost_model(anatomy, plan, kind="flops"), bud.cost_model(anatomy, kind="params")
    flops, params = total_cost(fc, anatomy, st.dims), total_cost(pc, anatomy, st.dims)
    dense_flops = total_cost(bud.cost_model(anatomy, kind="flops"), anatomy, [_dense(b) for b in anatomy.blocks])
    dense_params = total_cost(pc, anatomy, [_dense(b) for b in anatomy.blocks])
    per_block = []
    for i, d in enumerate(dims):
        errs = {"+".join(c.keys): round(c.errors[st.pos[u]], 8) for u, c in enumerate(curves) if c.block == i}
        per_block.append({"index": i, "dims": d, "proxy_error": errs})
    return {
        "budget": cfg.budget.to_dict(), "cost_model": cost.name,
        "dense_cost": dense_cost, "target_cost": target, "achieved_cost": st.total,
        "within_tolerance": bool(target * (1 - TOLERANCE) <= st.total <= target),
        "flops": flops, "params": params, "dense_flops": dense_flops, "dense_params": dense_params,
        "flops_fraction": flops / dense_flops, "params_fraction": params / dense_params,
        "chosen": chosen,
        "class_token_blocks": {str(i): t for i, t in plan.items()},
        "proxy_error": {k: v.error for k, v in candidates.items()},
        "uniform_sparsity": uniform[0], "uniform_error_before_fill": uniform[1],
        "error_kind": sorted({c.kind for c in curves}),
        # record text kept byte-identical (the module is now edgeprune.allocation.curves)
        "normalisation": "residual (METHODS.md §5; edgeprune.allocation.curves.normalise)",
        "blocks": per_block,
        "seconds": time.perf_counter() - t0,
    }


def _dense(b) -> dict[str, int]:
    return {"mlp": b.mlp_hidden, "qk": b.qk_dim, "v": b.v_dim, "heads": b.num_heads}

