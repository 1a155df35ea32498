"""A server's Prometheus ``/metrics``, read with prometheus_client's parser and mapped to telemetry names.

SGLang (``--enable-metrics``), vLLM, llama-server (``--metrics``) and ``expertdesk serve`` publish counters and gauges
under their own names (``sglang:generation_tokens_total``, ``vllm:num_requests_waiting``,
``expertdesk_cache_hits_total``). ``REMOTE_METRICS`` maps each telemetry quantity to the
names servers use for it; ``remote_telemetry`` says which of them a server offers and
which it does not, so the telemetry panel charts the first and names the second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.remote.endpoint import metrics_url

log = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RemoteMetric:
    """One telemetry quantity: its snapshot key, its title, and the sample names servers publish it under."""

    key: str
    title: str
    names: tuple[str, ...]


#: What the telemetry panel knows how to show, in its order. The expert-cache and SSD
#: quantities exist only on an ExpertDesk server (a GPU server holds every weight in VRAM).
REMOTE_METRICS = (
    RemoteMetric("cache_hits", "expert cache hits", ("expertdesk_cache_hits_total",)),
    RemoteMetric("cache_misses", "expert cache misses", ("expertdesk_cache_misses_total",)),
    RemoteMetric("pack_read_bytes", "SSD bytes read", ("expertdesk_ssd_read_bytes_total",)),
    RemoteMetric("cache_bytes", "expert cache size", ("expertdesk_cache_bytes",)),
    RemoteMetric("server_tokens_generated", "tokens generated",
                 ("expertdesk_tokens_generated_total", "vllm:generation_tokens_total",
                  "sglang:generation_tokens_total", "llamacpp:tokens_predicted_total")),
    RemoteMetric("server_requests", "requests",
                 ("expertdesk_requests_total", "vllm:request_success_total", "sglang:num_requests_total")),
    RemoteMetric("queue_depth", "queue depth",
                 ("expertdesk_queue_depth", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
                  "llamacpp:requests_deferred")),
    RemoteMetric("requests_running", "requests running",
                 ("expertdesk_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
                  "llamacpp:requests_processing")),
    RemoteMetric("server_tok_s", "server decode tok/s",
                 ("expertdesk_decode_tokens_per_second", "sglang:gen_throughput",
                  "llamacpp:predicted_tokens_seconds")),
    RemoteMetric("kv_cache_usage", "KV cache usage",
                 ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                  "llamacpp:kv_cache_usage_ratio")),
    RemoteMetric("prefix_cache_hit_rate", "prefix cache hit rate", ("sglang:cache_hit_rate",)),
)


def parse_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, summed over its labels: {sample name: value}.

    ValueError when the text is not the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    return samples


@dataclass(frozen=True)
class RemoteTelemetry:
    """What one scrape gave: values by telemetry key, and the titles offered and missing."""

    values: dict[str, float] = field(default_factory=dict)
    offered: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()


def remote_telemetry(samples: dict[str, float]) -> RemoteTelemetry:
    """Map parsed samples to the telemetry keys (vLLM's prefix-cache counters become a hit rate)."""
    values: dict[str, float] = {}
    hits, queries = samples.get("vllm:prefix_cache_hits_total"), samples.get("vllm:prefix_cache_queries_total")
    if hits is not None and queries:
        values["prefix_cache_hit_rate"] = hits / queries
    for metric in REMOTE_METRICS:
        found = next((samples[name] for name in metric.names if name in samples), None)
        if found is not None and metric.key not in values:
            values[metric.key] = found
    offered = tuple(m.title for m in REMOTE_METRICS if m.key in values)
    missing = tuple(m.title for m in REMOTE_METRICS if m.key not in values)
    return RemoteTelemetry(values, offered, missing)


def _telemetry_of(status: int, text: str, url: str) -> RemoteTelemetry | None:
    if status != 200:
        log.info("%s answered %s: no Prometheus metrics", url, status)
        return None
    try:
        samples = parse_samples(text)
    except ValueError as exc:
        log.info("%s is not Prometheus text (%s)", url, exc)
        return None
    return remote_telemetry(samples) if samples else None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_metrics_sync(base_url: str, api_key: str | None = None,
                       timeout_s: float = METRICS_TIMEOUT_S) -> RemoteTelemetry | None:
    """One scrape of the server's /metrics; None when it has none (or cannot be read)."""
    import httpx

    url = metrics_url(base_url)
    try:
        response = httpx.get(url, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.info("no metrics from %s: %s", url, exc)
        return None
    return _telemetry_of(response.status_code, response.text, url)


async def fetch_metrics(client, base_url: str, api_key: str | None = None) -> RemoteTelemetry | None:
    """The same scrape with an ``httpx.AsyncClient`` (the remote service's poller)."""
    import httpx

    url = metrics_url(base_url)
    try:
        response = await client.get(url, headers=_headers(api_key), timeout=METRICS_TIMEOUT_S)
    except httpx.HTTPError as exc:
        log.info("no metrics from %s: %s", url, exc)
        return None
    return _telemetry_of(response.status_code, response.text, url)


_FRACTIONS = ("kv_cache_usage", "prefix_cache_hit_rate")  # shown as percentages


def describe_remote_metrics(runtime: dict) -> str:
    """One paragraph for the telemetry panel: what the server's /metrics offer now, and what they do not.

    `runtime` is ``RemoteService.snapshot()["runtime"]``; "" for a local model.
    """
    info = runtime.get("remote_metrics")
    if not isinstance(info, dict):
        return ""
    if not info.get("available"):
        return (f"This server publishes no Prometheus metrics ({info.get('url')} did not answer with them): the "
                "charts show what this app measures of the replies (decode speed); the server's cache, queue and "
                "SSD traffic are not known.")
    parts = []
    for metric in REMOTE_METRICS:
        value = runtime.get(metric.key)
        if isinstance(value, (int, float)):
            parts.append(f"{metric.title} {value:.1%}" if metric.key in _FRACTIONS else f"{metric.title} {value:,.6g}")
    missing = ", ".join(info.get("missing") or ()) or "nothing"
    if not parts:
        return (f"The server's /metrics ({info.get('url')}) hold none of the quantities this panel knows "
                f"({missing}); the charts show what this app measures of the replies.")
    return f"From the server's /metrics: {'; '.join(parts)}. Not offered by this server: {missing}."
