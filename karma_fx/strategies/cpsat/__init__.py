"""``cpsat``, the exact planner, as one package; read it bottom-up:

``choice`` (what is decided per tensor) → ``model`` (candidates, decision literals, exact memory) →
``capacity`` (the all-linear first pass) and ``exact`` (the FIFO-timed model) → ``window`` (re-solves around
an incumbent) → ``planner`` (``CpSat``: bound, heuristics, models, windows, the simulator's last word).
``bound`` is the LP lower bound every plan is measured against.
"""
from karma_fx.strategies.cpsat.choice import KEEP, RECOMPUTE, Choice, Kind
from karma_fx.strategies.cpsat.exact import Model
from karma_fx.strategies.cpsat.options import SolverOptions
from karma_fx.strategies.cpsat.planner import CpSat

__all__ = ["CpSat", "SolverOptions", "Model", "Choice", "Kind", "KEEP", "RECOMPUTE"]
