"""The router's Prometheus metrics: replica state read at scrape time, requests counted as they go.
A registry per app, so several routers can live in one process (tests)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k3.route.admission import LONG, SHORT, Admission
from k3.route.replicas import ReplicaSet

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _FleetCollector:
    def __init__(self, replicas: ReplicaSet, admission: Admission):
        self.replicas, self.admission = replicas, admission

    def collect(self):
        up = GaugeMetricFamily("k3_route_replica_up", "1 while the replica passes its health checks", labels=["replica"])
        restarts = CounterMetricFamily("k3_route_replica_restarts", "Times the replica came back as a new process "
                                       "(empty prefix cache)", labels=["replica"])
        inflight = GaugeMetricFamily("k3_route_inflight_prompt_tokens", "Prompt tokens in flight, by replica and "
                                     "admission class", labels=["replica", "class"])
        for url, r in self.replicas.replicas.items():
            up.add_metric([url], 1 if r.up else 0)
            restarts.add_metric([url], r.restarts)
            for cls in (SHORT, LONG):
                inflight.add_metric([url, cls], self.admission.used.get((url, cls), 0))
        prefilling = GaugeMetricFamily("k3_route_prefilling", "Requests sent and not yet at their first token, by "
                                       "replica and admission class", labels=["replica", "class"])
        for url, r in self.replicas.replicas.items():
            for cls in (SHORT, LONG):
                prefilling.add_metric([url, cls], self.admission.prefilling.get((url, cls), 0))
        waiting = GaugeMetricFamily("k3_route_waiting", "Requests waiting for their admission budget", labels=["class"])
        for cls in (SHORT, LONG):
            waiting.add_metric([cls], self.admission.waiting(cls))
        yield from (up, restarts, inflight, prefilling, waiting)


class RouteMetrics:
    def __init__(self, replicas: ReplicaSet, admission: Admission):
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(replicas, admission))
        self.responses = Counter("k3_route_responses", "Replica responses passed on, by replica and status",
                                 ["replica", "status"], registry=self.registry)
        self.rejected = Counter("k3_route_rejected", "Requests the router refused itself, by status", ["status"],
                                registry=self.registry)
        self.failovers = Counter("k3_route_failovers", "Requests moved to their next replica, by what failed "
                                 "(connect, unavailable, response, stream, waiting)", ["reason"], registry=self.registry)
        self.stream_restarts = Counter("k3_route_stream_restarts", "Streams cut by a replica failure, by outcome "
                                       "(resumed: the client saw nothing; error: the documented error chunk)",
                                       ["outcome"], registry=self.registry)
        self.ttft = Histogram("k3_route_time_to_first_token_seconds", "Streams: arrival to the first generated text, "
                              "by admission class", ["class"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queued = Histogram("k3_route_admission_wait_seconds", "Time waited for the admission budget, by class",
                                ["class"], buckets=_LATENCY_BUCKETS, registry=self.registry)
