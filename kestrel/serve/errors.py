"""Errors the HTTP layer answers with, as OpenAI error bodies: {"error": {"message", "type", "param", "code"}}.

Status codes: 400 for anything wrong in the request (invalid JSON, wrong types, unknown or unsupported fields,
out-of-range values, a prompt or max_tokens beyond the context), like OpenAI's own API; 401 bad or missing API
key; 404 unknown model or route; 405 wrong method; 503 overloaded (with Retry-After) or engine dead; 500 a bug.
"""

from __future__ import annotations

from pydantic import ValidationError

_TYPE_BY_STATUS = {401: "authentication_error", 404: "not_found_error"}
# The code of an error the HTTP framework raised (an unknown route, a wrong method) by its status.
CODE_BY_STATUS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}

# How a field that accepts several JSON shapes is described when none of them matches.
_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
    "input": "a string or a list of messages",
}
# Fields of a string or a structure (the Responses API's `input`, a list of items; `tool_choice`, an object): where
# a structure was sent, its own flaw is named, not the string branch's ("should be a valid string", "expected
# 'none', 'auto' or 'required'")
_STRUCTURE_FIRST = {"input", "tool_choice"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = (
            type
            or _TYPE_BY_STATUS.get(status)
            or ("invalid_request_error" if status < 500 else "server_error")
        )
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by status (its Messages API's routes answer in its shape)
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(e: APIError) -> dict:
    """`e` as Anthropic's error body: {"type": "error", "error": {"type", "message"}}; it has no `param`, so the
    message names the field where it does not already."""
    kind = _ANTHROPIC_TYPE.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400; `code` says what kind of wrong (None: invalid_value, a value out of its range or fields that
    contradict each other), so that a client can tell the kinds apart without reading the message."""
    return APIError(400, message, param=param, code=code or "invalid_value")


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (e.g. `messages.0.content`)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object", code="invalid_json")
    top = _field_path(first["loc"])
    if top and top[0] in _STRUCTURE_FIRST:
        errors = [err for err in errors if len(_field_path(err["loc"])) > 1] or errors
        first = errors[0]
    # A content part of another type (image_url, ...) is clearer reported as itself than as a type mismatch.
    first = next((err for err in errors if err["type"] == "literal_error"), first)
    path = _field_path(first["loc"])
    param = ".".join(map(str, path)) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {param!r}", param=param, code="unknown_parameter")
    if (
        first["type"] == "union_tag_invalid"
    ):  # an item of a kind this server lacks (the Responses API's input)
        ctx = first.get("ctx", {})
        param = f"{param}.type" if param else "type"
        message = f"{param}: {ctx.get('tag')!r} is not supported by this server; expected {ctx.get('expected_tags')}"
        return bad_request(message, param=param, code="unsupported_value")
    if first["type"] == "missing":
        return bad_request(f"missing required field {param!r}", param=param, code="missing_parameter")
    # An image part, a tool message: name what was sent, not only what is allowed.
    if first["type"] == "literal_error":
        expected = first.get("ctx", {}).get("expected", "another value")
        given = repr(first["input"])
        given = given if len(given) <= 64 else given[:61] + "..."
        message = f"{param}: {given} is not supported by this server; expected {expected}"
        return bad_request(message, param=param, code="unsupported_value")
    # A value that matches none of a union's shapes: pydantic reports every branch; name the field once.
    union = [err for err in errors if _field_path(err["loc"])[: len(path)] == path]
    name = next((p for p in reversed(path) if isinstance(p, str)), None)
    if len(union) > 1 and name in _UNION_SHAPES:
        return bad_request(f"{param}: expected {_UNION_SHAPES[name]}", param=param, code="invalid_type")
    return bad_request(f"{param}: {first['msg']}", param=param, code="invalid_type")


def _field_path(loc: tuple) -> tuple:
    """Drop pydantic's union-branch tags ('str', 'list[int]', 'TextPart', ...) from an error location, and the
    Responses API's item kinds where they tag an item of its `input` (`input.3.function_call.arguments`)."""
    path = [p for p in loc if not (isinstance(p, str) and ("[" in p or p[:1].isupper() or p in _BRANCH_TAGS))]
    return tuple(
        p
        for k, p in enumerate(path)
        if not (p in _ITEM_KINDS and k >= 2 and isinstance(path[k - 1], int) and path[k - 2] == "input")
    )


_BRANCH_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "literal", "function-after"}
_ITEM_KINDS = {"message", "function_call", "function_call_output", "reasoning"}
