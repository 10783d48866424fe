"""Prometheus metrics: engine state read at scrape time, latencies observed by the routes.

A registry per app (not the global one), so several servers can live in one process (tests).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k3.serve.engine import LLMEngine
from k3.serve.runner import STEP_KINDS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        e = self.engine
        stats = e.cache.stats
        yield GaugeMetricFamily("k3_requests_running", "Requests being computed", value=len(e.scheduler.running))
        yield GaugeMetricFamily("k3_requests_waiting", "Requests queued", value=len(e.scheduler.waiting))
        yield GaugeMetricFamily("k3_cache_usage", "Fraction of pool pages held by requests", value=e.cache.pool.usage())
        yield CounterMetricFamily("k3_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=stats.query_tokens)
        yield CounterMetricFamily("k3_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=stats.hit_tokens)
        misses = CounterMetricFamily("k3_prefix_cache_misses", "Admissions that reused nothing, by reason",
                                     labels=["reason"])
        for reason, n in stats.miss_reasons.items():
            misses.add_metric([reason], n)
        yield misses
        yield CounterMetricFamily("k3_preemptions", "Requests preempted (recomputed later)",
                                  value=e.scheduler.num_preemptions)
        admission = e.scheduler.admission
        if admission is not None:
            yield CounterMetricFamily("k3_admissions", "Requests let into the engine (re-admissions after a "
                                      "preemption included)", value=admission.admitted)
            yield CounterMetricFamily("k3_admission_deferrals", "Admissions the auto rule held back for lack of "
                                      "projected room", value=admission.deferred)
            yield GaugeMetricFamily("k3_admission_output_ratio", "Share of remaining max_tokens the auto rule "
                                    "reserves per request", value=admission.ratio)
        host = e.cache.host
        if host is not None:
            tiers = CounterMetricFamily("k3_prefix_cache_tier_hits", "Prompt tokens served from the prefix cache, "
                                        "by the tier their pages came from", labels=["tier"])
            tiers.add_metric(["device"], stats.hit_tokens - host.stats.hit_tokens)
            tiers.add_metric(["host"], host.stats.hit_tokens)
            yield tiers
            moved = CounterMetricFamily("k3_host_cache_bytes", "Bytes copied between the device pool and the host "
                                        "tier", labels=["direction"])
            for direction, n in e.runner.transfer.bytes.items():
                moved.add_metric([direction], n)
            yield moved
            yield CounterMetricFamily("k3_host_cache_prefetch_seconds", "Time spent copying prefetched pages "
                                      "to the device (on CUDA: side-stream time, overlapped with a step)",
                                      value=e.runner.transfer.prefetch_seconds)
            yield CounterMetricFamily("k3_host_cache_evictions", "Host-tier pages reused for newer content",
                                      value=host.pool.num_evictions)
            yield GaugeMetricFamily("k3_host_cache_pages", "Pages of the host tier", value=host.pool.num_pages)
        yield CounterMetricFamily("k3_pool_evictions", "Cached pages reused for new content",
                                  value=e.cache.pool.num_evictions)
        steps = CounterMetricFamily("k3_runner_steps", "Model forwards by how they ran (k3.serve.runner.STEP_KINDS)",
                                    labels=["kind"])
        for kind in STEP_KINDS:
            steps.add_metric([kind], e.runner.step_counts[kind])
        yield steps
        if e.vision is not None:
            yield CounterMetricFamily("k3_encoder_images", "Images and video clips run through the vision tower "
                                      "(a prefix-cache hit over one skips it)", value=e.runner.encoder_counts["images"])
            yield CounterMetricFamily("k3_encoder_patches", "Patches run through the vision tower",
                                      value=e.runner.encoder_counts["patches"])
        yield CounterMetricFamily("k3_runner_slot_fills", "Decode steps that refilled the decode slots from pages "
                                  "(the batch changed)", value=e.runner.slot_fills)
        if e.runner.speculator is not None:
            spec = e.runner.spec_counts
            yield CounterMetricFamily("k3_spec_draft_tokens", "Tokens proposed by the speculative draft",
                                      value=spec["drafted"])
            yield CounterMetricFamily("k3_spec_accepted_tokens", "Drafted tokens the model accepted",
                                      value=spec["accepted"])
            yield CounterMetricFamily("k3_spec_verifications", "Sequence-steps that verified drafted tokens",
                                      value=spec["verified"])
            yield GaugeMetricFamily("k3_spec_mean_acceptance_length",
                                    "Tokens emitted per verification: accepted drafts plus the model's own (1 = none "
                                    "accepted)", value=1 + spec["accepted"] / max(spec["verified"], 1))
            yield GaugeMetricFamily("k3_spec_reserved_bytes", "Pool bytes set aside for draft states and KDA replay "
                                    "inputs", value=e.speculation_bytes)


class Metrics:
    def __init__(self, engine: LLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("k3_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("k3_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("k3_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry)
        self.generation_tokens = Counter("k3_generation_tokens", "Generated tokens", registry=self.registry)
        self.requests = Counter("k3_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("k3_requests_rejected", "Requests refused by status code", ["status"],
                                registry=self.registry)
