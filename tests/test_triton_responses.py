"""Responses sent from a thread of their own (`ResponsePump`): the loop never waits on a send, deltas that wait are
merged, every token arrives in order, a final response is a request's last, an error replaces what waits."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.triton.llmapi import RequestSpec
from trtllm_dflash.triton.responses import ResponsePump
from trtllm_dflash.triton.service import Job, text_array


class Client:
    """A request's client: records what arrives; `hold` makes every send after the first (which the pump makes from
    the caller's thread) block until `released`."""

    def __init__(self, hold: bool = False, broken: bool = False):
        self.received: list[tuple[dict, bool]] = []
        self.sends = 0
        self.errors: list[tuple[str, bool]] = []
        self.entered, self.released = threading.Event(), threading.Event()
        self.broken = broken
        if not hold:
            self.released.set()
        spec = RequestSpec(None, [0], SamplingParams(max_tokens=8), streaming=True)
        self.job = Job(spec, [0], self.emit, self.fail)

    def emit(self, outputs, final):
        self.sends += 1
        if self.sends > 1:
            self.entered.set()
            assert self.released.wait(10)
        if self.broken:
            raise RuntimeError("the client went away")
        self.received.append((outputs, final))

    def fail(self, message, cancelled=False):
        self.errors.append((message, cancelled))

    def text(self) -> str:
        return b"".join(outputs["text_output"][0] for outputs, _ in self.received).decode()

    def ids(self) -> list[int]:
        return [int(i) for outputs, _ in self.received for i in outputs["output_ids"]]


def delta(text: str, ids: list[int], **extra) -> dict:
    return {"text_output": text_array(text), "output_ids": np.array(ids, dtype=np.int32), **extra}


def busy_sender(pump: ResponsePump, client: Client) -> None:
    """"a" sent at once (a request's first response), "b" queued: returns once the sender is blocked inside "b"."""
    for piece in "ab":
        pump.emit(client.job, delta(piece, [1]), False)
    assert client.entered.wait(10)


@pytest.fixture
def pump():
    responses = ResponsePump()
    yield responses
    responses.close()


def test_the_first_response_goes_at_once_and_deltas_that_wait_for_a_busy_sender_go_out_as_one(pump):
    client = Client(hold=True)
    pump.emit(client.job, delta("a", [1]), False)
    assert [outputs["text_output"][0] for outputs, _ in client.received] == [b"a"]  # sent before emit returned
    pump.emit(client.job, delta("b", [2]), False)
    assert client.entered.wait(10)  # the sender is now inside the second send, blocked
    for i, piece in enumerate("cd"):  # queued without waiting (the decode loop's side)
        pump.emit(client.job, delta(piece, [3 + i]), False)
    pump.emit(client.job, delta("é", [5], finish_reason=text_array("length")), True)
    client.released.set()
    pump.drain()
    assert [final for _, final in client.received] == [False, False, True]
    assert client.text() == "abcdé" and client.ids() == [1, 2, 3, 4, 5]
    assert client.received[2][0]["finish_reason"][0] == b"length"


def test_an_error_replaces_what_waits(pump):
    client = Client(hold=True)
    busy_sender(pump, client)
    pump.emit(client.job, delta("c", [2]), False)
    pump.fail(client.job, "request cancelled", True)
    pump.emit(client.job, delta("d", [3]), True)  # nothing after the error reaches the client
    client.released.set()
    pump.drain()
    assert client.text() == "ab" and client.errors == [("request cancelled", True)]


def test_a_failed_send_cancels_the_request(pump):
    client = Client(broken=True)
    pump.emit(client.job, delta("a", [1]), False)
    pump.drain()
    assert client.job.cancelled and client.received == []


def test_close_sends_what_waits():
    pump = ResponsePump()
    client = Client(hold=True)
    busy_sender(pump, client)
    pump.emit(client.job, delta("c", [2]), True)
    client.released.set()
    pump.close()
    assert client.text() == "abc" and client.received[-1][1] and not pump.thread.is_alive()


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 2), st.text(min_size=0, max_size=3)), min_size=1, max_size=30))
def test_every_token_arrives_in_order_and_the_final_last(plan):
    """Three requests' deltas interleaved at random: each client's responses concatenate to what was emitted for it,
    and its final response arrives once, last."""
    pump = ResponsePump()
    clients = [Client() for _ in range(3)]
    emitted = [("", []) for _ in clients]
    for n, (who, piece) in enumerate(plan):
        text, ids = emitted[who]
        emitted[who] = (text + piece, ids + [n])
        pump.emit(clients[who].job, delta(piece, [n]), False)
    for client in clients:
        pump.emit(client.job, delta("!", [-1]), True)
    pump.close()
    for client, (text, ids) in zip(clients, emitted):
        assert client.text() == text + "!" and client.ids() == ids + [-1]
        assert [final for _, final in client.received].count(True) == 1 and client.received[-1][1]


def test_the_decode_loop_does_not_wait_for_a_send():
    """A client whose sends after the first block until generation is over: the batch still decodes to the end
    (before, each step waited for its send, and this deadlocked), and the client gets every token, in at most three
    responses (the first, sent at once; the one the sender held; the rest merged)."""
    from trtllm_dflash.runtime.stats import GenerationResult, RequestStats
    from trtllm_dflash.triton.service import DFlashService

    finished = threading.Event()

    class Runtime:
        backend, inflight = "reference", False

        def generate(self, prompts, params, batch_size, on_tokens, **hooks):
            for token in range(1, 21):
                on_tokens(0, [token])
            finished.set()
            return [GenerationResult(list(prompts[0]), list(range(1, 21)), "length", RequestStats(1))]

    received = []

    def emit(outputs, final):
        if received:
            assert finished.wait(10), "the loop waited for the send"
        received.append((outputs, final))

    service = DFlashService(Runtime(), None, (), vocab_size=32, max_positions=64)
    spec = RequestSpec(None, [0], SamplingParams(max_tokens=20), streaming=True, exclude_input=True)
    service.run_batch([Job(spec, [0], emit, lambda message, cancelled=False: None)])
    service.close()
    assert [int(i) for outputs, _ in received for i in outputs["output_ids"]] == list(range(1, 21))
    assert len(received) <= 3 and [final for _, final in received][-1]


def test_a_client_that_went_away_gets_no_more_text_and_the_cancellation_last(pump):
    client = Client(hold=True)
    busy_sender(pump, client)
    pump.emit(client.job, delta("c", [2]), False)
    client.job.cancelled = True  # the client went away while its second response was being sent
    client.released.set()
    pump.drain()
    pump.emit(client.job, delta("d", [3], finish_reason=text_array("length")), True)
    pump.drain()
    assert client.text() == "ab" and client.errors == [("request cancelled", True)]
