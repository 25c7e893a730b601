"""The draft-length controller: drafts only where their expected tokens pay for their rows.

The costs below are shaped like the CPU engine's (bench/RESULTS.md, speculative): a decode
step's quantized matmuls read the weights once per tile of 8 rows, so 8 rows cost twice
one row and the 9th row starts a second tile.
"""

from __future__ import annotations

import pytest

from gpu_worker.spec_decode.draft_length import (
    FORGET_AFTER,
    UNTRIED_DISCOUNT,
    DraftLengthController,
    StepCosts,
    expected_tokens,
)

# Seconds of a decode step by rows: 10 ms for one row, +1.4 ms a row to 8, a jump at 9.
CPU_LIKE = {rows: 0.010 + 0.0014 * (rows - 1) for rows in range(1, 9)} | {9: 0.030, 16: 0.031}


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


def test_before_any_timing_a_request_gets_the_configured_k() -> None:
    controller = DraftLengthController(5)
    controller.begin_step(1)
    assert controller.limit("a", room=100) == 5
    assert controller.limit("b", room=3) == 3


def test_a_well_accepted_single_stream_stops_at_the_tiles_edge() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "a", 0.9)
    controller.begin_step(1)
    # 8 rows (7 drafts) give ~5.7 tokens for 20 ms; the 9th row costs 10 ms for 0.5 more.
    assert controller.limit("a", room=100) == 7


def test_rarely_accepted_drafts_switch_speculation_off() -> None:
    controller = _timed(CPU_LIKE)
    _accepting(controller, "a", 0.1)
    controller.begin_step(1)
    assert controller.limit("a", room=100) == 0


def test_a_full_tile_of_requests_gets_no_drafts_that_would_start_the_next() -> None:
    controller = _timed(CPU_LIKE)
    for i in range(8):
        _accepting(controller, f"r{i}", 0.5)
    controller.begin_step(8)
    limits = []
    for i in range(8):
        limits.append(controller.limit(f"r{i}", room=100))
        controller.drafted(f"r{i}", limits[-1])
    assert limits == [0] * 8


def test_room_and_k_bound_the_limit() -> None:
    controller = _timed(CPU_LIKE, num_speculative_tokens=3)
    _accepting(controller, "a", 1.0)
    controller.begin_step(1)
    assert controller.limit("a", room=100) == 3
    controller.begin_step(1)
    assert controller.limit("a", room=2) == 2
    controller.begin_step(1)
    assert controller.limit("a", room=0) == 0


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
    controller.begin_step(1)
    # 8 rows, interpolated and discounted, look better than the 9 timed ones.
    first = controller.limit("a", room=100)
    assert first < 8
    controller.drafted("a", first)
    # Timed far worse than hoped, it gives way to another count.
    controller.step_timed(1 + first, 0.060)
    controller.begin_step(1)
    assert controller.limit("a", room=100) != first


def test_a_timing_not_renewed_is_forgotten_and_the_count_tried_again() -> None:
    # One row timed during a stall looks dear; while the controller drafts, that timing is
    # never renewed, until it is forgotten and one row is estimated from its neighbours.
    controller = _timed({1: 0.500, 5: 0.016})
    _accepting(controller, "a", 0.5)
    controller.begin_step(1)
    assert controller.limit("a", room=4) == 4
    for _ in range(FORGET_AFTER + 1):
        controller.step_timed(5, 0.016)
    assert controller.costs.estimate(1) == pytest.approx(UNTRIED_DISCOUNT * 0.016 / 5)
    controller.begin_step(1)
    assert controller.limit("a", room=4) == 0
