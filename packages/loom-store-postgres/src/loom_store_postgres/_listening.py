"""Wake-ups by LISTEN/NOTIFY: one connection per store listens on the store's channel
on a thread of its own, and calls every subscriber on each notification.

A notification is only a hint to look now: one lost (the connection broke, the server
restarted) costs a wait until the subscriber's next poll, never work. So after the
listening connection is made again, every subscriber is called once, for whatever
may have been sent meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

import psycopg
from psycopg import sql

__all__ = ["Listener"]

logger = logging.getLogger("loom")

#: Seconds between tries to listen again after the connection broke.
_RETRY: Final = 1.0
#: Seconds a listening wait lasts before it looks whether the store was closed.
_LOOK_FOR_CLOSE: Final = 0.5


class Listener:
    """Calls subscribers on notifications of one channel (see the module's docstring).

    Args:
        conninfo: libpq's connection URI.
        channel: the channel to LISTEN on.
    """

    def __init__(self, conninfo: str, channel: str) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._lock = threading.Lock()
        self._subscribers: dict[int, Callable[[], None]] = {}
        self._next_token = 0
        self._closed = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` on each notification until the returned function is called.

        The first subscription starts the listening thread, and returns once it listens
        (or has failed to connect once: it goes on trying meanwhile).
        """
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._subscribers[token] = wake
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._listen, name=f"loom-listen-{self._channel}", daemon=True
                )
                self._thread.start()
        self._listening.wait(timeout=5.0)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(token, None)

        return unsubscribe

    def close(self) -> None:
        """Stop listening (the thread ends within half a second)."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _wake_all(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers.values())
        for wake in subscribers:
            try:
                wake()
            except Exception:  # one subscriber's failure never stops the others
                logger.exception("loom: a wake-up subscriber failed")

    def _listen(self) -> None:
        first = True
        while not self._closed.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as connection:
                    connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    self._listening.set()
                    if not first:
                        self._wake_all()  # what was sent while it was not listening
                    first = False
                    while not self._closed.is_set():
                        for _notice in connection.notifies(timeout=_LOOK_FOR_CLOSE):
                            self._wake_all()
            except psycopg.Error as exc:
                self._listening.set()  # a subscriber polls meanwhile; no reason to wait
                first = False
                if not self._closed.is_set():
                    logger.warning(
                        "loom: listening on %s failed (%s); polling until it listens again",
                        self._channel,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else exc,
                    )
                    self._closed.wait(_RETRY)
