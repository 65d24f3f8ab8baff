"""The /metrics endpoint: a minimal HTTP/1.1 server on the event loop, for Prometheus to scrape.

prometheus_client's own ``start_http_server`` serves from a thread, which could not refresh the
engine's stats snapshot (that needs the event loop) before answering. This one answers
``GET /metrics`` (and ``/``) with one response per connection, then closes it; a scrape
refreshes the engine snapshot first, waiting at most ``refresh_timeout_s`` for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = structlog.get_logger(__name__)

_MAX_HEADER_BYTES = 16 * 1024
_READ_TIMEOUT_S = 10.0
_PATHS = ("/metrics", "/")


async def start_metrics_server(host: str, port: int, registry: CollectorRegistry,
                               before_scrape: Callable[[], Awaitable[None]] | None = None) -> asyncio.Server:
    """Listen on ``host``:``port`` (``port`` 0: any free port); raises OSError if it cannot."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _serve_one(reader, writer, registry, before_scrape)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError,
                ValueError):
            pass  # a client that went away or spoke something else than HTTP: nothing to answer
        except Exception as exc:  # a collector failing must not take the endpoint down
            log.warning("metrics request failed", error=repr(exc))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    bind_host = host.strip("[]") or None  # "[::]" -> "::"; "" -> every interface
    return await asyncio.start_server(handle, bind_host, port, limit=_MAX_HEADER_BYTES)


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, registry: CollectorRegistry,
                     before_scrape: Callable[[], Awaitable[None]] | None) -> None:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, target, _version = request_line.split(" ", 2)
    headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    path = target.split("?", 1)[0]
    content_type = "text/plain; charset=utf-8"
    if method not in ("GET", "HEAD"):
        status, body = "405 Method Not Allowed", b"only GET\n"
    elif path not in _PATHS:
        status, body = "404 Not Found", b"metrics are at /metrics\n"
    else:
        if before_scrape is not None:
            await before_scrape()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        status, body = "200 OK", encoder(registry)
    head_out = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
    writer.write(head_out if method == "HEAD" else head_out + body)
    await writer.drain()
