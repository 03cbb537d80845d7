"""What the engine does when its own code fails: the fault-injection hook and the KV books check.

A failure inside one request's work fails that request alone (serve/engine.py). Before the engine
goes on, `pool_problem` recounts the KV pools from the live sequences' block tables: if the books
do not balance, the engine's state cannot be trusted and it raises EngineFault, which stops it.

Tests make the engine fail on purpose through `LLMEngine.fault_injector(point, seq)`, called at
POINTS when set (and not at all when None). A `baton serve` subprocess gets one from the
environment, read once when the engine is built:
    BATON_FAULT_INJECT="postprocess:-1$,forward:^x"   (point:regex on the request id, comma-separated)
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from typing import Callable, Iterable

from baton.serve.block_manager import BlockManager
from baton.serve.sequence import Sequence

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


def pool_problem(bm: BlockManager, live: Iterable[Sequence]) -> str | None:
    """None if every block's ref count equals the live block tables holding it, the free list is
    exactly the unreferenced blocks and the host pool's free and held blocks add up; else why not."""
    live = list(live)
    refs = Counter(b for s in live for b in s.block_table if b >= 0)
    wrong = [b.block_id for b in bm.blocks if b.ref_count != refs.get(b.block_id, 0)]
    if wrong:
        b = bm.blocks[wrong[0]]
        return (
            f"KV block {b.block_id} has ref count {b.ref_count} but {refs.get(b.block_id, 0)} live sequences "
            f"hold it ({len(wrong)} blocks disagree)"
        )
    unreferenced = {b.block_id for b in bm.blocks if b.ref_count == 0}
    if set(bm.free_blocks) != unreferenced:
        return f"the KV free list has {bm.num_free_blocks} blocks but {len(unreferenced)} are unreferenced"
    held = [h for s in live for h in s.host_block_table]
    if len(bm.host_free) + len(held) != bm.num_host_blocks or len(set(held) | set(bm.host_free)) != bm.num_host_blocks:
        return (
            f"the host swap pool has {len(bm.host_free)} free and {len(held)} held blocks, not its {bm.num_host_blocks}"
        )
    return None
