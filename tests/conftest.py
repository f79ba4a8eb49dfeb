"""Shared fixtures: tiny zoo models captured once per session (capture is the slow part of planning)."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from karma_fx.zoo import build

# Inductor compiles only in tests about Inductor (they ask for compiler="inductor"), whatever the environment
# of whoever runs the suite says: every other test runs the planned graphs op by op. The default itself is
# tested with this variable removed (tests/test_inductor.py).
os.environ["KARMA_COMPILER"] = "eager"
# cpsat plans to the end, as before its default time limit: a wall-clock limit would make a test's plan depend on
# how busy the machine is (streamed weights keep their own 10 s a solver round). The default itself is tested with
# this variable removed (tests/test_cpsat.py).
os.environ["KARMA_TIME_LIMIT"] = "none"


@functools.lru_cache(maxsize=None)
def tiny(name: str):
    """(model, args, kwargs) of a tiny zoo model, built once."""
    return build(name, "tiny")


@functools.lru_cache(maxsize=None)
def prepared(name: str, device: str = "h100"):
    """``karma_fx.prepare`` of a tiny zoo model, shared between tests (read-only)."""
    import karma_fx

    model, args, kwargs = tiny(name)
    return karma_fx.prepare(model, args, kwargs, device=device, name=name)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _threads():
    """Each test starts with the process's compute threads: a bench's ``main`` run in a smoke test sets one
    thread (as its timings need) and left every later test of that worker on one."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo caches compiled code per model class; each test starts from an empty cache."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
