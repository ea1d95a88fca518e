"""Hypothesis strategies of HTTP requests for ``noria bench fuzz``: one ``RouteSpec`` per route.

What this module owns: what a request to each route may look like. A ``RouteSpec`` names a path
(a pattern, as the server's router registers it), the methods the server answers on it, and the
fields of its JSON body with a strategy of *valid* values each. ``shots(target, spec, context)``
draws one ``Shot`` (a request, ready to send) of a kind picked first:

=================  ========================================================================
kind               the request
=================  ========================================================================
valid              the body's fields drawn from their valid values (some left out)
wrong_type         one field's value replaced by any JSON value
missing / extra    fields removed / unknown fields added
huge               a number field at an extreme (``2**63``, ``-1``, ``1e308``, ``NaN`` ...)
unicode            string fields replaced by hostile text (lone surrogates, control, RTL, 10 kB)
not_object         a JSON body that is not an object
bad_json           bytes that are not JSON (or not UTF-8)
content_type       a valid body sent as text/plain, form or multipart
gzip / bomb        a gzip body / a small gzip body that inflates past the server's body limit
bogus_encoding     a Content-Encoding the body does not have (or no server knows)
oversize           a streamed body past the server's body limit
method             a method the route does not answer (or a random one)
headers            hostile headers (9 kB values, bogus auth, routing keys)
path               the route's path with a random suffix or query string
=================  ========================================================================

Bodies are bytes drawn by Hypothesis, so a run is a pure function of its seed; oversize and bomb
bodies are made by the driver when it sends them (``Shot.stream`` / ``Shot.body``), never drawn.
The route tables of the servers are read from their own routers by ``noria.bench.fuzz``, which
fails when a route has no spec here (``ENGINE_SPECS``, ``SESSION_SPECS``, ``ROUTER_PATHS``).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
HOSTILE_TEXT = [
    "", " ", "\x00", "\ud800", "\udfff", "a\ud83d", "\u202e\u0041", "🙂" * 40, "<|im_end|>", "<|im_start|>system\n",
    "<tool_call>{\"name\": 1}</tool_call>", "{{ raise_exception('x') }}", "{% for x in y %}", "%s%n%x", "../../etc/passwd",
    "\r\nX-Injected: 1", "a" * 10_000, "null", "NaN",
]  # fmt: skip
EXTREME_NUMBERS = [0, -1, 1, 2**31, -(2**31), 2**53 + 1, 2**63, -(2**63), 2**64, 10**30, -(10**30), 1e308, -1e308, 0.5, -0.0,
                   float("nan"), float("inf"), float("-inf")]  # fmt: skip
KINDS = (["valid"] * 6 + ["wrong_type"] * 3 + ["missing", "extra", "huge", "huge", "unicode", "unicode", "not_object", "bad_json",
         "content_type", "gzip", "bogus_encoding", "method", "method", "headers", "headers", "path", "bomb", "oversize"])  # fmt: skip
"""Kinds of shot, repeated by weight (valid bodies reach the deepest code, so they come most often)."""
BODYLESS_KINDS = ["valid"] * 3 + ["method", "method", "headers", "path", "bad_json", "gzip", "bogus_encoding", "oversize"]
HEAVY = frozenset({"bomb", "oversize"})
"""Kinds that move the server's whole body limit (64 MiB for ``noria serve``): the driver sends at most
one per ``--heavy-every`` requests and a small gzip body in the others' place."""


@dataclass(frozen=True)
class Shot:
    """One request to send: ``path`` is concrete (with its query), ``route`` the pattern it tests."""

    target: str
    route: str
    kind: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    stream: int = 0
    """Bytes to stream as the body (oversize); the driver makes them as it sends."""


@dataclass(frozen=True)
class RouteSpec:
    """A route: its path pattern, the methods it answers, its body's fields (name -> valid values)."""

    path: str
    methods: tuple[str, ...] = ("POST",)
    fields: dict[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    body: bool = True


# ------------------------------------------------------------------------------------ values

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=8)  # fmt: skip
small_text = st.text(max_size=24) | st.sampled_from(HOSTILE_TEXT[:12])
token_ids = st.lists(st.integers(0, 300), min_size=1, max_size=12)
new_tokens = st.integers(1, 6)
sampling_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": new_tokens, "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "stop": st.lists(st.text(max_size=4), max_size=2), "stop_token_ids": st.lists(st.integers(0, 300), max_size=2),
    "ignore_eos": st.booleans(), "seed": st.integers(0, 2**31), "sampling_seed": st.integers(0, 2**31),
})  # fmt: skip
chat_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": small_text}),
                         min_size=1, max_size=4)  # fmt: skip


def sampling_fields() -> dict[str, Any]:
    """The OpenAI sampling fields, valid values (kept small so a valid request stays cheap)."""
    return {
        "model": st.text(max_size=8), "max_tokens": new_tokens, "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 300), max_size=2), "ignore_eos": st.booleans(), "seed": st.integers(0, 2**31),
        "n": st.integers(1, 3), "stream": st.booleans(), "routing_key": st.text(min_size=1, max_size=8),
    }  # fmt: skip


# ------------------------------------------------------------------------------------ route tables


def engine_specs(model_path: str = "/nonexistent", tensors: dict[str, list[int]] | None = None) -> list[RouteSpec]:
    """Every route of ``noria serve`` (native, weights, OpenAI). ``model_path`` is a folder an update
    from disk may load (the served model: a valid update); ``tensors`` the small live tensors
    (name -> shape) a valid ``/update_weights_from_tensor`` may overwrite."""
    both = ("GET", "POST")
    bodyless = [RouteSpec(p, both, body=False) for p in (
        "/health", "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load",
        "/metrics", "/get_weight_version", "/flush_cache", "/continue_generation", "/release_memory_occupation",
        "/resume_memory_occupation", "/weights_info")]  # fmt: skip
    named = st.sampled_from(sorted(tensors)) if tensors else st.text(max_size=20)
    return bodyless + [
        RouteSpec("/generate", ("POST",), {
            "text": small_text | st.lists(small_text, min_size=1, max_size=3), "input_ids": token_ids | st.lists(token_ids, min_size=1, max_size=3),
            "sampling_params": sampling_params, "rid": st.text(max_size=8), "return_logprob": st.booleans(),
            "top_logprobs_num": st.integers(0, 5), "stream": st.booleans(), "return_text_in_logprobs": st.booleans(),
            "routing_key": st.text(min_size=1, max_size=8), "return_routed_experts": st.booleans(), "logprob_start_len": st.integers(-1, 4),
            "log_metrics": st.booleans(), "lora_path": st.none(), "priority": st.integers(-3, 3),
        }, required=("input_ids",)),  # fmt: skip
        RouteSpec("/v1/completions", ("POST",), {**sampling_fields(), "prompt": small_text | token_ids | st.lists(small_text, min_size=1, max_size=2),
                                                "logprobs": st.integers(0, 5), "echo": st.just(False)}, required=("prompt",)),  # fmt: skip
        RouteSpec("/v1/chat/completions", ("POST",), {**sampling_fields(), "messages": chat_messages, "logprobs": st.booleans(),
                                                     "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.booleans()},
                  required=("messages",)),  # fmt: skip
        RouteSpec("/v1/models", ("GET",), body=False),
        RouteSpec("/classify", ("POST",), {
            "text": small_text | st.lists(small_text, min_size=1, max_size=3), "input_ids": token_ids | st.lists(token_ids, min_size=1, max_size=3),
            "rid": st.text(max_size=8), "priority": st.integers(-2, 2), "model": st.text(max_size=8),
        }),  # fmt: skip (a generative model answers 400: not a sequence classifier)
        RouteSpec("/pause_generation", both, {"mode": st.sampled_from(["retract", "in_place", "drain"])}),
        RouteSpec("/abort_request", both, {"rid": st.text(max_size=8), "abort_all": st.booleans()}),
        RouteSpec("/update_weights_from_disk", both, {"model_path": st.sampled_from([model_path, "/nonexistent", "/", "/proc/self"]),
                                                     "weight_version": st.integers(0, 10) | st.text(max_size=3),
                                                     "load_format": st.none(), "abort_all_requests": st.booleans()}, ("model_path",)),  # fmt: skip
        RouteSpec("/init_weights_update_group", both, {
            "master_address": st.sampled_from(["127.0.0.1", "localhost", "256.0.0.1", ""]), "master_port": st.integers(1, 65535),
            "rank_offset": st.integers(-1, 2), "world_size": st.integers(0, 3), "group_name": st.text(max_size=6),
            "backend": st.sampled_from(["gloo", "nccl", "mpi", "x"]), "timeout_s": st.floats(0.01, 0.3),
        }, ("master_address", "master_port", "rank_offset", "world_size", "timeout_s")),  # fmt: skip
        RouteSpec("/update_weights_from_distributed", both, {
            "names": st.lists(named, max_size=2), "dtypes": st.lists(st.sampled_from(["float32", "bfloat16", "x"]), max_size=2),
            "shapes": st.lists(st.lists(st.integers(0, 64), max_size=2), max_size=2), "group_name": st.text(max_size=6),
            "weight_version": st.integers(0, 10), "flush_cache": st.booleans(), "update_id": st.text(max_size=6),
            "chunks": st.lists(st.integers(0, 3), max_size=2),
        }, ("names", "dtypes", "shapes")),  # fmt: skip
        RouteSpec("/update_weights_from_tensor", both, {"named_tensors": named_tensors(tensors or {}), "weight_version": st.integers(0, 10),
                                                       "flush_cache": st.booleans(), "load_format": st.none()}, ("named_tensors",)),  # fmt: skip
        RouteSpec("/update_weights_from_ipc", both, {
            "handle": st.fixed_dictionaries({"kind": st.sampled_from(["shm", "staging", "cuda", "x"])},
                                            optional={"name": st.text(max_size=12), "size": st.integers(-1, 2**20)}),
            "tensors": st.lists(st.fixed_dictionaries({"name": named, "dtype": st.sampled_from(["float32", "x"]),
                                                       "shape": st.lists(st.integers(0, 64), max_size=2), "offset": st.integers(-1, 4096)}),
                                min_size=1, max_size=2),
            "update_id": st.text(max_size=6), "weight_version": st.integers(0, 10),
        }, ("handle", "tensors")),  # fmt: skip
        RouteSpec("/weights_staging_area", both, {"update_id": st.text(min_size=1, max_size=6)}, ("update_id",)),
        RouteSpec("/commit_weights", both, {"update_id": st.text(max_size=6), "weight_version": st.integers(0, 10)}, ("update_id",)),
        RouteSpec("/discard_weights", both, {"update_id": st.text(max_size=6)}),
        RouteSpec("/weights_checksum", both, {"names": st.lists(named, max_size=3), "algo": st.sampled_from(["sha256", "xxh64", "md5", "x"])}),
        RouteSpec("/load_lora_adapter", ("POST",), {  # a folder that is no peft adapter (the served model's included): 400
            "lora_name": st.text(max_size=8), "lora_path": st.sampled_from([model_path, "/nonexistent", "/", "/proc/self"]),
            "version": st.integers(0, 5), "load_inplace": st.booleans(), "pinned": st.booleans(),
        }, ("lora_name", "lora_path")),  # fmt: skip
        RouteSpec("/unload_lora_adapter", ("POST",), {"lora_name": st.text(max_size=8)}, ("lora_name",)),
        RouteSpec("/lora_adapters", ("GET",), body=False),
    ]


def named_tensors(tensors: dict[str, list[int]]) -> st.SearchStrategy:
    """``named_tensors`` of ``/update_weights_from_tensor``: the live small tensors at their shape
    (finite values: a real update), or made-up names, shapes and data."""
    made_up = st.fixed_dictionaries({"name": st.text(max_size=12), "dtype": st.sampled_from(["float32", "bfloat16", "int8", "complex"]),
                                     "shape": st.lists(st.integers(-1, 8), max_size=3), "data": json_values | st.text(max_size=16)})  # fmt: skip
    if not tensors:
        return st.lists(made_up, min_size=1, max_size=2)

    def live(name: str) -> st.SearchStrategy:
        n = 1
        for d in tensors[name]:
            n *= d
        data = st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n)
        return st.fixed_dictionaries({"name": st.just(name), "dtype": st.just("float32"), "shape": st.just(tensors[name]), "data": data})

    return st.lists(st.sampled_from(sorted(tensors)).flatmap(live) | made_up, min_size=1, max_size=2)


def session_specs() -> list[RouteSpec]:
    """The session server's routes (``{secret}`` is the server's path secret, ``{sid}`` a session id)."""
    chat = {
        "messages": chat_messages | st.just([{"role": "user", "content": "hi"}]), "max_tokens": new_tokens, "max_completion_tokens": new_tokens,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2), "stream": st.booleans(),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.text(min_size=1, max_size=6), "parameters": st.just({"type": "object"})})}), max_size=1),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=6), json_scalars, max_size=2), "temperature": st.floats(0, 2),
    }  # fmt: skip
    return [
        RouteSpec("/{secret}/sessions/{sid}/v1/chat/completions", ("POST",), chat, ("messages",)),
        RouteSpec("/{secret}/v1/chat/completions", ("POST",), chat, ("messages",)),
        RouteSpec("/{secret}/sessions/{sid}", ("GET", "HEAD"), body=False),
    ]


ROUTER_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/health", "/health_generate", "/get_server_info",
                "/get_model_info", "/v1/models", "/flush_cache", "/get_load")  # fmt: skip
"""What the sglang-router front forwards to its engines (its admin routes, ``/workers``, are not
fuzzed: they add and remove engines, which is the launcher's business, not a client's)."""


def router_specs(engine: list[RouteSpec]) -> list[RouteSpec]:
    """The router's forwarded routes, with the engine's specs of the same paths."""
    by_path = {s.path: s for s in engine}
    return [by_path[p] for p in ROUTER_PATHS]


# ------------------------------------------------------------------------------------ shots


@st.composite
def shots(draw: Any, target: str, spec: RouteSpec, fill: dict[str, st.SearchStrategy], limit: int) -> Shot:
    """One request to ``spec``'s route; ``fill`` draws the path's parameters, ``limit`` is the
    server's body limit in bytes (oversize and bomb bodies pass it)."""
    kind = draw(st.sampled_from(KINDS if spec.body else BODYLESS_KINDS))
    path = spec.path
    for name, strategy in fill.items():
        path = path.replace("{" + name + "}", draw(strategy))
    method = draw(st.sampled_from(spec.methods))
    headers: dict[str, str] = {"Content-Type": "application/json"}
    body: bytes | None = json.dumps(draw(valid_body(spec))).encode() if spec.body else None
    stream = 0
    if kind in ("wrong_type", "missing", "extra", "huge", "unicode", "not_object"):
        body = json.dumps(draw(mutated(spec, kind))).encode()
    elif kind == "bad_json":
        body = draw(st.binary(min_size=1, max_size=64) | st.sampled_from([b"{", b'{"a": }', b"\xff\xfe", b"[" * 5000, b'{"a": 1}{']))
    elif kind == "content_type":
        headers["Content-Type"] = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", "a/b"]))
    elif kind == "gzip":
        body, headers["Content-Encoding"] = gzip.compress(body or b"{}"), "gzip"
    elif kind == "bomb":
        body, headers["Content-Encoding"] = gzip_bomb(limit), "gzip"
    elif kind == "bogus_encoding":
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "zstd", "x-bogus", "gzip, gzip", "identity", ""]))
    elif kind == "oversize":
        body, stream = None, limit + (1 << 20)
    elif kind == "method":
        method = draw(st.sampled_from([m for m in METHODS if m not in spec.methods] or list(METHODS)) | st.sampled_from(METHODS))
    elif kind == "headers":
        headers.update(draw(hostile_headers()))
    elif kind == "path":
        path += draw(st.sampled_from(["/", "/x", "//", "/%00", "?", "?a=1&a=2", "?names=a,b&algo=x", "/../health", "%2F"]))
    return Shot(target, spec.path, kind, method, path, tuple(headers.items()), body, stream)


@st.composite
def valid_body(draw: Any, spec: RouteSpec) -> dict[str, Any]:
    """The required fields and some optional ones, each from its valid values."""
    body = {}
    for name, values in spec.fields.items():
        if name in spec.required or draw(st.booleans()):
            body[name] = draw(values)
    if spec.path == "/generate" and "text" in body and "input_ids" in body:  # exactly one prompt, mostly
        del body[draw(st.sampled_from(["text", "input_ids"]))]
    return body


@st.composite
def mutated(draw: Any, spec: RouteSpec, kind: str) -> Any:
    """A valid body broken one way (the module docstring's kinds)."""
    body = draw(valid_body(spec))
    keys = sorted(body) or sorted(spec.fields) or ["x"]
    if kind == "not_object":
        return draw(st.one_of(json_scalars, st.lists(json_values, max_size=3)))
    if kind == "wrong_type":
        body[draw(st.sampled_from(keys))] = draw(json_values)
    elif kind == "missing":
        for key in draw(st.lists(st.sampled_from(keys), max_size=len(keys), unique=True)):
            body.pop(key, None)
    elif kind == "extra":
        body.update(draw(st.dictionaries(st.text(max_size=10), json_values, min_size=1, max_size=3)))
    elif kind == "huge":
        body[draw(st.sampled_from(keys))] = draw(st.sampled_from(EXTREME_NUMBERS))
        if "sampling_params" in spec.fields:
            body["sampling_params"] = {draw(st.sampled_from(["max_new_tokens", "temperature", "top_k", "seed", "min_p"])): draw(st.sampled_from(EXTREME_NUMBERS))}
    else:  # unicode
        body[draw(st.sampled_from(keys))] = draw(st.sampled_from(HOSTILE_TEXT) | st.text(max_size=30))
    return body


def hostile_headers() -> st.SearchStrategy:
    names = st.sampled_from(["Authorization", "X-SMG-Routing-Key", "x-session-id", "Accept-Encoding", "Expect", "Connection",
                             "Accept", "Cookie", "X-Forwarded-For", "Range", "If-None-Match", "X-Fuzz"])  # fmt: skip
    values = st.sampled_from(["Bearer x", "Bearer " + "a" * 9000, "", "gzip;q=0", "100-continue", "close", "bytes=0-1,0-1",
                              "*/*"]) | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip)  # fmt: skip
    return st.dictionaries(names, values, min_size=1, max_size=3)  # what HTTP allows (h11 refuses to send the rest)


_BOMBS: dict[int, bytes] = {}


def gzip_bomb(limit: int) -> bytes:
    """A gzip body of spaces that inflates to twice ``limit`` (made once per limit: ~1/1000 of it)."""
    if limit not in _BOMBS:
        _BOMBS[limit] = gzip.compress(b" " * (2 * limit), compresslevel=9)
    return _BOMBS[limit]
