"""TEST DOUBLES, not servers: minimal local HTTP servers that speak the documented streaming
protocols dflash-bench's clients read, so the clients are tested without a model.

- OpenAICompletionsDouble: GET /v1/models, POST /v1/completions with "stream": true, answering
  `data: {...}` events (one token per chunk), a usage chunk, then `data: [DONE]`. With
  `trtllm_perf_metrics=True` it also speaks trtllm-serve's per-request metrics (with
  `return_perf_metrics` on): stream ids `cmpl-<request id>`, `avg_decoded_tokens_per_iter` in each
  choice, and GET /perf_metrics draining the finished requests' `speculative_decoding` counts.
- KServeGenerateStreamDouble: GET /v2/health/ready, GET /v2/models/<name>, POST
  /v2/repository/index, POST /v2/models/<name>/generate_stream answering one SSE event per group
  of `output_ids` and a final event with our model's acceptance statistics.
Each streams `max_tokens` tokens, `tokens_per_chunk` at a time, `delay_s` apart (the OpenAI double
can serve more models, each at its own pace: `extra_models`); after
`fail_after` requests every request is refused (HTTP 500), to test a server dying mid-sweep.
Bound to 127.0.0.1 on a free port; `with double:` starts and stops it.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StreamingDouble:
    def __init__(self, model: str = "dflash", delay_s: float = 0.002, tokens_per_chunk: int = 1,
                 fail_after: int | None = None, acceptance_length: float = 2.5,
                 extra_models: dict[str, float] | None = None, trtllm_perf_metrics: bool = False):
        self.model, self.delay_s, self.tokens_per_chunk = model, delay_s, tokens_per_chunk
        self.delays = {model: delay_s, **(extra_models or {})}  # model name -> seconds per chunk (OpenAI double)
        self.fail_after, self.acceptance_length = fail_after, acceptance_length
        self.requests: list[dict] = []
        self.trtllm_perf_metrics, self.finished_metrics = trtllm_perf_metrics, []  # drained by GET /perf_metrics
        self.lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet tests
                pass

            def do_GET(self):
                double.route(self, "GET", None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                double.route(self, "POST", json.loads(self.rfile.read(length) or b"{}"))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def admit(self, body: dict) -> int | None:
        """The request's id (1, 2, ...), or None when the double refuses it."""
        with self.lock:
            self.requests.append(body)
            return len(self.requests) if self.fail_after is None or len(self.requests) <= self.fail_after else None

    @staticmethod
    def reply_json(handler, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def stream(self, handler, events) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for event in events:
            handler.wfile.write(f"data: {event}\n\n".encode())
            handler.wfile.flush()
        handler.close_connection = True

    def chunks(self, max_tokens: int, delay_s: float | None = None):
        """Groups of token ids, `delay_s` apart (the first after one delay: a 'prefill')."""
        sent = 0
        while sent < max_tokens:
            time.sleep(self.delay_s if delay_s is None else delay_s)
            count = min(self.tokens_per_chunk, max_tokens - sent)
            yield list(range(sent + 10, sent + 10 + count))
            sent += count


class OpenAICompletionsDouble(StreamingDouble):
    def route(self, handler, method, body):
        if method == "GET" and handler.path == "/v1/models":
            return self.reply_json(handler, 200, {"object": "list", "data": [{"id": name, "object": "model"}
                                                                             for name in self.delays]})
        if method == "POST" and handler.path == "/v1/completions":
            if body.get("model") not in self.delays:
                return self.reply_json(handler, 404, {"error": {"message": f"model {body.get('model')} not found"}})
            request_id = self.admit(body)
            if request_id is None:
                return self.reply_json(handler, 500, {"error": {"message": "double: failing on purpose"}})
            return self.stream(handler, self.events(body, request_id))
        if method == "GET" and handler.path == "/perf_metrics" and self.trtllm_perf_metrics:
            with self.lock:
                drained, self.finished_metrics = self.finished_metrics, []
            return self.reply_json(handler, 200, drained)
        return self.reply_json(handler, 404, {"detail": "Not Found"})

    def events(self, body, request_id: int):
        total, stream_id = 0, f"cmpl-{request_id}" if self.trtllm_perf_metrics else "cmpl-double"
        extra = {"avg_decoded_tokens_per_iter": self.acceptance_length} if self.trtllm_perf_metrics else {}
        for ids in self.chunks(body["max_tokens"], self.delays[body["model"]]):
            total += len(ids)
            yield json.dumps({"id": stream_id, "object": "text_completion", "model": body["model"],
                              "choices": [{"index": 0, "text": "x" * len(ids), "finish_reason": None, **extra}]})
        if body.get("stream_options", {}).get("include_usage"):
            yield json.dumps({"id": stream_id, "object": "text_completion", "choices": [],
                              "usage": {"prompt_tokens": 5, "completion_tokens": total, "total_tokens": total + 5}})
        if self.trtllm_perf_metrics:  # recorded before [DONE], as trtllm-serve's _extract_metrics is
            with self.lock:
                self.finished_metrics.append({"request_id": request_id, "perf_metrics": {
                    "first_iter": 0, "last_iter": total, "timing_metrics": {},
                    "speculative_decoding": {"acceptance_rate": 0.2, "total_accepted_draft_tokens": 6,
                                             "total_draft_tokens": 28}}})
        yield "[DONE]"


class KServeGenerateStreamDouble(StreamingDouble):
    def route(self, handler, method, body):
        path = handler.path
        if method == "GET" and path == "/v2/health/ready":
            return self.reply_json(handler, 200, {})
        if method == "GET" and path.startswith("/v2/models/"):
            name = path.removeprefix("/v2/models/")
            if name == self.model:
                return self.reply_json(handler, 200, {"name": self.model, "versions": ["1"], "platform": "python"})
            return self.reply_json(handler, 400, {"error": f"Request for unknown model: '{name}' is not found"})
        if method == "POST" and path == "/v2/repository/index":
            return self.reply_json(handler, 200, [{"name": self.model, "version": "1", "state": "READY"}])
        if method == "POST" and path == f"/v2/models/{self.model}/generate_stream":
            if self.admit(body) is None:
                return self.reply_json(handler, 500, {"error": "double: failing on purpose"})
            return self.stream(handler, self.events(body))
        if method == "POST" and path.endswith("/generate_stream"):
            return self.reply_json(handler, 400, {"error": "Request for unknown model"})
        return self.reply_json(handler, 404, {"error": "Not Found"})

    def events(self, body):
        for ids in self.chunks(int(body.get("sampling_param_max_tokens", 16))):
            yield json.dumps({"model_name": self.model, "model_version": "1", "text_output": "x" * len(ids),
                              "output_ids": ids})
        yield json.dumps({"model_name": self.model, "model_version": "1", "finish_reason": "length",
                          "acceptance_length": self.acceptance_length, "acceptance_rate": 0.2,
                          "total_accepted_draft_tokens": 6, "total_draft_tokens": 28})
