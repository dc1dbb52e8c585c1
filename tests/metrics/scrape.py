"""Reading /metrics the way Prometheus does: prometheus-client's own text parser."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: `value(sample, **labels)` sums the samples of that name whose labels include
    `labels` (0.0 when there is none)."""

    def __init__(self, text: str):
        self.samples = [s for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def value(self, sample: str, **labels: str) -> float:
        return sum(s.value for s in self.samples if s.name == sample
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def buckets(self, histogram: str, **labels: str) -> dict[float, float]:
        """Cumulative bucket counts by upper bound."""
        return {float(s.labels["le"]): s.value for s in self.samples
                if s.name == histogram + "_bucket"
                and all(s.labels.get(k) == v for k, v in labels.items())}

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


async def scrape(url: str) -> Scrape:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(url)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
