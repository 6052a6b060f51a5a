"""Observability: Prometheus metrics and their scrape-time collectors (heap, GPU), OpenTelemetry tracing and
its exporter, and structured JSON logs. A hook here never breaks a request.

May import the prefix cache (its metric families) and the shared base; never the engine or the HTTP side."""
