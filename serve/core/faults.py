"""What the engine does when its own code fails: the fault-injection hook and the KV books check.

A failure inside one request's work fails that request alone (serve/engine/engine.py). Before the
engine goes on, BlockManager.problem recounts the KV pools from the live sequences' block tables:
if the books do not balance, the engine's state cannot be trusted and it raises EngineFault, which
stops it.

Tests make the engine fail on purpose through `LLMEngine.fault_injector(point, seq)`, called at
POINTS when set (and not at all when None). A `baton serve` subprocess gets one from the
environment, read once when the engine is built:
    BATON_FAULT_INJECT="postprocess:-1$,forward:^x"   (point:regex on the request id, comma-separated)
"""

from __future__ import annotations

import logging
import os
import re
from typing import Callable

from baton.serve.core.sequence import Sequence

log = logging.getLogger(__name__)

# propose: a speculative proposal (per sequence); forward: the batched model step (called once per
# scheduled sequence, a raise fails the whole batch); sample: a token draw; postprocess: appending a
# token, detokenizing, stop checks, speculative verification.
POINTS = ("propose", "forward", "sample", "postprocess")
FaultInjector = Callable[[str, Sequence], None]
SequenceFailure = Callable[[Sequence, str, Exception], None]  # fail(seq, phase, exc): fails its request
ENV = "BATON_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised by an injector: a stand-in for a bug in the engine's per-request code."""


class EngineFault(RuntimeError):
    """The engine could not recover from a failure; it must be restarted (the message says why)."""


def injector_from_spec(spec: str) -> FaultInjector:
    """An injector raising InjectedFault at `point` for requests whose id matches `regex`."""
    rules: list[tuple[str, re.Pattern]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, sep, pattern = part.partition(":")
        if not sep or point not in POINTS:
            raise ValueError(f"{ENV}: {part!r} is not point:regex with point one of {', '.join(POINTS)}")
        rules.append((point, re.compile(pattern)))

    def inject(point: str, seq: Sequence) -> None:
        for p, rx in rules:
            if p == point and rx.search(seq.request_id):
                raise InjectedFault(f"injected fault at {point} for request {seq.request_id!r}")

    return inject


def injector_from_env() -> FaultInjector | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    log.warning("%s=%r: requests matching it will fail on purpose (a test hook)", ENV, spec)
    return injector_from_spec(spec)


def per_sequence(
    point: str,
    seqs: list[Sequence],
    fn: Callable[[list[Sequence]], list],
    inject: FaultInjector | None,
    fail: SequenceFailure,
) -> list[tuple]:
    """[(seq, fn's result for it)]: fn on the whole batch or, if that raises, on each sequence alone,
    calling fail(seq, point, exc) for those that still raise (finished sequences are skipped)."""

    def run(batch: list[Sequence]) -> list:
        if inject is not None:
            for seq in batch:
                inject(point, seq)
        return fn(batch)

    seqs = [s for s in seqs if not s.is_finished]
    try:
        return list(zip(seqs, run(seqs)))
    except Exception:
        log.warning("%s raised for a batch of %d sequences: retrying each alone", point, len(seqs), exc_info=True)
    done = []
    for seq in seqs:
        if not seq.is_finished:  # (its request may have failed with another of its samples)
            try:
                done.append((seq, run([seq])[0]))
            except Exception as e:
                fail(seq, point, e)
    return done
