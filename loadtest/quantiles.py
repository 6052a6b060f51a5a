"""Latency quantiles, as every table of the load test reports them."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel


class Quantiles(BaseModel):
    p50: float
    p95: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> Quantiles | None:
        if not values:
            return None
        p50, p95, p99 = np.percentile(np.asarray(values, dtype=float), [50, 95, 99])
        return cls(p50=float(p50), p95=float(p95), p99=float(p99), mean=float(np.mean(values)))
