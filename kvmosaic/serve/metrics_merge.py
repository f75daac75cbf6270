"""Every replica's Prometheus metrics as one exposition, each sample labelled ``replica``.

Concatenating the replicas' texts would repeat each ``# HELP``/``# TYPE`` line (an invalid
exposition); here the texts are parsed with ``prometheus_client``'s parser, the families of one
name merged, and written once by its renderer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_replica_metrics(texts: dict[str, str], label: str = "replica") -> bytes:
    """``{replica id: exposition text}`` -> one exposition with ``label="<replica id>"`` on
    every sample (families in first-seen order, replicas in the order given)."""
    merged: dict[str, Metric] = {}
    for rid, text in texts.items():
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [Sample(s.name, {**s.labels, label: rid}, s.value, s.timestamp, s.exemplar)
                            for s in fam.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
