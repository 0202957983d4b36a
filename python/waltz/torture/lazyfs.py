"""A LazyFS-style FUSE file system for the torture runs' disk faults (docs/torture.md).

SIGKILL keeps the page cache, so killing a storage node never loses what it wrote but did not
sync. This file system sits between a storage node and its data directory and keeps every write
that was not yet fsynced (or fdatasynced) in its own memory, page by page: reads see them, the
backing directory does not. Killing the file system's process is a power loss: the unsynced
writes are gone, and only what the node synced survives. Before dying it can also tear the last
write at a page boundary (its first pages reach the disk, the rest do not), as a disk may.

Metadata (create, rename, unlink, mkdir) goes to the backing directory at once (it errs on the
side of keeping: every loss this layer produces is one a real power loss could produce too); a
truncate, growing or shrinking, stays in memory like a write until the file is synced.

It also makes the disk full (ENOSPC once a budget of new bytes is used up) and slow (a delay on
every write and sync), both switched at run time through a control socket:

    python -m waltz.torture.lazyfs BACKING MOUNTPOINT CONTROL_NAME  (an abstract Unix socket)

`LazyFs` starts one, sends it commands and simulates the power loss.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any

PAGE = 4096
_OPERATIONS = frozenset(
    "getattr access readdir mkdir rmdir chmod chown utimens readlink symlink link unlink rename statfs fsyncdir "
    "create open release flush read write fsync truncate".split()
)


class _File:
    """The unsynced state of one backing inode: its dirty pages and its size as the node sees it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.dirty: dict[int, bytearray] = {}
        self.backed = size
        """The backing file's bytes from here on are not the file's (an unsynced shrink cut them)."""


class LazyOperations:
    """The FUSE operations (fusepy's `Operations` protocol), passing through to `root`."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._mutex = threading.Lock()
        self.files: dict[int, _File] = {}
        self.budget: int | None = None
        """Bytes the disk may still grow by; None: unlimited."""
        self.delay = 0.0
        """Seconds slept before every write and sync."""
        self.last_writes: dict[int, tuple[int, str, int, bytes]] = {}
        """Per inode with unsynced pages: (sequence, backing path, offset, data) of its last write."""
        self.sequence = 0

    # fusepy calls the method named for each operation; the others answer ENOSYS.
    def __call__(self, op: str, *args: Any) -> Any:
        method = getattr(self, op, None) if op in _OPERATIONS else None
        if method is None:
            from fuse import FuseOSError

            raise FuseOSError(errno.ENOSYS)
        return method(*args)

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _ino(self, fh: int) -> int:
        return os.fstat(fh).st_ino

    # ---- metadata: straight to the backing directory --------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        # The backing file's size is read under the lock: a sync flushing the dirty pages in
        # between would leave a size from before the flush and no dirty state to correct it (an
        # fstat then saw the index file shrink under the engine: torture seed 63).
        with self._mutex:
            st = os.lstat(self._path(path))
            attrs = {k: getattr(st, k) for k in dir(st) if k.startswith("st_") and not k.endswith("_ns")}
            f = self.files.get(st.st_ino)
            if f is not None:
                attrs["st_size"] = f.size
                attrs["st_blocks"] = (f.size + 511) // 512
        return attrs

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._path(path), amode):
            raise OSError(errno.EACCES, "access")
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._path(path), uid, gid)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._path(path), times)

    def readlink(self, path: str) -> str:
        return os.readlink(self._path(path))

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._path(target))

    def link(self, target: str, source: str) -> None:
        os.link(self._path(source), self._path(target))

    def unlink(self, path: str) -> None:
        full = self._path(path)
        st = os.lstat(full)
        os.unlink(full)
        if st.st_nlink <= 1:
            with self._mutex:
                self.files.pop(st.st_ino, None)  # the inode number may be reused by a new file
                self.last_writes.pop(st.st_ino, None)

    def rename(self, old: str, new: str) -> None:
        target = self._path(new)
        with contextlib.suppress(FileNotFoundError):
            replaced = os.lstat(target)
            if replaced.st_nlink <= 1:
                with self._mutex:
                    self.files.pop(replaced.st_ino, None)
                    self.last_writes.pop(replaced.st_ino, None)
        os.rename(self._path(old), target)

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._path(path))
        out = {k: getattr(sv, k) for k in dir(sv) if k.startswith("f_") and k != "f_fsid"}
        if self.budget is not None:
            out["f_bavail"] = out["f_bfree"] = self.budget // max(1, sv.f_bsize)
        return out

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0  # metadata is in the backing directory already

    # ---- data: unsynced pages stay here ------------------------------------------------------

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT, mode)

    def open(self, path: str, flags: int) -> int:
        # Always read-write: a sync through any handle writes the file's dirty pages.
        fh = os.open(self._path(path), os.O_RDWR)
        if flags & os.O_TRUNC:
            self._truncate(fh, 0)
        return fh

    def release(self, path: str, fh: int) -> int:
        os.close(fh)  # dirty pages belong to the inode and outlive the handle, as in a page cache
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) is not a sync

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            f = self.files.get(self._ino(fh))
            if f is None:
                return os.pread(fh, size, offset)
            end = min(offset + size, f.size)
            if end <= offset:
                return b""
            buf = self._backing(fh, f, end - offset, offset)
            for page in range(offset // PAGE, (end - 1) // PAGE + 1):
                dirty = f.dirty.get(page)
                if dirty is None:
                    continue
                lo, hi = max(offset, page * PAGE), min(end, (page + 1) * PAGE)
                buf[lo - offset : hi - offset] = dirty[lo - page * PAGE : hi - page * PAGE]
            return bytes(buf)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        with self._mutex:
            ino = self._ino(fh)
            f = self.files.get(ino)
            if f is None:
                f = self.files[ino] = _File(os.fstat(fh).st_size)
            if self.budget is not None:
                growth = offset + len(data) - f.size
                if growth > self.budget:
                    keep = len(data) - (growth - self.budget)
                    if keep <= 0:
                        raise OSError(errno.ENOSPC, "disk full")
                    data = data[:keep]  # a full disk takes a prefix (a short write), then refuses
                self.budget -= max(0, offset + len(data) - f.size)
            end = offset + len(data)
            for page in range(offset // PAGE, (end - 1) // PAGE + 1):
                buf = f.dirty.get(page)
                if buf is None:
                    buf = f.dirty[page] = self._backing(fh, f, PAGE, page * PAGE)
                lo, hi = max(offset, page * PAGE), min(end, (page + 1) * PAGE)
                buf[lo - page * PAGE : hi - page * PAGE] = data[lo - offset : hi - offset]
            f.size = max(f.size, end)
            self.sequence += 1
            self.last_writes[ino] = (self.sequence, os.readlink(f"/proc/self/fd/{fh}"), offset, bytes(data))
            return len(data)

    @staticmethod
    def _backing(fh: int, f: _File, n: int, offset: int) -> bytearray:
        """`n` bytes at `offset` as the disk has them for `f`: zeros past its end or a shrink."""
        have = os.pread(fh, min(n, f.backed - offset), offset) if offset < f.backed else b""
        return bytearray(have).ljust(n, b"\0")

    def _flush(self, fh: int) -> None:
        """Writes the file's dirty pages to the backing file (caller holds the lock)."""
        ino = self._ino(fh)
        f = self.files.pop(ino, None)
        self.last_writes.pop(ino, None)
        if f is None:
            return
        if os.fstat(fh).st_size > f.backed:
            os.ftruncate(fh, f.backed)
        for page, buf in sorted(f.dirty.items()):
            n = min(PAGE, f.size - page * PAGE)
            if n > 0:
                os.pwrite(fh, bytes(buf[:n]), page * PAGE)
        if os.fstat(fh).st_size != f.size:
            os.ftruncate(fh, f.size)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        with self._mutex:
            self._flush(fh)
            os.fdatasync(fh) if datasync else os.fsync(fh)
        return 0

    def _truncate(self, fh: int, length: int) -> None:
        with self._mutex:
            ino = self._ino(fh)
            f = self.files.get(ino)
            size = f.size if f is not None else os.fstat(fh).st_size
            if f is None:
                f = self.files[ino] = _File(size)
            # A truncate stays in memory like a write until a sync: lost at a power loss.
            if length < f.size:
                f.backed = min(f.backed, length)
                for page in [p for p in f.dirty if p * PAGE >= length]:
                    del f.dirty[page]
                partial = f.dirty.get(length // PAGE)
                if partial is not None:
                    partial[length % PAGE :] = bytes(PAGE - length % PAGE)
            f.size = length

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        if fh is not None:
            self._truncate(fh, length)
            return
        fd = os.open(self._path(path), os.O_RDWR)
        try:
            self._truncate(fd, length)
        finally:
            os.close(fd)

    # ---- control -------------------------------------------------------------------------------

    def dirty_bytes(self) -> int:
        with self._mutex:
            return sum(len(f.dirty) for f in self.files.values()) * PAGE

    def tear(self, fraction: float) -> dict[str, Any]:
        """Writes the last unsynced write's bytes up to a page boundary inside it to the backing
        file (the boundary picked by `fraction` of those inside it): the torn prefix that reached
        the disk before the power went. Nothing when the write spans no boundary."""
        with self._mutex:
            if not self.last_writes:
                return {"torn": None}
            ino, (_, path, offset, data) = max(self.last_writes.items(), key=lambda kv: kv[1])
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino != ino:
                    # Renamed since, and another file took the name: the pages are not that file's.
                    return {"torn": None}
            boundaries = list(range((offset // PAGE + 1) * PAGE, offset + len(data), PAGE))
            if not boundaries:
                return {"torn": None, "write": len(data)}
            cut = boundaries[min(len(boundaries) - 1, int(fraction * len(boundaries)))]
            try:
                fd = os.open(path, os.O_WRONLY)
            except FileNotFoundError:
                return {"torn": None}
            try:
                os.pwrite(fd, data[: cut - offset], offset)
            finally:
                os.close(fd)
            return {"torn": os.path.relpath(path, self.root), "offset": offset, "kept": cut - offset, "of": len(data)}

    def command(self, line: str) -> dict[str, Any]:
        word, _, arg = line.strip().partition(" ")
        if word == "ping":
            return {"ok": True}
        if word == "full":
            with self._mutex:
                self.budget = int(arg)
            return {"ok": True}
        if word == "space":
            with self._mutex:
                self.budget = None
            return {"ok": True}
        if word == "delay":
            self.delay = float(arg)
            return {"ok": True}
        if word == "dirty":
            return {"ok": True, "dirty": self.dirty_bytes()}
        if word == "tear":
            return {"ok": True, "dirty": self.dirty_bytes(), **self.tear(float(arg))}
        return {"ok": False, "error": f"unknown command {word!r}"}


def _serve_control(ops: LazyOperations, name: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)  # abstract: no path (a run's directory can be longer than a socket path)
    server.listen(8)

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile("rw") as f:
                for line in f:
                    f.write(json.dumps(ops.command(line)) + "\n")
                    f.flush()

    threading.Thread(target=loop, name="lazyfs-control", daemon=True).start()


def main() -> None:
    from fuse import FUSE

    backing, mountpoint, control = sys.argv[1:4]
    ops = LazyOperations(os.path.realpath(backing))
    _serve_control(ops, control)
    # big_writes: 128 KiB writes instead of 4 KiB ones; the kernel cache stays in front for reads.
    FUSE(ops, mountpoint, foreground=True, nothreads=False, big_writes=True, max_write=1 << 17)


class LazyFs:
    """One mounted LazyFS process: `backing` holds what reached the disk, `mountpoint` is what
    the storage node uses."""

    def __init__(self, backing: pathlib.Path, mountpoint: pathlib.Path, control: str, log: pathlib.Path) -> None:
        self.backing, self.mountpoint, self.control, self.log = backing, mountpoint, control, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "waltz.torture.lazyfs",
                    str(self.backing),
                    str(self.mountpoint),
                    str(self.control),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise RuntimeError(f"LazyFS did not mount {self.mountpoint}: {tail[0]}")
            time.sleep(0.05)

    def command(self, line: str, timeout: float = 10.0) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect("\0" + self.control)
            s.sendall(line.encode() + b"\n")
            with s.makefile("r") as f:
                reply: dict[str, Any] = json.loads(f.readline())
        if not reply.get("ok"):
            raise RuntimeError(f"LazyFS {self.mountpoint}: {line!r} -> {reply}")
        return reply

    def power_loss(self, tear: float | None = None) -> dict[str, Any]:
        """The machine loses power (its users must be dead already): unsynced writes are lost,
        the last one torn at a page boundary when `tear` is given; then the disk is mounted
        again, empty of anything unsynced."""
        detail = self.command(f"tear {tear}" if tear is not None else "dirty")
        detail.pop("ok", None)
        self._kill()
        self.start()
        return detail

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._unmount()

    def _unmount(self) -> None:
        # A dead FUSE process leaves its mount behind (ENOTCONN): detach it.
        for _ in range(50):
            if not _mounted(self.mountpoint):
                return
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)
            time.sleep(0.05)

    def stop(self) -> None:
        """Unmounts cleanly: a SIGTERM makes libfuse unmount (unsynced pages are then dropped,
        as a stop is the end of the run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._unmount()


def _mounted(path: pathlib.Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


if __name__ == "__main__":
    main()
