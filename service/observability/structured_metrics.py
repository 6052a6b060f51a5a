"""Structured output's Prometheus families (docs/METRICS.md): constrained requests by kind, compile time,
mask time per decode batch, and refusals by reason."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFIX = "reformer_"
# service/text/structured/grammars.py's ConstraintKind and RefusalReason: every series starts at zero
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
REFUSALS = ("invalid", "too_large", "timeout")
# compiling takes from well under a millisecond (a cache-sized schema) to the compile timeout; masks from
# microseconds (a byte vocabulary) to milliseconds (a large one)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MASK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class StructuredMetrics:
    """Registered on the service's registry; its series stay 0 until a request asks for structured output."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            PREFIX + "structured_requests", "Generation requests with a structured-output constraint, by kind.",
            ["kind"], registry=registry)
        self.compile_time = Histogram(
            PREFIX + "structured_compile_seconds", "Time compiling a constraint not in the grammar cache.",
            buckets=COMPILE_BUCKETS, registry=registry)
        self.mask_time = Histogram(
            PREFIX + "structured_mask_seconds", "Time computing the allowed tokens of one batch's constrained "
            "rows (a decode step's overlaps the model's step).", buckets=MASK_BUCKETS, registry=registry)
        self.refused = Counter(
            PREFIX + "structured_refused", "Constraints refused, by reason: invalid (the engine cannot compile "
            "it), too_large (over the size limit), timeout (compiling outlasted the limit).", ["reason"],
            registry=registry)
        for kind in KINDS:
            self.requests.labels(kind)
        for reason in REFUSALS:
            self.refused.labels(reason)
