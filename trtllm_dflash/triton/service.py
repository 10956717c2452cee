"""What the Triton model does with requests, without Triton: the request adapter and batch runner.

`model.py` only turns Triton tensors into a dict of numpy arrays and `emit` calls into Triton
responses; parsing (`llmapi.py`), batching (`scheduler.py`) and everything here (streaming deltas,
per-request limits and stop strings, acceptance statistics) is unit-tested without a server.

Requests batched together run as one `generate` call with the largest max_tokens among them; each
request's own limit, stop strings and cancellation are applied here as its tokens arrive, and a
request that is done gets its final response at once and leaves the batch at the next step. On the reference
runtime (in-flight batching) a request that arrives meanwhile joins the running call at its next step, when it fits
(`run_batch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar
from pathlib import Path

import numpy as np

from ..checkpoints.gpt_oss import read_target_config, stop_token_ids
from ..errors import InputError
from ..runtime.interface import Runtime, check_request, default_draft_length
from ..runtime.stats import RequestStats
from .llmapi import RequestSpec, parse_request
from .responses import ResponsePump

Outputs = dict[str, np.ndarray]
Emit = Callable[[Outputs, bool], None]  # (output tensors, final)
Fail = Callable[[str, bool], None]  # (message, cancelled)


def acceptance(stats: RequestStats) -> tuple[int, int]:
    """(accepted drafts, drafted tokens) over a request's verify steps."""
    accepted = sum(a * n for a, n in enumerate(stats.accepted_histogram))
    return accepted, stats.steps * (stats.block_size - 1)


def text_array(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=object)


@dataclass
class Job:
    """A parsed request on its way through the scheduler, with the way back to its client."""

    spec: RequestSpec
    prompt: list[int]
    emit: Emit
    fail: Fail
    is_cancelled: Callable[[], bool] = lambda: False
    request_id: str = ""
    arrival_ns: int = field(default_factory=time.time_ns)
    cancelled: bool = False  # set by a `stop` request naming this request's id, or a failed send
    answered: bool = False  # whether a response went out (`ResponsePump` sends the first at once)
    checked_at: float = 0.0
    CHECK_EVERY_S: ClassVar[float] = 0.05  # asking the client is a round trip to the server

    def gone(self, every_s: float | None = None) -> bool:
        """Cancelled here or by the client (asked at most every CHECK_EVERY_S)."""
        now = time.monotonic()
        if not self.cancelled and now - self.checked_at >= (self.CHECK_EVERY_S if every_s is None else every_s):
            self.checked_at = now
            self.cancelled = bool(self.is_cancelled())
        return self.cancelled


# (free rows, whether a job fits the running batch) -> waiting jobs that join it now (`BatchScheduler.admit`)
Admit = Callable[[int, Callable[[Job], bool]], list[Job]]


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of streamed text to keep back: an incomplete UTF-8 sequence, and before it
    the start of a stop string that the next tokens may complete."""
    complete = text.rstrip("\ufffd")
    return len(text) - len(complete) + max((k for s in stops for k in range(1, len(s)) if complete.endswith(s[:k])),
                                           default=0)


class IncrementalText:
    """A token stream's text, decoded as tokens arrive from a window of the last few tokens, never the whole stream
    (decoding everything at every step made a stream quadratic: 0.74 ms a step at 4,096 tokens, 2.8 ms with a stop
    string, against ~0.03 ms at 128). The window starts one chunk back (`prefix_offset`) so that a tokenizer whose
    pieces depend on the one before (a leading space) decodes as in the whole text; text is `stable` once its window
    no longer ends in half a character (U+FFFD). The vLLM / TGI scheme."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.stable = ""  # the text of ids[:read_offset]
        self.prefix_offset = self.read_offset = 0

    def extend(self, ids: list[int]) -> None:
        if not ids:  # already decoded (a stop-string search extends token by token)
            return
        self.ids += ids
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.stable += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    @property
    def text(self) -> str:
        """All of it: the stable text and the tail a later token may still change (e.g. half a character)."""
        if self.read_offset == len(self.ids):
            return self.stable
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        return self.stable + self.decode(self.ids[self.prefix_offset:])[len(prefix):]


class RequestStream:
    """One request's tokens as they are committed: its own max_tokens, stop tokens and strings,
    streaming deltas (at its first iteration and every `stream_interval`-th, as TensorRT-LLM's LLM API streams), and
    its final response (with statistics counted from the steps it saw)."""

    def __init__(self, job: Job, decode: Callable[[list[int]], str], stop_ids: frozenset[int], block_size: int,
                 scheduled_ns: int, responses: ResponsePump, stream_interval: int = 1):
        self.job, self.stop_ids, self.responses = job, stop_ids, responses
        self.stream_interval = stream_interval
        self.stats = RequestStats(block_size)
        self.tokens: list[int] = []
        self.output = IncrementalText(decode)  # the text of `tokens`
        self.searched = 0  # output text searched for stop strings up to here
        self.finish: str | None = None
        self.stop_reason = "None"  # as upstream's str(stop_reason) when nothing stopped it
        self.cut: int | None = None  # text length where a stop string begins
        self.sent_chars, self.sent_ids = 0, 0
        self.times = {"arrival_time_ns": job.arrival_ns, "first_scheduled_time_ns": scheduled_ns}
        spec = job.spec
        self.echo = "" if spec.exclude_input else (spec.prompt_text if spec.prompt_text is not None
                                                    else decode(job.prompt))
        self.echo_ids = [] if spec.exclude_input else list(job.prompt)

    @property
    def done(self) -> bool:
        """Finished here, cancelled by a `stop` request, or cancelled by the client."""
        return self.finish is not None or self.job.gone()

    def text(self) -> str:
        text = self.output.text
        return self.echo + (text if self.cut is None else text[: self.cut])

    def add(self, tokens: list[int]) -> None:
        if self.done:
            return
        now = time.time_ns()
        self.times.setdefault("first_token_time_ns", now)
        self.times["last_token_time_ns"] = now
        if self.tokens:  # every call after the prefill token is one verify step
            self.stats.record_step(min(len(tokens), self.stats.block_size) - 1)
        limit, stops = self.job.spec.params.max_tokens, self.job.spec.stop_strings
        for token in tokens:
            self.tokens.append(token)
            if token in self.stop_ids:
                self.finish, self.stop_reason = "stop", str(token)
            elif stops and self.match_stop_string():
                self.finish = "stop"
            elif len(self.tokens) >= limit:
                self.finish = "length"
            if self.finish:
                break
        self.output.extend(self.tokens[len(self.output.ids):])
        if self.finish is not None:
            self.send_final()
        elif self.job.spec.streaming and self.streams_now():
            text = self.text()
            self.send_delta(text[: len(text) - held_back(text, stops)], final=False)

    def streams_now(self) -> bool:
        """Whether this iteration sends a delta: the first (the prefill's token) and every stream_interval-th."""
        iteration = len(self.stats.accepted_per_step) + 1  # the verify steps seen, after the prefill
        return iteration == 1 or iteration % self.stream_interval == 0

    def match_stop_string(self) -> bool:
        """Whether the text so far holds a stop string (`cut`: where the first begins). Only the text past what was
        searched before is searched, from far enough back to catch a stop string that began there."""
        self.output.extend(self.tokens[len(self.output.ids):])
        text, stops = self.output.text, self.job.spec.stop_strings
        start = max(0, self.searched - max(map(len, stops)) + 1)
        hits = [(at, s) for s in stops if (at := text.find(s, start)) >= 0]
        self.searched = len(self.output.stable)  # the tail past it may still change
        if hits:
            self.cut, self.stop_reason = min(hits)
        return bool(hits)

    def send_delta(self, text: str, final: bool, extra: Outputs | None = None) -> None:
        echoed = len(self.echo_ids)  # the ids sent so far: the echoed prompt's, then the output's
        ids = self.echo_ids[self.sent_ids:] + self.tokens[max(0, self.sent_ids - echoed):]
        outputs = {"text_output": text_array(text[self.sent_chars:]),
                   "output_ids": np.array(ids, dtype=np.int32), **(extra or {})}
        self.sent_chars, self.sent_ids = len(text), echoed + len(self.tokens)
        self.responses.emit(self.job, outputs, final)

    def send_final(self) -> None:
        accepted, drafted = acceptance(self.stats)
        final: Outputs = {
            "finish_reason": text_array(self.finish),
            "acceptance_rate": np.array([accepted / drafted if drafted else 0.0], dtype=np.float32),
            "acceptance_length": np.array([self.stats.acceptance_length], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([accepted], dtype=np.int32),
            "total_draft_tokens": np.array([drafted], dtype=np.int32),
        }
        if self.job.spec.stop_reason:
            final["stop_reason"] = text_array(self.stop_reason)
        if self.job.spec.perf_metrics:
            final.update({name: np.array([t], dtype=np.int64) for name, t in self.times.items()})
        self.send_delta(self.text(), final=True, extra=final)

    def end(self, runtime_finish: str) -> None:
        """The batch is over: a request the runtime ended (cancelled, interrupted) gets its answer."""
        if self.finish is not None:
            return
        if self.job.gone(every_s=0):
            self.responses.fail(self.job, "request cancelled", True)
        else:
            self.finish = runtime_finish
            self.send_final()


class DFlashService:
    """Runs batches of requests on any `Runtime`; text needs the engine's tokenizer, ids never do."""

    def __init__(self, runtime: Runtime, tokenizer, stop_ids: tuple[int, ...], block_size: int = 1,
                 vocab_size: int | None = None, max_positions: int | None = None, max_batch_size: int = 8,
                 stream_interval: int = 1):
        self.runtime, self.tokenizer, self.stop_ids = runtime, tokenizer, stop_ids
        self.block_size, self.vocab_size, self.max_positions = block_size, vocab_size, max_positions
        self.max_batch_size, self.stream_interval = max_batch_size, stream_interval
        self.responses = ResponsePump()

    def close(self) -> None:
        """Sends what waits and stops the sender thread (the model unloads)."""
        self.responses.close()

    @classmethod
    def from_engine(cls, engine_dir: str | Path, backend: str = "auto", verify_checksums: bool = False,
                    device: str = "auto", speculation: str = "dflash", batching: str = "inflight",
                    stream_interval: int | None = None, draft_length: str | None = None,
                    draft_method: str | None = None) -> "DFlashService":
        """speculation "off" serves the target alone (the autoregressive baseline, reference runtime); batching
        "static" makes the reference runtime finish a batch before the next starts (TensorRT-LLM batches in flight
        itself); `stream_interval` (default: the engine's LLM API option, else 1) spaces streamed responses;
        `draft_method` (reference runtime: dflash-sa, the default, dflash or ngram) how it drafts; `draft_length`
        "adaptive" (default for dflash-sa and dflash) prices its drafts per step (`reference_runtime`), "fixed" (default
        for ngram) drafts the engine's block."""
        from ..cli.common import resolve_device, resolve_dtype
        from ..engine.load import engine_runtime, engine_speculation, reference_runtime
        from ..engine.manifest import open_engine
        from ..runtime.interface import choose_backend

        engine = open_engine(engine_dir, verify_checksums)
        torch_device = resolve_device(device)
        dtype = resolve_dtype("auto", torch_device)
        inflight = batching == "inflight"
        if speculation == "off" or draft_method is not None:
            if choose_backend(backend)[0] != "reference":
                what = "the autoregressive baseline" if speculation == "off" else f"draft method {draft_method}"
                raise InputError(f"{what} runs on the reference backend.", field="backend")
        if speculation == "off":
            runtime = reference_runtime(engine, torch_device, dtype, None, inflight)
        else:
            method = draft_method or "dflash-sa"
            runtime, _ = engine_runtime(engine, backend, torch_device, dtype, inflight,
                                        draft_length or default_draft_length(method), method)
        tokenizer = None
        if (engine.target_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(engine.target_dir)
        config = read_target_config(engine.target_dir)
        options = engine.llm_api_options()
        positions = min(config.get("max_position_embeddings") or options.max_seq_len, options.max_seq_len)
        block, _ = engine_speculation(engine)
        return cls(runtime, tokenizer, tuple(stop_token_ids(engine.target_dir, config)),
                   (block or 1) if speculation != "off" else 1,
                   config["vocab_size"], positions, options.max_batch_size or 8,
                   # TensorRT-LLM's executor applies the engine's stream_interval to what it hands us
                   (stream_interval or options.stream_interval or 1) if runtime.backend == "reference" else 1)

    def prompt_ids(self, spec: RequestSpec) -> list[int]:
        if spec.prompt_ids is not None:
            return spec.prompt_ids
        if self.tokenizer is None:
            raise InputError("the engine's target has no tokenizer.json; send 'input_ids' instead.",
                             field="text_input")
        return self.tokenizer.encode(spec.prompt_text)

    def prepare(self, inputs) -> tuple[RequestSpec, list[int]]:
        """Parse and check one request against the engine's limits, before it joins a batch."""
        spec = parse_request(inputs)
        if spec.stop_request:
            return spec, []
        prompt = self.prompt_ids(spec)
        try:
            check_request([prompt], 1, self.vocab_size, spec.params.max_tokens, self.max_positions)
        except InputError as exc:
            field_name = {"prompt": "input_ids" if spec.prompt_ids is not None else "text_input",
                          "max_tokens": "sampling_param_max_tokens"}.get(exc.field, exc.field)
            raise InputError(str(exc).split(": ", 1)[1].replace("prompt 0", "the prompt"), field=field_name) from None
        return spec, prompt

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def run_batch(self, jobs: list[Job], admit: Admit | None = None) -> None:
        """Generate for jobs that share sampling parameters (all greedy, or one sampled request). With `admit` (the
        scheduler's) and a runtime that batches in flight, waiting jobs join while it runs: greedy ones with at most
        the batch's max_tokens, up to the engine's max batch size."""
        def open_stream(job: Job, scheduled_ns: int) -> RequestStream:
            return RequestStream(job, self.text, frozenset(self.stop_ids), self.block_size, scheduled_ns,
                                 self.responses, self.stream_interval)

        scheduled = time.time_ns()
        streams = [open_stream(job, scheduled) for job in jobs]
        params = replace(jobs[0].spec.params, max_tokens=max(job.spec.params.max_tokens for job in jobs),
                         stop_token_ids=self.stop_ids)
        # the reference runtime drops a finished or cancelled request from the batch at the next step
        hooks: dict = {"cancelled": lambda i: streams[i].done} if self.runtime.backend == "reference" else {}
        batch_size = len(jobs)
        if admit is not None and getattr(self.runtime, "inflight", False) and params.greedy:
            def fits(job: Job) -> bool:
                return job.spec.params.greedy and job.spec.params.max_tokens <= params.max_tokens

            def joining(free: int) -> list[list[int]]:
                arriving = admit(free, fits)
                streams.extend(open_stream(job, time.time_ns()) for job in arriving)
                return [job.prompt for job in arriving]

            hooks["admit"], batch_size = joining, max(self.max_batch_size, len(jobs))
        try:
            results = self.runtime.generate([job.prompt for job in jobs], params, batch_size,
                                            lambda i, tokens: streams[i].add(tokens), **hooks)
        except Exception as exc:  # noqa: BLE001 -- every request of the batch still gets an answer
            message = str(exc) if isinstance(exc, InputError) else f"internal error: {type(exc).__name__}: {exc}"
            for stream in streams:
                if stream.finish is None:
                    self.responses.fail(stream.job, message, False)
        else:
            for stream, result in zip(streams, results):
                stream.end(result.finish_reason)
        self.responses.drain()  # a batch is over when its clients have their answers
