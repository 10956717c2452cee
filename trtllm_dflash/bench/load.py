"""Load shapes and the prompts they carry: a closed loop of N users, or Poisson arrivals at a
request rate (open loop), bounded by a request count or a duration; prompts from a text/JSONL file,
a ShareGPT conversation file or synthetic token ids.

Outputs have a fixed length (`max_tokens`, stop tokens ignored where the runtime allows it), the
convention of trtllm-bench's --osl and genai-perf's output-tokens-mean, so points differ in speed only.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from .metrics import RequestRecord
from .points import CONCURRENCY

Prompt = str | list[int]


@dataclass(frozen=True)
class LoadShape:
    kind: str  # CONCURRENCY (closed loop) or RATE (open loop, Poisson)
    level: float  # users, or requests/s
    requests: int  # requests per run (cycling through the prompts); 0 with a duration
    duration: float | None = None  # seconds: no request is sent after it
    seed: int = 0

    @property
    def label(self) -> str:
        return f"c={int(self.level)}" if self.kind == CONCURRENCY else f"rate={self.level:g}/s"

    def prompts(self, prompts: Sequence[Prompt]) -> Iterator[Prompt]:
        """The run's prompts in order: `requests` of them, or unbounded for a duration-bound run."""
        cycled = itertools.cycle(prompts)
        return cycled if self.duration is not None else itertools.islice(cycled, self.requests)

    def arrivals(self) -> list[float]:
        return poisson_arrivals(self.level, self.requests, self.duration, self.seed)


def poisson_arrivals(rate: float, count: int, duration: float | None, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process at `rate` requests/s: exponential gaps from a seeded
    generator, the first request at 0; `count` of them, or all that fall inside `duration`."""
    if rate <= 0:
        raise InputError(f"expected a positive request rate, got {rate}.", field="--request-rate")
    rng = np.random.default_rng(seed)
    offsets, now = [], 0.0
    while (duration is None and len(offsets) < count) or (duration is not None and now <= duration):
        offsets.append(now)
        now += float(rng.exponential(1.0 / rate))
    return offsets


def closed_loop(send: Callable[[Prompt], RequestRecord], prompts: Iterator[Prompt], users: int,
                duration: float | None) -> list[RequestRecord]:
    """`users` threads, each sending its next request when its previous one ends, until the prompts
    run out or `duration` has passed."""
    lock, records = threading.Lock(), []
    start = time.perf_counter()

    def user() -> None:
        while True:
            with lock:
                if duration is not None and time.perf_counter() - start > duration:
                    return
                prompt = next(prompts, None)
            if prompt is None:
                return
            record = send(prompt)
            with lock:
                records.append(record)

    threads = [threading.Thread(target=user, daemon=True) for _ in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records


def open_loop(send: Callable[[Prompt], RequestRecord], prompts: Iterator[Prompt],
              arrivals: Sequence[float]) -> list[RequestRecord]:
    """One thread per request, started at its arrival offset whether or not earlier ones finished."""
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def one(prompt: Prompt) -> None:
        record = send(prompt)
        with lock:
            records.append(record)

    start, threads = time.perf_counter(), []
    for offset, prompt in zip(arrivals, prompts):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(prompt,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return records


def read_sharegpt(path: Path) -> list[str]:
    """The first human turn of every conversation in a ShareGPT file (a JSON list of
    {"conversations": [{"from": "human", "value": ...}, ...]}, the format vLLM's and SGLang's
    serving benchmarks read)."""
    if not path.is_file():
        raise InputError("file not found; expected a ShareGPT JSON file.", path=path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not valid JSON ({exc}).", path=path) from None
    if not isinstance(data, list):
        raise InputError("expected a JSON list of conversations (ShareGPT format).", path=path)
    prompts = []
    for number, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise InputError(f"entry {number} has no 'conversations' list.", path=path, field="conversations")
        first = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")),
                     None)
        if isinstance(first, str) and first.strip():
            prompts.append(first)
    if not prompts:
        raise InputError("no conversation has a non-empty human turn.", path=path, field="conversations")
    return prompts


def synthetic_prompts(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `input_len` token ids drawn uniformly from the vocabulary (seeded);
    the two lowest and the top id are avoided (special tokens in most vocabularies)."""
    if input_len < 1 or vocab_size < 4:
        raise InputError(f"expected an input length >= 1 and a vocabulary of at least 4, got {input_len} and "
                         f"{vocab_size}.", field="--synthetic-input-len")
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab_size - 1, size=(count, input_len)).tolist()


def describe(prompts: Sequence[Prompt]) -> dict:
    """Counts for the bench JSON (token lengths where prompts are token ids)."""
    lengths = [len(p) for p in prompts if not isinstance(p, str)]
    info = {"count": len(prompts), "text": sum(isinstance(p, str) for p in prompts)}
    if lengths:
        info["input_tokens_mean"] = float(np.mean(lengths))
    return info

