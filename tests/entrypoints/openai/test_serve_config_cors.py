"""`pagedllm serve --config FILE` (YAML; the command line wins over the file), vLLM's CORS defaults (a preflight is
answered before the API-key check, answers carry Access-Control-Allow-Origin) and --root-path."""

from __future__ import annotations

import http.client

from conftest import RemoteServer
from test_serve_score import DOCS, QUERY, _save_cross_encoder

from pagedllm.entrypoints.cli_config import expand_config


def test_expand_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: /m\nmax_model_len: 64\nenable-prefix-caching: false\nenforce_eager: true\n"
        "served-model-name: [a, b]\nhf_overrides: {x: 1}\nseed: null\ndtype: float16\n"
    )
    argv = expand_config(["serve", "--config", str(cfg), "--dtype", "float32"])
    assert argv == ["serve", "--dtype", "float32", "--model", "/m", "--max-model-len", "64",
                    "--no-enable-prefix-caching", "--enforce-eager", "--served-model-name", "a", "b",
                    "--hf-overrides", '{"x": 1}']  # fmt: skip
    assert expand_config(["serve", "m"]) == ["serve", "m"]
    (tmp_path / "list.yaml").write_text("- a\n")
    try:
        expand_config(["serve", f"--config={tmp_path / 'list.yaml'}"])
    except ValueError as e:
        assert "mapping of flag names" in str(e)
    else:
        raise AssertionError("a list is not a config")


def test_config_file_cors_and_root_path(tmp_path):
    path = _save_cross_encoder(tmp_path / "model")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {path}\nserved_model_name: from-file\ntask: score\ndtype: float32\nroot-path: /api\n")
    server = RemoteServer(["--config", str(cfg), "--served-model-name", "from-cli"], api_key="k", model="from-cli")
    try:
        server.wait_ready(timeout=120)
        status, body = server.request("POST", "/v1/score", {"model": "from-cli", "text_1": QUERY, "text_2": DOCS})
        assert status == 200 and body["model"] == "from-cli"  # the command line won over the file
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        headers = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
        conn.request("OPTIONS", "/v1/score", headers=headers)  # a preflight carries no API key
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") == "*"
        conn.request("POST", "/v1/score", body=b"{}", headers={"Origin": "http://example.com"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 401 and resp.getheader("access-control-allow-origin") == "*"
        conn.close()
        status, spec = server.request("GET", "/openapi.json")
        assert status == 200 and spec["servers"] == [{"url": "/api"}]
    finally:
        server.stop()
