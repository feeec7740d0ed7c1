"""The stages of one in-process pipeline, each on its own thread, for the unit tests that run a step that way
(``test_stage_inprocess``, ``test_moe_pipeline``, ``test_overlap_copies``)."""
from __future__ import annotations

import threading
from typing import Callable, Optional


def run_stage_threads(P: int, body: Callable[[int], None], on_error: Callable[[], None], join_s: float,
                      cleanup: Optional[Callable[[], None]] = None, what: str = "a stage thread") -> None:
    """``body(s)`` for each stage ``s`` of ``P``, each on a daemon thread. The first exception of a stage
    calls ``on_error()`` in that thread at once (the other stages stop waiting for it: an aborted barrier, a
    set event and woken conditions) and is raised here once every thread has joined or waited ``join_s``
    seconds; without one, a thread still alive fails the test (``<what> hangs``). ``cleanup()`` runs after the
    joins, before either."""
    errors: list = []

    def run(s: int) -> None:
        try:
            body(s)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            on_error()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    if cleanup is not None:
        cleanup()
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"{what} hangs"


def wake_links(abort: threading.Event, links: dict) -> Callable[[], None]:
    """``on_error`` for stages linked by ``{key: (Condition, queue)}``: set ``abort`` and wake every waiter."""
    def wake() -> None:
        abort.set()
        for cv, _ in links.values():
            with cv:
                cv.notify_all()
    return wake
