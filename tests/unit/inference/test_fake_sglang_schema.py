"""The fake SGLang server's recorded schema matches the pinned sglang's source.

tests/fakes/fake_sglang.py answers with the request structs and routes of SGLang 0.5.23; this
reads the installed sglang's own files (srt/managers/io_struct.py, srt/entrypoints/
http_server.py) with ``ast`` / text search, without importing sglang (its import pulls
transformers and CUDA-side modules), so a version bump that renames a field or a route
fails here instead of on a cluster. ``make install-sglang`` installs the pinned version.
"""
from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import version
from pathlib import Path

from tests.fakes.fake_sglang import REQUEST_FIELDS, ROUTE_SCHEMA, SGLANG_VERSION

BASE_REQ = {"rid", "http_worker_ipc"}


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang is not installed: run `make install-sglang`"
    return Path(spec.origin).parent


def struct_fields() -> dict[str, set[str]]:
    tree = ast.parse((sglang_root() / "srt" / "managers" / "io_struct.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in REQUEST_FIELDS:
            names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if any(isinstance(b, ast.Name) and b.id == "BaseReq" for b in node.bases):
                names |= BASE_REQ
            out[node.name] = names
    return out


def test_the_fake_records_the_pinned_version():
    assert version("sglang") == SGLANG_VERSION


def test_request_fields_match_io_struct():
    real = struct_fields()
    assert set(real) == set(REQUEST_FIELDS)
    for name, fields in REQUEST_FIELDS.items():
        assert fields == real[name], (name, sorted(fields ^ real[name]))


def test_routes_exist_in_the_http_server():
    text = (sglang_root() / "srt" / "entrypoints" / "http_server.py").read_text()
    for route in [*ROUTE_SCHEMA, "/health", "/health_generate", "/model_info", "/get_model_info", "/flush_cache"]:
        assert f'"{route}"' in text, route


def test_the_client_sends_only_fields_sglang_knows():
    """Every field InferenceClient puts in a request body is a field of SGLang's struct."""
    import workers.common.inference_client as client
    tree = ast.parse(Path(client.__file__).read_text())
    sent = {k.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    sent |= {"return_routed_experts", "rid"}  # set by item assignment in generate()
    known = set().union(*REQUEST_FIELDS.values()) | {"temperature", "max_new_tokens", "stop_token_ids",
                                                     "Authorization",  # sampling_params keys, the auth header
                                                     "type", "message"}  # a default finish_reason the client builds
    assert sent <= known, sorted(sent - known)
