"""Measuring the sweep: every (runner, load) point, repeats interleaved so that machine drift hits
all points alike, reduced to one BenchPoint per point (medians, each repeat kept for the spread).

A runner is the in-process reference runtime or a server endpoint; both turn a load shape into
request timelines, so their serving figures are computed by the same code (`metrics.py`).

In-process batching is the reference runtime's: static batches. Closed loop at c users = back-to-
back batches of c (outputs have a fixed length, so a batch's users all finish together and send
their next requests together). Open loop = a dynamic batcher: at every batch boundary, every
request that has arrived (up to the batch limit) is batched, as Triton's dynamic batcher would.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import InputError
from ..runtime.reference import ReferenceRuntime
from ..runtime.sampling import SamplingParams
from ..runtime.stats import GenerationResult
from .endpoints import EndpointError, HttpEndpoint
from .load import LoadShape, Prompt, closed_loop, open_loop
from .metrics import RequestRecord, distribution, latency_samples, reported_acceptance, run_figures
from .points import CONCURRENCY, BenchPoint


@dataclass
class Run:
    records: list[RequestRecord]
    runtime: dict | None = None  # in-process step figures (runtime_figures)


class InProcessRunner:
    """A reference runtime labelled with its method and draft length (0 = AR)."""

    def __init__(self, method: str, draft_len: int, runtime: ReferenceRuntime, max_tokens: int,
                 max_batch: int = 64):
        self.method, self.draft_len, self.runtime = method, draft_len, runtime
        self.params = SamplingParams(max_tokens=max_tokens)  # greedy; no stop tokens: fixed-length outputs
        self.max_batch = max_batch

    def warm_up(self, prompt: Sequence[int]) -> None:
        self.runtime.warm_up(prompt)

    def batch(self, prompts: list[Sequence[int]], sends: list[float]) -> tuple[list[RequestRecord], list]:
        records = [RequestRecord(prompt_tokens=len(p), send=s) for p, s in zip(prompts, sends)]
        results = self.runtime.generate(prompts, self.params, len(prompts),
                                        lambda i, tokens: records[i].add_chunk(time.perf_counter(), len(tokens)))
        for record, result in zip(records, results):
            record.end = record.chunks[-1][0] if record.chunks else time.perf_counter()
            record.tau = result.stats.acceptance_length
            record.per_position_acceptance = result.stats.per_position_acceptance[: self.draft_len]
        return records, results

    def run(self, prompts: Sequence[Prompt], shape: LoadShape) -> Run:
        step_times = {"draft": 0.0, "verify": 0.0}
        source = shape.prompts(prompts)
        batches = self.closed(source, shape) if shape.kind == CONCURRENCY else self.open(source, shape)
        records, results = [], []
        for batch_records, batch_results, times in batches:
            records += batch_records
            results.append(batch_results)
            for key in step_times:
                step_times[key] += times[key]
        return Run(records, runtime_figures(results, step_times))

    def closed(self, source: Iterator[Prompt], shape: LoadShape):
        start, users = time.perf_counter(), int(shape.level)
        while shape.duration is None or time.perf_counter() - start <= shape.duration:
            chunk = [p for _, p in zip(range(users), source)]
            if not chunk:
                return
            now = time.perf_counter()
            records, results = self.batch(chunk, [now] * len(chunk))
            yield records, results, dict(self.runtime.step_times)

    def open(self, source: Iterator[Prompt], shape: LoadShape):
        queue = list(zip(shape.arrivals(), source))
        start = time.perf_counter()
        while queue:
            time.sleep(max(0.0, start + queue[0][0] - time.perf_counter()))
            now = time.perf_counter() - start
            taken = [item for item in queue[: self.max_batch] if item[0] <= now]
            queue = queue[len(taken):]
            records, results = self.batch([p for _, p in taken], [start + offset for offset, _ in taken])
            yield records, results, dict(self.runtime.step_times)


def runtime_figures(batches: list[list[GenerationResult]], step_times: dict[str, float]) -> dict:
    """Decode-only step figures of one run (prefill excluded), per batch step. Decode tokens are
    summed per request (each request's first token comes from its prefill)."""
    results = [r for batch in batches for r in batch]
    batch_steps = sum(max(r.stats.steps for r in batch) for batch in batches if batch)
    decode_time = sum(max(r.stats.decode_time for r in batch) for batch in batches if batch)
    decode_tokens = sum(r.stats.num_decode_tokens for r in results)
    request_steps = sum(r.stats.steps for r in results)
    return {"decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
            "draft_s": step_times["draft"] / max(batch_steps, 1), "verify_s": step_times["verify"] / max(batch_steps, 1),
            "step_s": decode_time / max(batch_steps, 1), "mean_batch": request_steps / max(batch_steps, 1),
            "steps": batch_steps, "decode_tokens": decode_tokens}


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

