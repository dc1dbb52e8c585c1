"""`flotilla up` turns every service's /metrics on: each URL in the state file answers with that
service's metrics (prometheus-client's parser), and a request shows up in the gateway's and the
engine's counts."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import MODEL, SuiteHandle
from tests.metrics.scrape import Scrape

EXPECTED = {"gateway": "flotilla:http_requests_total",
            "tokenizer": "flotilla:tokenizer_streams_running",
            "engine": "flotilla:num_requests_running",
            "tools": "process_cpu_seconds_total"}


def test_every_service_serves_its_metrics(suite: SuiteHandle, http: httpx.Client) -> None:
    urls = suite.state()["metrics_urls"]
    assert set(urls) == set(EXPECTED)
    before = Scrape(httpx.get(urls["engine"], timeout=10).text)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "One, two,",
                                           "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    generated = r.json()["usage"]["completion_tokens"]
    scrapes = {name: Scrape(httpx.get(url, timeout=10).text) for name, url in urls.items()}
    for name, metric in EXPECTED.items():
        assert metric in scrapes[name].names(), (name, metric)
    assert scrapes["gateway"].value("flotilla:http_requests_total",
                                    endpoint="/v1/completions", status="200") >= 1
    engine_generated = (scrapes["engine"].value("flotilla:generation_tokens_total")
                        - before.value("flotilla:generation_tokens_total"))
    assert engine_generated >= generated  # other e2e tests may run beside it, never fewer
