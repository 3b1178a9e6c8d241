"""What a launcher hands the ranks it starts, without importing torch: the device variable and
a free rendezvous port. `meshplan run` has its ranks started 0.4 s after the command (5 s when
its launcher imported torch); each rank imports torch itself (`devices.resolve_device`
reads the variable)."""

from __future__ import annotations

import socket

DEVICE_CHOICES = ("auto", "cpu", "cuda")
# A launcher's --device, handed to the ranks of the script it starts (`meshplan run`).
DEVICE_ENV = "MESHPLAN_DEVICE"


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
