"""The retention policy and holds in the metadata (`waltz.cluster.retention`): parsing, overrides,
holds that expire, and changes by compare-and-set on a real embedded store."""

from __future__ import annotations

import pathlib
import threading

import pytest
from waltz import errors
from waltz.cluster import open_store
from waltz.cluster import retention as r
from waltz.cluster.metadata import ClusterMetadata


def test_durations_and_sizes_parse_or_say_what_is_wrong() -> None:
    assert r.parse_duration("7d") == 7 * 86_400_000
    assert r.parse_duration("1h30m") == 5_400_000
    assert r.parse_duration("500ms") == 500
    assert r.parse_duration("none") is None
    assert r.parse_size("10GiB") == 10 << 30
    assert r.parse_size("500MB") == 500_000_000
    assert r.parse_size("4096") == 4096
    assert r.parse_size("unlimited") is None
    for bad in ("7", "7 parsecs", "d", "0s", "-1h"):
        with pytest.raises(errors.InvalidArgumentError, match="bad duration"):
            r.parse_duration(bad)
    for bad in ("-3", "10 GiBs", "1.5GB", "0"):
        with pytest.raises(errors.InvalidArgumentError, match="bad size"):
            r.parse_size(bad)


def test_overrides_inherit_what_they_do_not_set_and_holds_expire() -> None:
    c = r.RetentionConfig(
        r.RetentionPolicy(max_age_ms=1000, max_bytes=None, min_kept=5),
        {1: {"max_bytes": 100}, 2: {"max_age_ms": None}},
        {
            "a": r.Hold("a", 1, 50, created_ms=0),
            "b": r.Hold("b", 1, 30, created_ms=0, expires_ms=100),
            "c": r.Hold("c", 2, 10, created_ms=0),
        },
    )
    assert c.policy_for(0) == r.RetentionPolicy(1000, None, 5)
    assert c.policy_for(1) == r.RetentionPolicy(1000, 100, 5)
    assert c.policy_for(2).keeps_everything
    assert c.hold_from(1, now_ms=99) == 30 and c.hold_from(1, now_ms=100) == 50
    assert c.hold_from(0, now_ms=0) == r.NO_HOLD
    assert r.RetentionConfig.from_json(c.to_json()) == c
    assert r.RetentionConfig.from_json(None) == r.RetentionConfig()


def test_changes_on_a_real_store_are_compare_and_set(tmp_path: pathlib.Path) -> None:
    store = open_store(f"embedded:{tmp_path / 'm.db'}")
    store.start()
    try:
        meta = ClusterMetadata(store, "/waltz/t")
        meta.create("t", 4, 3)
        assert r.read(meta) == (r.RetentionConfig(), -1)  # absent: keep everything
        r.set_policy(meta, None, max_age_ms=60_000)
        r.set_policy(meta, 3, max_bytes=1 << 20)
        # Holds added from many threads at once: none is lost to a race.
        threads = [threading.Thread(target=r.add_hold, args=(meta, f"h{i}", 1, 100 + i, None)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c, version = r.read(meta)
        assert version >= 0 and sorted(c.holds) == [f"h{i}" for i in range(8)]
        assert c.hold_from(1, 0) == 100 and c.policy_for(3) == r.RetentionPolicy(60_000, 1 << 20, 0)
        assert r.release_hold(meta, "h0") and not r.release_hold(meta, "h0")
        r.set_policy(meta, 3, clear=True)
        assert 3 not in r.read(meta)[0].overrides
        with pytest.raises(errors.ClusterError, match="partition 9 does not exist"):
            r.add_hold(meta, "x", 9, 1, None)
        with pytest.raises(errors.InvalidArgumentError, match="bad hold name"):
            r.add_hold(meta, "no spaces", 0, 1, None)
        with pytest.raises(errors.InvalidArgumentError, match="non-negative"):
            r.set_policy(meta, None, max_bytes=-5)
    finally:
        store.close()
