"""``greedy``: a per-tensor swap-and-recompute heuristic driven by the concurrency model; one of cpsat's fallbacks.

KARMA decides per block with one rule (swap if the copies hide, else recompute). Per tensor there is more
room: the copy engines can carry a fixed number of bytes while the step computes, whatever layer they come
from, and what recomputing costs varies a hundredfold between a matmul output and a pointwise one. So:

1. swap the tensors that are dearest to recompute per byte and have the longest gaps, up to a byte quota
   that the copy streams can carry (a grid of quotas around the forward's copy capacity is tried), less those
   whose copies would queue past where they are needed (``lands_in_time``); each prefetch is issued early
   enough for its copy to hide behind the backward before its first read;
2. evict as few of the rest as make the step fit, in one of five orders (recompute cheapest per byte
   first; the same with short chains only, or with chains at most 1.5x or 2.5x as dear as alone; block by
   block keeping block outputs), then swap what is left:
   a coarse scan and a bisection, every probe judged by the simulator; recomputes are grouped by where the
   backward first needs them, so chains share their ops;
3. keep the fastest plan that fits, and drop the waits for copies out that it does not need.

Under a time limit (``Greedy(time_limit_s=...)``, or the deadline of a cpsat call running it as a fallback,
``karma_fx.progress``) no new probe starts once it has passed, and the best plan so far is returned; the first
probe always runs, so there is always a plan.

Without a host link (``costs.allow_offload`` false) nothing is swapped: one quota (zero), and the orders only
recompute.
"""
from __future__ import annotations

from dataclasses import replace

from karma_fx import progress
from karma_fx.costs import Costs
from karma_fx.plan import Decision, Offload, Plan
from karma_fx.problem import Problem
from karma_fx.strategies.base import (Gap, RecomputeBuilder, block_inputs, blocks_from_cuts, figures_of, offload_for,
                                     read_by_chains, reconcile, saved_gaps)
from karma_fx.strategies.torch_budget import decisions_for_saved

QUOTAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
"""Swapped bytes as multiples of what the device→host stream can move during the forward."""
LARGE_OPS = 4000
QUOTAS_LARGE = (2.0, 1.0, 0.0)
"""On graphs of more than ``LARGE_OPS`` ops a simulation costs ~0.2 s and the full grid minutes: fewer quotas,
the likeliest winner first, since a time limit often stops the search after one (a quota takes 4-18 s on
ResNet-1001). With only the swaps whose copies hide kept (``lands_in_time``), a larger quota did better there
(bf16-mixed, H100 preset) at every budget: at 0.7 of its peak, quota 0 / 1 / 2 gave 1.067x / 1.049x / 1.035x,
at 0.25 1.403x / 1.202x / 1.170x; quota 3 was within 1.5% of quota 2."""
ORDERS_LARGE = ("bounded 2.5x", "cheap-first", "bounded 1.5x", "by-block", "local")
"""The eviction orders on those graphs, the likeliest winner first. On ResNet-1001 (bf16-mixed, H100 preset,
quotas 2 / 1 / 0 each with all five orders, no time limit) the winner at 0.7 / 0.5 / 0.35 / 0.25 of the peak
was cheap-first (tied with both bounded orders and local) / cheap-first (bounded 2.5x 0.02% behind) /
cheap-first / bounded 2.5x; by-block never came within 3%, local only at 0.7. At 0.35 and 0.25 those two
also took 2.9-3.2 s each to judge, the bounded orders 0.9-1.8 s. Tried in the order the orders are built
(cheap-first, local, by-block, then the bounded ones), the bounded orders were what cpsat's greedy never
reached: it runs after the bound and the one-pass heuristics (19 s there), and at 0.25 it stopped before
them, 10.9% behind greedy alone."""
STOP_RATIO = 1.0
"""On those graphs the quotas stop once one's fastest plan is this much slower than the best so far (the next
one, further from the winner, will not win). A later quota tries the order that has won so far first, and
stops there when that plan is this much slower. On ResNet-1001 (bf16-mixed, H100 preset, 0.7 to 0.25 of its
peak, every quota and order tried) the step time rose with every quota step down (quota 1's best 1.4-2.7%
over quota 2's, quota 0's 3.1-20% over), and no later quota had an order that beat its try of the winning
one. It was 1.1, under which greedy ran all three quotas (20-40 s) and left cpsat's block pass no time."""
GROWTHS = (1.5, 2.5)
"""How much longer than alone a recompute chain may grow in the bounded pools (``bounded_drops``)."""
LOOKAHEAD = 1.2
"""Slack on every prefetch: its copy is planned to take this many times its modelled duration."""


def rebuild_chain(problem: Problem, costs: Costs, gap: Gap, builder: RecomputeBuilder) -> tuple[float, set[str]] | None:
    """The price of rebuilding ``gap`` alone from what the step still holds at its first backward read (each op at
    ``Costs.rebuild_us``: less than its time where the backward's loops would join the chain), and the storages
    that chain reads (``None``: it cannot be rebuilt)."""
    if not problem.ops[gap.storage.producer or 0].recomputable:
        return None
    try:
        r = builder.group([gap], {gap.storage.name})
    except ValueError:
        return None
    indices = [problem.op_index(op) for op in r.ops]
    made = {s for i in indices for s in problem.ops[i].outputs}
    reads = {s for i in indices for s in problem.ops[i].inputs} - made
    return sum(costs.rebuild_us(problem, i) for i in indices), reads


class Greedy:
    name = "greedy"

    def __init__(self, time_limit_s: float | None = None) -> None:
        self.time_limit_s = time_limit_s

    def __call__(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        with progress.deadline(self.time_limit_s):
            return self._plan(problem, costs, budget_bytes)

    def _plan(self, problem: Problem, costs: Costs, budget_bytes: int) -> Plan:
        keep = figures_of(problem, costs, ())
        if keep.peak_bytes <= budget_bytes:
            return Plan(strategy=self.name, budget_bytes=budget_bytes, notes=("everything fits: nothing moves",))
        builder = RecomputeBuilder(problem)
        gaps = [g for g in saved_gaps(problem) if g.storage.size_bytes > 0]
        chains = {g.storage.name: rebuild_chain(problem, costs, g, builder) for g in gaps}
        start = costs.op_starts_us()
        nf = problem.num_fwd_ops
        fwd_capacity = start[nf] * costs.d2h_bytes_per_us

        def dearness(g: Gap) -> float:  # recompute µs per MB; unrebuildable first
            chain = chains[g.storage.name]
            return float("inf") if chain is None else chain[0] / g.storage.size_bytes * 1e6

        # Long-gap, dear tensors first; a tensor whose gap cannot hide its two copies is never swapped.
        swappable = [g for g in gaps if costs.allow_offload
                     and g.storage.size_bytes >= costs.copy_latency_us * costs.d2h_bytes_per_us
                     and start[g.first_bwd_use] - start[g.storage.producer + 1]
                     >= 2 * (costs.copy_time_us(g.storage.size_bytes, "d2h") + costs.copy_time_us(g.storage.size_bytes, "h2d"))]
        swappable.sort(key=lambda g: (-dearness(g), g.storage.producer, g.storage.name))
        cheap_first = sorted((g for g in gaps if chains[g.storage.name] is not None),
                             key=lambda g: (dearness(g), -g.storage.size_bytes, g.storage.name))

        best: tuple[tuple[int, float], tuple[Decision, ...], str] | None = None
        quota_best: float | None = None
        best_order: str | None = None
        lowest: tuple[int, float, tuple[Decision, ...], str] | None = None
        judged: dict = {}
        boundaries = block_inputs(problem, blocks_from_cuts(problem, len(problem.cut_points)))
        large = len(problem.ops) > LARGE_OPS
        stopped = False
        for quota in (QUOTAS_LARGE if large else QUOTAS) if costs.allow_offload else (0.0,):
            if stopped:
                break
            if large and best is not None and quota_best is not None and quota_best > STOP_RATIO * best[0][1]:
                break  # this quota did worse than an earlier one: the next will not win
            quota_best = None
            swapped, total = [], 0
            for g in swappable:
                if total + g.storage.size_bytes <= quota * fwd_capacity:
                    swapped.append(g)
                    total += g.storage.size_bytes
            hidden = lands_in_time(costs, swapped, start, start[nf])
            away = {g.storage.name for g in hidden}
            late = [g for g in swapped if g.storage.name not in away]  # swapped only where fetched on demand
            swapped = hidden
            # (name, the order's tensors), the bounded ones built only when tried (~0.25 s each on ResNet-1001)
            ordered = [(name, lambda drops=drops: drops)
                       for name, drops in self._orders(cheap_first, chains, away, boundaries).items()]
            ordered += [(f"bounded {growth:g}x",
                         lambda growth=growth, away=away: bounded_drops(problem, costs, builder, cheap_first, chains,
                                                                        away, growth)) for growth in GROWTHS]
            if large:  # the order that won so far first, then ORDERS_LARGE's
                rank = {name: k for k, name in enumerate(ORDERS_LARGE)}
                ordered.sort(key=lambda item: (item[0] != best_order, rank.get(item[0], len(rank))))
            for n_order, (order, make_order) in enumerate(ordered):
                if (best is not None or lowest is not None) and progress.past_deadline():
                    stopped = True
                    break
                if (large and n_order == 1 and best is not None and quota_best is not None
                        and quota_best > STOP_RATIO * best[0][1]):
                    break  # this quota's try of the winning order was worse: see STOP_RATIO
                progress.report(f"swap quota {quota:g}, {order} order", strategy=self.name,
                                slowdown=best[0][1] / keep.makespan_us if best and keep.makespan_us else None,
                                peak_bytes=judged[best[1]].peak_bytes if best else None)
                recomputed = make_order()
                chosen = away | {g.storage.name for g in recomputed}
                pool = [(g, "recompute") for g in recomputed] \
                    + [(g, "swap") for g in gaps if g.storage.name not in chosen and costs.allow_offload]
                found = self._fit(problem, costs, budget_bytes, builder, gaps, swapped, late, pool, start,
                                  f"quota {quota:g}: {len(swapped)} swapped, {order} order", judged)
                fits, key, decisions, label = found
                if fits and (best is None or key < best[0]):
                    best = (key, decisions, label)
                    best_order = order
                if fits and (quota_best is None or key[1] < quota_best):
                    quota_best = key[1]
                if not fits and (lowest is None or key < lowest[:2]):
                    lowest = (*key, decisions, label)
        cut = (progress.stopped_note(),) if stopped else ()
        if best is not None:
            decisions, loosened = loosen_releases(problem, costs, budget_bytes, best[1])
            return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=decisions,
                        notes=(best[2] + (f", {loosened} waits for a copy out dropped" if loosened else ""),) + cut)
        assert lowest is not None
        return Plan(strategy=self.name, budget_bytes=budget_bytes, decisions=lowest[2],
                    notes=(lowest[3] + ": the leanest this heuristic gets, above the budget",) + cut)

    @staticmethod
    def _orders(cheap_first: list[Gap], chains: dict, away: set[str], boundaries: set[str]) -> dict[str, list[Gap]]:
        """Tensors to recompute beyond the swap quota, in the order they are evicted (``_fit`` then swaps
        everything left, so its last prefix is as lean as swapping can make it).

        "cheap-first": every rebuildable tensor, cheapest first (chains grow as their inputs go too);
        "local": the same, but a tensor only if its chain reads nothing dropped, so every chain stays as short
        as it was alone; "by-block": block by block from the first, keeping each block's output
        (``boundaries``; checkpointing's structure: a dropped block is rebuilt from the kept output of the one
        before). The first suits graphs of cheap pointwise runs, the others graphs that would otherwise
        rebuild whole stretches at once; ``bounded_drops`` adds orders in between."""
        free = [g for g in cheap_first if g.storage.name not in away]
        local, dropped, pinned = [], set(), set()
        for g in free:
            name, reads = g.storage.name, chains[g.storage.name][1]
            if name in pinned or reads & dropped:
                continue
            local.append(g)
            dropped.add(name)
            pinned |= reads
        by_block = sorted((g for g in free if g.storage.name not in boundaries),
                          key=lambda g: (g.storage.producer, g.storage.name))
        return {"cheap-first": free, "local": local, "by-block": by_block}

    @staticmethod
    def _fit(problem: Problem, costs: Costs, budget_bytes: int, builder: RecomputeBuilder, gaps: list[Gap],
             swapped: list[Gap], late: list[Gap], pool: list[tuple[Gap, str]], start: list[float], label: str,
             judged: dict):
        """Evict the shortest prefix of ``pool`` that fits (bisection; the simulator judges every probe, and
        ``judged`` remembers its verdicts across orders and quotas): (fits, (peak or 0, step time), decisions,
        label)."""
        everything = frozenset(g.storage.name for g in gaps)
        all_gaps = saved_gaps(problem)

        def timeline(decisions: tuple[Decision, ...]):
            if decisions not in judged:
                judged[decisions] = figures_of(problem, costs, decisions)
            return judged[decisions]

        def plan_with(k: int, queue: bool) -> tuple[Decision, ...]:
            recomputed = {g.storage.name for g, kind in pool[:k] if kind == "recompute"}
            rebuilt = decisions_for_saved(problem, everything - recomputed, builder, all_gaps)
            due = read_by_chains(problem, rebuilt)  # a swapped tensor a chain reads is due before that chain
            decided = {g.storage.name for g, _ in pool[:k]}
            fetched = swapped if queue else swapped + [g for g in late if g.storage.name not in decided]
            swaps = just_in_time(problem, costs, fetched, start, release=not queue, queue=queue, due=due) \
                + just_in_time(problem, costs, [g for g, kind in pool[:k] if kind == "swap"], start, release=True,
                               queue=queue, due=due)
            return reconcile(problem, swaps + rebuilt)

        def fits(k: int, queue: bool) -> bool:
            return timeline(plan_with(k, queue)).peak_bytes <= budget_bytes

        # The peak is not monotone in the prefix (a recompute's temporaries can raise a backward peak), so scan
        # in coarse steps for the first prefix that fits, then bisect back into the step before it. Prefetches
        # go where the FIFO stream hides them; only where no prefix fits so, on demand, every copy out waited
        # for (``just_in_time(queue=False)``: the step stalls instead of holding the swapped bytes).
        step = max(1, len(pool) // 8)
        marks = list(range(0, len(pool), step)) + [len(pool)]
        for queue in (True, False):
            if not queue and not fits(len(pool), queue):
                break  # not even every eviction fetched on demand fits: no scan (it doubled greedy's time there)
            hi = next((k for k in marks if fits(k, queue)), None)
            if hi is not None:
                break
        if hi is None:
            leanest = min((plan_with(len(pool), queue) for queue in (True, False)),
                          key=lambda d: (timeline(d).peak_bytes, timeline(d).makespan_us))
            top = timeline(leanest)
            return False, (top.peak_bytes, top.makespan_us), leanest, label + f", all {len(pool)} evicted"
        lo = max(0, hi - step + 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid, queue):
                hi = mid
            else:
                lo = mid + 1
        decisions = plan_with(hi, queue)
        fetching = "" if queue else ", fetched on demand"
        return True, (0, timeline(decisions).makespan_us), decisions, label + f", {hi} evicted{fetching}"


def bounded_drops(problem: Problem, costs: Costs, builder: RecomputeBuilder, cheap_first: list[Gap], chains: dict,
                  away: set[str], growth: float) -> list[Gap]:
    """Rebuildable tensors, cheapest first, each taken only if its chain, rebuilt from what is left after
    the tensors taken before it, costs at most ``growth`` times its chain alone.

    Between the cheap-first order (chains grow without limit: on a ResNet each layer ends up rebuilding the
    stretch before it) and the local one (no chain may read a dropped tensor: a ResNet can then drop only its
    ReLU outputs, half its bytes), this lets a chain rebuild a neighbour or two. Chains taken earlier may still
    grow when a tensor they read is taken later; also bounding those was tried and measured worse (resnet200
    at 0.25: 1.296x against 1.176x), because recomputes grouped at one backward read share their ops."""
    dropped: set[str] = set()
    out: list[Gap] = []
    for g in cheap_first:
        name = g.storage.name
        if name in away:
            continue
        try:
            chain = builder.group([g], dropped | {name})
        except ValueError:
            continue
        if sum(costs.rebuild_us(problem, problem.op_index(op)) for op in chain.ops) <= growth * chains[name][0]:
            out.append(g)
            dropped.add(name)
    return out


def lands_in_time(costs: Costs, swapped: list[Gap], start: list[float], backward_start: float) -> list[Gap]:
    """``swapped`` less the tensors whose copies cannot hide on the two FIFO streams (times from the unplanned
    step): walking the forward, a copy out queues behind those of the tensors produced before it, and must
    land early enough for its copy back to hide before the first backward read; walking the backward from
    its end, each copy back must end before its read and before the next one starts, and start after the
    forward and after its copy out landed. A tensor that misses either is not swapped: its copies would
    only stall the step (ResNet-1001, bf16-mixed, H100 preset, at 0.7 with a quarter of the forward's copy
    capacity swapped: 590 µs waiting at the first backward op for the last copies out, then 10 µs at most
    reads of the first stages, where the copies back came faster than the stream carries them). Where every
    copy is fetched on demand (``just_in_time(queue=False)``) nothing hides anyway, and ``Greedy`` swaps
    those tensors too."""
    queue_end = 0.0
    landed: dict[str, float] = {}
    for g in sorted(swapped, key=lambda g: (g.storage.producer, g.storage.name)):
        size = g.storage.size_bytes
        end = max(queue_end, start[g.storage.producer + 1]) + costs.copy_time_us(size, "d2h")
        if end + LOOKAHEAD * costs.copy_time_us(size, "h2d") <= start[g.first_bwd_use]:
            landed[g.storage.name] = queue_end = end
    order = sorted((g for g in swapped if g.storage.name in landed),
                   key=lambda g: (g.first_bwd_use, g.storage.producer, g.storage.name))
    kept = copy_back_starts(costs, order, start, {g.storage.name: g.first_bwd_use for g in order},
                            lambda g, begin: begin >= max(backward_start, landed[g.storage.name]))
    return [g for g in swapped if g.storage.name in kept]


def copy_back_starts(costs: Costs, order: list[Gap], start: list[float], read_at: dict[str, int],
                     take=lambda g, begin: True) -> dict[str, float]:
    """When each copy back starts on the FIFO host→device stream, walking ``order`` (by first read) from its
    last read to its first: a copy ends before its read (``read_at``) and before the next copy starts, with
    ``LOOKAHEAD`` slack on its duration. ``take(gap, start)``: whether that copy is made at all (one that is
    not leaves the stream to the earlier ones). Both ``just_in_time``'s placement and ``lands_in_time``'s
    check walk it, so the two cannot drift apart."""
    out: dict[str, float] = {}
    next_start = float("inf")
    for g in reversed(order):
        name = g.storage.name
        begin = min(start[read_at[name]], next_start) - LOOKAHEAD * costs.copy_time_us(g.storage.size_bytes, "h2d")
        if take(g, begin):
            out[name] = next_start = begin
    return out


def just_in_time(problem: Problem, costs: Costs, swapped: list[Gap], start: list[float], *,
                 release: bool = False, queue: bool = True, due: dict[str, int] | None = None) -> list[Decision]:
    """Offloads right after production, prefetched as late as the FIFO host→device stream allows: walking the
    backward's reads from last to first, each copy must end before its read and before the next copy starts
    (times from the unplanned step; ``start[i]`` is when op i starts). ``release``: compute waits for each
    copy out right after the tensor's last forward read, so its bytes are free from there whatever the copy
    stream's backlog (the leanest swap); otherwise the bytes go when the copy is done.

    ``queue=False`` fetches each tensor on demand, at its first backward read. Where the stream carries more
    than the backward can hide, the FIFO placement starts the whole backlog at the start of the backward and
    every swapped tensor is back on the device at once; on demand, the step stalls for each copy instead and
    holds no swapped tensor before its read (ResNet-50, bf16-mixed, H100 preset, at 0.25 of its peak: no
    FIFO placement fit, the leanest peaking at 2.82 GiB; on demand 2.25 GiB).

    ``due``: storage -> an op before the first backward read where the tensor is read already (by a recompute
    chain: ``base.read_by_chains``); its copy is placed to end before that op. Placing it for the later read
    left ``reconcile`` to issue it at the chain itself, the copy in full view: on Llama in bf16 at 0.35 of its
    peak, 1.4 ms of stall per layer, and greedy swapped a quarter of what the copy stream could carry."""
    due = due or {}
    read_at = {g.storage.name: min(g.first_bwd_use, due.get(g.storage.name, g.first_bwd_use)) for g in swapped}
    order = sorted(swapped, key=lambda g: (read_at[g.storage.name], g.storage.producer, g.storage.name))
    if not queue:
        return [offload_for(problem, g, release=release) for g in order]
    begins = copy_back_starts(costs, order, start, read_at)
    out: list[Decision] = []
    at = len(start) - 1
    for g in reversed(order):
        floor = max(problem.num_fwd_ops, g.last_fwd_use + 1)
        at = min(at, read_at[g.storage.name])
        while at > floor and start[at] > begins[g.storage.name]:
            at -= 1
        out.append(offload_for(problem, g, prefetch_at=max(at, floor), release=release))
    return out[::-1]


def loosen_releases(problem: Problem, costs: Costs, budget_bytes: int, decisions: tuple[Decision, ...],
                    max_trials: int = 64) -> tuple[tuple[Decision, ...], int]:
    """Drop each forced wait for a copy out (``release_before``) that the budget does not need: one pass, last
    offload first (the waits near the peak matter most), at most ``max_trials`` simulations, each change kept
    only if the simulator says the step still fits and got faster. Returns the decisions and how many waits
    were dropped."""
    current = list(decisions)
    time = figures_of(problem, costs, current).makespan_us
    dropped = 0
    waits = [k for k, d in enumerate(current) if isinstance(d, Offload) and d.release_before is not None]
    for k in reversed(waits[-max_trials:]):
        if progress.past_deadline():
            break  # every trial is optional polish: past the time limit the plan as it stands is fine
        d = current[k]
        trial = current[:k] + [replace(d, release_before=None)] + current[k + 1:]
        tl = figures_of(problem, costs, trial)
        if tl.peak_bytes <= budget_bytes and tl.makespan_us < time:
            current, time, dropped = trial, tl.makespan_us, dropped + 1
    return tuple(current), dropped
