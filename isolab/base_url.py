"""Owns reading the address of an OpenAI-compatible server, as the black-box tools take it (`isolab
probe` and `isolab doctor` --base-url, `isolab bench --url`): http(s) with a host, or one sentence;
and how those tools put what a server said into that sentence (`one_line`, `failure`)."""

from __future__ import annotations

import httpx

from isolab.errors import InvalidRequestError


def check_base_url(base_url: str, option: str = "--base-url") -> httpx.URL:
    """The URL, or InvalidRequestError naming `option` (ftp:// and a bare host:port were 'cannot reach
    ... UnsupportedProtocol' after the tool had started)."""
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{option} {base_url!r} is not a URL ({exc})", field=option.lstrip("-")) from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidRequestError(f"{option} {base_url!r} is not an http:// or https:// URL, e.g. http://127.0.0.1:8000",
                                  field=option.lstrip("-"))
    if url.port is not None and not 0 < url.port < 65536:  # (it was an OverflowError's traceback at connect)
        raise InvalidRequestError(f"{option} {base_url!r} is not a URL (port {url.port}: a port is 1 to 65535)",
                                  field=option.lstrip("-"))
    path = url.path.rstrip("/")
    endpoint = next((e for e in ENDPOINTS if path.endswith(e)), None)
    if endpoint is not None:  # (it was '.../v1/completions/v1/models gave no model (HTTP 404)')
        root = str(url.copy_with(path=path[: -len(endpoint)] or "/", query=None, fragment=None)).rstrip("/")
        raise InvalidRequestError(f"{option} {base_url!r} names the endpoint {endpoint}: give the server's address, "
                                  f"{root}", field=option.lstrip("-"))
    return url


ENDPOINTS = ("/chat/completions", "/completions", "/models", "/embeddings", "/health", "/metrics")


def one_line(text: str) -> str:
    """A server's text (an HTML error page, say) as one line for a one-sentence error."""
    return " ".join(text.split())


def failure(exc: BaseException) -> str:
    """A request that got no HTTP answer, for a sentence: 'ReadTimeout: no answer' when httpx says nothing."""
    return f"{type(exc).__name__}: {one_line(str(exc)) or 'no answer'}"
