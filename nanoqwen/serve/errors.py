"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, for every way a request can
fail, with the matching HTTP status; the server stays up after each. The web framework is imported only
where a response is made, so the engine thread, the prompt layouts and `nanoqwen chat` (which raise or
share APIError) run without fastapi installed."""

from __future__ import annotations


TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        from fastapi.responses import JSONResponse
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation(exc) -> APIError:
    """A pydantic ValidationError as a 400 naming the first bad field."""
    err = exc.errors()[0]
    param = ".".join(str(x) for x in err.get("loc", ())) or None
    return APIError(f"{param or 'body'}: {err.get('msg')}", param=param)


async def parse(request, model):
    """The JSON body as ``model``, whatever the Content-Type says (curl -d sends form encoding). pydantic
    parses the bytes itself (its Rust parser: a 4096-id prompt in half the time of json.loads and then
    validating the objects), and strictly: UTF-8 only, no lone surrogate escapes, no NaN, a nesting limit."""
    from pydantic import ValidationError
    from starlette.requests import ClientDisconnect
    try:
        body = await request.body()
    except ClientDisconnect:   # gone, or cut off by the read deadline: nobody reads the answer, no traceback
        raise APIError("the connection closed before the whole body arrived", code="incomplete_body") from None
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(f"the body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}",
                           code="invalid_json") from None
        raise validation(e) from None


def _http(_request, exc):
    return APIError(str(exc.detail), status=exc.status_code).response()


def _fault(_request, exc):
    """Whatever escaped a route (a bug): still OpenAI's object, never a plain-text 500."""
    return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, code="internal_error").response()


def install(app) -> None:
    from starlette.exceptions import HTTPException
    app.add_exception_handler(APIError, lambda _r, e: e.response())
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _fault)
