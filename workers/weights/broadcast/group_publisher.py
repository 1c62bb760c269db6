"""What the two broadcast publishers share: the first publish, the end, the NaN/inf gate.

``BroadcastPublisher`` (publisher.py: our bucket protocol into embedded workers) and
``SGLangBroadcastPublisher`` (sglang/broadcast_publisher.py: SGLang's own protocol) differ in how a
group is formed and how an update travels, and agree on everything around it, which lives
here once:

- the first publish (step 0) goes through ``initial`` (the filesystem transport): servers
  boot from a checkpoint on disk; only then is the group formed (``_form``, which blocks until
  every receiver joined; that wait is reported as the step's ``wait_s``);
- once the orchestrator finished (``finished``), nothing is offered any more;
- before a version is offered, every rank checks its local shards of the weight stream for
  NaN/inf (``WeightStream.local_nonfinite``: together the ranks see every element), and all
  ranks refuse or skip it together (base.refuse_nonfinite): once
  offered, the receivers post their receives and must get every tensor.
"""
from __future__ import annotations

import abc
import time
from typing import Mapping, Optional, Union

import torch

from workers.common.protocol import RunPaths
from workers.weights.base import Peers, SyncStats, WeightPublisher, refuse_nonfinite
from workers.weights.broadcast.handshake import Handshake
from workers.weights.stream import WeightStream, as_stream


class GroupPublisher(WeightPublisher):
    """Trainer side of a broadcast transport; ``initial`` publishes step 0 (and fallbacks) to disk."""

    def __init__(self, paths: RunPaths, cfg, peers: Peers, *, initial: WeightPublisher, host: str, port: int,
                 num_receivers: int, device: Optional[torch.device] = None):
        self.paths, self.cfg, self.peers, self.initial = paths, cfg, peers, initial
        self.host, self.port, self.num_receivers = host, port, num_receivers
        self.device = torch.device(device or "cpu")
        self.handshake = Handshake(paths.root)
        self.finished = False  # the orchestrator is done: no update will be requested again
        if peers.rank == 0:
            self.handshake.reset()

    @property
    @abc.abstractmethod
    def formed(self) -> bool:
        """The group exists (after the first publish)."""

    @abc.abstractmethod
    def _form(self, stream: WeightStream) -> None:
        """Form the group with every receiver (collective over the trainer ranks)."""

    @abc.abstractmethod
    def _update(self, version: int, stream: WeightStream) -> SyncStats:
        """Offer ``version``, wait for the orchestrator's request, send it (gathering as it goes)."""

    def publish(self, version: int, weights: Union[WeightStream, Mapping[str, torch.Tensor]]) -> SyncStats:
        """COLLECTIVE. ``weights``: a stream (gathered as sent) or a full state dict."""
        stream = as_stream(weights)
        if not self.formed:
            out = self.initial.publish(version, stream)  # servers start from a checkpoint on disk
            t0 = time.perf_counter()
            self._form(stream)
            out.wait_s = time.perf_counter() - t0
            return out
        if self.finished:
            return SyncStats(bytes=0, seconds=0.0, skipped=True)
        if refuse_nonfinite(version, stream.local_nonfinite(), skip=self.cfg.skip_nonfinite, peers=self.peers):
            return SyncStats(bytes=0, seconds=0.0, skipped=True)
        return self._update(version, stream)
