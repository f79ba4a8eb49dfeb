"""The code between a step's compiled runs, which no plan sees but the budget must count.

Two things about it are learnt once per sequence of runs (a sequence is the regions the step ran, in order:
``signature``):

* **what it allocates** (``gaps``): the eager code at a graph break, after run ``k`` until run ``k + 1``, and the
  loss head after the last run until the backward begins (``F.cross_entropy(step(x), y)``: the log-softmax of the
  logits and its gradient). Measured by a ``karma_fx.measure_run.GapMeter`` over one whole step, started where the
  front door begins a step (outside every compiled region) and stopped when that step's backward call returns;
  guessed until then (``loss_head_guess``), and wherever it cannot be measured: under the raw backend (no step
  boundary outside the regions), with worker threads of ours beside the step, on a GPU.
* **how far the whole step climbed**, from the same measurement, handed to the session, which compares it with
  the step its plans predicted (``karma_fx.margin``). The raw backend measures this alone (``gaps=False``):
  its meter starts inside the step's first run, after the code before it, so what it would say of the gaps
  between runs is not the gaps a planned step sees, but the climb from there to the step's peak is.
* **which outputs of the last run the caller keeps** into the backward (``kept``): HF models return their logits
  beside the loss, and a loop that only backpropagates the loss lets them go before the backward. Watched with
  storage weak references, which cost nothing and work everywhere.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from karma_fx.regions import Run

LOSS_HEAD_GUESS = 2
"""Until the code after the last forward has been measured, it is taken to climb by this many times the
bytes of the outputs the caller gets (a cross-entropy over logits: their log-softmax and its gradient, the
logits freed meanwhile: measured 2.0x on a CPU)."""

Signature = tuple[int, ...]


def loss_head_guess(view: Run) -> int:
    """What the code after the step's last forward may allocate, before it is measured: nothing where the model
    returns a scalar (it computed its loss itself, as a HF model given labels does), else ``LOSS_HEAD_GUESS``
    times the outputs it returns (a loss over them)."""
    if any(b <= 8 for _, b, _ in view.makes):
        return 0
    return LOSS_HEAD_GUESS * sum(b for _, b, saved in view.makes if not saved)


def _holders(ref: Any) -> int:
    """How many tensors (and storage objects) hold the storage ``ref`` refers to. An output the backward reads
    stays alive through its saved tensor whether or not the caller holds it: it is let go where no more hold it
    when the backward begins than when the run returned it, less the tensors returned on it (each returned
    tensor gone, and no view of one made since; a view holds its base too). Where the count cannot be read, as
    many as ever: held."""
    try:
        return int(torch._C._storage_Use_Count(ref.cdata))
    except (AttributeError, RuntimeError, TypeError):
        return 1 << 30


class Between:
    """What is known, and being learnt, about the code between one session's runs."""

    def __init__(self) -> None:
        self.gaps: dict[Signature, int] = {}
        """Per sequence of runs so far: what the code after its last run allocated (measured)."""
        self.kept: dict[Signature, frozenset[int]] = {}
        """Per sequence of runs: which outputs of its last run the caller still held when the backward began, in
        any step so far (a loop may hold them only on the steps it logs)."""
        self.remeasured = False
        """Something was measured since the session last chose its plans: choose again, with it."""
        self._meter: Any = None
        self._outputs: list[tuple[int, Any, int, int]] = []

    def unknown(self, signature: Signature) -> bool:
        """Whether the code after some run of ``signature`` is still to be measured."""
        return any(signature[:k + 1] not in self.gaps for k in range(len(signature)))

    def gap_list(self, views: list[Run], signature: Signature) -> list[int]:
        """Per run of ``views`` (the sequence ``signature``): the bytes the code after it allocates, measured or
        guessed."""
        out = []
        for k, view in enumerate(views):
            g = self.gaps.get(signature[:k + 1])
            if g is None:
                g = loss_head_guess(view) if k == len(views) - 1 else 0
            out.append(g)
        return out

    def caller_keeps(self, signature: Signature) -> frozenset[int] | None:
        return self.kept.get(signature)

    # ---- measuring ----------------------------------------------------------------------------------------
    def start(self, ran: Callable[[], Signature], climbed: Callable[[int], None] = lambda _: None,
              gaps: bool = True) -> None:
        """Measure the code between the compiled calls of the step about to begin. Call it before the step's
        first compiled call allocates, and only where no worker thread of ours runs beside the step (a profiler session that
        such threads allocate under crashed the process when it stopped) and not on a GPU (its backward runs on
        the autograd engine's thread). ``ran`` says which sequence the step ran, when the meter stops;
        ``climbed`` then gets how far the whole step climbed above what it began with (after the gaps are
        learnt), where the meter saw it all; ``gaps=False`` learns only that climb."""
        from karma_fx.measure_run import GapMeter

        def learn(measured: dict[int, int], climb: int) -> None:
            signature = ran()
            for k, nbytes in (measured.items() if gaps else ()):
                if k < len(signature):
                    key = signature[:k + 1]
                    self.gaps[key] = max(self.gaps.get(key, 0), nbytes)
                    self.remeasured = True
            if climb:
                climbed(climb)

        meter = GapMeter("cpu", done=learn)
        if meter.start():
            if meter.stop_after_backward():
                self._meter = meter
            else:  # someone's profile function is in place: leave their session of the step alone
                meter.stop()

    def finish(self) -> None:
        """Stop measuring (the meter hands what it measured to ``learn``)."""
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.stop()

    def run_starts(self, k: int) -> None:
        """Run ``k`` begins: the code after run ``k - 1`` ends here."""
        if self._meter is not None and k > 0:
            self._meter.end(k - 1)

    def run_returned(self, k: int, out: Any, watch: bool = True) -> None:
        """Run ``k`` has returned ``out``: the code after it begins; where ``watch``, watch its outputs (every
        step: what one step lets go, another may hold)."""
        if self._meter is not None:
            self._meter.begin(k)
        self._outputs = []
        if watch:
            from torch.multiprocessing.reductions import StorageWeakRef

            tensors = [(o, t) for o, t in enumerate(out if isinstance(out, (list, tuple)) else (out,))
                       if isinstance(t, torch.Tensor)]
            refs = {}
            for o, t in tensors:  # outputs sharing a storage (a tensor and a view of it) are watched as one
                ref = StorageWeakRef(t.untyped_storage())
                refs.setdefault(ref.cdata, []).append((o, ref))
            for group in refs.values():
                ref = group[0][1]
                self._outputs.extend((o, ref, _holders(ref), len(group)) for o, _ in group)

    def backward_began(self, signature: Signature) -> None:
        """The step's backward begins after its run ``len(signature) - 1``: the loss head ends here, and which
        of that run's outputs the caller still holds is known."""
        if self._meter is not None and signature:
            self._meter.end(len(signature) - 1)
        if signature and self._outputs:
            # kept: more hold its storage than when the run returned it, less the tensors it returned on it
            kept = frozenset(o for o, ref, held, returned in self._outputs
                             if not ref.expired() and _holders(ref) > held - returned)
            before = self.kept.get(signature)
            if before is None or not kept <= before:
                self.kept[signature] = kept | (before or frozenset())
                self.remeasured = self.remeasured or before is not None  # held now, let go before: choose again
