"""uvicorn's httptools HTTP/1.1 protocol with bounds on the request head.

httptools (llhttp, the parser uvicorn picks when it is installed) bounds nothing: a 10 MB
header value was buffered whole and handed to the app. (uvicorn's h11 protocol has
`h11_max_incomplete_event_size`, 16 KiB, but no count of fields, and costs more CPU per
request.) Limits enforced here, while the head is parsed and before any app code runs:
- `max_header_bytes`: the bytes read while a request's head (request line and headers) is not
  yet complete. Counted per socket read, so a head is refused at most one read (64-256 KiB)
  past the limit; a read in which a head completes, or that finishes one request and starts
  the next, is not counted (the count can only be low by one read, never high).
- `max_headers`: header fields in one request.
Past either limit the client gets `431 Request Header Fields Too Large` with OpenAI's error
envelope and the connection closes at once: nothing more of it is read or buffered, and the
app never sees the request.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from flotilla.libs.common.errors import envelope
from flotilla.libs.common.messages import ErrorInfo


class _HeadRefused(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that refuses oversized heads (see the module rules). Subclasses made
    by `limited_protocol` set the two limits."""

    max_header_bytes = 64 * 1024
    max_headers = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests the next bytes are a head
        self._head_bytes = 0
        self._header_count = 0
        self._heads_completed = 0
        self._refusal: str | None = None

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        counted, heads = self._in_head, self._heads_completed
        super().data_received(data)
        if (self._refusal is None and self._in_head and counted
                and heads == self._heads_completed):  # the whole read was head bytes
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(f"The request line and headers are larger than this server's "
                             f"limit of {self.max_header_bytes:,} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._refusal = (f"The request has more than this server's limit of "
                             f"{self.max_headers} header fields.")
            raise _HeadRefused()  # stops the parser; uvicorn then calls send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._heads_completed += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._send_431(self._refusal)
        else:
            super().send_400_response(msg)

    def _refuse(self, message: str) -> None:
        self._refusal = message
        self._send_431(message)

    def _send_431(self, message: str) -> None:
        if self.transport.is_closing():
            return
        info = ErrorInfo(status=431, type="invalid_request_error", message=message,
                         code="request_header_fields_too_large")
        body = json.dumps(envelope(info)).encode()
        self.transport.write(b"".join([
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n", body]))
        self.transport.close()


def limited_protocol(max_header_bytes: int, max_headers: int) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`) for these limits."""
    return type("GatewayHttpProtocol", (LimitedHttpToolsProtocol,),
                {"max_header_bytes": max_header_bytes, "max_headers": max_headers})
