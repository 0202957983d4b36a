"""A crash-test workload: appends (and optionally truncates) forever, printing what is durable.

Lines on stdout, each flushed only after the engine returned:
  A <txid> <epoch>   transaction <txid> with payload_for(txid, epoch) is acknowledged
  T <txid>           a truncation to <txid> is about to start
  t <txid>           that truncation returned
  E <kind> <msg>     an append failed; the workload then checks the partition refuses more
  R <kind>           the append after a failure was refused with this error
  C <txid> <tag> <n> (--threads) transaction <txid> holds <tag> repeated to <n> bytes
The payload depends on the epoch (the number of truncations so far), so a checker can tell a
re-appended id from a resurrected one.
"""

from __future__ import annotations

import argparse
import random
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for `support` when run as a script

from waltz import errors  # noqa: E402
from waltz.storage import RecordBatch, ReqId, Storage  # noqa: E402

from support.chaos_payload import payload_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--truncate-every", type=int, default=0)
    ap.add_argument("--segment-size", type=int, default=64 << 10)
    ap.add_argument("--checkpoint", type=int, default=50)
    ap.add_argument("--max-batches", type=int, default=10**9)
    ap.add_argument("--threads", type=int, default=0, help="concurrent append_next writers instead")
    ap.add_argument(
        "--record-batch", action="store_true", help="append RecordBatch objects (large records written by reference)"
    )
    args = ap.parse_args()
    if args.threads:
        concurrent(args)
        return
    rng = random.Random(args.seed)
    # RecordBatch data of 4 KiB or more is written by reference (pwritev): have some of both.
    max_size = 12000 if args.record_batch else 3000
    s = Storage.open(args.dir, segment_size=args.segment_size, checkpoint_interval=args.checkpoint)
    p = s.partition(0)
    epoch = args.epoch
    nxt = p.max_transaction_id + 1
    out = sys.stdout
    for n in range(args.max_batches):
        if args.truncate_every and n % args.truncate_every == args.truncate_every - 1 and nxt > 0:
            target = rng.randrange(max(p.first_transaction_id - 1, -1), nxt)
            out.write(f"T {target}\n")
            out.flush()
            p.truncate(target)
            epoch += 1
            nxt = target + 1
            out.write(f"t {target}\n")
            out.flush()
            continue
        count = rng.choice([1, 1, 2, 5, 20, 100])
        records = [
            (ReqId(1, epoch, 0, t), epoch, payload_for(t, epoch, rng.randrange(0, max_size)))
            for t in range(nxt, nxt + count)
        ]
        batch = RecordBatch(records) if args.record_batch else records
        try:
            last = p.append(nxt, batch)
        except errors.WaltzError as e:
            out.write(f"E {type(e).__name__} {e}\n")
            out.flush()
            try:
                p.append(nxt, records[:1])
                out.write("R none\n")
            except errors.WaltzError as e2:
                out.write(f"R {type(e2).__name__}\n")
            out.flush()
            return
        out.write("".join(f"A {t} {epoch}\n" for t in range(nxt, last + 1)))
        out.flush()
        nxt = last + 1


def concurrent(args: argparse.Namespace) -> None:
    """Threads appending with append_next (group commit); each prints its acknowledged ids.

    The engine picks the ids, so a payload cannot name its id in advance: each record carries
    payload_for(-1, epoch, size) tagged with its thread and counter, and the checker reads back
    exactly the bytes the writer acknowledged under that id.
    """
    import threading

    s = Storage.open(args.dir, segment_size=args.segment_size, checkpoint_interval=args.checkpoint)
    p = s.partition(0)
    lock = threading.Lock()

    def run(tid: int) -> None:
        rng = random.Random(args.seed * 1000 + tid)
        for n in range(args.max_batches):
            count = rng.choice([1, 1, 1, 3, 10])
            tags = [f"{tid}:{n}:{k}" for k in range(count)]
            batch = [(ReqId(2, tid, 0, n), k, tag.encode() * rng.randrange(1, 40)) for k, tag in enumerate(tags)]
            first, last = p.append_next(batch)
            with lock:
                sys.stdout.write("".join(f"C {first + k} {tags[k]} {len(batch[k][2])}\n" for k in range(count)))
                sys.stdout.flush()

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
