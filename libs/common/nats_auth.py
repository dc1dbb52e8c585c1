"""How a service proves itself to NATS: user and password, a token or an nkey seed, and TLS.

Rules:
- `NatsSecurity.from_settings(settings)` is the one place these settings are read; `Bus.connect`
  passes `connect_options()` to nats-py, so every service's connection (and the launcher's
  probe) is made the same way. Nothing set = an open connection (a private loopback server).
- Secrets stay `SecretStr` until handed to nats-py; `describe()` names the method, never the
  secret, for logs.
- TLS: `tls_ca` set = the server's certificate must chain to it (hostname checked); a client
  certificate and key are sent when given (servers with `verify: true`).
"""

from __future__ import annotations

import importlib.util
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from flotilla.libs.common.settings import CommonSettings


@dataclass(frozen=True)
class NatsSecurity:
    user: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    nkey_seed: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> NatsSecurity:
        security = cls(settings.nats_user, settings.nats_password, settings.nats_token,
                       settings.nats_nkey_seed, settings.nats_tls_ca, settings.nats_tls_cert,
                       settings.nats_tls_key)
        security.check()
        return security

    def check(self) -> None:
        """Refuse settings that cannot work, at start-up, with the setting's name."""
        if (self.user is None) != (self.password is None):
            raise ValueError("FLOTILLA_NATS_USER and FLOTILLA_NATS_PASSWORD go together")
        methods = [self.user is not None, self.token is not None, self.nkey_seed is not None]
        if sum(methods) > 1:
            raise ValueError("set one NATS authentication: a user and password, a token or "
                             "an nkey seed")
        if self.nkey_seed is not None and importlib.util.find_spec("nkeys") is None:
            raise ValueError("FLOTILLA_NATS_NKEY_SEED needs the `nkeys` package "
                             "(pip install 'nats-py[nkeys]')")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("FLOTILLA_NATS_TLS_CERT and FLOTILLA_NATS_TLS_KEY go together")
        for name, path in (("NATS_NKEY_SEED", self.nkey_seed), ("NATS_TLS_CA", self.tls_ca),
                           ("NATS_TLS_CERT", self.tls_cert), ("NATS_TLS_KEY", self.tls_key)):
            if path is not None and not path.is_file():
                raise ValueError(f"FLOTILLA_{name}: no file at {path}")

    def describe(self) -> str:
        how = ("user " + self.user if self.user else "token" if self.token
               else "nkey" if self.nkey_seed else "no authentication")
        return how + (", TLS" if self.tls_ca or self.tls_cert else "")

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_ca is None and self.tls_cert is None:
            return None
        context = ssl.create_default_context(
            cafile=str(self.tls_ca) if self.tls_ca else None)
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's `connect`."""
        options: dict[str, Any] = {}
        if self.user is not None and self.password is not None:
            options |= {"user": self.user, "password": self.password.get_secret_value()}
        if self.token is not None:
            options["token"] = self.token.get_secret_value()
        if self.nkey_seed is not None:
            options["nkeys_seed"] = str(self.nkey_seed)
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        return options
