"""Decoder, direct mode: the scheduler's local offer (`core.local_budget.LocalOffer`),
handed to its HTTP process through a small file.

Rank 0 of the decode scheduler writes it every `local_pacing.SYNC_STEPS` scheduling
steps (when its models are synced) and at least every `local_prefill.OFFER_EVERY_S`
(steps of a busy decoder take long), replacing the file atomically; the HTTP process reads
it when a plain direct request could be prefilled here, at most once per `REREAD_S`, and
uses it only while it is fresh (`MAX_AGE_S`): a scheduler that stopped stepping - paused,
stuck, gone - offers nothing, and the request is placed as without it (the scheduler
decides).

The burst an offer says is ready (`BurstAllowance`) is one step's: a request placed here
on an offer with it ready claims it (`OfferReader.claim_burst_if_ready`), and later
requests are judged without it until an offer lists the claiming request among those
that left the scheduler's local queue (launched in a step, or sent out: the offer's
`burst_ready` then accounts for it) or that request ends here. Without the claim, every
request placed between two offers counted on the same burst, and the scheduler sent all
but the first out again, each a scheduling step and a hand-off later. Each HTTP worker
(`--tokenizer-worker-num`) claims for the requests it places: with several, as many
requests may count on one burst, as all did before.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from sgl_pd.core.local_budget import LocalOffer

logger = logging.getLogger("sgl_pd.local_prefill")

MAX_AGE_S = 2.0  # an older offer says nothing of the scheduler now
REREAD_S = 0.05  # the HTTP process reads the file at most this often


def offer_path(port: int) -> Path:
    """Where the decode server listening on `port` keeps its scheduler's offer: in a
    directory of this user's alone (another user cannot plant an offer there)."""
    return Path(tempfile.gettempdir()) / f"sgl_pd_{os.getuid()}" / f"local_offer_{port}.json"


def _private(directory: Path) -> bool:
    """`directory` exists (made if need be), belongs to this user and only they may
    write in it."""
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        status = directory.stat()
    except OSError:
        return False
    return status.st_uid == os.getuid() and not status.st_mode & 0o022


def write_offer(path: Path, offer: LocalOffer) -> None:
    """Replaces the offer at `path` (never a half-written file: a rename)."""
    if not _private(path.parent):
        return
    part = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        part.write_text(offer.to_json())
        part.replace(path)
    except OSError as e:  # (a full or read-only temp dir: placement goes on without it)
        logger.debug("local offer not written to %s: %s", path, e)


class OfferReader:
    """The HTTP process's view of its scheduler's latest offer."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._read_s = -REREAD_S
        self._offer: LocalOffer | None = None
        self._burst_claimed_by: int | None = None  # a room placed here on the burst
        atexit.register(self._remove)

    def claim_burst_if_ready(self, room: int, now_s: float | None = None) -> None:
        """The request of bootstrap room `room` is placed here: if the latest offer says
        a burst is ready, it is that request's (the scheduler's next local step spends
        it on the request, or finds it gone and sends the request out)."""
        with self._lock:
            offer = self._current(time.time() if now_s is None else now_s)
            if offer is not None and offer.burst_ready:
                self._burst_claimed_by = room

    def request_ended(self, room: int) -> None:
        """The request of `room`, placed here, ended (answered, failed, aborted): a burst
        it claimed is the scheduler's to tell about again, even if it never got there."""
        with self._lock:
            if self._burst_claimed_by == room:
                self._burst_claimed_by = None

    def current(self, now_s: float | None = None) -> LocalOffer | None:
        """The latest offer while it is fresh, else None; without its burst while a
        request placed here claims it and no offer shows that request past the queue."""
        with self._lock:
            return self._current(time.time() if now_s is None else now_s)

    def _current(self, now: float) -> LocalOffer | None:
        if now - self._read_s >= REREAD_S:
            self._read_s = now
            try:
                if not _private(self._path.parent):
                    raise ValueError(f"{self._path.parent} is not this user's alone")
                self._offer = LocalOffer.from_json(self._path.read_text())
            except (OSError, ValueError):
                self._offer = None  # (none yet, or a file of another version)
        offer = self._offer
        if offer is None or not 0 <= now - offer.written_s <= MAX_AGE_S:
            return None
        if self._burst_claimed_by in offer.arrived_rooms:
            self._burst_claimed_by = None
        if self._burst_claimed_by is not None and offer.burst_ready:
            return dataclasses.replace(offer, burst_ready=False)
        return offer

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            self._path.unlink()
