"""Exit codes the commands share, in a module of their own so that every command can import them
without importing the entry point (which imports every command)."""

MISSING_EXTRA_EXIT = 2
"""Exit code when a command needs an extra that is not installed (as click's usage errors: the
command cannot run as installed, nothing was attempted)."""
