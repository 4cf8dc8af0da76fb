"""The checkpoint package's own exception type (a module of its own: every file raises it)."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, truncated, corrupt or refused (the message names the
    file and, where it helps, what to do)."""
