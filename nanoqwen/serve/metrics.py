"""Prometheus metrics (``GET /metrics``), vLLM-style names under ``nanoqwen_``. One registry per server,
so tests that build several apps in one process do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("nanoqwen_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("nanoqwen_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("nanoqwen_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("nanoqwen_prefix_cache_hit_tokens",
                                     "prompt tokens whose K/V came from the prefix cache", registry=r)
        self.draft_tokens = Counter("nanoqwen_spec_decode_num_draft_tokens",
                                    "draft tokens speculative decoding proposed", registry=r)
        self.accepted_tokens = Counter("nanoqwen_spec_decode_num_accepted_tokens",
                                       "draft tokens the model accepted", registry=r)
        self.cancelled = Counter("nanoqwen_requests_cancelled", "generations stopped because the client left",
                                 registry=r)
        self.ttft = Histogram("nanoqwen_time_to_first_token_seconds",
                              "request received (before parsing) -> first token generated, queue wait included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nanoqwen_inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("nanoqwen_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("nanoqwen_requests_running", "requests the engine is generating (sequences running)",
                             registry=r)
        self.kv_pages = Gauge("nanoqwen_kv_pages", "KV cache pages: held by running sequences, kept for prefix "
                              "reuse, free", ["state"], registry=r)
        self.step_sequences = Histogram("nanoqwen_step_sequences", "sequences in one engine step (batch size)",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.step_rows = Histogram("nanoqwen_step_rows", "rows of one engine step: decode, verify and prompt rows",
                                   buckets=ROW_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
