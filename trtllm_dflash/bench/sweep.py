"""Measuring the sweep: every (runner, load) point, repeats interleaved so that machine drift hits
all points alike, reduced to one BenchPoint per point (medians, each repeat kept for the spread).

A runner is the in-process reference runtime or a server endpoint; both turn a load shape into
request timelines, so their serving figures are computed by the same code (`metrics.py`).

In-process batching is the reference runtime's in-flight batching, as `dflash-serve`'s: closed loop at c users = c
rows, each user's next request joining at the step after its last one ended (sent then); open loop = requests join
at the first step after they arrive, up to the batch limit, and a new call starts when one arrives while none runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import InputError
from ..runtime.reference import ReferenceRuntime
from ..runtime.sampling import SamplingParams
from ..runtime.stats import GenerationResult, total_stats
from .endpoints import EndpointError, HttpEndpoint
from .load import LoadShape, Prompt, closed_loop, open_loop
from .metrics import RequestRecord, distribution, latency_samples, reported_acceptance, run_figures
from .points import CONCURRENCY, BenchPoint


@dataclass
class Run:
    records: list[RequestRecord]
    runtime: dict | None = None  # in-process step figures (runtime_figures)


@dataclass
class RunLog:
    """What an in-process run gathers over its `generate` calls."""

    records: list[RequestRecord] = field(default_factory=list)  # in the order the requests were sent
    results: list[GenerationResult] = field(default_factory=list)
    totals: dict = field(default_factory=dict)  # the runtime's step times and counts, summed over calls


class InProcessRunner:
    """A reference runtime labelled with its method and draft length (0 = AR)."""

    def __init__(self, method: str, draft_len: int, runtime: ReferenceRuntime, max_tokens: int,
                 max_batch: int = 64):
        if not runtime.inflight:
            raise ValueError("the in-process runner batches in flight: give it ReferenceRuntime(..., inflight=True)")
        self.method, self.draft_len, self.runtime = method, draft_len, runtime
        self.params = SamplingParams(max_tokens=max_tokens)  # greedy; no stop tokens: fixed-length outputs
        self.max_batch = max_batch

    def warm_up(self, prompt: Sequence[int]) -> None:
        self.runtime.warm_up(prompt)

    def call(self, log: RunLog, first: list[tuple[float, Sequence[int]]], rows: int,
             admit: Callable[[int], list[tuple[float, Sequence[int]]]]) -> None:
        """One in-flight `generate` on `rows` rows: `first`, then what `admit(free)` hands over, each a (send time,
        prompt) whose request is logged as it joins; the call's results, step times and counts added to the log."""
        offset = len(log.records)

        def joined(requests: list[tuple[float, Sequence[int]]]) -> list[Sequence[int]]:
            log.records.extend(RequestRecord(prompt_tokens=len(p), send=send) for send, p in requests)
            return [p for _, p in requests]

        def streamed(i: int, tokens: list[int]) -> None:
            log.records[offset + i].add_chunk(time.perf_counter(), len(tokens))

        batch = self.runtime.generate(joined(first), self.params, rows, streamed,
                                      admit=lambda free: joined(admit(free)))
        for record, result in zip(log.records[offset:], batch):
            record.end = record.chunks[-1][0] if record.chunks else time.perf_counter()
            record.tau = result.stats.acceptance_length
            record.per_position_acceptance = result.stats.per_position_acceptance[: self.draft_len]
        log.results += batch
        for key, value in (*self.runtime.step_times.items(), *self.runtime.step_counts.items()):
            log.totals[key] = log.totals.get(key, 0) + value

    def run(self, prompts: Sequence[Prompt], shape: LoadShape) -> Run:
        source, log = shape.prompts(prompts), RunLog()
        if shape.kind == CONCURRENCY:
            self.closed(source, shape, log)
        else:
            self.open(source, shape, log)
        return Run(log.records, runtime_figures(log.results, log.totals))

    def closed(self, source: Iterator[Prompt], shape: LoadShape, log: RunLog) -> None:
        start, users = time.perf_counter(), int(shape.level)

        def admit(free: int) -> list[tuple[float, Sequence[int]]]:
            if shape.duration is not None and time.perf_counter() - start > shape.duration:
                return []
            now = time.perf_counter()
            return [(now, p) for _, p in zip(range(free), source)]

        first = [(start, p) for _, p in zip(range(users), source)]
        if first:
            self.call(log, first, users, admit)

    def open(self, source: Iterator[Prompt], shape: LoadShape, log: RunLog) -> None:
        queue = list(zip(shape.arrivals(), source))
        start = time.perf_counter()

        def arrived(most: int) -> list[tuple[float, Sequence[int]]]:
            now, taken = time.perf_counter() - start, []
            while queue and len(taken) < most and queue[0][0] <= now:
                offset, prompt = queue.pop(0)
                taken.append((start + offset, prompt))
            return taken

        while queue:  # a call ends when nothing runs and nothing has arrived: wait for the next arrival
            time.sleep(max(0.0, start + queue[0][0] - time.perf_counter()))
            first = arrived(self.max_batch)
            if first:
                self.call(log, first, self.max_batch, arrived)


def runtime_figures(results: list[GenerationResult], totals: dict) -> dict:
    """Decode-only step figures of one run (prefills excluded: `total_stats`' decode time), per verify step of the
    batch; `totals`: the run's step times and counts (`ReferenceRuntime.step_times`, `step_counts`). Decode tokens are
    summed per request (each request's first token comes from its prefill)."""
    steps = totals.get("steps", 0)
    decode = total_stats(results, 1) if results else None
    decode_time = decode.decode_time if decode else 0.0
    decode_tokens = decode.num_decode_tokens if decode else 0
    return {"decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
            "draft_s": totals.get("draft", 0.0) / max(steps, 1), "verify_s": totals.get("verify", 0.0) / max(steps, 1),
            "step_s": decode_time / max(steps, 1), "mean_batch": totals.get("rows", 0) / max(steps, 1),
            "steps": steps, "decode_tokens": decode_tokens}


class EndpointRunner:
    """A model on a running server, labelled with the method and draft length it was built with."""

    def __init__(self, method: str, draft_len: int, endpoint: HttpEndpoint):
        self.method, self.draft_len, self.endpoint = method, draft_len, endpoint

    def warm_up(self, prompt: Prompt) -> None:
        record = self.endpoint.send(prompt)
        if not record.ok:
            raise EndpointError(f"the warm-up request to model {self.endpoint.model!r} failed: {record.error}",
                                field="--endpoint")

    def run(self, prompts: Sequence[Prompt], shape: LoadShape) -> Run:
        source = shape.prompts(prompts)
        if shape.kind == CONCURRENCY:
            records = closed_loop(self.endpoint.send, source, int(shape.level), shape.duration)
        else:
            records = open_loop(self.endpoint.send, source, shape.arrivals())
        return Run(records)


Runner = InProcessRunner | EndpointRunner


def runner_name(runner: Runner) -> str:
    return f"{runner.method} K={runner.draft_len if runner.draft_len >= 0 else '?'}"


class PartialSweep(InputError):
    """The sweep stopped on an endpoint failure; `points` holds the points completed before it."""

    def __init__(self, message: str, points: list[BenchPoint]):
        super().__init__(message, field="--endpoint")
        self.points = points


def reduce_repeats(runner: Runner, shape: LoadShape, runs: list[Run]) -> BenchPoint:
    """Medians over repeats, every repeat's throughput and speed kept; latencies pooled."""
    figures = [run_figures(run.records) for run in runs]
    records = [r for run in runs for r in run.records]
    samples = latency_samples(records)
    tau, per_position = reported_acceptance(records)
    throughput = [f.get("output_tokens_per_s", 0.0) for f in figures]
    per_user = [f.get("tokens_per_s_user", 0.0) for f in figures]
    runtime = {}
    if runs[0].runtime is not None:
        runtime = {key: statistics.median(run.runtime[key] for run in runs)
                   for key in ("decode_tokens_per_s", "draft_s", "verify_s", "step_s")}
        runtime.update({key: runs[0].runtime[key] for key in ("mean_batch", "steps", "decode_tokens")})
    concurrency = int(shape.level) if shape.kind == CONCURRENCY else getattr(runner, "max_batch", 0)
    return BenchPoint(
        method=runner.method, draft_len=runner.draft_len, concurrency=concurrency, load=shape.kind,
        rate=None if shape.kind == CONCURRENCY else shape.level,
        tokens_per_s_user=statistics.median(per_user), tokens_per_s=statistics.median(throughput),
        tokens_per_s_repeats=throughput, tokens_per_s_user_repeats=per_user,
        requests_per_s=statistics.median(f.get("requests_per_s", 0.0) for f in figures),
        requests=int(statistics.median(f["completed"] for f in figures)), failed=sum(f["failed"] for f in figures),
        latency={name: distribution(values) for name, values in samples.items()},
        samples={name: [round(v, 6) for v in samples[name]] for name in ("ttft_s", "tpot_s", "e2e_s")},
        tau=tau, per_position_acceptance=per_position, repeats=len(runs),
        draft_s=runtime.get("draft_s"), verify_s=runtime.get("verify_s"), step_s=runtime.get("step_s"),
        mean_batch=runtime.get("mean_batch"), steps=runtime.get("steps"), decode_tokens=runtime.get("decode_tokens"),
        decode_tokens_per_s=runtime.get("decode_tokens_per_s"))


def failure(runner: Runner, shape: LoadShape, run: Run) -> str | None:
    """Why a run is unusable: every request failed (a dead or refusing server)."""
    if run.records and not any(r.ok for r in run.records):
        first = next((r.error for r in run.records if r.error), "no tokens came back")
        return f"every request of {runner_name(runner)} at {shape.label} failed: {first}"
    if not run.records:
        return f"{runner_name(runner)} at {shape.label} sent no request (duration too short?)"
    return None


def run_sweep(runners: Sequence[Runner], prompts: Sequence[Prompt], shapes: Sequence[LoadShape], repeats: int,
              on_point: Callable[[Runner, LoadShape, Run, int], None] | None = None) -> list[BenchPoint]:
    """Every runner at every load, `repeats` times, interleaved (repeat-major, so drift hits every
    point alike); a warm-up first so no point pays one-time costs."""
    for runner in runners:
        runner.warm_up(prompts[0])
    samples: dict[tuple[int, int], list[Run]] = {}

    def finished() -> list[BenchPoint]:
        return [reduce_repeats(runners[i], shapes[j], runs) for (i, j), runs in samples.items()]

    for repeat in range(repeats):
        for j, shape in enumerate(shapes):
            for i, runner in enumerate(runners):
                run = runner.run(prompts, shape)
                problem = failure(runner, shape, run)
                if problem:
                    raise PartialSweep(problem, finished())
                samples.setdefault((i, j), []).append(run)
                if on_point is not None:
                    on_point(runner, shape, run, repeat)
    return finished()

