"""A closed bus: nats-servers started with generated configs (a token; users; TLS with a
self-signed certificate made here). A plain nats-py client without the credentials can neither
subscribe to request subjects nor publish cancels; the gateway and a tokenizer with them serve
a chat completion end to end."""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import ipaddress
import secrets
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pydantic import SecretStr

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.nats_auth import NatsSecurity
from flotilla.libs.common.settings import CommonSettings
from flotilla.services.gateway.service import GatewayService
from flotilla.services.launcher.nats_server import NatsServer
from tests.gateway.conftest import chat, gateway_settings
from tests.gateway.fakes import FakeTokenizer


async def _refused(url: str, **options: object) -> str:
    """The error a plain client gets for connecting (and subscribing, publishing) with
    `options`; fails the test when it gets through."""
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2, **options)
    except Exception as exc:  # the server ends the connection at CONNECT
        return str(exc) or type(exc).__name__
    try:
        await nc.subscribe(subjects.tokenizer_generate("any"))
        await nc.publish(subjects.CANCEL, b"{}")
        await nc.flush(timeout=2)
    except Exception as exc:
        return str(exc) or type(exc).__name__
    finally:
        await nc.close()
    raise AssertionError(f"a client with {sorted(options)} got onto the closed bus")


async def _serve_one_chat(url: str, security: NatsSecurity) -> None:
    """A tokenizer (fake, on the real bus) and a real gateway, both with `security`: one chat
    completion through them."""
    bus = await Bus.connect(url, "test-closed-bus", security=security)
    model = f"closed-{secrets.token_hex(4)}"
    tokenizer = FakeTokenizer(bus, model)
    await tokenizer.start()
    gateway = GatewayService(gateway_settings(nats_url=url), bus)
    await gateway.start()
    try:
        for _ in range(100):
            if await gateway.state.registry.get(model) is not None:
                break
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            r = await client.post("/v1/chat/completions", json=chat(model, "quick"))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "ok"
    finally:
        await gateway.stop()
        await tokenizer.stop()
        await bus.close()


@pytest.fixture(scope="module")
def token_server() -> AsyncIterator[tuple[NatsServer, str]]:
    token = secrets.token_urlsafe(32)
    with NatsServer(token=token) as server:
        yield server, token


async def test_token_bus_refuses_strangers_and_serves_with_the_token(
        token_server: tuple[NatsServer, str]) -> None:
    server, token = token_server
    assert token not in " ".join(server.argv())  # never on the command line
    assert oct(server.config_file.stat().st_mode & 0o777) == "0o600"  # type: ignore[union-attr]
    assert "uthorization" in await _refused(server.url)
    assert "uthorization" in await _refused(server.url, token="wrong")
    assert "uthorization" in await _refused(server.url, user="flotilla", password=token)
    await _serve_one_chat(server.url, NatsSecurity(token=SecretStr(token)))


async def test_per_service_users_from_settings() -> None:
    password = secrets.token_urlsafe(24)
    users = [f'{{user: {name}, password: "{password}{name}"}}' for name in ("gateway", "tok")]
    config = f"authorization {{ users = [ {', '.join(users)} ] }}\n"
    with NatsServer(config=config) as server:
        assert "uthorization" in await _refused(server.url)
        assert "uthorization" in await _refused(server.url, user="gateway", password="x")
        settings = CommonSettings(nats_url=server.url, nats_user="gateway",
                                  nats_password=password + "gateway")
        await _serve_one_chat(server.url, NatsSecurity.from_settings(settings))


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost, signed by itself (so it is its own CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flotilla-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "server.pem", directory / "server-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_tls_and_token(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    token = secrets.token_urlsafe(32)
    tls = f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n'
    with NatsServer(token=token, config=tls) as server:
        url = f"tls://127.0.0.1:{server.port}"
        assert await _refused(server.url, token=token)  # TLS required: plain text refused
        untrusted = ssl.create_default_context()  # the system CAs do not know our certificate
        assert await _refused(url, token=token, tls=untrusted)
        settings = CommonSettings(nats_url=url, nats_token=token, nats_tls_ca=cert)
        await _serve_one_chat(url, NatsSecurity.from_settings(settings))


def test_security_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        NatsSecurity.from_settings(CommonSettings(nats_user="gateway"))
    with pytest.raises(ValueError, match="one NATS authentication"):
        NatsSecurity.from_settings(CommonSettings(nats_user="u", nats_password="p",
                                                  nats_token="t"))
    with pytest.raises(ValueError, match="no file"):
        NatsSecurity.from_settings(CommonSettings(nats_tls_ca=Path("/nonexistent/ca.pem")))
    if importlib.util.find_spec("nkeys") is None:
        seed = Path(__file__)  # any file: the missing package is named first
        with pytest.raises(ValueError, match="nkeys"):
            NatsSecurity.from_settings(CommonSettings(nats_nkey_seed=seed))
    assert NatsSecurity.from_settings(CommonSettings()).connect_options() == {}
    described = NatsSecurity(token=SecretStr("s3cret")).describe()
    assert "s3cret" not in described and "token" in described
