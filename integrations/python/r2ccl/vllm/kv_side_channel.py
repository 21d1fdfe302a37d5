"""The side channel of r2ccl's vLLM KV connector: a decode instance registers the blocks it
allocated for a request with the prefill instance, which then pushes that request's KV into them.

One request, one answer, on a TCP connection that both ends authenticate before anything else:
each proves it holds the deployment's token (R2CCL_BOOTSTRAP_TOKEN, or the connector's "token"
option) by an HMAC-SHA256 over both ends' fresh nonces; the token never crosses the wire, and a
body is parsed only once its HMAC matched. Bodies are JSON, at most MAX_BODY bytes. Without a token
the channel serves loopback only, unless R2CCL_INSECURE_NO_TOKEN=1 (as r2ccl's rails)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

MAX_BODY = 1 << 20
NONCE = 32
MAC = 32
HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64  # served at once; the next waits in the listen backlog

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelError(RuntimeError):
    pass


def token_from(extra: dict[str, Any]) -> bytes | None:
    token = extra.get("token") or os.environ.get("R2CCL_BOOTSTRAP_TOKEN")
    return token.encode() if token else None


def _insecure_allowed() -> bool:
    return os.environ.get("R2CCL_INSECURE_NO_TOKEN") == "1"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"r2ccl-kv-side-channel\0" + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise SideChannelError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _send_body(sock: socket.socket, token: bytes, label: bytes, nonces: bytes, body: dict) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_BODY:
        raise SideChannelError(f"a message of {len(data)} bytes is over the {MAX_BODY}-byte limit")
    sock.sendall(struct.pack("!I", len(data)) + data + _mac(token, label, nonces, data))


def _recv_body(sock: socket.socket, token: bytes, label: bytes, nonces: bytes) -> dict:
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > MAX_BODY:
        raise SideChannelError(f"a message of {size} bytes is over the {MAX_BODY}-byte limit")
    data = _recv_exact(sock, size)
    mac = _recv_exact(sock, MAC)
    if not hmac.compare_digest(mac, _mac(token, label, nonces, data)):
        raise SideChannelError("a message whose HMAC does not match the token")
    try:
        body = json.loads(data)
    except ValueError as e:
        raise SideChannelError(f"a message that is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise SideChannelError(f"a message that is a JSON {type(body).__name__}, not an object")
    return body


class Server:
    """Serves `handler` on host:port (port 0: any) from a thread of its own."""

    def __init__(self, host: str, port: int, token: bytes | None, handler: Handler) -> None:
        if token is None and not _is_loopback(host) and not _insecure_allowed():
            raise SideChannelError(
                f"r2ccl KV connector: no token (R2CCL_BOOTSTRAP_TOKEN, or the connector's 'token' "
                f"option) and the side channel would listen on {host}, which is not loopback; set "
                f"one on both instances, or R2CCL_INSECURE_NO_TOKEN=1 on a trusted network")
        self._token = token or b""
        self._handler = handler
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="r2ccl-kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._closed:
                conn.close()
                return
            self._slots.acquire()
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(HELLO_TIMEOUT_S)
                client_nonce = _recv_exact(conn, NONCE)
                server_nonce = secrets.token_bytes(NONCE)
                nonces = client_nonce + server_nonce
                conn.sendall(server_nonce + _mac(self._token, b"server", nonces))
                request = _recv_body(conn, self._token, b"client", nonces)
                try:
                    reply = self._handler(request)
                except Exception as e:  # noqa: BLE001 - answered, never ends the thread
                    reply = {"error": f"{type(e).__name__}: {e}"}
                _send_body(conn, self._token, b"reply", nonces, reply)
        except (OSError, SideChannelError, struct.error):
            pass  # the client is told nothing more: it was not authenticated, or it left
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stops serving: the listening socket is shut down (which wakes the thread in accept), and
        a connection accepted meanwhile is closed unanswered."""
        self._closed = True
        for end in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close):
            try:
                end()
            except OSError:
                pass
        self._thread.join(timeout=HELLO_TIMEOUT_S)


def call(host: str, port: int, token: bytes | None, body: dict, timeout: float = 10.0) -> dict:
    """Sends `body` to the server at host:port once it proved it holds the token; returns its
    answer (SideChannelError when the server is not who it should be, or the answer is bad)."""
    if token is None and not _is_loopback(host) and not _insecure_allowed():
        raise SideChannelError(
            f"r2ccl KV connector: no token (R2CCL_BOOTSTRAP_TOKEN, or the connector's 'token' option) "
            f"to talk to {host}, which is not loopback")
    key = token or b""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        client_nonce = secrets.token_bytes(NONCE)
        sock.sendall(client_nonce)
        server_nonce = _recv_exact(sock, NONCE)
        nonces = client_nonce + server_nonce
        if not hmac.compare_digest(_recv_exact(sock, MAC), _mac(key, b"server", nonces)):
            raise SideChannelError(f"{host}:{port} does not hold this deployment's token")
        _send_body(sock, key, b"client", nonces, body)
        return _recv_body(sock, key, b"reply", nonces)
