"""A served request's text as its tokens arrive (`IncrementalText`, `RequestStream`): the same text, stop-string
cuts and deltas as decoding the whole stream every time, from windows of a few tokens."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.embedded import TARGET_DIR
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.triton.llmapi import RequestSpec
from trtllm_dflash.triton.responses import ResponsePump
from trtllm_dflash.triton.service import IncrementalText, Job, RequestStream

# code with multi-byte characters, which this byte-level tokenizer splits across tokens
TEXT = st.text(st.sampled_from(list("def f(x):\n    return x + 1  # é ü ñ 中文 ∑ 🚀 \"'")), min_size=1, max_size=60)
CHUNKS = st.lists(st.integers(1, 9), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET_DIR)


def chunked(ids: list[int], sizes: list[int]):
    at, i = 0, 0
    while at < len(ids):
        size = sizes[i % len(sizes)]
        yield ids[at: at + size]
        at, i = at + size, i + 1


@settings(max_examples=60, deadline=None)
@given(text=TEXT, sizes=CHUNKS)
def test_incremental_text_is_the_whole_decode_after_every_chunk(tokenizer, text, sizes):
    ids = tokenizer.encode(text)
    output, seen = IncrementalText(tokenizer.decode), []
    for chunk in chunked(ids, sizes):
        output.extend(chunk)
        seen += chunk
        whole = tokenizer.decode(seen)
        assert output.text == whole and whole.startswith(output.stable)
    assert output.text == text


def test_a_piece_that_depends_on_the_one_before_decodes_as_in_the_whole_text():
    """A SentencePiece-like decoder drops the text's leading space: decoding only the new tokens would lose every
    chunk's first space; the window's one chunk of context keeps it."""
    pieces = {1: "\u2581def", 2: "\u2581f", 3: "(x):", 4: "\u2581return", 5: "\u2581x"}

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    ids, output, naive = [1, 2, 3, 4, 5, 2], IncrementalText(decode), ""
    for token in ids:
        output.extend([token])
        naive += decode([token])
        assert output.text == decode(ids[: len(output.ids)])
    assert output.text == "def f(x): return x f" and naive != output.text


def test_a_long_stream_decodes_windows_of_a_few_tokens(tokenizer):
    """What kept streaming linear: no decode call sees more than a couple of chunks, however long the stream."""
    longest = [0]

    def decode(ids):
        longest[0] = max(longest[0], len(ids))
        return tokenizer.decode(ids)

    ids = tokenizer.encode("def f(x):\n    return x + 1  # é 中文 🚀\n" * 150)
    output = IncrementalText(decode)
    for chunk in chunked(ids, [1, 3, 8, 2]):
        output.extend(chunk)
    assert len(ids) > 2000 and output.text == tokenizer.decode(ids)
    assert longest[0] <= 3 * 8


@pytest.fixture(scope="module")
def responses():
    pump = ResponsePump()
    yield pump
    pump.close()


def stream(tokenizer, responses, stops: tuple[str, ...], streaming: bool, limit: int = 10_000, interval: int = 1):
    spec = RequestSpec(None, [0], SamplingParams(max_tokens=limit), streaming=streaming, stop_strings=stops)
    sent = []
    job = Job(spec, [0], lambda outputs, final: sent.append(outputs), lambda message, cancelled=False: None)
    return RequestStream(job, tokenizer.decode, frozenset(), 8, time.time_ns(), responses, interval), sent


@settings(max_examples=60, deadline=None)
@given(text=TEXT, sizes=CHUNKS, data=st.data())
def test_stop_strings_cut_where_the_whole_decode_first_holds_one(tokenizer, responses, text, sizes, data):
    """Against the brute force: decode every prefix of the stream, stop at the first token whose text holds a stop
    string, cut the text where the earliest one begins."""
    ids = tokenizer.encode(text)
    start = data.draw(st.integers(0, len(text) - 1))
    stops = (text[start: start + data.draw(st.integers(1, 4))], "never seen")
    expected_tokens, expected_text = len(ids), text
    for n in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:n])
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            expected_tokens, expected_text = n, prefix[: min(hits)]
            break
    for streaming in (False, True):
        request, sent = stream(tokenizer, responses, stops, streaming)
        for chunk in chunked(ids, sizes):
            request.add(chunk)
            if request.finish:
                break
        if not request.finish:
            request.end("length")
        responses.drain()
        assert len(request.tokens) == expected_tokens
        assert b"".join(outputs["text_output"][0] for outputs in sent).decode() == expected_text
        assert [int(i) for outputs in sent for i in outputs["output_ids"]] == ids[:expected_tokens]


@pytest.mark.parametrize("interval", [1, 3, 4])
def test_deltas_at_the_first_iteration_and_every_stream_interval_th(tokenizer, interval):
    """TensorRT-LLM's stream_interval: a response at a request's first iteration, every interval-th, and its final,
    which carries what came since; together the same text and ids."""
    class Recorder:  # the responses as the stream hands them over (the pump would merge some)
        def __init__(self):
            self.emitted = []

        def emit(self, job, outputs, final):
            self.emitted.append(outputs)

    ids = tokenizer.encode("def f(x):\n    return x + 1  # é 中文\n" * 3)
    recorder = Recorder()
    request, _ = stream(tokenizer, recorder, (), streaming=True, limit=len(ids), interval=interval)
    steps = list(chunked(ids, [1, 3, 2, 4]))
    for chunk in steps:
        request.add(chunk)
    assert request.finish == "length"
    last = len(steps)
    assert len(recorder.emitted) == 1 + sum(i == 1 or i % interval == 0 for i in range(1, last))
    assert b"".join(outputs["text_output"][0] for outputs in recorder.emitted).decode() == tokenizer.decode(ids)
    assert [int(i) for outputs in recorder.emitted for i in outputs["output_ids"]] == ids
