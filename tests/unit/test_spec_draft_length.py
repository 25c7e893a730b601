"""The draft-length controller: drafts only where their expected tokens pay for their rows.

The costs below are shaped like the CPU engine's (bench/RESULTS.md, speculative): a decode
step's quantized matmuls read the weights once per tile of 8 rows, so 8 rows cost twice
one row and the 9th row starts a second tile.
"""

from __future__ import annotations

import pytest

from gpu_worker.spec_decode.draft_length import (
    FORGET_AFTER,
    PROBE_COST,
    PROBE_EVERY,
    UNTRIED_DISCOUNT,
    DraftLengthController,
    DraftStep,
    StepCosts,
    expected_tokens,
)

# Seconds of a decode step by rows, every count timed: 10 ms for one row, +1.4 ms a row to
# 8, then 10 ms more at each tile's edge (9, 17, ...).
CPU_LIKE = {rows: 0.010 * -(-rows // 8) + 0.0014 * min(rows - 1, 7) for rows in range(1, 65)}


def _timed(costs: dict[int, float], num_speculative_tokens: int = 8) -> DraftLengthController:
    controller = DraftLengthController(num_speculative_tokens)
    for rows, seconds in costs.items():
        controller.step_timed(rows, seconds)
    return controller


def _accepting(controller: DraftLengthController, request_id: str, rate: float) -> None:
    """Verifications of 10 drafts each whose runs of acceptances give `rate`: a accepted
    then one rejected is a passes out of a + 1 tests."""
    accepted = round(rate / (1 - rate)) if rate < 1 else 10
    for _ in range(20):
        controller.verified(request_id, 10, accepted)


def test_expected_tokens_is_one_plus_the_chance_of_each_draft_in_turn() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_costs_interpolate_between_timed_rows_and_discount_the_untried() -> None:
    costs = StepCosts()
    assert costs.estimate(1) is None
    costs.observe(1, 0.010)
    costs.observe(9, 0.030)
    assert costs.estimate(1) == 0.010
    assert costs.estimate(5) == pytest.approx(UNTRIED_DISCOUNT * 0.020)
    # Past the largest: the slope of the two largest goes on.
    assert costs.estimate(13) == pytest.approx(UNTRIED_DISCOUNT * 0.040)
    # A new timing moves the average part of the way.
    costs.observe(9, 0.050)
    assert 0.030 < (costs.estimate(9) or 0) < 0.050


def test_one_timed_row_count_extrapolates_at_half_its_cost_per_row() -> None:
    costs = StepCosts()
    costs.observe(4, 0.016)
    assert costs.estimate(8) == pytest.approx(UNTRIED_DISCOUNT * (0.016 + 0.002 * 4))
    assert costs.estimate(2) == pytest.approx(UNTRIED_DISCOUNT * 0.008)


def test_before_any_timing_every_request_gets_the_configured_k() -> None:
    controller = DraftLengthController(5)
    assert controller.plan(["a", "b"]) == {"a": 5, "b": 5}
    assert controller.plan([]) == {}


def test_a_well_accepted_single_stream_stops_at_the_tiles_edge() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "a", 0.9)
    # 8 rows (7 drafts) give ~5.7 tokens for 20 ms; the 9th row costs 10 ms for 0.5 more.
    assert controller.plan(["a"]) == {"a": 7}


def test_rarely_accepted_drafts_switch_speculation_off() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "a", 0.1)
    assert controller.plan(["a"]) == {"a": 0}


def test_a_full_tile_of_requests_gets_no_drafts_that_would_start_the_next() -> None:
    controller = _timed(CPU_LIKE)
    requests = [f"r{i}" for i in range(8)]
    for request_id in requests:
        _accepting(controller, request_id, 0.5)
    assert controller.plan(requests) == dict.fromkeys(requests, 0)


def test_drafts_go_to_the_requests_likeliest_to_use_them() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "good", 0.9)
    _accepting(controller, "poor", 0.3)
    plan = controller.plan(["poor", "good"])
    assert plan["good"] > plan["poor"]


def test_k_bounds_the_plan() -> None:
    controller = _timed(CPU_LIKE, num_speculative_tokens=3)
    _accepting(controller, "a", 1.0)
    assert controller.plan(["a"]) == {"a": 3}


def test_a_request_left_without_drafts_is_probed_while_a_row_is_cheap() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "a", 0.1)
    plans = [controller.plan(["a"])["a"] for _ in range(PROBE_EVERY)]
    assert plans == [0] * (PROBE_EVERY - 1) + [1]
    # Where one more row would cost more than PROBE_COST of the step, no probe.
    dear = _timed({1: 0.010, 2: 0.010 * PROBE_COST * 1.1, 3: 0.040})
    _accepting(dear, "a", 0.1)
    assert all(dear.plan(["a"])["a"] == 0 for _ in range(2 * PROBE_EVERY))


def test_a_new_request_starts_from_the_rate_of_all_requests_and_finish_forgets_it() -> None:
    controller = DraftLengthController(4)
    start = controller.rate("new")
    _accepting(controller, "a", 0.9)
    assert controller.rate("new") > start
    assert controller.rate("a") > 0.85
    # The first rejection is a failure; drafts after it were never tested.
    controller.verified("b", 4, 0)
    controller.verified("b", 4, 0)
    assert controller.rate("b") < controller.rate("a")
    controller.finish("a")
    assert controller.rate("a") == controller.rate("never-seen")


def test_an_untried_row_count_is_tried_once_then_judged_by_its_timing() -> None:
    controller = _timed({1: 0.010, 9: 0.030})
    _accepting(controller, "a", 0.9)
    # 8 rows, interpolated and discounted, look better than the 9 timed ones.
    first = controller.plan(["a"])["a"]
    assert 0 < first < 8
    # Timed far worse than hoped, it gives way to another count.
    controller.step_timed(1 + first, 0.060)
    assert controller.plan(["a"])["a"] != first


def test_a_timing_not_renewed_is_forgotten_and_the_count_tried_again() -> None:
    # One row timed during a stall looks dear; while the controller drafts, that timing is
    # never renewed, until it is forgotten and one row is estimated from its neighbours.
    controller = _timed({1: 0.500, 5: 0.016})
    _accepting(controller, "a", 0.5)
    assert controller.plan(["a"], other_rows=0)["a"] == 4
    for _ in range(FORGET_AFTER + 1):
        controller.step_timed(5, 0.016)
    assert controller.costs.estimate(1) == pytest.approx(UNTRIED_DISCOUNT * 0.016 / 5)
    assert controller.plan(["a"])["a"] == 0


def _drafting(controller: DraftLengthController, costs: dict[int, float]) -> None:
    """The drafter's model steps timed by tokens, as a decode step of 1 row reports them."""
    controller.step_timed(
        1,
        CPU_LIKE[1] + sum(costs.values()),
        [DraftStep(num_tokens, seconds) for num_tokens, seconds in costs.items()],
    )


def test_a_draft_model_as_dear_as_the_target_switches_itself_off() -> None:
    # A draft step costs what a target decode step does (a model drafting for itself):
    # each draft costs a step, so no number of drafts pays for itself.
    controller = _timed(CPU_LIKE)
    _drafting(controller, CPU_LIKE)
    _accepting(controller, "a", 1.0)
    assert controller.plan(["a"], catch_up=lambda request_id: 2) == {"a": 0}
    requests = [f"r{i}" for i in range(8)]
    for request_id in requests:
        _accepting(controller, request_id, 1.0)
    assert controller.plan(requests, catch_up=lambda request_id: 2) == dict.fromkeys(requests, 0)
    # No probe either: its drafting step alone costs a step.
    for _ in range(2 * PROBE_EVERY):
        assert controller.plan(["a"], catch_up=lambda request_id: 2) == {"a": 0}


def test_a_cheap_draft_model_drafts_and_its_catch_up_is_weighed() -> None:
    # A draft step of up to 8 tokens costs a tenth of a target row's step: drafting pays,
    # unless each round must first compute many tokens (64 here, a dear step).
    cheap = {tokens: CPU_LIKE[tokens] / 10 for tokens in range(1, 9)}
    controller = _timed(CPU_LIKE)
    _drafting(controller, {**cheap, 64: 0.100})
    _accepting(controller, "a", 0.9)
    assert controller.plan(["a"], catch_up=lambda request_id: 2)["a"] > 0
    assert controller.plan(["a"], catch_up=lambda request_id: 64) == {"a": 0}


def test_a_step_s_drafting_time_is_not_counted_as_its_rows_cost() -> None:
    controller = DraftLengthController(4)
    controller.step_timed(3, 0.050, [DraftStep(5, 0.020), DraftStep(1, 0.010)])
    assert controller.costs.estimate(3) == pytest.approx(0.020)
    assert controller.draft_costs.estimate(5) == pytest.approx(0.020)
    # A step with prefill rows teaches the drafting costs only.
    controller.drafted([DraftStep(2, 0.012)])
    assert controller.draft_costs.estimate(2) == pytest.approx(0.012)
    assert controller.costs.estimate(2) != pytest.approx(0.012)
