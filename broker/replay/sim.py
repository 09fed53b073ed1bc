"""A virtual-time simulator of the broker's warm pools, driven by a trace.

It mirrors what the broker does (``broker.acquire.service`` upkeep, ``broker.pools.store`` claims):

* a request first tries a warm pod of its image, oldest first (the Redis list is FIFO);
  a hit costs ``hit_s``; a miss creates a pod on demand (``create_s`` after its paced start);
* every create (on demand, refill, replacement) takes a token from one token bucket
  (GCRA, ``create_rate``/``create_burst``), like ``broker.pacing``;
* a claimed warm pod is replaced at once (the hand-out triggers upkeep);
* a warm pod idle for ``idle_timeout_s`` is deleted. With ``refill="always"`` (what the
  broker's upkeep does today) the pool is refilled to its size regardless of demand, so an
  expired pod is replaced; with ``refill="demand"`` a pool is refilled only when a request
  for its image arrives, so pools of images nobody asks for drain away;
* with ``reuse`` a released pod (used at most ``max_reuses`` times) goes back to its
  image's pool; above the pool's size the oldest idle pods are trimmed, as upkeep does
  (upkeep also counts in-flight refills against the size; the simulator counts only
  ready pods when trimming, so a reused pod can stand in for a refill still creating);
* ``max_live`` caps all live pods (creating, warm, held): a miss at the cap waits for a
  release; ``max_warm`` is a global budget of warm pods (idle plus in-flight refills)
  shared by all images.

All times are seconds of trace time; nothing sleeps, so a day of trace runs in seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from broker.errors import InvalidRequest
from broker.replay.trace import TraceEvent

Refill = Literal["always", "demand"]


@dataclass(frozen=True)
class Policy:
    """A pool policy to evaluate; defaults are on-demand creation only (no warm pods)."""

    warm: dict[str, int] = field(default_factory=dict)  # image -> pool size
    warm_default: int = 0  # pool size for images not in ``warm``
    idle_timeout_s: float = 300.0
    refill: Refill = "always"
    reuse: bool = False
    max_reuses: int = 8
    max_live: int | None = None
    max_warm: int | None = None
    create_s: float = 5.0  # create-to-ready of one pod
    hit_s: float = 0.05  # warm-hit acquisition (claim + health check)
    create_rate: float | None = None  # creates/s through the pacer (None: unpaced)
    create_burst: int = 1
    prefill: bool = True  # pools are full when the trace starts

    def __post_init__(self) -> None:
        if self.refill not in ("always", "demand"):
            raise InvalidRequest(f"refill must be 'always' or 'demand', not {self.refill!r}")
        if min(self.create_s, self.hit_s, self.idle_timeout_s) < 0:
            raise InvalidRequest("create_s, hit_s and idle_timeout_s must be >= 0")
        if self.create_rate is not None and self.create_rate <= 0:
            raise InvalidRequest("create_rate must be > 0")
        if self.create_burst < 1 or self.max_reuses < 0:
            raise InvalidRequest("create_burst must be >= 1 and max_reuses >= 0")
        sizes = [self.warm_default, *self.warm.values()]
        if any(s < 0 for s in sizes):
            raise InvalidRequest("pool sizes must be >= 0")

    def size(self, image: str) -> int:
        return self.warm.get(image, self.warm_default)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Result:
    requests: int = 0
    hits: int = 0
    misses: int = 0
    creates: int = 0
    creates_on_demand: int = 0
    creates_warm: int = 0
    reuses: int = 0
    expired: int = 0
    trimmed: int = 0
    queued_at_cap: int = 0
    prefilled: int = 0
    peak_live: int = 0
    idle_pod_s: float = 0.0
    busy_pod_s: float = 0.0
    creating_pod_s: float = 0.0
    duration_s: float = 0.0
    waits: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else math.nan

    def to_dict(self) -> dict[str, Any]:
        hours = 3600.0
        return {
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "wait_mean_s": sum(self.waits) / len(self.waits) if self.waits else math.nan,
            "wait_p50_s": percentile(self.waits, 50),
            "wait_p90_s": percentile(self.waits, 90),
            "wait_p99_s": percentile(self.waits, 99),
            "creates": self.creates,
            "creates_on_demand": self.creates_on_demand,
            "creates_warm": self.creates_warm,
            "creates_per_request": self.creates / self.requests if self.requests else math.nan,
            "reuses": self.reuses,
            "expired": self.expired,
            "trimmed": self.trimmed,
            "queued_at_cap": self.queued_at_cap,
            "prefilled": self.prefilled,
            "peak_live": self.peak_live,
            "idle_pod_hours": self.idle_pod_s / hours,
            "busy_pod_hours": self.busy_pod_s / hours,
            "creating_pod_hours": self.creating_pod_s / hours,
            "total_pod_hours": (self.idle_pod_s + self.busy_pod_s + self.creating_pod_s) / hours,
            "duration_s": self.duration_s,
        }


@dataclass
class _Pod:
    id: int
    image: str
    state: str = "creating"  # creating | idle | busy | gone
    since: float = 0.0
    uses: int = 0
    request: int | None = None  # index of the request it was created for (None: warm)
    epoch: int = 0  # bumps on every idle period, so stale expiry events are ignored


class _Sim:
    def __init__(self, events: list[TraceEvent], policy: Policy) -> None:
        self.events = events
        self.p = policy
        self.r = Result(requests=len(events))
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = itertools.count()
        self.pods: dict[int, _Pod] = {}
        self.ids = itertools.count()
        self.idle: dict[str, deque[int]] = {}
        self.inflight_warm: dict[str, int] = {}
        self.waiting: deque[int] = deque()
        self.live = 0
        self.tat = -math.inf
        self.pending = 0  # acquires not yet released: the run ends when this reaches 0
        self.demanded: set[str] = set()

    # -- plumbing ----------------------------------------------------------------------

    def push(self, t: float, kind: str, ref: int, epoch: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, ref, epoch))

    def paced_start(self, t: float) -> float:
        if self.p.create_rate is None:
            return t
        interval = 1.0 / self.p.create_rate
        tau = (self.p.create_burst - 1) * interval
        start = max(t, self.tat - tau)
        self.tat = max(self.tat, start) + interval
        return start

    def new_pod(self, t: float, image: str, request: int | None) -> None:
        start = self.paced_start(t)
        pod = _Pod(next(self.ids), image, since=start, request=request)
        self.pods[pod.id] = pod
        self.live += 1
        self.r.peak_live = max(self.r.peak_live, self.live)
        self.r.creates += 1
        self.r.creating_pod_s += self.p.create_s
        if request is None:
            self.r.creates_warm += 1
            self.inflight_warm[image] = self.inflight_warm.get(image, 0) + 1
        else:
            self.r.creates_on_demand += 1
        self.push(start + self.p.create_s, "ready", pod.id)

    def make_idle(self, t: float, pod: _Pod) -> None:
        pod.state, pod.since, pod.epoch = "idle", t, pod.epoch + 1
        self.idle.setdefault(pod.image, deque()).append(pod.id)
        if self.p.idle_timeout_s < math.inf:
            self.push(t + self.p.idle_timeout_s, "expire", pod.id, pod.epoch)

    def leave_idle(self, t: float, pod: _Pod) -> None:
        self.r.idle_pod_s += t - pod.since
        self.idle[pod.image].remove(pod.id)

    def delete(self, t: float, pod: _Pod) -> None:
        pod.state = "gone"
        self.live -= 1
        self.serve_waiting(t)

    def warm_total(self) -> int:
        return sum(len(q) for q in self.idle.values()) + sum(self.inflight_warm.values())

    def room(self) -> bool:
        return self.p.max_live is None or self.live < self.p.max_live

    # -- pool upkeep ---------------------------------------------------------------------

    def refill(self, t: float, image: str) -> None:
        if self.p.refill == "demand" and image not in self.demanded:
            return
        while len(self.idle.get(image, ())) + self.inflight_warm.get(image, 0) < self.p.size(image):
            if not self.room():
                return
            if self.p.max_warm is not None and self.warm_total() >= self.p.max_warm:
                return
            self.new_pod(t, image, None)

    def prefill(self, image: str) -> None:
        """Pools full before the trace starts (not counted as creates: see ``prefilled``)."""
        for _ in range(self.p.size(image)):
            if not self.room() or (
                self.p.max_warm is not None and self.warm_total() >= self.p.max_warm
            ):
                return
            pod = _Pod(next(self.ids), image)
            self.pods[pod.id] = pod
            self.live += 1
            self.r.peak_live = max(self.r.peak_live, self.live)
            self.r.prefilled += 1
            self.make_idle(0.0, pod)

    def trim(self, t: float, image: str) -> None:
        queue = self.idle.get(image, deque())
        while len(queue) > self.p.size(image):
            pod = self.pods[queue[0]]  # oldest idle first, like upkeep
            self.leave_idle(t, pod)
            self.r.trimmed += 1
            self.delete(t, pod)

    def serve_waiting(self, t: float) -> None:
        while self.waiting and self.room():
            index = self.waiting.popleft()
            self.new_pod(t, self.events[index].image, index)

    # -- events ----------------------------------------------------------------------------

    def on_acquire(self, t: float, index: int, _epoch: int) -> None:
        event = self.events[index]
        image = event.image
        if self.p.refill == "demand" and image not in self.demanded:
            self.demanded.add(image)
        queue = self.idle.get(image)
        if queue:
            pod = self.pods[queue[0]]
            self.leave_idle(t, pod)
            pod.state, pod.since = "busy", t + self.p.hit_s
            self.r.hits += 1
            self.r.waits.append(self.p.hit_s)
            self.push(t + self.p.hit_s + event.duration, "release", pod.id)
        else:
            self.r.misses += 1
            if self.room():
                self.new_pod(t, image, index)
            else:
                self.r.queued_at_cap += 1
                self.waiting.append(index)
        self.refill(t, image)

    def on_ready(self, t: float, pod_id: int, _epoch: int) -> None:
        pod = self.pods[pod_id]
        if pod.request is None:
            self.inflight_warm[pod.image] -= 1
            self.make_idle(t, pod)
            self.trim(t, pod.image)
            return
        event = self.events[pod.request]
        pod.state, pod.since = "busy", t
        self.r.waits.append(t - event.time)
        self.push(t + event.duration, "release", pod.id)

    def on_release(self, t: float, pod_id: int, _epoch: int) -> None:
        pod = self.pods[pod_id]
        self.r.busy_pod_s += t - pod.since
        self.pending -= 1
        if self.p.reuse and pod.uses < self.p.max_reuses and self.p.size(pod.image) > 0:
            pod.uses += 1
            self.r.reuses += 1
            pod.request = None
            self.make_idle(t, pod)
            self.trim(t, pod.image)
            return
        self.delete(t, pod)

    def on_expire(self, t: float, pod_id: int, epoch: int) -> None:
        pod = self.pods[pod_id]
        if pod.state != "idle" or pod.epoch != epoch:
            return  # claimed (or expired) since this timer was set
        self.leave_idle(t, pod)
        self.r.expired += 1
        self.delete(t, pod)
        if self.p.refill == "always":
            self.refill(t, pod.image)

    def run(self) -> Result:
        if self.p.prefill:
            images = set(self.p.warm) | (
                {e.image for e in self.events} if self.p.warm_default else set()
            )
            for image in sorted(images):
                self.demanded.add(image)
                self.prefill(image)
        for index, event in enumerate(self.events):
            self.push(event.time, "acquire", index)
        self.pending = len(self.events)
        end = 0.0
        handlers = {
            "acquire": self.on_acquire,
            "ready": self.on_ready,
            "release": self.on_release,
            "expire": self.on_expire,
        }
        while self.heap and self.pending > 0:
            t, _, kind, ref, epoch = heapq.heappop(self.heap)
            end = t
            handlers[kind](t, ref, epoch)
        for queue in self.idle.values():
            for pod_id in list(queue):
                self.r.idle_pod_s += end - self.pods[pod_id].since
        self.r.duration_s = end
        return self.r


def simulate(events: Iterable[TraceEvent], policy: Policy) -> Result:
    """Replay ``events`` (sorted by time) under ``policy``; returns the predicted figures."""
    ordered = sorted(events, key=lambda e: e.time)
    return _Sim(ordered, policy).run()
