"""What the tokenizer service tests share: settings for a service of their own (its fixtures
`service` and `engine` are in conftest.py) and `gateway`, which talks to the service as the
gateway does."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import Admission, TextFrame, TextRequest
from flotilla.libs.common.settings import TokenizerSettings

HELLO = [{"role": "user", "content": "Say hello"}]


def settings_for(model_path: Path, **kw: Any) -> TokenizerSettings:
    return TokenizerSettings(
        model=str(model_path), served_model_name=f"test-tok-{uuid.uuid4().hex[:8]}",
        heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5, request_timeout_s=2.0,
        discovery_interval_s=0.2, template_timeout_s=0.5, **kw)


@dataclass
class Outcome:
    admission: Admission
    frames: list[TextFrame] = field(default_factory=list)
    error: FlotillaError | None = None

    @property
    def text(self) -> str:
        return "".join(f.data.text for f in self.frames if f.kind == "data" and f.data)


def request(kind: str = "chat", **kw: Any) -> TextRequest:
    rid = f"req-{uuid.uuid4().hex[:10]}"
    if kind == "chat":
        kw.setdefault("messages", HELLO)
    return TextRequest(request_id=rid, model="m", kind=kind,  # type: ignore[arg-type]
                       stream_subject=subjects.text_stream(rid), **kw)


async def gateway(bus: Bus, model: str, req: TextRequest, timeout: float = 1.0,
                  on_frame: Any = None) -> Outcome:
    """What the gateway does: reader first, then the request, then read until final/error."""
    req = req.model_copy(update={"model": model})
    reader = await bus.open_reader(req.stream_subject, TextFrame, timeout)
    try:
        admission = await bus.request(subjects.tokenizer_generate(model), req, Admission, 5.0)
        out = Outcome(admission)
        if not admission.accepted:
            return out
        try:
            async for frame in reader:
                out.frames.append(frame)
                if on_frame is not None and await on_frame(frame):
                    break
        except FlotillaError as exc:
            out.error = exc
        return out
    finally:
        await reader.close()
