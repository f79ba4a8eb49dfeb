"""The step ledger (``karma_fx.regions``) on hand-built runs, numbers small enough to check by hand."""
from __future__ import annotations

from karma_fx.regions import Footprint, Run, Step, pinned_by_breaks, step_peak


def fp(fwd: int, bwd: int, internal: int = 0) -> Footprint:
    return Footprint(fwd_peak_bytes=fwd, bwd_peak_bytes=bwd, own_bytes=0, internal_held_bytes=internal)


def phases(step: Step) -> dict[tuple[int, str], int]:
    return {(p.run, p.stage): p.device_bytes for p in step.phases}


def test_one_run_is_its_own_curve_over_what_the_step_holds_besides():
    run = Run(fp=fp(300, 500, internal=200), own_bytes=100, makes=((("out", 0, 0), 10, False),))
    step = Step(persistent_bytes=1000, runs=(run,), gap_bytes=(40,))
    got = phases(step)
    assert got[(0, "forward")] == 1000 - 100 + 300
    # after the forward: persistent, what it keeps for its backward, its output, and the loss head's climb
    assert got[(0, "after")] == 1000 + 200 + 10 + 40
    assert got[(0, "backward")] == 1000 - 100 + 500
    assert step.peak_bytes == 1400 and step.peak.stage == "backward"


def test_a_tensor_crossing_a_break_is_counted_once():
    """Run 0 keeps its output for its backward; run 1 reads it. In run 1's forward its curve counts it, and
    run 0's held bytes must not count it again; in run 1's backward it is still there (run 0 keeps it), but
    run 1's backward does not read it, so its curve's copy goes."""
    h = ("out", 0, 0)
    first = Run(fp=fp(300, 400, internal=100), own_bytes=50, makes=((h, 64, True),))
    second = Run(fp=fp(200, 250, internal=30), own_bytes=20, reads=((h, 64, False),),
                 makes=((("out", 1, 0), 4, False),))
    got = phases(Step(persistent_bytes=1000, runs=(first, second)))
    assert got[(1, "forward")] == 1000 - 20 + 100 + 200  # run 0's internal held; h is in run 1's own curve
    assert got[(1, "backward")] == 1000 - 20 + 100 + 64 + 250 - 64  # h held by run 0; run 1 drops its copy
    # run 1 is done: nothing of it is left but its output, the loss the caller holds (no new gradients)
    assert got[(0, "backward")] == 1000 - 50 + 400 + 4


def test_later_runs_new_gradients_stay_through_earlier_backwards_unless_accumulated():
    a = Run(fp=fp(100, 100), own_bytes=0, makes=((("out", 0, 0), 8, False),))
    b = Run(fp=fp(100, 100), own_bytes=0, reads=((("out", 0, 0), 8, False),), makes=((("out", 1, 0), 4, False),),
            new_grad_bytes=70)
    fresh = phases(Step(persistent_bytes=0, runs=(a, b)))
    held = phases(Step(persistent_bytes=0, runs=(a, replace_grads(b, 0))))
    assert fresh[(0, "backward")] - held[(0, "backward")] == 70


def test_runs_sharing_parameters_leave_their_gradient_from_the_last_ones_backward():
    """One model called on three pieces before one backward: every run reads the weights w (60 bytes of
    gradient) and v (10), and each says so (as the session builds them). The last run's backward runs first and
    leaves both gradients; each earlier run's backward makes its own on top (counted in its curve) and adds them
    in, leaving nothing new. Counted once per run, the first run's backward held 70 bytes too many; counted at
    the first run only (as it was), every backward but the last lacked them."""
    sizes = {"w": 60, "v": 10}
    views = tuple(Run(fp=fp(100, 100), own_bytes=0, makes=((("out", k, 0), 4, False),), new_grad_bytes=70,
                      grad_ids=frozenset(sizes), grad_sizes=sizes) for k in range(3))
    got = phases(Step(persistent_bytes=0, runs=views))
    assert got[(2, "backward")] == 100  # its curve holds the gradients it makes
    # the last run's gradients and its own curve; the last run's output the caller holds in, its own output out
    assert got[(1, "backward")] == 70 + 100 + 4 - 4
    assert got[(0, "backward")] == 70 + 100 + 4 - 4
    # a last run that reads only w besides a new weight u (5): v's gradient is left by the first run's backward
    third = Run(fp=fp(100, 100), own_bytes=0, makes=((("out", 2, 0), 4, False),), new_grad_bytes=65,
                grad_ids=frozenset({"w", "u"}), grad_sizes={"w": 60, "u": 5})
    got = phases(Step(persistent_bytes=0, runs=(views[0], views[1], third)))
    assert got[(1, "backward")] == 65 + 100 + 4 - 4
    assert got[(0, "backward")] == 65 + 10 + 100 + 4 - 4


def replace_grads(run: Run, nbytes: int) -> Run:
    from dataclasses import replace

    return replace(run, new_grad_bytes=nbytes)


def test_a_tensor_waiting_for_a_later_run_is_alive_in_between():
    """A residual made by run 0, read again only by run 2: alive during run 1's forward, though run 1 does not
    read it (Python holds it)."""
    r = ("out", 0, 0)
    runs = (Run(fp=fp(10, 10), own_bytes=0, makes=((r, 500, False), (("out", 0, 1), 8, False))),
            Run(fp=fp(10, 10), own_bytes=0, reads=((("out", 0, 1), 8, False),), makes=((("out", 1, 0), 8, False),)),
            Run(fp=fp(10, 10), own_bytes=0, reads=((r, 500, False), (("out", 1, 0), 8, False)),
                makes=((("out", 2, 0), 4, False),)))
    got = phases(Step(persistent_bytes=0, runs=runs))
    assert got[(1, "forward")] == 500 + 10


def test_the_caller_letting_outputs_go_before_the_backward():
    logits = ("out", 0, 0)
    kept = Run(fp=fp(100, 900), own_bytes=0, makes=((logits, 400, False),))
    dropped = Run(fp=fp(100, 900), own_bytes=0, makes=((logits, 400, False),), caller_keeps=frozenset())
    assert step_peak(0, [kept]) - step_peak(0, [dropped]) == 400


def test_a_saved_output_the_caller_let_go_is_freed_where_its_backward_has_read_it():
    """The logits a loss's gradient reads: held by the caller, the backward's peak is the one counted with them
    held (900); let go (``caller_keeps`` without them), the one counted with them freed after their last
    reader (700); not known yet, or another saved output still held, the held one."""
    logits, loss = ("out", 0, 1), ("out", 0, 0)

    def run(keeps):
        return Run(fp=Footprint(fwd_peak_bytes=100, bwd_peak_bytes=900, own_bytes=0, internal_held_bytes=0,
                                bwd_peak_released_bytes=700),
                   own_bytes=0, makes=((loss, 4, False), (logits, 400, True)), caller_keeps=keeps)

    assert step_peak(0, [run(frozenset({0}))]) == 700
    assert step_peak(0, [run(frozenset({0, 1}))]) == 900
    assert step_peak(0, [run(None)]) == 900
    # in a run before the last, its outputs are later runs' inputs: counted as before
    later = Run(fp=fp(1, 1), own_bytes=0, reads=((logits, 400, False),), makes=((("out", 1, 0), 4, False),))
    assert phases(Step(0, (run(frozenset()), later)))[(0, "backward")] == 900


def test_another_plan_of_a_run_says_which_of_its_edges_its_backward_reads():
    """The step as written saves the logits (its backward reads them); a plan chunking the head does not. The
    run seen with the first, under the second, counts the logits the caller let go as gone from its backward."""
    as_written = Footprint(fwd_peak_bytes=100, bwd_peak_bytes=900, own_bytes=0, internal_held_bytes=0,
                           inputs=((0, False), (64, True)), outputs=((4, False), (400, True)))
    chunked = Footprint(fwd_peak_bytes=100, bwd_peak_bytes=900, own_bytes=0, internal_held_bytes=0,
                        inputs=((0, False), (64, False)), outputs=((4, False), (400, False)))
    h = ("out", 0, 0)
    run = Run(fp=as_written, own_bytes=0, reads=((h, 64, True),), read_positions=(1,),
              makes=((("out", 1, 0), 4, False), (("out", 1, 1), 400, True)), caller_keeps=frozenset({0}))
    other = run.with_fp(chunked)
    assert other.reads == ((h, 64, False),) and [saved for _, _, saved in other.makes] == [False, False]
    assert phases(Step(0, (other,)))[(0, "backward")] == 900 - 400 - 64
    assert phases(Step(0, (run,)))[(0, "backward")] == 900


def test_breaks_pin_what_a_backward_reads_across_them():
    h, g = ("out", 0, 0), ("out", 1, 0)
    runs = [Run(fp=fp(1, 1), own_bytes=0, makes=((h, 64, True),)),
            Run(fp=fp(1, 1), own_bytes=0, reads=((h, 64, False),), makes=((g, 32, False),)),
            Run(fp=fp(1, 1), own_bytes=0, reads=((g, 32, False),), makes=((("out", 2, 0), 4, False),))]
    assert pinned_by_breaks(runs) == [0, 64, 0]  # g is read by run 2's forward only: nothing pins it
