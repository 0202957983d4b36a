"""`waltz.client.sync.Slots`: a partition's `max_pending` places for `WaltzClient`'s submitting
threads. A thread finding none free waits until one is released, one place per release."""

from __future__ import annotations

import threading
import time

from waltz.client.sync import Slots


def test_a_thread_waits_for_room_and_each_release_admits_one() -> None:
    slots = Slots(2)
    slots.acquire()
    slots.acquire()
    admitted: list[int] = []

    def take(i: int) -> None:
        slots.acquire()
        admitted.append(i)

    waiting = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in waiting:
        t.start()
    time.sleep(0.2)
    assert admitted == []  # both places are taken
    slots.release()
    deadline = time.monotonic() + 5
    while not admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(admitted) == 1  # one release, one thread in
    slots.release()
    for t in waiting:
        t.join(5)
    assert sorted(admitted) == [0, 1]


def test_places_released_without_waiters_are_kept_for_later() -> None:
    slots = Slots(1)
    slots.acquire()
    slots.release()
    slots.release()  # what close() does to wake a waiter that is not there: one more place
    done = threading.Event()

    def take_two() -> None:
        slots.acquire()
        slots.acquire()
        done.set()

    threading.Thread(target=take_two, daemon=True).start()
    assert done.wait(5)
