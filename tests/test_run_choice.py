"""The session's choice of plan for a region's run, as plain data (``karma_fx.run_choice``)."""
from __future__ import annotations

from karma_fx.run_choice import Candidate, Choice, choose_plan, worth_planning

MiB = 1 << 20


def test_the_fastest_plan_under_which_the_step_fits():
    keep = Candidate(0, 100.0, 9 * MiB, 12 * MiB, keep=True)
    offload = Candidate(1, 110.0, 6 * MiB, 9 * MiB)
    recompute = Candidate(2, 130.0, 5 * MiB, 8 * MiB)
    lean = Candidate(3, 200.0, 3 * MiB, 6 * MiB, leanest=True)
    cands = [keep, offload, recompute, lean]
    assert choose_plan(cands, 12 * MiB, 9 * MiB, ()) == Choice(use=0)
    assert choose_plan(cands, 10 * MiB, 7 * MiB, ()) == Choice(use=1)
    assert choose_plan(cands, 8 * MiB, 5 * MiB, ()) == Choice(use=2)


def test_the_step_as_written_wherever_it_fits_even_where_a_plan_is_predicted_faster():
    keep = Candidate(0, 100.0, 9 * MiB, 12 * MiB, keep=True)
    fused = Candidate(1, 97.0, 8 * MiB, 11 * MiB, ran_last_step=True, ran_before=True)
    assert choose_plan([keep, fused], 12 * MiB, 9 * MiB, ()) == Choice(use=0)
    assert choose_plan([keep, fused], 11 * MiB, 8 * MiB, ()) == Choice(use=1)


def test_equal_times_prefer_the_lower_own_peak():
    a, b = Candidate(0, 100.0, 6 * MiB, 9 * MiB), Candidate(1, 100.0, 5 * MiB, 9 * MiB)
    assert choose_plan([a, b], 9 * MiB, 6 * MiB, ()) == Choice(use=1)


def test_last_steps_plan_is_kept_while_it_fits():
    fast = Candidate(0, 100.0, 8 * MiB, 10 * MiB)
    ran = Candidate(1, 110.0, 6 * MiB, 9 * MiB, ran_last_step=True)
    assert choose_plan([fast, ran], 10 * MiB, 8 * MiB, ()) == Choice(use=1)
    no_longer = Candidate(1, 110.0, 6 * MiB, 11 * MiB, ran_last_step=True)
    assert choose_plan([fast, no_longer], 10 * MiB, 8 * MiB, ()) == Choice(use=0)



def test_a_faster_plan_that_ran_before_is_taken_back():
    """Going back to a plan already compiled costs no recompile: the fastest that fits wins again."""
    fast = Candidate(0, 100.0, 8 * MiB, 10 * MiB, ran_before=True)
    ran = Candidate(1, 110.0, 6 * MiB, 9 * MiB, ran_last_step=True, ran_before=True)
    assert choose_plan([fast, ran], 10 * MiB, 8 * MiB, ()) == Choice(use=0)

def test_last_steps_leanest_plan_does_not_stop_a_better_one():
    lean = Candidate(0, 200.0, 3 * MiB, 6 * MiB, leanest=True, ran_last_step=True)
    better = Candidate(1, 120.0, 5 * MiB, 8 * MiB)
    assert choose_plan([lean, better], 8 * MiB, 5 * MiB, ()) == Choice(use=1)


def test_only_the_leanest_fits_plan_anew_once_per_target():
    keep = Candidate(0, 100.0, 9 * MiB, 12 * MiB)
    lean = Candidate(1, 200.0, 3 * MiB, 6 * MiB, leanest=True)
    assert choose_plan([keep, lean], 8 * MiB, 5 * MiB, ()) == Choice(plan_at=5 * MiB)
    # a plan was made for about that room already: it was no better, so run the leanest
    assert choose_plan([keep, lean], 8 * MiB, 5 * MiB, (5 * MiB + 50_000,)) == Choice(use=1)
    assert choose_plan([keep, lean], 8 * MiB, 5 * MiB, (6 * MiB,)) == Choice(plan_at=5 * MiB)


def test_nothing_fits_plan_at_the_target():
    keep = Candidate(0, 100.0, 9 * MiB, 12 * MiB)
    assert choose_plan([keep], 8 * MiB, 5 * MiB, (5 * MiB,)) == Choice(plan_at=5 * MiB)
    assert choose_plan([], 8 * MiB, 5 * MiB, ()) == Choice(plan_at=5 * MiB)


def test_worth_planning_is_two_percent():
    assert not worth_planning(100, (101,))
    assert not worth_planning(100, (99,))
    assert worth_planning(100, (97,))
    assert worth_planning(100, ())
