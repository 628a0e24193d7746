"""Rank 0's value, from its last message or the kernel's memory file, until the caller takes it."""

from __future__ import annotations

import os
import pickle
import weakref
from typing import Any

from ddpnb.core import pickling


class ResultSlot:
    """Where rank 0's value arrives. An engine that shares memory with the kernel gets `fd`, an anonymous memory
    file rank 0 writes a value holding tensors into (`rank.main._dump_result`); every other value travels pickled
    in rank 0's `Returned` message. The file's memory goes with the last reference to it: this fd, or a tensor
    mapped from it."""

    def __init__(self, memory_file: bool) -> None:
        self.fd: int | None = None
        self._closer: Any = None
        self._payload: bytes | None = None
        self._saved = False  # rank 0 wrote its value into the file
        self._value: Any = None
        if memory_file:
            try:
                self.fd = os.memfd_create("ddpnb-result", os.MFD_CLOEXEC)
            except (AttributeError, OSError):  # no memfd_create here, or refused: every value travels pickled
                return
            self._closer = weakref.finalize(self, os.close, self.fd)  # a result nobody took

    def returned(self, payload: bytes | None, saved: bool) -> None:
        self._payload, self._saved = payload, saved

    def take(self) -> Any:
        """The value, unpickled (or mapped) once; the bytes are dropped so a big result is not held twice."""
        if self._payload is not None:
            self._value, self._payload = pickle.loads(self._payload), None
        elif self._saved:  # mapped, not read: the tensors are the file's pages
            assert self.fd is not None
            self._value, self._saved = pickling.load(self.fd), False
            self.close()
        return self._value

    def settle(self, succeeded: bool) -> None:
        """The run ended: what rank 0 sent is not needed unless it succeeded; an unused file is closed."""
        if not succeeded:
            self._payload, self._saved = None, False
        if not self._saved:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            self._closer()
            self.fd = None
