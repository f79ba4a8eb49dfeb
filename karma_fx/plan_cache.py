"""Plans saved on disk, keyed by what they were made for, so that a restarted job does not plan again.

The key is a hash of the planning problem itself (every op, its inputs and outputs; every storage, its size and
kind), the device model, the strategy and the budget in bytes: a different model, shape, dtype, device or budget
gives a different key, and a cached plan is still checked by the simulator before it is used.

Example::

    cache = PlanCache("~/.cache/karma")
    plan = cache.get(problem, device, "cpsat", budget_bytes) or plan_it()
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from karma_fx.errors import KarmaError
from karma_fx.plan import Plan
from karma_fx.problem import Problem

log = logging.getLogger("karma_fx.plan_cache")


def problem_key(problem: Problem, *parts: object) -> str:
    """A stable hash of ``problem`` and ``parts`` (device, strategy, budget...)."""
    digest = hashlib.sha256()
    for op in problem.ops:
        digest.update(repr((op.name, op.target, op.phase, op.inputs, op.outputs, op.flops, op.bytes_accessed,
                            op.random, op.mutates)).encode())
    for st in problem.storages:
        digest.update(repr((st.name, st.size_bytes, st.kind, st.producer, st.users, st.is_output)).encode())
    digest.update(repr((problem.num_fwd_ops,) + parts).encode())
    return digest.hexdigest()[:32]


class PlanCache:
    """A directory of ``<key>.json`` plans."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()

    def get(self, key: str) -> Plan | None:
        path = self.directory / f"{key}.json"
        if not path.is_file():
            return None
        try:
            plan = Plan.load(path)
        except KarmaError as exc:
            log.warning("karma_fx: ignoring the cached plan %s: %s", path, exc)
            return None
        log.info("karma_fx: reusing the plan cached in %s", path)
        return plan

    def put(self, key: str, plan: Plan) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(plan.replace(schedule=()).to_dict()) + "\n")
            tmp.replace(self.directory / f"{key}.json")
        except OSError as exc:
            log.warning("karma_fx: could not save the plan in %s: %s", self.directory, exc)
