"""Sending responses from a thread of their own, so the decode loop never waits on a client.

A Python-backend `send` is a round trip to the server process: the thread that calls it blocks until the server has
taken the response (~0.15-0.35 ms on the project's CPUs, once per request per step: round 32's `perf sched`). Made
from the decode loop, those waits were the served overhead (a response every 4th step made the autoregressive
server 49-71% faster). Here the loop only queues a response; a sender thread sends, and the deltas of one request
that wait while it is busy go out merged as one response (text and ids concatenated), so a slow client costs fewer,
larger responses instead of decode time. Every token still reaches the client, in order, and a request's final
response stays its last.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .service import Job, Outputs


@dataclass
class Pending:
    """What waits to go to one request: a response (outputs, final) or an error (message, cancelled)."""

    outputs: Outputs | None = None
    final: bool = False
    error: tuple[str, bool] | None = None


def merged(earlier: Outputs, later: Outputs) -> Outputs:
    """Two consecutive responses of one request as one: text and ids concatenated, anything else the later's."""
    outputs = {**earlier, **later}
    outputs["text_output"] = np.array([earlier["text_output"][0] + later["text_output"][0]], dtype=object)
    outputs["output_ids"] = np.concatenate([earlier["output_ids"], later["output_ids"]])
    return outputs


class ResponsePump:
    """Queues each request's responses and sends them from one thread (`emit`, `fail`); `drain` waits until
    everything queued so far is sent."""

    def __init__(self):
        self.pending: dict[int, tuple[Job, Pending]] = {}  # id(job) -> what waits; insertion order = arrival order
        self.wake = threading.Condition()
        self.sending = False
        self.closing = False
        self.thread = threading.Thread(target=self.loop, name="dflash-responses", daemon=True)
        self.thread.start()

    def emit(self, job: Job, outputs: Outputs, final: bool) -> None:
        if not job.answered:  # a request's first response goes at once, from the caller: else its time to first
            job.answered = True  # token waits for the sender thread to get the interpreter (up to 5 ms)
            self.send(job, outputs, final)
            return
        with self.wake:
            _, waiting = self.pending.setdefault(id(job), (job, Pending()))
            if waiting.error is None:  # after an error the request has had its answer
                waiting.outputs = outputs if waiting.outputs is None else merged(waiting.outputs, outputs)
                waiting.final = final
            self.wake.notify_all()

    def fail(self, job: Job, message: str, cancelled: bool) -> None:
        """An error ends the request: it replaces what still waits (the client gets the error, not more text)."""
        with self.wake:
            self.pending[id(job)] = (job, Pending(error=(message, cancelled)))
            self.wake.notify_all()

    def loop(self) -> None:
        while True:
            with self.wake:
                self.sending = False
                self.wake.notify_all()  # `drain` waits for an idle sender
                while not self.pending and not self.closing:
                    self.wake.wait()
                if not self.pending:
                    return
                batch, self.pending = list(self.pending.values()), {}
                self.sending = True
            for job, waiting in batch:
                error = waiting.error
                if error is None and job.gone():  # the client went away: no more text, the cancellation its answer
                    if not waiting.final:
                        continue
                    error = ("request cancelled", True)
                if error is not None:
                    job.fail(*error)
                else:
                    self.send(job, waiting.outputs, waiting.final)

    @staticmethod
    def send(job: Job, outputs: Outputs, final: bool) -> None:
        try:
            job.emit(outputs, final)
        except Exception:  # noqa: BLE001 -- the client is gone: the loop stops generating for it
            job.cancelled = True

    def drain(self) -> None:
        with self.wake:
            while self.pending or self.sending:
                self.wake.wait()

    def close(self, timeout_s: float = 10) -> None:
        """Sends what waits, then stops the thread."""
        with self.wake:
            self.closing = True
            self.wake.notify_all()
        self.thread.join(timeout_s)
