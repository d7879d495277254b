"""``/metrics`` of ``qspec serve --replicas N``: the counters of every replica, summed.

Ray Serve sends a scrape to one replica; each replica's counters live in its own process. Every replica
posts its exposition to one small Ray actor (:class:`MetricsBoard`, named, made by the first replica
that asks) each time it answers a scrape and every :data:`POST_EVERY_S` seconds, and answers a scrape
with the sum of the newest exposition of each live replica (:func:`sum_expositions`: counters, gauges
and histogram buckets add up; a replica that has not posted for :data:`STALE_AFTER_S` is left out).

>>> a = "# TYPE t_total counter\\nt_total 3.0\\n# TYPE up gauge\\nup 1.0\\n"
>>> print(sum_expositions([a, a.replace("3.0", "4.0")]), end="")
# TYPE t_total counter
t_total 7.0
# TYPE up gauge
up 2.0
"""

from __future__ import annotations

import threading
import time

from prometheus_client.parser import text_string_to_metric_families

BOARD_NAME = "qspec-metrics"
NAMESPACE = "serve"  # Ray Serve's: the command deletes the board with the application
POST_EVERY_S = 2.0
STALE_AFTER_S = 15.0


def sum_expositions(texts: list[str]) -> str:
    """One Prometheus text exposition whose every sample is the sum of that sample across ``texts``
    (``_created`` timestamps are dropped: a sum of them means nothing)."""
    kinds: dict[str, str] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if not family.samples:
                continue
            kinds.setdefault(family.name, family.type)
            samples = sums.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = samples.get(key, 0.0) + sample.value
    lines = []
    for name, samples in sums.items():
        kind = kinds[name]
        lines.append(f"# TYPE {name}_total {kind}" if kind == "counter" else f"# TYPE {name} {kind}")
        for (sample, labels), value in samples.items():
            shown = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{sample}{{{shown}}} {value!r}" if shown else f"{sample} {value!r}")
    return "".join(line + "\n" for line in lines)


class MetricsBoard:
    """A Ray actor: the newest exposition of each replica and when it came."""

    def __init__(self):
        self.posts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self.posts[replica] = (time.time(), text)

    def live(self) -> list[str]:
        now = time.time()
        return [text for at, text in self.posts.values() if now - at < STALE_AFTER_S]


class ReplicaMetrics:
    """One replica's side: post its own exposition to the board, and read the sum of all."""

    def __init__(self, replica: str, render):
        import ray

        self.replica, self.render = replica, lambda: render().decode()
        board = ray.remote(num_cpus=0)(MetricsBoard)
        self.board = board.options(
            name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote()
        self._stop = threading.Event()
        threading.Thread(target=self._post_every, name="qspec-metrics-post", daemon=True).start()

    def _post_every(self) -> None:
        while not self._stop.wait(POST_EVERY_S):
            try:
                self.board.post.remote(self.replica, self.render())
            except Exception:  # the board or Ray is going away with the application
                return

    async def summed(self) -> str:
        await self.board.post.remote(self.replica, self.render())
        return sum_expositions(await self.board.live.remote())

    def stop(self) -> None:
        self._stop.set()
