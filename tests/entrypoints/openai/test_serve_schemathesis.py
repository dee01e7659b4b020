"""Schemathesis against the server's OpenAPI schema: every operation gets a bounded, derandomized set of generated
requests (the schema's examples; its coverage cases: boundary and wrong-type values, missing fields, undeclared
methods; then positive and negative fuzzing), sent to a real server process, and no answer is a 5xx.

The schema is built from the app at import, because schemathesis makes one pytest item per operation only from a
schema it has at collection time (its fixture-based loader does not run under pytest 9); a test checks that the
running server's /openapi.json is that same schema. The server is the conftest's capped one (a 48-token context,
n <= 2): the schema leaves max_tokens, n and the prompts unbounded, as OpenAI's does, and the server's own caps, not
a filtered schema, keep each generated call short.

Checks beyond "no 5xx": response bodies, headers and content types as the schema declares them, and a 405 with an
Allow header for undeclared methods. Left out: status_code_conformance (the schema declares FastAPI's 422, while the
server answers OpenAI's 400/401/404, which no route declares) and negative_data_rejection (pydantic's lax mode
accepts e.g. "5" or 5.0 for an int, which the schema calls invalid).

PAGEDLLM_SCHEMATHESIS_EXAMPLES sets the fuzzed cases per operation (default 10, for CI's time budget); a long run,
e.g. 1000 per operation (over 10,000 cases in all):

    PAGEDLLM_SCHEMATHESIS_EXAMPLES=1000 pytest -s tests/entrypoints/openai/test_serve_schemathesis.py

prints the number of cases sent per operation at the end (with -s)."""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    unsupported_method,
)

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.limits import ServerLimits  # noqa: E402

# fuzzed cases per operation (the examples and coverage cases come on top)
MAX_EXAMPLES = int(os.environ.get("PAGEDLLM_SCHEMATHESIS_EXAMPLES", "10"))
SENT: Counter[str] = Counter()  # cases sent per operation
CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    response_headers_conformance,
    content_type_conformance,
    unsupported_method,
]
# the routes' schema only: building the app reads the limits and nothing of the engine
OPENAPI = build_app(SimpleNamespace(limits=ServerLimits(), engine=None)).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)


def test_served_schema_is_the_tested_one(capped_server):
    status, served = capped_server.request("GET", "/openapi.json")
    assert status == 200
    assert served == OPENAPI


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_openapi_operation(case, capped_server):
    SENT[f"{case.method} {case.path}"] += 1
    if SENT.total() % 1000 == 0:
        print(f"schemathesis: {SENT.total()} cases so far", flush=True)
    case.call_and_validate(base_url=capped_server.base_url, headers=capped_server.headers(), timeout=60, checks=CHECKS)


def teardown_module() -> None:
    for operation, count in sorted(SENT.items()):
        print(f"schemathesis: {count} cases for {operation}")
    print(f"schemathesis: {sum(SENT.values())} cases in all")
