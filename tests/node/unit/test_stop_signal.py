"""The storage node's daemon stops on a SIGTERM that the kernel delivered to another thread."""

from __future__ import annotations

import subprocess
import sys

# The daemon's own wait, in a process of its own: the handler is the daemon's (it sets the
# event), the signal goes to a thread other than the main one while the main thread waits.
# Before `wait_for_stop`, the main thread's untimed `Event.wait()` was never interrupted and the
# process hung (a storage node outlived SIGTERM at three CI teardowns).
PROGRAM = """
import signal, threading, time
from waltz.storage.daemon import wait_for_stop

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())

def other_thread():
    time.sleep(0.5)  # the main thread is waiting by then
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=other_thread).start()
wait_for_stop(stop)
print("stopped")
"""


def test_a_sigterm_taken_by_another_thread_still_ends_the_wait() -> None:
    try:
        r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the wait never ended: the signal's handler did not run in the main thread") from None
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "stopped"
