"""Exceptions raised by tpusync. The native engine maps each status code to one class here."""


class TpuSyncError(Exception):
    """Base class of every tpusync error."""


class InvalidArgumentError(TpuSyncError, ValueError):
    """A malformed argument: wrong key, wrong buffer size, bad geometry."""


class NotFoundError(TpuSyncError, KeyError):
    """A block or file that must exist does not."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PreconditionError(TpuSyncError, RuntimeError):
    """The call is valid but not in the current state (already stored, not pinned, closed)."""


class CapacityError(TpuSyncError):
    """No room: DRAM full of pinned blocks, a full disk, a pool larger than /dev/shm."""


class CorruptionError(TpuSyncError):
    """A stored block failed its integrity check."""


class StorageIOError(TpuSyncError, OSError):
    """The operating system refused an I/O call."""


class UnavailableError(TpuSyncError, ConnectionError):
    """A peer or service cannot be reached."""


class ProtocolError(UnavailableError):
    """A peer's bytes broke the wire protocol (a malformed or altered frame): the connection was
    closed, as for an unreachable peer."""


class DeadlineExceededError(TpuSyncError, TimeoutError):
    """An operation did not finish before its deadline."""


class AuthError(TpuSyncError, PermissionError):
    """A peer failed the shared-secret handshake."""
