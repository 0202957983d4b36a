"""A Waltz cluster on one machine, as real processes (`waltz dev`, `waltz demo`, tests)."""

from waltz.local.cluster import LocalCluster, MemberStatus

__all__ = ["LocalCluster", "MemberStatus"]
