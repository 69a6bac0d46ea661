"""Faults and bad inputs through the real CLI, each in subprocesses with a timeout: every one ends in a
clear error or a correct resume, with no hang and no lost or doubled step. The scenarios are in
faults.py; `python -m tests.reliability.report` runs all of them, these tests the quick ones and the
most telling Ray ones (each Ray run starts a local Ray, ~20 s on 2 cores): SIGTERM to the whole process
group, and a stopped rollout worker caught by worker_timeout_s.

The selected scenarios run AT_ONCE at a time, in threads started by the first of these tests (each scenario is
subprocesses and waiting: one driver leaves the second core idle): the Ray ones one after another from the start
(two local Rays at once would double the heaviest start), the others in the tests' order beside them; each test
takes its scenario's outcome. So a scenario also runs beside another's load, as on a busy machine.
"""

from __future__ import annotations

import threading

import pytest

from .faults import EXIT_TIMEOUT, RUN_TIMEOUT, SCENARIOS, Outcome, Scenario, run_scenario

AT_ONCE = 2


def bound(scenario: Scenario) -> int:
    """A pytest timeout above the scenario's own subprocess timeouts (two runs, a stop, the cleanup), and the
    scenario it may wait behind."""
    return int(2 * RUN_TIMEOUT[scenario.ray] + EXIT_TIMEOUT + 60) + int(2 * RUN_TIMEOUT[True] + EXIT_TIMEOUT)


def cases() -> list:
    chosen = []
    for scenario in (s for s in SCENARIOS if s.in_tests):
        marks = [pytest.mark.timeout(bound(scenario))]
        if scenario.ray:
            marks.append(pytest.mark.ray)
        chosen.append(pytest.param(scenario, id=scenario.name, marks=marks))
    return chosen


class Scenarios:
    """Runs `scenarios` AT_ONCE at a time in threads: each thread takes the first waiting Ray scenario when no other
    Ray one runs, else the first waiting other one; `outcome(s)` waits for one."""

    def __init__(self, scenarios: list[Scenario]):
        self.waiting = list(scenarios)
        self.outcomes: dict[str, Outcome | BaseException] = {}
        self.on_ray = False
        self.changed = threading.Condition()
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"fault-scenarios-{i}")
                        for i in range(min(AT_ONCE, len(scenarios)))]
        for thread in self.threads:
            thread.start()

    def _next(self) -> Scenario | None:
        with self.changed:
            while self.waiting:
                # the Ray ones, the longest, one after another from the start; the others beside them
                ready = [s for s in self.waiting if s.ray and not self.on_ray] or [s for s in self.waiting if not s.ray]
                if ready:
                    self.waiting.remove(ready[0])
                    self.on_ray = self.on_ray or ready[0].ray
                    return ready[0]
                self.changed.wait()
            return None

    def _work(self) -> None:
        while (scenario := self._next()) is not None:
            try:
                outcome: Outcome | BaseException = run_scenario(scenario)
            except BaseException as exc:  # noqa: BLE001 - the test that takes it raises it
                outcome = exc
            with self.changed:
                self.outcomes[scenario.name] = outcome
                self.on_ray = self.on_ray and not scenario.ray
                self.changed.notify_all()

    def outcome(self, scenario: Scenario) -> Outcome:
        with self.changed:
            if scenario.name not in self.outcomes and scenario not in self.waiting and not any(
                    t.is_alive() for t in self.threads):
                raise RuntimeError(f"scenario {scenario.name!r} was not started")
            self.changed.wait_for(lambda: scenario.name in self.outcomes)
            outcome = self.outcomes.pop(scenario.name)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        """Start no more; wait for those running (each bounded by its own timeouts)."""
        with self.changed:
            self.waiting.clear()
            self.changed.notify_all()
        for thread in self.threads:
            thread.join()


@pytest.fixture(scope="module")
def scenarios(request):
    """The scenarios of this module's selected tests (after -k and -m), started at once, in the tests' order."""
    chosen = [item.callspec.params["scenario"] for item in request.session.items
              if item.module is request.module and "scenario" in getattr(getattr(item, "callspec", None), "params", {})]
    pool = Scenarios(chosen)
    yield pool
    pool.close()


@pytest.mark.parametrize("scenario", cases())
def test_fault_ends_in_a_clear_error_or_a_correct_resume(scenario: Scenario, scenarios: Scenarios):
    outcome = scenarios.outcome(scenario)
    assert not outcome.hang, outcome.detail
    assert outcome.survived, outcome.detail
    assert outcome.steps_lost == 0, outcome.detail
