"""llama-server's ``response_fields``: a client (llama.vim) names the fields of the /infill response it
reads, nested ones by their path; the response then holds only those, each under the name it was asked by
(``"timings/prompt_n"`` is a top-level key). A field that does not exist is left out, as in llama-server."""

from __future__ import annotations


def response_fields(obj: dict, paths: list[str]) -> dict:
    if not paths:
        return obj
    out = {}
    for path in paths:
        value = obj
        for key in path.split("/"):
            if not (isinstance(value, dict) and key in value):
                break
            value = value[key]
        else:
            out[path] = value
    return out
