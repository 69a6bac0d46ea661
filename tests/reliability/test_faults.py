"""Faults and bad inputs through the real CLI, each in subprocesses with a timeout: every one ends in a
clear error or a correct resume, with no hang and no lost or doubled step. The scenarios are in
faults.py; `python -m tests.reliability.report` runs all of them, these tests the quick ones and the
most telling Ray ones (each Ray run starts a local Ray, ~20 s on 2 cores): SIGTERM to the whole process
group, and a stopped rollout worker caught by worker_timeout_s."""

from __future__ import annotations

import pytest

from .faults import EXIT_TIMEOUT, RUN_TIMEOUT, SCENARIOS, Scenario, run_scenario


def bound(scenario: Scenario) -> int:
    """A pytest timeout above the scenario's own subprocess timeouts (two runs, a stop, the cleanup)."""
    return int(2 * RUN_TIMEOUT[scenario.ray] + EXIT_TIMEOUT + 60)


def cases() -> list:
    chosen = []
    for scenario in (s for s in SCENARIOS if s.in_tests):
        marks = [pytest.mark.timeout(bound(scenario))]
        if scenario.ray:
            marks.append(pytest.mark.ray)
        chosen.append(pytest.param(scenario, id=scenario.name, marks=marks))
    return chosen


@pytest.mark.parametrize("scenario", cases())
def test_fault_ends_in_a_clear_error_or_a_correct_resume(scenario: Scenario):
    outcome = run_scenario(scenario)
    assert not outcome.hang, outcome.detail
    assert outcome.survived, outcome.detail
    assert outcome.steps_lost == 0, outcome.detail
