"""Streaming clients for a running server: Triton's KServe generate extension and an
OpenAI-compatible completions endpoint, each turning one request into a `RequestRecord`.

- triton: POST /v2/models/<name>/generate_stream, Server-Sent Events, one JSON object per response
  (triton-inference-server/server docs/protocol/extension_generate.md @ 0bd93bc8: request fields
  beyond `text_input` become the model's input tensors; an error is `{"error": ...}`, also inside
  the stream after a 200). Our model's tensors (trtllm_dflash/triton/service.py): `input_ids` or
  `text_input`, `streaming`, `sampling_param_*` in; `output_ids` per streamed group, and
  `acceptance_length`, `total_accepted_draft_tokens`, `total_draft_tokens` in the final response.
- openai: POST /v1/completions with "stream": true (trtllm-serve, vLLM, SGLang): `data: {...}`
  events, `data: [DONE]` last; the token count comes from the usage chunk
  (`stream_options.include_usage`) where the server sends one, else one token per chunk. DFlash
  statistics are read where a chunk carries the fields our Triton model returns, or from
  trtllm-serve's per-request metrics (see `TrtllmPerfMetrics`); otherwise they are "not reported".
Only the standard library's http.client: nothing to install, and every read has a timeout.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from ..errors import InputError
from .load import Prompt
from .metrics import RequestRecord

PROTOCOLS = ("triton", "openai")
STAT_FIELDS = ("acceptance_length", "total_accepted_draft_tokens", "total_draft_tokens")
NETWORK_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, malformed


class EndpointError(InputError):
    """The endpoint cannot be benchmarked: nothing answers, another protocol answers, or the model
    is not there. Raised before a sweep, or during one when every request of a run failed."""


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise InputError(f"expected http://HOST:PORT, got {url!r}.", field="--endpoint")
    try:
        return parts.hostname, parts.port or 80
    except ValueError:
        raise InputError(f"expected a port number in {url!r}.", field="--endpoint") from None


def scalar(value):
    """A one-element tensor comes back as a value or a one-element list, depending on the server."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def sse_data(response: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of a Server-Sent Events stream, one per event."""
    lines: list[str] = []
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


class HttpEndpoint:
    protocol = ""
    health_path = ""

    def __init__(self, url: str, model: str, max_tokens: int, timeout: float = 300.0):
        self.url, self.model, self.max_tokens, self.timeout = url.rstrip("/"), model, max_tokens, timeout
        self.host, self.port = split_url(url)

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def get(self, path: str, method: str = "GET", body: dict | None = None) -> tuple[int, object]:
        """(status, parsed JSON body or None) of a short request; a dead endpoint is an EndpointError."""
        connection = self.connect(timeout=10.0)
        try:
            connection.request(method, path, body=None if body is None else json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except NETWORK_ERRORS as exc:
            raise EndpointError(f"nothing answers at {self.url} ({describe_network_error(exc)}); is the server "
                                "running, and on this host and port?", field="--endpoint") from None
        finally:
            connection.close()
        try:
            return response.status, json.loads(payload) if payload else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return response.status, None

    def wrong_protocol(self, status: int) -> EndpointError:
        other = "openai" if self.protocol == "triton" else "triton"
        return EndpointError(f"{self.url} answered HTTP {status} to GET {self.health_path}, so it does not speak the "
                             f"{self.protocol} protocol; is it the other kind of server (--protocol {other})?",
                             field="--protocol")

    def missing_model(self, served: list[str]) -> EndpointError:
        return EndpointError(f"the server at {self.url} has no model {self.model!r}; it serves "
                             f"{', '.join(served) or 'none'}.", field="--model")

    def stream(self, path: str, body: dict, record: RequestRecord) -> Iterator[dict]:
        """POST `body` and yield every JSON event of the SSE reply; failures land in record.error."""
        connection = self.connect()
        try:
            connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                             "Accept": "text/event-stream"})
            response = connection.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {error_text(response.read())}"
                return
            for data in sse_data(response):
                if data.strip() == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"not JSON in the stream: {data[:80]!r}"
                    return
                if isinstance(event, dict) and "error" in event:
                    record.error = str(event["error"] if not isinstance(event["error"], dict)
                                       else event["error"].get("message", event["error"]))
                    return
                yield event
            record.end = time.perf_counter()
        except NETWORK_ERRORS as exc:
            record.error = f"connection to {self.url} failed: {describe_network_error(exc)}"
        finally:
            connection.close()


def describe_network_error(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def error_text(payload: bytes) -> str:
    try:
        parsed = json.loads(payload)
        message = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        return str(message.get("message", message) if isinstance(message, dict) else message)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return payload[:200].decode("utf-8", "replace")


def read_stats(event: dict, record: RequestRecord) -> None:
    """DFlash statistics where the event carries them (our Triton model's final response)."""
    if "acceptance_length" in event:
        record.tau = float(scalar(event["acceptance_length"]))
    if "total_accepted_draft_tokens" in event and "total_draft_tokens" in event:
        record.accepted_drafts = int(scalar(event["total_accepted_draft_tokens"]))
        record.drafted = int(scalar(event["total_draft_tokens"]))


class TritonEndpoint(HttpEndpoint):
    protocol = "triton"
    health_path = "/v2/health/ready"

    def check(self) -> None:
        status, _ = self.get(self.health_path)
        if status == 404:
            raise self.wrong_protocol(status)
        if status != 200:
            raise EndpointError(f"{self.url} is not ready (HTTP {status} on {self.health_path}).", field="--endpoint")
        status, _ = self.get(f"/v2/models/{self.model}")
        if status != 200:
            _, index = self.get("/v2/repository/index", "POST", {})
            served = [m.get("name", "?") for m in index if isinstance(m, dict)] if isinstance(index, list) else []
            raise self.missing_model(served)

    def send(self, prompt: Prompt) -> RequestRecord:
        ids = not isinstance(prompt, str)
        record = RequestRecord(prompt_tokens=len(prompt) if ids else 0, send=time.perf_counter())
        body = {"input_ids" if ids else "text_input": prompt, "streaming": True,
                "sampling_param_max_tokens": self.max_tokens, "sampling_param_temperature": 0.0}
        for event in self.stream(f"/v2/models/{self.model}/generate_stream", body, record):
            output = event.get("output_ids")
            tokens = len(output) if isinstance(output, list) else int(output is not None)
            if tokens:
                record.add_chunk(time.perf_counter(), tokens)
            read_stats(event, record)
        return record


class TrtllmPerfMetrics:
    """trtllm-serve's per-request metrics, kept only with `return_perf_metrics: true` and
    `perf_metrics_max_requests` > 0 in its LLM API options (else GET /perf_metrics answers `[]`)
    (NVIDIA/TensorRT-LLM tensorrt_llm/serve/openai_server.py, get_perf_metrics and
    _extract_metrics; schema in tensorrt_llm/serve/_perf_metrics_schema.py @ 4856bb73):
    GET /perf_metrics answers `[{"request_id": N, "perf_metrics": {..., "speculative_decoding":
    {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"}}}]` for the requests
    finished since the last GET (each GET drains the list), recorded before the stream's
    `[DONE]`. A request is matched by its stream id, `cmpl-<request_id>` (postprocess_handlers.py,
    _ensure_stream_metadata; older servers send a random id, which cannot be matched). One GET
    serves every request finished so far, so concurrent users share what it drained."""

    STREAM_ID = re.compile(r"cmpl-(\d+)")

    def __init__(self, endpoint: HttpEndpoint):
        self.endpoint, self.lock = endpoint, threading.Lock()
        self.drained: dict[int, dict] = {}
        self.available = True  # until the server shows it keeps none (404, or an empty list)

    def read(self, stream_id: object, record: RequestRecord) -> None:
        match = self.STREAM_ID.fullmatch(stream_id) if isinstance(stream_id, str) else None
        if match is None or not self.available:
            return
        request_id = int(match.group(1))
        with self.lock:
            if request_id not in self.drained:
                self.drain()
            entry = self.drained.pop(request_id, {})
        spec = entry.get("speculative_decoding")  # absent when the request drafted nothing
        if isinstance(spec, dict):
            read_stats(spec, record)

    def drain(self) -> None:
        try:
            status, entries = self.endpoint.get("/perf_metrics")
        except EndpointError:
            return  # the request itself succeeded; its statistics stay "not reported"
        if status != 200 or not isinstance(entries, list) or not entries:
            self.available = False
            return
        for entry in entries:
            if isinstance(entry, dict) and isinstance(entry.get("request_id"), int):
                metrics = entry.get("perf_metrics")
                self.drained[entry["request_id"]] = metrics if isinstance(metrics, dict) else {}


class OpenAIEndpoint(HttpEndpoint):
    protocol = "openai"
    health_path = "/v1/models"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.perf_metrics = TrtllmPerfMetrics(self)

    def check(self) -> None:
        status, listing = self.get(self.health_path)
        if status == 404:
            raise self.wrong_protocol(status)
        if status != 200 or not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
            raise EndpointError(f"{self.url} did not list its models (HTTP {status} on {self.health_path}).",
                                field="--endpoint")
        served = [m.get("id", "?") for m in listing["data"] if isinstance(m, dict)]
        if self.model not in served:
            raise self.missing_model(served)

    def send(self, prompt: Prompt) -> RequestRecord:
        record = RequestRecord(prompt_tokens=0 if isinstance(prompt, str) else len(prompt), send=time.perf_counter())
        # ignore_eos: fixed-length outputs (a vLLM / SGLang / trtllm-serve extension; others ignore it).
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        stream_id = None
        for event in self.stream("/v1/completions", body, record):
            stream_id = event.get("id", stream_id)
            choices = event.get("choices") or []
            choice = choices[0] if choices and isinstance(choices[0], dict) else {}
            if choice.get("text"):
                record.add_chunk(time.perf_counter(), 1)
            # trtllm-serve's per-choice acceptance length (postprocess_handlers.py @ 7b437aaa).
            if isinstance(choice.get("avg_decoded_tokens_per_iter"), (int, float)):
                record.tau = float(choice["avg_decoded_tokens_per_iter"])
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                record.reported_output_tokens = usage["completion_tokens"]
            read_stats(event, record)
        if record.ok and record.accepted_drafts is None:
            self.perf_metrics.read(stream_id, record)
        return record


def make_endpoint(protocol: str, url: str, model: str, max_tokens: int, timeout: float) -> HttpEndpoint:
    kinds = {"triton": TritonEndpoint, "openai": OpenAIEndpoint}
    if protocol not in kinds:
        raise InputError(f"expected one of {', '.join(PROTOCOLS)}, got {protocol!r}.", field="--protocol")
    return kinds[protocol](url, model, max_tokens, timeout)
