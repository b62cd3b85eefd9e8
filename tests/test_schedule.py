"""The pipeline schedule model (`autopar.cost.schedule`): orders, simulation, closed forms.

The closed forms the search ranks candidates with (step time, micro-batches in flight)
equal the simulation of each schedule's order on balanced stages; the simulation follows
unbalanced stages and transfers; the order is the one torch's schedule classes run (checked
against a live PipelineRunner in tests/test_pipeline_runtime.py); and the peak of live
saved activations is measured as autograd frees them.
"""

import pytest
import torch

from autopar.cost.schedule import (
    check_microbatches,
    in_flight,
    order,
    simulate,
    stage_count,
    stage_owner,
    stages_per_rank,
    step_time,
)
from autopar.errors import PlanError
from autopar.runtime.measure import measure_peak_saved_activations, measure_saved_activations

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zero_bubble", 2)]


@pytest.mark.parametrize("schedule,chunks", CASES)
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_closed_forms_equal_the_simulation(schedule, chunks, p):
    v = stages_per_rank(schedule, chunks)
    for m in (p, 2 * p, 2 * p + 1, 4 * p):
        try:
            check_microbatches(schedule, p, m, chunks)
        except PlanError:
            continue
        # every rank: 1 s forward + 2 s backward per micro-batch, split over its v stages
        run = simulate(schedule, p, m, chunks, forward=1.0 / v, backward=2.0 / v)
        assert step_time(schedule, p, m, [3.0] * p, chunks) == pytest.approx(run.step_s)
        assert in_flight(schedule, p, m, chunks) == pytest.approx(run.peak_microbatches)
        assert sum(run.busy_s) == pytest.approx(3.0 * m * p)


def test_known_bubbles_and_memory():
    # GPipe and 1F1B: (p - 1) / (m + p - 1) idle; 1F1B holds p - r micro-batches on rank r
    run = simulate("1f1b", 4, 8, forward=1.0, backward=2.0)
    assert run.idle == pytest.approx([3 / 11] * 4)
    assert run.peak_microbatches == [4, 3, 2, 1]
    assert simulate("gpipe", 4, 8, forward=1.0, backward=2.0).peak_microbatches == [8] * 4
    # interleaving divides the warm-up by v; ZB-V fills it with weight gradients
    inter = simulate("interleaved", 4, 8, 2, forward=0.5, backward=1.0)
    assert inter.step_s == pytest.approx(24 + 3 * 3 / 2)
    zbv = simulate("zero_bubble", 4, 8, forward=0.5, backward=1.0)
    assert zbv.step_s == pytest.approx(24 + 3 * 0.5)
    assert zbv.peak_microbatches == [4] * 4  # 1F1B's first stage, on every rank


def test_simulation_follows_the_slowest_stage_and_transfers():
    even = simulate("1f1b", 2, 8, forward=1.0, backward=2.0)
    slow = simulate("1f1b", 2, 8, forward=[1.0, 2.0], backward=[2.0, 4.0])
    assert slow.step_s == pytest.approx(3 + 8 * 6)  # the first forward, then stage 1 busy
    assert slow.idle[1] == pytest.approx(1 - 48 / 51)
    linked = simulate("1f1b", 2, 8, forward=1.0, backward=2.0, p2p=0.25)
    assert linked.step_s > even.step_s
    assert linked.busy_s == even.busy_s  # transfers are waiting, not work
    held = simulate("gpipe", 2, 4, forward=1.0, backward=2.0, activations=[10.0, 30.0])
    assert held.peak_bytes == [40.0, 120.0]


def test_orders_cover_every_action_once():
    for schedule, chunks in CASES:
        p, m = 4, 8
        n = stage_count(schedule, p, chunks)
        seen = [a for ops in order(schedule, p, m, chunks) for a in ops]
        assert len(seen) == len(set(seen))
        forwards = {(s, i) for kind, s, i in seen if kind == "F"}
        assert forwards == {(s, i) for s in range(n) for i in range(m)}
        for r, ops in enumerate(order(schedule, p, m, chunks)):
            assert all(stage_owner(schedule, s, p) == r for _, s, _ in ops)


def test_bad_microbatch_counts_get_one_sentence():
    with pytest.raises(PlanError, match="1f1b schedule over 4 stages needs at least 4"):
        check_microbatches("1f1b", 4, 2)
    with pytest.raises(PlanError, match="not a whole number of rounds"):
        check_microbatches("interleaved", 2, 7, 2)
    with pytest.raises(PlanError, match="unknown pipeline schedule 'loop'"):
        stage_count("loop", 2)


def test_peak_saved_activations_follow_what_is_alive():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    params = list(model.parameters())

    def whole():
        model(x).sum().backward()

    def one_at_a_time():  # each half's activations are freed before the next is made
        for k in range(2):
            model(x[16 * k:16 * (k + 1)]).sum().backward()

    def all_forwards_first():  # GPipe's order: both halves held at once
        losses = [model(x[16 * k:16 * (k + 1)]).sum() for k in range(2)]
        for loss in losses:
            loss.backward()

    total = measure_saved_activations(whole, params, [x])
    assert measure_peak_saved_activations(whole, params, [x]) == total
    assert measure_peak_saved_activations(one_at_a_time, params, [x]) == total // 2
    assert measure_peak_saved_activations(all_forwards_first, params, [x]) == total
