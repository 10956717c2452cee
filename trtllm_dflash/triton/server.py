"""Finding, assembling, starting and stopping a real Triton Inference Server for `dflash-serve`.

Two servers are supported:
  system   `tritonserver` on PATH or in /opt/tritonserver (NGC containers), with its own backends;
  bundled  the tritonserver 2.51 inside the `nvidia-pytriton` wheel (`pip install '.[serve]'`). Its
           python backend is three loose files, assembled here into a backend directory; the stub
           links the interpreter's libpython and finds our venv through `python3` on PATH.
Everything that would make the server fail later (ports taken, no binary, no libpython, numpy 2
with the 2.51 python backend) is checked before it starts and reported as one InputError.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError

SYSTEM_SERVER = Path("/opt/tritonserver/bin/tritonserver")
SHM_DIR = Path("/dev/shm")
EXIT_TIMEOUT_S = 5  # tritonserver's own grace period for in-flight requests on shutdown
LOG_LEVELS = ("error", "warning", "info", "verbose")
SERVE_HINT = "install the serving extra: pip install 'trtllm-dflash[serve]' (or pip install -e '.[serve]')"


@dataclass(frozen=True)
class ServerInstall:
    binary: Path
    backend_files: dict[str, Path] | None  # bundled: python-backend file name -> source; system: None
    library_path: tuple[str, ...] = ()
    bundled: bool = False


def bundled_root() -> Path | None:
    """pytriton/tritonserver inside the installed wheel, found without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(spec.submodule_search_locations[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def system_server() -> Path | None:
    found = shutil.which("tritonserver")
    if found:
        return Path(found)
    return SYSTEM_SERVER if SYSTEM_SERVER.is_file() else None


def check_libpython() -> Path:
    """The python backend stub dlopens this interpreter's shared libpython."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    library = Path(libdir or "") / (soname or "")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not soname or not library.is_file():
        raise InputError(
            f"Triton's python backend stub needs this interpreter's shared library ({soname or 'libpython'} in "
            f"{libdir}), but {sys.executable} was built without one (--enable-shared). Use a Python with a shared "
            "libpython (Debian/Ubuntu python3, python.org or conda builds; pyenv: "
            "PYTHON_CONFIGURE_OPTS=--enable-shared).", field="libpython")
    return library


def check_numpy_for_bundled() -> None:
    """tritonserver 2.51's python backend crashes its stub on the first string tensor with numpy 2
    (fixed upstream after 2.51, triton-inference-server/python_backend#384)."""
    version = importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        raise InputError(
            f"numpy {version} is installed, but the Triton server bundled in nvidia-pytriton (2.51) crashes its "
            "python backend on string tensors with numpy 2. Serve from a separate environment with numpy < 2: "
            f"{SERVE_HINT}.", field="numpy")


def find_server(choice: str = "auto") -> ServerInstall:
    """auto: the system server when there is one, else the bundled one; or an explicit binary path."""
    if choice not in ("auto", "bundled"):
        binary = Path(choice)
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise InputError(f"{binary} is not an executable file.", field="--tritonserver")
        return ServerInstall(binary, None)
    if choice == "auto" and (binary := system_server()) is not None:
        return ServerInstall(binary, None)
    root = bundled_root()
    if root is None:
        raise InputError(
            "no Triton Inference Server found: no `tritonserver` on PATH or in /opt/tritonserver, and no "
            f"nvidia-pytriton wheel in this environment. On CPU, {SERVE_HINT}; on a GPU host, run inside "
            "NVIDIA's Triton TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3).",
            field="tritonserver")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise InputError(f"the bundled Triton server has python backend stubs for Python {', '.join(have)}, not "
                         f"{version} ({sys.executable}).", field="python")
    check_numpy_for_bundled()
    libpython = check_libpython()
    backend = root / "backends" / "python"
    files = {"libtriton_python.so": backend / "libtriton_python.so",
             "triton_python_backend_utils.py": backend / "triton_python_backend_utils.py",
             "triton_python_backend_stub": stub}
    libs = root.parent.parent / "nvidia_pytriton.libs"  # the wheel's vendored shared libraries
    return ServerInstall(root / "bin" / "tritonserver", files, (str(libs), str(libpython.parent)), bundled=True)


def assemble_backends(install: ServerInstall, directory: Path) -> Path | None:
    """The bundled python backend as Triton expects it: <directory>/python/{the three files}."""
    if install.backend_files is None:
        return None
    python = directory / "python"
    python.mkdir(parents=True)
    for name, source in install.backend_files.items():
        shutil.copy2(source, python / name)
    return directory


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is not "in use"
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(host: str, ports: dict[str, int]) -> None:
    if len(set(ports.values())) < len(ports):
        raise InputError(f"{' and '.join(ports)} must differ, got {ports}.", field=next(iter(ports)))
    for option, port in ports.items():
        if not 0 < port < 65536:
            raise InputError(f"expected a port in 1..65535, got {port}.", field=option)
        if port_in_use(host, port):
            raise InputError(f"{host}:{port} is already in use (another server?); choose another with {option}.",
                             field=option)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def log_flags(level: str) -> list[str]:
    if level not in LOG_LEVELS:
        raise InputError(f"expected one of {', '.join(LOG_LEVELS)}, got {level!r}.", field="--log")
    return {"error": ["--log-warning", "false", "--log-info", "false"],
            "warning": ["--log-info", "false"], "info": [], "verbose": ["--log-verbose", "1"]}[level]


@dataclass
class ServerOptions:
    repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    log: str = "info"
    shm_prefix: str = field(default_factory=lambda: f"triton_python_backend_shm_region_dflash_{os.getpid()}_")


def server_command(install: ServerInstall, backends: Path | None, options: ServerOptions) -> list[str]:
    command = [str(install.binary), "--model-repository", str(options.repository),
               "--http-address", options.host, "--http-port", str(options.http_port),
               "--grpc-address", options.host, "--grpc-port", str(options.grpc_port),
               "--allow-metrics", "false", "--exit-timeout-secs", str(EXIT_TIMEOUT_S),
               # our own prefix, so the regions a crashed stub leaves are ours to find and remove
               "--backend-config", f"python,shm-region-prefix-name={options.shm_prefix}",
               *log_flags(options.log)]
    if backends is not None:
        command += ["--backend-directory", str(backends)]
    return command


def server_environment(install: ServerInstall) -> dict[str, str]:
    env = dict(os.environ)
    if install.bundled:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*install.library_path, env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        # the stub resolves its interpreter as `python3` on PATH: this environment's must come first
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def children(pid: int) -> list[int]:
    """Direct children of pid (the python backend stubs of a tritonserver), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def remove_shm_regions(prefix: str) -> list[Path]:
    removed = []
    for region in SHM_DIR.glob(prefix + "*"):
        region.unlink(missing_ok=True)
        removed.append(region)
    return removed


class TritonProcess:
    """A tritonserver child in its own session (a terminal's Ctrl-C reaches us, and we stop it in
    order), its output streamed line by line to `echo`."""

    def __init__(self, command: list[str], env: dict[str, str], echo: Callable[[str], None], cwd: Path):
        # `cwd` outside the caller's directory: the Python backend's stub imports from its working directory first,
        # and started in a source checkout it served the checkout's trtllm_dflash, whatever the environment held
        self.process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace", start_new_session=True)
        self.reader = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self.reader.start()

    def _pump(self, echo: Callable[[str], None]) -> None:
        for line in self.process.stdout:
            echo(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, grace_s: float = EXIT_TIMEOUT_S + 3) -> int:
        """SIGTERM (Triton drains in-flight requests for up to EXIT_TIMEOUT_S), then SIGKILL to the
        whole process group, so no stub outlives the server."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.process.wait()
        self.reader.join(2)
        return code


def wait_until_ready(server: TritonProcess, url: str, model: str, timeout_s: float,
                     stopping: Callable[[], bool] = lambda: False) -> None:
    """Poll Triton's readiness API (tritonclient) until the model is ready (or we are asked to
    stop); a server that exits or stays unready past the timeout is a RuntimeError."""
    try:
        import tritonclient.http as httpclient
    except ImportError:
        raise InputError(f"tritonclient is not installed; {SERVE_HINT}.", field="tritonclient") from None
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not stopping():
            if server.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {server.poll()} while starting (its log is above).")
            try:
                if client.is_server_ready() and client.is_model_ready(model):
                    return
            except (InferenceServerException, ConnectionError, OSError):
                pass
            time.sleep(0.25)
    finally:
        client.close()
    if stopping():
        return
    raise RuntimeError(f"the model {model!r} was not ready after {timeout_s:.0f} s (the server's log is above).")
