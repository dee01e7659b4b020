"""Runs a script written against vLLM (as its documents and examples show it) with only the names changed: `vllm`
-> `pagedllm` in the imports, and quoted names (hub models, file paths, URLs) -> local ones."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import re
import shutil
import sys
import threading
from pathlib import Path


def as_pagedllm(script: str, names: dict[str, str]) -> str:
    """The only changes: `vllm` -> `pagedllm` in the imports, each quoted name -> its local value."""
    script = re.sub(r"^(\s*)from vllm([. ])", r"\1from pagedllm\2", script, flags=re.M)
    for name, local in names.items():
        script = script.replace(f'"{name}"', repr(local))
    return script


def run_script(script: str, names: dict[str, str], argv: list[str] | None = None, namespace: dict | None = None) -> str:
    """Runs the changed script as __main__ (in `namespace`, where the test can read its variables afterwards);
    returns what it printed."""
    code = as_pagedllm(script, names)
    assert "vllm" not in code.replace("pagedllm", "")
    out, saved = io.StringIO(), sys.argv
    if namespace is not None:
        namespace["__name__"] = "__main__"
    sys.argv = ["example.py", *(argv or [])]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "example.py", "exec"), namespace if namespace is not None else {"__name__": "__main__"})
    finally:
        sys.argv = saved
    return out.getvalue()


def greedy_copy(path: str, folder: Path, max_tokens: int) -> str:
    """A copy of the checkpoint whose generation defaults are temperature 0 and max_tokens new tokens: the
    documents' calls without sampling parameters are then greedy and short."""
    shutil.copytree(path, folder, dirs_exist_ok=True)
    file = folder / "generation_config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": max_tokens}))
    return str(folder)


@contextlib.contextmanager
def http_folder(folder: Path):
    """An HTTP server on 127.0.0.1 serving folder (the documents' https media URLs point here); yields its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)
