"""A TCP port for a bootstrap or a store on 127.0.0.1, for the GPU scripts that start ranks."""

from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768-60999 by default): no outgoing connection, nor one in
# TIME_WAIT, takes the port between the check here and the listen of the rank that serves it.
LOW, HIGH = 20000, 32767


def free_port(taken: tuple[int, ...] = ()) -> int:
    """A port under 32768, not in `taken`, that nothing listens on now (50 tries at most)."""
    for _ in range(50):
        port = random.randint(LOW, HIGH)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH} on 127.0.0.1 after 50 tries")
