"""The exception hierarchy of teraio, one class per stable status code (docs/C_ABI.md).

Every error the engine, the scheduler or the binding reports is a :class:`TeraioError`; its
``status`` is the integer code the C ABI returns for the same error.
"""

from __future__ import annotations


class TeraioError(Exception):
    """Base class of every teraio error. ``status`` is the stable integer code."""

    status = 0


class InvalidArgumentError(TeraioError, ValueError):
    """A parameter is wrong: a size, dtype, buffer, option, configuration key or value."""

    status = -1


class InvalidHandleError(TeraioError):
    """A handle is not (or no longer) valid (C ABI; Python objects check themselves)."""

    status = -2


class IoError(TeraioError, OSError):
    """An I/O system call failed, or moved fewer bytes than asked."""

    status = -3


class NoSpaceError(TeraioError):
    """The array, a memory tier or the engine's host buffers are full."""

    status = -4


class CorruptionError(TeraioError):
    """On-disk metadata is damaged or inconsistent."""

    status = -5


class ChecksumMismatchError(CorruptionError):
    """Data read back does not match the crc32c written with it; never handed back."""

    status = -6


class OverwriteRefusedError(TeraioError):
    """A target holds other data (a filesystem, a partition table, another array)."""

    status = -7


class UnknownTensorError(TeraioError, LookupError):
    """No tensor with this id or name."""

    status = -8


class InvalidStateError(TeraioError):
    """Not valid now: e.g. a prefetch of a freed tensor, an engine buffer still busy."""

    status = -9


class UnsupportedError(TeraioError):
    """Not available on this system or build."""

    status = -10


class ClosedError(TeraioError):
    """The engine was closed."""

    status = -11


class TraceError(TeraioError, ValueError):
    """A trace is invalid or corrupt (the message names the JSON path)."""

    status = -12


class PlanError(TeraioError, ValueError):
    """A plan is inconsistent with its trace."""

    status = -13


class SimulationError(TeraioError):
    """The simulator could not make progress."""

    status = -14


class DivergedError(TeraioError):
    """The iteration left the plan (another kernel, another size); the executor runs in safe
    mode (nothing offloaded, everything read back) until you re-plan."""

    status = -15


class DeviceError(TeraioError):
    """A GPU (CUDA driver, NVRTC, cuFile) call failed."""

    status = -16


class InternalError(TeraioError):
    """A bug: a Rust panic was caught at the boundary."""

    status = -99


__all__ = [
    "TeraioError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "IoError",
    "NoSpaceError",
    "CorruptionError",
    "ChecksumMismatchError",
    "OverwriteRefusedError",
    "UnknownTensorError",
    "InvalidStateError",
    "UnsupportedError",
    "ClosedError",
    "TraceError",
    "PlanError",
    "SimulationError",
    "DivergedError",
    "DeviceError",
    "InternalError",
]
