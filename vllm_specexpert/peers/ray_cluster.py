"""Joining a Ray cluster for the mesh: Ray as an optional dependency (the ``mesh``
extra), an address checked before Ray's own minute of retries, one error naming the
field for each failure."""

from __future__ import annotations

import socket
from types import ModuleType

from vllm_specexpert.config import SpecExpertConfigError


def require_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise SpecExpertConfigError(
            "mesh",
            "needs Ray, which is not installed",
            "pip install 'vllm-specexpert[mesh]' (or remove mesh)",
        ) from None
    return ray


def init_ray(ray: ModuleType, address: str | None) -> bool:
    """Join the cluster at ``address`` (``None``: start a local Ray); whether this call
    started Ray (and so shuts it down on close)."""
    if ray.is_initialized():
        return False
    check_reachable(address)
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except Exception as error:  # noqa: BLE001 - ConnectionError and Ray's own kinds
        raise SpecExpertConfigError(
            "mesh.ray_address",
            f"cannot join the Ray cluster at {address!r}: {first_line(error)}",
            "start it (`ray start --head`) and give its address, or null for a local Ray",
        ) from None
    return True


PROBE_TIMEOUT_S = 3.0
"""How long the check of ``mesh.ray_address`` waits for a TCP connection."""


def check_reachable(address: str | None) -> None:
    """A ``host:port`` (or ``ray://host:port``) address where nothing accepts a TCP
    connection within :data:`PROBE_TIMEOUT_S` fails at once (``ray.init`` would retry for
    about a minute). ``auto`` and ``None`` (a local Ray) are not probed."""
    host, _, port = (address or "").rpartition("://")[2].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise SpecExpertConfigError(
            "mesh.ray_address",
            f"nothing answers at {address!r}: {first_line(error)}",
            "start the cluster (`ray start --head`) and give its GCS address, or null "
            "for a local Ray",
        ) from None


def first_line(error: BaseException) -> str:
    """The type and first line of ``error``; of a remote task's error (Ray's
    ``RayTaskError``), the exception the task raised."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
