"""The scrape's text format (each series' name and labels formatted once, kept between
scrapes) writes exactly what prometheus-client's ``generate_latest`` writes, for every kind
of metric and for labels that need escaping, and follows the values as they change."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.metrics_core import GaugeHistogramMetricFamily, Metric

from app.observability.prometheus import _TextFormat


class _Stamped:
    """A custom collector: samples with timestamps, and a gauge histogram (its ``_gsum`` and
    ``_gcount`` go under gauges of their own in the text format)."""

    def __init__(self) -> None:
        self.value = 1.0

    def collect(self) -> Iterator[Metric]:
        stamped = Metric("stamped", "Sampled at a time.", "gauge")
        stamped.add_sample("stamped", {"at": "now"}, self.value, timestamp=1700000000.25)
        yield stamped
        family = GaugeHistogramMetricFamily("queue_wait", "Waiting now.", labels=["queue"])
        family.add_metric(["gpu"], [("1.0", self.value), ("+Inf", 2 * self.value)], 3.5)
        yield family


def test_the_text_format_writes_what_the_librarys_does() -> None:
    registry = CollectorRegistry()
    requests = Counter("req", "Requests.\nBy route.", ["route", "status"], registry=registry)
    latency = Histogram("lat", "Latency \\ seconds.", ["route"], registry=registry)
    busy = Gauge("busy", "In flight.", registry=registry)
    sizes = Summary("size", "Body sizes.", ["kind"], registry=registry)
    Info("build", "The build.", registry=registry).info({"version": "1.0", "commit": "abc"})
    state = Enum("phase", "Phase.", states=["idle", "busy"], registry=registry)
    stamped = _Stamped()
    registry.register(stamped)
    format_ = _TextFormat()
    odd = 'a "quoted" \\ back\nslash'
    for step in (1, 2, 7):  # the second and third scrapes use what the first formatted
        requests.labels("/runs/{run_id}", "200").inc(step)
        requests.labels(odd, "404").inc()
        latency.labels("/runs").observe(0.003 * step)
        busy.set(step * 1e7)  # Go's exponent form past 1e6
        sizes.labels("json").observe(float(step))
        state.state("busy" if step % 2 else "idle")
        stamped.value = step / 3
        ours = format_(registry)
        assert ours == generate_latest(registry)
        assert b'req_total{route="a \\"quoted\\" \\\\ back\\nslash",status="404"}' in ours
    assert b"\nbusy 7e+07\n" in ours
    assert b'\nstamped{at="now"} 2.3333333333333335 1700000000250\n' in ours
