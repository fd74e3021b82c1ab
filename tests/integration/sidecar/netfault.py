"""A TCP relay on 127.0.0.1 that injects network faults between two real processes.

It forwards bytes both ways and can hold the server-to-client direction (`hold`), or cut
both connections after a number of server-to-client bytes (`cut_after`), so a test can
kill or stop a peer at an exact point of a transfer instead of racing it. With `record` it
keeps every byte it forwarded (`downstream`: server to client, `upstream`: client to
server), what a wiretap on the link would see.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, target_port: int, *, cut_after: int | None = None, record: bool = False):
        self.target_port = target_port
        self.cut_after = cut_after
        self.record = record
        self.downstream = bytearray()
        self.upstream = bytearray()
        self.forwarded = 0  # server-to-client bytes
        self.passing = threading.Event()
        self.passing.set()
        self.cut = threading.Event()
        self.reached = threading.Event()  # set once `hold_after` bytes went through
        self.hold_after: int | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hold(self, after_bytes: int) -> None:
        """Stop forwarding server-to-client data once `after_bytes` have gone through."""
        self.hold_after = after_bytes

    def release(self) -> None:
        self.hold_after = None
        self.passing.set()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while not self.cut.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if self.record:
                    with self._lock:
                        (self.downstream if downstream else self.upstream).extend(data)
                if downstream:
                    with self._lock:
                        budget = None
                        if self.cut_after is not None:
                            budget = self.cut_after - self.forwarded
                        if self.hold_after is not None:
                            hold_budget = self.hold_after - self.forwarded
                            budget = hold_budget if budget is None else min(budget, hold_budget)
                        if budget is not None and budget < len(data):
                            data, rest = data[:max(budget, 0)], data[max(budget, 0):]
                        else:
                            rest = b""
                        self.forwarded += len(data)
                    dst.sendall(data)
                    if rest:
                        if self.cut_after is not None and self.forwarded >= self.cut_after:
                            self.close()
                            return
                        self.passing.clear()
                        self.reached.set()
                        self.passing.wait()
                        self.forwarded += len(rest)
                        dst.sendall(rest)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cut.set()
        with self._lock:
            for s in self._sockets:
                # shutdown first: close() alone does not wake a thread blocked in recv()
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        self._listener.close()
        self.passing.set()
