"""Batching concurrent requests: one worker thread, a first-come queue, in-flight admission.

Triton calls the decoupled model's `execute` as requests arrive; each becomes a Job in the queue
and `execute` returns at once. The worker takes everything compatible with the oldest waiting job
(up to the engine's max batch size) and runs it as one batch. While it runs, a runtime with in-flight
batching (the reference runtime) asks for more whenever rows are free: jobs from the front of the queue join
the running batch at its next step, as long as each fits it (`DFlashService.run_batch` says what fits: greedy, and
no more tokens than the batch decodes); the first that does not stops admission, so it leads the next batch and
nothing waits behind a batch that keeps taking newer jobs. Greedy requests batch together; a sampled request runs
on its own, so its seed reproduces `dflash-run` exactly (the reference runtime draws one random stream per batch).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .service import Admit, Job


def take_batch(queue: deque[Job], most: int) -> list[Job]:
    """The oldest job plus, when it is greedy, the next greedy jobs (in arrival order) up to `most`."""
    head = queue.popleft()
    batch = [head]
    if head.spec.params.greedy:
        for job in list(queue):
            if len(batch) == most:
                break
            if job.spec.params.greedy:
                queue.remove(job)
                batch.append(job)
    return batch


def take_joining(queue: deque[Job], most: int, fits: Callable[[Job], bool]) -> list[Job]:
    """Up to `most` jobs from the front of the queue while each fits the running batch (first come, first served)."""
    joining = []
    while queue and len(joining) < most and fits(queue[0]):
        joining.append(queue.popleft())
    return joining


def still_wanted(jobs: list[Job]) -> list[Job]:
    """The jobs whose clients still want them; one cancelled while it waited gets its answer now."""
    wanted = []
    for job in jobs:
        if job.gone(every_s=0):
            job.fail("request cancelled", True)
        else:
            wanted.append(job)
    return wanted


class BatchScheduler:
    def __init__(self, run_batch: Callable[[list[Job], Admit], None], max_batch_size: int):
        self.run_batch, self.max_batch_size = run_batch, max_batch_size
        self.queue: deque[Job] = deque()
        self.running: list[Job] = []
        self.wake = threading.Condition()
        self.closing = False
        self.worker = threading.Thread(target=self.loop, name="dflash-batches", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> None:
        with self.wake:
            self.queue.append(job)
            self.wake.notify()

    def cancel(self, request_id: str) -> int:
        """Upstream's `stop` request: cancel every waiting or running job with this request id."""
        with self.wake:
            jobs = [job for job in (*self.queue, *self.running) if request_id and job.request_id == request_id]
            for job in jobs:
                job.cancelled = True
            return len(jobs)

    def loop(self) -> None:
        while True:
            with self.wake:
                while not self.queue and not self.closing:
                    self.wake.wait()
                if self.closing:
                    break
                self.running = take_batch(self.queue, self.max_batch_size)
            waiting = still_wanted(self.running)
            if waiting:
                self.run_batch(waiting, self.admit)
            with self.wake:
                self.running = []
        for job in self.queue:  # the model is unloading: nothing waits forever
            job.fail("the model is shutting down", False)

    def admit(self, most: int, fits: Callable[[Job], bool]) -> list[Job]:
        """Jobs that join the running batch now (`take_joining`, `still_wanted`)."""
        if not self.queue:  # asked every step: most steps find nobody waiting, and need not take the lock for that
            return []
        with self.wake:
            if self.closing:  # unloading: the running batch finishes, and what waits gets its answer from `loop`
                return []
            joining = take_joining(self.queue, most, fits)
            self.running += joining
        return still_wanted(joining)

    def close(self, timeout_s: float = 10) -> None:
        with self.wake:
            self.closing = True
            self.wake.notify()
        self.worker.join(timeout_s)
