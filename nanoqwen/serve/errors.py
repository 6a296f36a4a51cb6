"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, for every way a request can
fail, with the matching HTTP status; the server stays up after each. The web framework is imported only
where a response is made, so the engine thread, the prompt layouts and `nanoqwen chat` (which raise or
share APIError) run without fastapi installed."""

from __future__ import annotations

import json

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
    """The JSON body as ``model``, whatever the Content-Type says (curl -d sends form encoding)."""
    from pydantic import ValidationError
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation(e) from None


def _http(_request, exc):
    return APIError(str(exc.detail), status=exc.status_code).response()


def install(app) -> None:
    from starlette.exceptions import HTTPException
    app.add_exception_handler(APIError, lambda _r, e: e.response())
    app.add_exception_handler(HTTPException, _http)
