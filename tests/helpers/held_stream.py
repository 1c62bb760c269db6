"""A weight stream wrapper for tests: how many gathered bytes does a publisher hold at once?"""
from __future__ import annotations

import weakref

from workers.weights.stream import WeightStream


class Held(WeightStream):
    """Wraps a stream and counts the bytes of the tensors it yielded that are still referenced
    (weakref finalizers), and the peak of that: a consumer that keeps every tensor shows the
    whole model, one that drops each once written shows about one tensor."""

    def __init__(self, inner: WeightStream):
        self.inner, self.metas = inner, inner.metas
        self.live = self.peak = 0

    def items(self, names=None):
        for name, t in self.inner.items(names):
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._drop, n)
            yield name, t
            del t

    def _drop(self, n: int) -> None:
        self.live -= n

    def local_nonfinite(self):
        return self.inner.local_nonfinite()
