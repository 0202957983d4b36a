"""The Waltz server: partitions, locks, quorum writes and feeds (issue 5; the lock table so far)."""
