"""Runs a short seeded torture run against a mutant of Waltz and expects it to FAIL.

    .venv/bin/python tests/torture/mutants/run_mutant.py tests/torture/mutants/lazyfs-skip-fdatasync.patch \\
        -- --duration 40s --seed 5 --faults power-loss,power-loss-majority

Applies the patch to a temporary git worktree of HEAD, builds the native extension there (the
checkout's cargo target directory is shared, so only the mutated crate compiles), then runs
`waltz torture` with that worktree's `python/` first on PYTHONPATH (the nodes the run starts
inherit it). Exit 0 when the run FAILED (the mutant was caught), 1 when it PASSED (the faults
cannot see the bug), 2 when the mutant could not be built. The run's directory is kept and printed.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    patch = pathlib.Path(argv[0]).resolve()
    torture_args = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    root = pathlib.Path(__file__).resolve().parents[3]
    work = pathlib.Path(tempfile.mkdtemp(prefix="waltz-mutant-"))
    tree, run = work / "tree", work / "run"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), "HEAD"], check=True)
    try:
        subprocess.run(["git", "-C", str(tree), "apply", str(patch)], check=True)
        env = {**os.environ, "CARGO_TARGET_DIR": str(root / "target"), "PYO3_PYTHON": sys.executable}
        print(f"mutant {patch.name}: building in {tree}", flush=True)
        # The target directory is shared: a second runner's build must not replace the library
        # between this one's build and its copy (cargo's own lock is released in between).
        (root / "target").mkdir(exist_ok=True)
        with open(root / "target" / ".mutant-build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            built = subprocess.run(
                ["cargo", "build", "--release", "--lib", "--features", "python", "--quiet"], cwd=tree, env=env
            )
            if built.returncode != 0:
                return 2
            shutil.copy(
                root / "target" / "release" / "libwaltz_native.so", tree / "python" / "waltz" / "_native.abi3.so"
            )
        cmd = [sys.executable, "-m", "waltz.cli.main", "torture", *torture_args, "--directory", str(run)]
        print(f"mutant {patch.name}: {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree / "python")})
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
    caught = done.returncode != 0
    print(f"mutant {patch.name}: {'CAUGHT (the run FAILED)' if caught else 'SURVIVED (the run PASSED)'}; run in {run}")
    return 0 if caught else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
