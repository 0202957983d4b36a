"""waltz.clock: the wall clock every part of Waltz reads, which the torture run's clock faults step
and skew through a file (issue 37 item 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from waltz import clock


class Fake:
    """A clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def look_again(c: clock.FileClock, mono: Fake) -> None:
    """Lets the next read look at the file, and gives it an mtime of its own (two writes may land
    in one tick of the file system's clock)."""
    mono.now += clock.CHECK_EVERY
    if os.path.exists(c.path):
        st = os.stat(c.path)
        os.utime(c.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_steps_skews_and_heals_as_the_file_says(tmp_path) -> None:
    path = tmp_path / "clock"
    system, mono = Fake(1_000.0), Fake(0.0)
    c = clock.FileClock(str(path), system, mono)
    assert c.time() == 1_000.0, "no file: the system clock"

    path.write_text(clock.render(-90_000))
    look_again(c, mono)
    assert c.time() == pytest.approx(910.0)
    system.now = 1_010.0
    assert c.time() == pytest.approx(920.0), "a step keeps the clock's rate"

    path.write_text(clock.render(0, 2.0, 1_010_000))
    look_again(c, mono)
    assert c.time() == pytest.approx(1_010.0), "a skew starts where the system clock is"
    system.now = 1_020.0
    assert c.time() == pytest.approx(1_030.0), "and runs twice as fast"

    path.unlink()
    look_again(c, mono)
    assert c.time() == 1_020.0, "healed: no file, no step"


def test_the_file_is_looked_at_only_every_check_interval(tmp_path) -> None:
    path = tmp_path / "clock"
    mono = Fake(0.0)
    c = clock.FileClock(str(path), Fake(500.0), mono)
    assert c.time() == 500.0
    path.write_text(clock.render(60_000))
    mono.now += clock.CHECK_EVERY * 0.9
    assert c.time() == 500.0, "read within CHECK_EVERY of the last look: not seen yet"
    mono.now += clock.CHECK_EVERY * 0.2
    assert c.time() == pytest.approx(560.0)


@pytest.mark.parametrize("text", ["", "1 2", "x 1 0", "0 0 0", "0 -2 0", "0 nan 0", "inf 1 0", "1 2 3 4"])
def test_what_is_not_a_clock_file_is_no_step(tmp_path, text: str) -> None:
    assert clock.parse(text) is None
    path = tmp_path / "clock"
    path.write_text(text)
    assert clock.FileClock(str(path), Fake(7.0)).time() == 7.0


def test_render_and_parse_agree() -> None:
    assert clock.parse(clock.render(-1500, 0.25, 123456)) == (-1500.0, 0.25, 123456.0)


def test_the_environment_variable_chooses_the_clock(tmp_path) -> None:
    """Without the variable the module's `time` is `time.time` itself (nothing in the way); with
    it, every reader in the process (Python and the native engine) shows the step."""
    path = tmp_path / "clock"
    path.write_text(clock.render(3_600_000))
    code = (
        "import sys, time\n"
        "from waltz import clock\n"
        "from waltz.storage import Storage\n"
        "native = Storage.create(sys.argv[1], bytes(16), 1).creation_time_ms / 1000\n"
        "now = time.time()\n"
        "print(clock.time is time.time, *(round(t - now) for t in"
        " (clock.time(), clock.now_ms() / 1000, clock.time_ns() / 1e9, native)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != clock.CLOCK_FILE_ENV}
    plain = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["True", "0", "0", "0", "0"]
    stepped = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "b")],
        env={**env, clock.CLOCK_FILE_ENV: str(path)},
        capture_output=True,
        text=True,
    )
    assert stepped.returncode == 0, stepped.stderr
    assert stepped.stdout.split() == ["False", "3600", "3600", "3600", "3600"]
