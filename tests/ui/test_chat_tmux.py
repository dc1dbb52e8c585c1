"""`flotilla chat` in a real terminal (tmux): Ctrl-C stops a streaming answer and the gateway
cancels it, Ctrl-C at the prompt starts a new chat, `/exit` quits with status 0."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


async def tmux(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec("tmux", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return out.decode()


async def screen_until(session: str, text: str, timeout: float = 20, times: int = 1) -> str:
    """Waits until `text` is on the screen (with its history) `times` times."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        screen = await tmux("capture-pane", "-p", "-J", "-t", session, "-S", "-200")
        if screen.count(text) >= times or loop.time() > deadline:
            assert screen.count(text) >= times, f"{text!r} not on the screen:\n{screen}"
            return screen
        await asyncio.sleep(0.1)


async def test_ctrl_c_stops_the_answer_and_exit_quits(gateway, models, tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    fake = models[0]
    session = f"flotilla-chat-{uuid.uuid4().hex[:6]}"
    status = tmp_path / "status"
    command = (f"cd {shlex.quote(str(ROOT))} && PYTHONPATH=. {shlex.quote(sys.executable)} -m "
               f"flotilla.services.chat --url {gateway.url}/v1 --model {fake.model}; "
               f"echo $? > {status}; sleep 60")
    await tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "50", command)
    try:
        await screen_until(session, "chatting with")
        await tmux("send-keys", "-t", session, "slow", "Enter")
        await screen_until(session, "w3 ")
        rid = fake.requests[-1].request_id
        await tmux("send-keys", "-t", session, "C-c")
        await screen_until(session, "stopped]")
        for _ in range(50):
            if fake.cancelled(rid):
                break
            await asyncio.sleep(0.05)
        assert fake.cancelled(rid), "Ctrl-C must close the stream and the gateway cancel"

        await tmux("send-keys", "-t", session, "hello", "Enter")
        await screen_until(session, "TTFT", times=2)  # the answer's numbers: it has ended
        assert "Hello world !" in await screen_until(session, "> ", times=3)
        history = fake.requests[-1].messages
        assert [m["role"] for m in history] == ["user", "assistant", "user"]
        assert history[1]["content"].startswith("w0 w1 w2")  # the stopped answer, kept

        await tmux("send-keys", "-t", session, "C-c")  # at the prompt: a new chat
        await screen_until(session, "(new chat)")
        await tmux("send-keys", "-t", session, "hello", "Enter")
        for _ in range(50):
            if fake.requests[-1].messages == [{"role": "user", "content": "hello"}]:
                break
            await asyncio.sleep(0.05)
        assert fake.requests[-1].messages == [{"role": "user", "content": "hello"}]

        await screen_until(session, "TTFT", times=3)
        await tmux("send-keys", "-t", session, "/exit", "Enter")
        for _ in range(100):
            if status.exists() and status.read_text().strip():
                break
            await asyncio.sleep(0.1)
        assert status.read_text().strip() == "0"
    finally:
        await tmux("kill-session", "-t", session)
