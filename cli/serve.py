"""dflash-serve: serve an engine with a real Triton Inference Server, in the foreground.

Writes the engine's model repository (with this run's model name, backend and device) into a
temporary directory, starts tritonserver on it (the system one, else the one bundled in the
nvidia-pytriton wheel of the `serve` extra), waits until the model is ready, prints the URLs, and
streams the server's log. Ctrl-C or SIGTERM stops the server (in-flight requests get Triton's
grace period) and removes what it left: the temporary directory and shared-memory regions.
If the model's stub process dies, dflash-serve stops the server and exits 1 rather than serve a
model that can only answer errors: restart it (or let a supervisor do so).
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import click

from trtllm_dflash.errors import InputError
from trtllm_dflash.runtime.interface import DRAFT_METHODS

from .common import clean_errors, resolve_device
from .run import resolve_draft_length

EXIT_SERVER_FAILED = 1


def curl_example(url: str, model: str) -> str:
    body = '{"text_input": "The capital of France is", "sampling_param_max_tokens": 32}'
    return f"curl -s {url}/v2/models/{model}/generate -d '{body}'"


def open_serving_engine(engine_dir: Path | None, verify: bool):
    from trtllm_dflash.engine.manifest import open_engine

    if engine_dir is not None:
        return open_engine(engine_dir, verify_checksums=verify)
    from trtllm_dflash.engine.build import default_engine

    return default_engine(log=lambda message: click.echo(message, err=True))


def stub_pids(server_pid: int) -> set[int]:
    from trtllm_dflash.triton.server import children

    def is_stub(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/comm").read_text().startswith("triton_python")
        except OSError:
            return False

    return {pid for pid in children(server_pid) if is_stub(pid)}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine_dir", required=False, type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP and gRPC endpoints bind.")
@click.option("--http-port", default=8000, show_default=True)
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--model-name", default="dflash", show_default=True)
@click.option("--backend", type=click.Choice(["auto", "trtllm", "reference"]), default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N (reference backend).")
@click.option("--autoregressive", is_flag=True,
              help="Serve the target alone: the baseline DFlash is measured against (reference backend).")
@click.option("--batching", type=click.Choice(["inflight", "static"]), default="inflight", show_default=True,
              help="The reference backend's batching: inflight (a request that arrives while a batch runs joins it at "
                   "its next step) or static (it waits for the batch to end). TensorRT-LLM batches in flight itself.")
@click.option("--draft-method", type=click.Choice(DRAFT_METHODS),
              help="The reference backend's drafts, as dflash-run's option: DFlash with suffix-automaton drafts, DFlash "
                   "alone, or n-gram prompt lookup (the draft-model-free baseline). [default: dflash-sa]")
@click.option("--draft-length", type=click.Choice(["fixed", "adaptive"]),
              help="The reference backend's drafts: dflash-run's adaptive policy (step costs measured at start-up at "
                   "1, 2, 4, ... rows, each step priced by its live rows) or the engine's verify block every step. "
                   "[default: adaptive; fixed for ngram]")
@click.option("--stream-interval", type=click.IntRange(min=1),
              help="Streamed responses at a request's first iteration and every N-th after (TensorRT-LLM's "
                   "stream_interval). Default: the engine's LLM API option, else 1.")
@click.option("--tritonserver", "server_choice", default="auto", show_default=True,
              help="auto (system tritonserver, else the nvidia-pytriton one), bundled, or a binary's path.")
@click.option("--log", "log_level", type=click.Choice(["error", "warning", "info", "verbose"]), default="info",
              show_default=True, help="How much of the server's log to show.")
@click.option("--startup-timeout", default=300.0, show_default=True, help="Seconds to wait for the model.")
@click.option("--verify", is_flag=True, help="Check every file of ENGINE_DIR against its sha256 first.")
@clean_errors
def main(engine_dir, host, http_port, grpc_port, model_name, backend, device, autoregressive, batching,
         draft_method, draft_length, stream_interval, server_choice, log_level, startup_timeout, verify):
    """Serve ENGINE_DIR (default: the embedded engine) with Triton Inference Server until Ctrl-C."""
    from trtllm_dflash.runtime.interface import choose_backend
    from trtllm_dflash.triton import server as triton
    from trtllm_dflash.triton.repository import ModelParameters, write_model_repository

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", model_name):
        raise InputError(f"expected letters, digits, '_', '.' or '-', got {model_name!r}.", field="--model-name")
    chosen, reason = choose_backend(backend)
    if autoregressive and chosen != "reference":
        raise InputError("the autoregressive baseline runs on the reference backend; add --backend reference.",
                         field="--autoregressive")
    if batching == "static" and chosen != "reference":
        raise InputError("static batching is the reference backend's; TensorRT-LLM batches in flight. Add --backend "
                         "reference.", field="--batching")
    if draft_method is not None and (chosen != "reference" or autoregressive):
        raise InputError("chooses the reference backend's drafts; TensorRT-LLM runs the engine's DFlash, and "
                         "--autoregressive drafts nothing. Add --backend reference, or drop --autoregressive.",
                         field="--draft-method")
    if draft_length is not None and chosen != "reference":
        raise InputError("sizes the reference backend's drafts; TensorRT-LLM sizes them by the engine's "
                         "draft_len_schedule. Add --backend reference.", field="--draft-length")
    if stream_interval is not None and chosen != "reference":
        raise InputError("spaces the reference backend's streamed responses; TensorRT-LLM streams at the engine's "
                         "stream_interval (its LLM API option). Add --backend reference.", field="--stream-interval")
    if chosen == "reference":
        resolve_device(device)
        resolve_draft_length(draft_length, draft_method or DRAFT_METHODS[0], chosen)  # refuses adaptive n-gram
    install = triton.find_server(server_choice)
    triton.check_ports(host, {"--http-port": http_port, "--grpc-port": grpc_port})
    engine = open_serving_engine(engine_dir, verify)

    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    work = Path(tempfile.mkdtemp(prefix="dflash-serve-"))
    options = triton.ServerOptions(work / "models", host, http_port, grpc_port, log_level)
    process, code = None, 0
    try:
        run = ModelParameters(backend, device, "off" if autoregressive else "dflash", batching, stream_interval,
                              draft_method=draft_method, draft_length=draft_length)
        write_model_repository(options.repository, str(engine.root), engine.llm_api_options(), engine.root,
                               model_name, run)
        backends = triton.assemble_backends(install, work / "backends")
        click.echo(f"dflash-serve: {engine.root} on {install.binary} (backend {chosen}: {reason})", err=True)
        process = triton.TritonProcess(triton.server_command(install, backends, options),
                                       triton.server_environment(install), lambda line: click.echo(line, err=True),
                                       cwd=work)
        url = f"http://{host}:{http_port}"
        try:
            triton.wait_until_ready(process, f"{host}:{http_port}", model_name, startup_timeout, stopping.is_set)
        except RuntimeError as exc:
            click.echo(f"error: {exc}", err=True)
            code = EXIT_SERVER_FAILED
        if not stopping.is_set() and code == 0:
            code = serve_until_stopped(process, stopping, url, f"{host}:{grpc_port}", model_name)
    finally:
        if process is not None:
            process.stop()
        triton.remove_shm_regions(options.shm_prefix)
        shutil.rmtree(work, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0:
        click.echo("dflash-serve: stopped", err=True)
    sys.exit(code)


def serve_until_stopped(process, stopping: threading.Event, url: str, grpc: str, model_name: str) -> int:
    """Print where to send requests, then watch the server and its stub until asked to stop."""
    stubs = stub_pids(process.pid)
    click.echo(f"\nready: model {model_name!r}\n  HTTP  {url}/v2/models/{model_name}/generate "
               f"(and /generate_stream)\n  gRPC  {grpc}\n  try:  {curl_example(url, model_name)}\n"
               "Ctrl-C stops the server.", err=True)
    while not stopping.wait(0.2):
        if process.poll() is not None:
            click.echo(f"error: tritonserver exited with code {process.poll()} (its log is above).", err=True)
            return EXIT_SERVER_FAILED
        from trtllm_dflash.triton.server import alive

        dead = [pid for pid in stubs if not alive(pid)]
        if dead:
            click.echo(f"error: the model's python backend stub (pid {dead[0]}) died; requests in flight were "
                       "lost. Stopping the server; start dflash-serve again (or let your supervisor restart it).",
                       err=True)
            return EXIT_SERVER_FAILED
    return 0
