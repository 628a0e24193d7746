"""The kernel's door for a run's hosts: a TCP listener on the address the nodes reach, which lets in only a
connection that proves the run's secret (multiprocessing's HMAC challenge, both ways) and then says a host's
`Hello`.

Each connection is checked in a thread of its own, every read bounded by AUTH_WAIT, so a stranger that connects and
never answers holds only its own check: the hosts behind it come in and the run goes on. Whatever is refused is
reported to the engine (which logs it); closing the door ends every check still waiting.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from ddpnb.remote.wire import Hello

# seconds a connection may leave a read of its challenge and hello unanswered before it is dropped: long enough for
# a host on a loaded node; a stranger holds only its own check meanwhile, and `close` ends it
AUTH_WAIT = 60
# seconds `close` gives each check it ended to report: a woken check only logs a line, but on a loaded machine its
# thread may wait seconds for a CPU, and the run's end must find what was refused already in the log
CLOSE_WAIT = 10.0

Admit = Callable[[Connection, Hello], None]
Refuse = Callable[[Any, BaseException], None]


class Door:
    """Listens on `host` (port 0; `address` says where) until `close`; `admit(conn, hello)` for each host that
    proves `secret` (it must not block), `refuse(peer, exc)` for anything else, both from the door's threads.
    `greeting`: the type of the first frame after the secret (a host's `Hello`; a detached run's viewer's ask)."""

    def __init__(self, host: str, secret: bytes, admit: Admit, refuse: Refuse, greeting: type = Hello) -> None:
        self._server = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._secret = secret
        self._greeting = greeting
        self._admit, self._refuse = admit, refuse
        self._checking: dict[socket.socket, threading.Thread] = {}  # each connection being checked, its check
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="ddpnb-door", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:  # the door was closed
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                check = self._checking[sock] = threading.Thread(
                    target=self._check, args=(sock, peer), name="ddpnb-door-check", daemon=True
                )
            check.start()

    def _check(self, sock: socket.socket, peer: Any) -> None:
        with sock:  # kept till the check ends, for `close` to wake it; the connection reads a duplicate
            # a receive timeout in the kernel's socket, not Python's: multiprocessing reads the descriptor directly
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _seconds(AUTH_WAIT))
            conn = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(conn, self._secret)
                answer_challenge(conn, self._secret)
                hello = pickle.loads(conn.recv_bytes())  # the secret is proven: this is one of the run's own
                if not isinstance(hello, self._greeting):
                    raise TypeError(f"not a {self._greeting.__name__}: {type(hello).__name__}")
            except BlockingIOError:
                conn.close()
                self._refused(peer, TimeoutError(f"it left the challenge unanswered for {AUTH_WAIT} s"))
                return
            except (AuthenticationError, EOFError, OSError, TypeError, ValueError, pickle.UnpicklingError) as exc:
                conn.close()
                self._refused(peer, exc)
                return
            finally:
                with self._lock:
                    self._checking.pop(sock, None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _seconds(0))  # a host's reads wait as they must
        with self._lock:  # under the lock: once `close` returned, no host is let in
            if not self._closed:
                self._admit(conn, hello)
                return
        conn.close()

    def _refused(self, peer: Any, exc: BaseException) -> None:
        with self._lock:
            closed = self._closed
        if closed:  # its read was ended by `close`
            exc = ConnectionAbortedError("the run ended before it proved the secret")
        self._refuse(peer, exc)

    def close(self) -> None:
        """No one comes in now: the listener closed, and every check still waiting ended and reported."""
        with self._lock:
            self._closed = True
            checking = dict(self._checking)
        for sock in checking:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its check's read
            except OSError:  # its check ended meanwhile
                continue
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes `accept` (Linux)
        except OSError:
            pass
        self._server.close()
        for check in checking.values():
            check.join(CLOSE_WAIT)


def _seconds(seconds: int) -> bytes:
    """A `struct timeval`, as SO_RCVTIMEO takes it (0: no timeout)."""
    return struct.pack("ll", seconds, 0)
