"""A real `python -m pagedllm serve` process on 127.0.0.1 (a free port), started once and shared by the test modules
here (session scope: a folder without __init__.py has no package scope), and the offline LLM the tests compare it
with, loaded while the server starts."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
API_KEY = "test-key-123"
MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 128 << 20
MAX_BODY_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """A server subprocess; its log goes to a temp file that a failed start prints."""

    def __init__(
        self,
        args: list[str],
        api_key: str | None = None,
        model: str | None = None,
        command: tuple[str, ...] = ("-m", "pagedllm", "serve"),
        env: dict[str, str] | None = None,
    ) -> None:
        """`api_key` is passed as --api-key (None: none passed); `env` adds to the environment."""
        self.model = model  # the served model name
        self.port = _free_port()
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, *command, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--uvicorn-log-level", "warning"] + (["--api-key", api_key] if api_key else [])
        # one torch thread: the server shares the cores with the test process (whose offline LLM is the reference),
        # and two processes each spinning two OpenMP threads on two cores slow both several-fold
        # the API-key variables only where a test sets them on purpose
        inherited = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_API_KEY", "VLLM_API_KEY")}
        env = {**inherited, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.read_log()}")

    def request(
        self, method: str, path: str, body=None, auth: bool = True, headers: dict | None = None, timeout: float = 60
    ) -> tuple[int, object]:
        """(status, parsed JSON body or text); `body` is a dict (sent as JSON), bytes or str (sent as they are)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            all_headers = {"Content-Type": "application/json", **(self.headers() if auth else {}), **(headers or {})}
            conn.request(method, path, body=data, headers=all_headers)
            resp = conn.getresponse()
            text = resp.read().decode()
            if resp.getheader("content-type", "").startswith("application/json"):
                return resp.status, json.loads(text)
            return resp.status, text
        finally:
            conn.close()

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-5000:]

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        url, key = self.base_url + "/v1", self.api_key or "none"
        return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def server_process(smollm2):
    server = RemoteServer(
        [
            smollm2,
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--max-body-bytes",
            str(MAX_BODY_BYTES),
        ],
        api_key=API_KEY,
        model=MODEL_NAME,
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},  # /v1/responses' store (off by default)
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline_llm(server_process, smollm2):
    """The same model offline (loaded while the server process starts)."""
    from pagedllm import LLM

    return LLM(smollm2, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES)


@pytest.fixture(scope="session")
def server(server_process) -> RemoteServer:
    server_process.wait_ready()
    return server_process


@pytest.fixture
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def embed_server(minilm):
    """`pagedllm serve --task embed` with the bundled embedding model (started by the module that uses it)."""
    server = RemoteServer([minilm, "--task", "embed", "--served-model-name", "minilm-test"], model="minilm-test")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def capped_server(smollm2):
    """The chat model behind tight caps (a 48-token context, n <= 2, 4 prompts a call), so that generated requests,
    whatever max_tokens they ask for, finish in about a second each on CPU (started by the module that uses it)."""
    server = RemoteServer(
        [smollm2, "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "48"]
        + ["--kv-cache-memory-bytes", str(16 << 20), "--max-n", "2", "--max-prompts", "4"],
        api_key=API_KEY,
        model=MODEL_NAME,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


TOOL_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_chat_template.jinja")


@pytest.fixture(scope="module")
def tool_server(smollm2):
    """The chat model with a template that renders tools, hermes tool calls read from "auto" replies, and
    deepseek_r1 reasoning (the template opens <think>; enable_thinking=false closes it in the prompt)."""
    server = RemoteServer(
        [smollm2, "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
        + ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--chat-template", TOOL_TEMPLATE]
        + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"],
        api_key=API_KEY,
        model=MODEL_NAME,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
