"""A small Prometheus text-format registry (counters, gauges, summaries)."""
from __future__ import annotations

from collections import defaultdict


class Metrics:
    def __init__(self):
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.summaries: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        self.gauges: dict[str, callable] = {}
        self.help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value

    def observe(self, name: str, value: float) -> None:
        s = self.summaries[name]
        s[0] += value
        s[1] += 1

    def gauge(self, name: str, fn) -> None:
        self.gauges[name] = fn

    def render(self) -> str:
        lines = []
        seen = set()
        for (name, labels), v in sorted(self.counters.items()):
            if name not in seen:
                lines.append(f"# TYPE {name} counter")
                seen.add(name)
            lab = ",".join(f'{k}="{v2}"' for k, v2 in labels)
            lines.append(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
        for name, (total, count) in sorted(self.summaries.items()):
            lines += [f"# TYPE {name} summary", f"{name}_sum {total:.6f}", f"{name}_count {count}"]
        for name, fn in sorted(self.gauges.items()):
            lines += [f"# TYPE {name} gauge", f"{name} {fn():g}"]
        return "\n".join(lines) + "\n"
