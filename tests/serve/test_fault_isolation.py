"""A request can fail only itself: a fault in one request's work (or in a batched forward) fails
that request (or that batch) with an error, frees its KV blocks at once, and every other request
gets exactly the output it gets without the fault - in the engine, the async engine and a real
`baton serve`. Only a fault the engine cannot recover from (the KV books do not add up) stops it,
and then the server says why."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from baton.serve.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from baton.serve.client import BatonClient
from baton.serve.core.faults import EngineFault, InjectedFault, injector_from_spec
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

from .conftest import BASE
from .server_fixtures import ServerProcess, ServerThread, offline


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _rand(24, 0)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# (step it is added at, request id, prompt, params): n > 1, seeded, and a prefix-cached one ("c")
PLAN = [
    (0, "a", PREFIX + _rand(5, 1), GREEDY),
    (0, "b", _rand(13, 2), SamplingParams(temperature=1.0, n=3, max_tokens=12, seed=7, ignore_eos=True)),
    (1, "bad", _rand(9, 3), SamplingParams(temperature=1.0, n=2, max_tokens=20, seed=3, ignore_eos=True)),
    (2, "d", _rand(30, 4), GREEDY),
    (4, "c", PREFIX + _rand(7, 5), GREEDY),
]
CONFIGS = {
    "roomy": EngineConfig(num_kv_blocks=64, block_size=8),
    "swap": EngineConfig(
        num_kv_blocks=16, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap")
    ),
}


def pool_whole(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return (
        bm.num_free_blocks == bm.num_blocks
        and len(bm.host_free) == bm.num_host_blocks
        and all(b.ref_count == 0 for b in bm.blocks)
        and not engine.scheduler.has_work()
    )


def drive(engine: LLMEngine, plan, per_step=None) -> dict:
    """Add each request at its step, step to the end; each request's one final output. After every
    step the KV books must add up and the batch must respect max_num_seqs."""
    pending, finals, step = sorted(plan, key=lambda p: p[0]), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        outs = engine.step()
        for out in outs:
            assert out.request_id not in finals, "a request reported after its final output"
            if out.finished:
                finals[out.request_id] = out
        s = engine.scheduler
        assert engine.block_manager.problem(s.running + s.waiting + s.swapped) is None
        assert len(s.running) <= s.config.max_num_seqs
        if per_step is not None:
            per_step(step, outs)
        step += 1
    return finals


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def fail_at(point: str, request_id: str, index: int = 0, after: int = 0):
    """An injector failing one sample of one request once it has `after` output tokens."""

    def inject(p: str, seq: Sequence) -> None:
        if p == point and seq.request_id == request_id and seq.index == index and seq.num_output_tokens >= after:
            raise InjectedFault(f"injected fault at {p} for {request_id}")

    return inject


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Every request of PLAN but the failing one, on an engine without faults."""

    def run(mode: str, plan=PLAN) -> dict:
        engine = LLMEngine.from_checkpoint(llama_dir, CONFIGS[mode])
        finals = drive(engine, [p for p in plan if p[1] != "bad"])
        if mode == "swap":
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to force swapping"
        return {rid: tokens(out) for rid, out in finals.items()}

    return run


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("point", ["postprocess", "sample"])
def test_one_sequence_fault_fails_only_its_request(llama_dir, reference, mode, point):
    engine = LLMEngine.from_checkpoint(llama_dir, CONFIGS[mode])
    engine.fault_injector = fail_at(point, "bad", index=1, after=3)  # its second sample, mid-stream
    failed_with = {}

    def per_step(step, outs):
        if "bad" in (o.request_id for o in outs if o.finished):
            failed_with["others"] = [o.request_id for o in outs if o.request_id != "bad"]
            assert not any(s.request_id == "bad" for s in engine.scheduler.running + engine.scheduler.swapped)

    finals = drive(engine, PLAN, per_step)
    bad = finals.pop("bad")
    assert bad.finished and f"{point} failed" in bad.error and "injected fault" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert all(len(c.token_ids) >= 3 for c in bad.outputs), "it had streamed tokens before it failed"
    assert failed_with["others"], "the rest of the batch went on in the step that failed it"
    assert {rid: tokens(out) for rid, out in finals.items()} == reference(mode)
    assert all(c.finish_reason == "length" for out in finals.values() for c in out.outputs)
    assert finals["c"].metrics.num_cached_prompt_tokens >= 16, "c was meant to hit the prefix cache"
    assert pool_whole(engine)


def test_forward_fault_fails_exactly_that_batch(llama_dir, reference):
    mode = "swap"
    engine = LLMEngine.from_checkpoint(llama_dir, CONFIGS[mode])
    execute, calls, batch = engine.runner.execute, [0], set()

    def flaky(scheduled, *args):
        calls[0] += 1
        if calls[0] == 6:
            batch.update(seq.request_id for seq, _ in scheduled)
            raise RuntimeError("simulated device fault")
        return execute(scheduled, *args)

    engine.runner.execute = flaky
    plan = [p for p in PLAN if p[1] != "bad"] + [(12, "e", _rand(11, 6), GREEDY)]  # e: added after the fault
    finals = drive(engine, plan)
    failed = {rid for rid, out in finals.items() if out.error is not None}
    assert failed == batch and batch and set(finals) - batch, (batch, set(finals))
    for rid in failed:
        assert "forward failed" in finals[rid].error and "simulated device fault" in finals[rid].error
        assert {c.finish_reason for c in finals[rid].outputs} == {"error"}
    ref = reference(mode, plan)
    assert {rid: tokens(finals[rid]) for rid in set(finals) - failed} == {rid: ref[rid] for rid in set(ref) - failed}
    assert "e" not in failed
    assert pool_whole(engine)


def test_propose_and_verify_faults_with_speculation(llama_dir):
    from baton.serve.speculative import SpeculativeConfig

    cfg = EngineConfig(num_kv_blocks=64, block_size=8, speculative=SpeculativeConfig("ngram", 3, ngram_min=1))
    plan = [
        (0, "a", [5, 6, 7, 5, 6, 7, 5, 6], GREEDY),
        (0, "p", [9, 8, 9, 8, 9, 8], GREEDY),
        (1, "v", [4, 3, 4, 3, 4, 3, 4], GREEDY),
        (2, "d", _rand(20, 7), GREEDY),
    ]
    ref = {rid: tokens(o) for rid, o in drive(LLMEngine.from_checkpoint(llama_dir, cfg), plan).items()}
    engine = LLMEngine.from_checkpoint(llama_dir, cfg)
    propose, verify = fail_at("propose", "p", after=2), fail_at("postprocess", "v", after=4)
    engine.fault_injector = lambda point, seq: (propose(point, seq), verify(point, seq))
    finals = drive(engine, plan)
    assert "propose failed" in finals.pop("p").error and "postprocess failed" in finals.pop("v").error
    assert {rid: tokens(o) for rid, o in finals.items()} == {rid: ref[rid] for rid in ("a", "d")}
    assert engine.speculative.stats.proposed > 0 and pool_whole(engine)


def test_unschedulable_request_fails_not_the_engine(llama_dir, monkeypatch):
    """Should admission ever let through what the pool cannot hold, step() fails that request."""
    engine = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=4, block_size=8))
    monkeypatch.setattr(engine.scheduler, "check_fits", lambda *a: None)
    engine.add_request("huge", _rand(60, 8), GREEDY)  # 8 blocks of prompt, 4 in the pool
    (out,) = engine.step()
    assert out.finished and "no progress" in out.error and out.outputs[0].finish_reason == "error"
    finals = drive(engine, [(0, "ok", _rand(9, 9), GREEDY)])
    assert finals["ok"].error is None and len(finals["ok"].outputs[0].token_ids) == 16 and pool_whole(engine)


def test_books_that_do_not_add_up_stop_the_engine(llama_dir):
    engine = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=32, block_size=8))

    def corrupt(point, seq):
        if point == "postprocess":
            engine.block_manager.blocks[seq.block_table[0]].ref_count += 1  # a leak the recount must see
            raise InjectedFault("fault that leaks a block")

    engine.fault_injector = corrupt
    engine.add_request("r", _rand(9, 10), GREEDY)
    with pytest.raises(EngineFault, match="does not add up"):
        engine.step()


def test_async_engine_fails_only_that_stream(llama_dir):
    prompts = {f"r{i}": _rand(4 + 5 * i, 20 + i) for i in range(5)}
    expected = {rid: ids for rid, (ids, _, _) in zip(prompts, offline(llama_dir, list(prompts.values()), 16, True))}
    engine = AsyncLLMEngine(LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8)))
    engine.engine.fault_injector = fail_at("postprocess", "r2", after=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def consume(rid):
        got = []
        try:
            async for out in engine.generate(prompts[rid], params, rid):
                got += out.outputs[0].delta_token_ids
        except RequestFailedError as e:
            return e
        return got

    async def main(rids):
        return dict(zip(rids, await asyncio.gather(*(consume(r) for r in rids))))

    try:
        results = asyncio.run(main(list(prompts)))
        err = results.pop("r2")
        assert isinstance(err, RequestFailedError) and err.request_id == "r2" and "injected fault" in str(err)
        assert results == {rid: expected[rid] for rid in results}
        assert engine.dead is None
        assert engine.snapshot(pool_whole)
        engine.engine.fault_injector = None
        assert asyncio.run(main(["r2"])) == {"r2": expected["r2"]}, "later requests are served"
    finally:
        engine.shutdown()


def test_async_engine_dies_only_when_it_cannot_recover(llama_dir):
    engine = AsyncLLMEngine(LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=32, block_size=8)))

    def corrupt(point, seq):
        if point == "postprocess":
            engine.engine.block_manager.blocks[seq.block_table[0]].ref_count += 1
            raise InjectedFault("fault that leaks a block")

    engine.engine.fault_injector = corrupt

    async def run():
        async for _ in engine.generate(_rand(9, 11), GREEDY, "r"):
            pass

    try:
        with pytest.raises(EngineDeadError, match="does not add up") as e:
            asyncio.run(run())
        assert "KV block" in e.value.reason and engine.dead is not None and engine.failure_reason == e.value.reason
        with pytest.raises(EngineDeadError, match="does not add up"):
            asyncio.run(run())
    finally:
        engine.shutdown()


def test_server_says_why_the_engine_died(llama_dir):
    s = ServerThread(llama_dir, num_kv_blocks=32)

    def corrupt(point, seq):
        if point == "postprocess":
            s.server.rt.async_engine.engine.block_manager.blocks[seq.block_table[0]].ref_count += 1
            raise InjectedFault("fault that leaks a block")

    try:
        with BatonClient(s.target, timeout=30) as c:
            assert c.complete("The fox", max_tokens=4, temperature=0).completions[0].finish_reason == "length"
            s.server.rt.async_engine.engine.fault_injector = corrupt
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "does not add up" in e.value.details()
            info = c.server_info()
            assert c.health() == "NOT_SERVING" and info.state == "failed" and "KV block" in info.failure_reason
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "restarted" in e.value.details() and info.failure_reason in e.value.details()
    finally:
        s.stop()


def test_health_fails_as_soon_as_the_engine_dies_with_no_call_in_flight(llama_dir):
    """The engine dies on a request no client waits for (added to the engine directly): health
    turns NOT_SERVING and ServerInfo says why, with no generation call after the fault."""
    s = ServerThread(llama_dir, num_kv_blocks=32)
    core = s.server.rt.async_engine.engine

    def corrupt(point, seq):
        if point == "postprocess":
            core.block_manager.blocks[seq.block_table[0]].ref_count += 1  # the KV recount will not add up
            raise InjectedFault("fault that leaks a block")

    try:
        with BatonClient(s.target, timeout=30) as c:
            assert c.health() == "SERVING"
            core.fault_injector = corrupt
            s.server.rt.async_engine.snapshot(lambda e: e.add_request("orphan", _rand(9, 12), GREEDY))
            deadline = time.monotonic() + 20
            while c.health() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.02)
            info = c.server_info()
            assert c.health() == "NOT_SERVING" and info.state == "failed"
            assert "does not add up" in info.failure_reason and "KV block" in info.failure_reason
            assert info.failure_reason == s.server.rt.async_engine.failure_reason
    finally:
        s.stop()


def test_fault_spec_from_the_environment():
    inject = injector_from_spec("postprocess:-1$, forward:^x")
    seq = lambda rid: Sequence(0, rid, 0, [1], SamplingParams())  # noqa: E731
    inject("postprocess", seq("abc-11"))
    inject("forward", seq("abc-1"))
    with pytest.raises(InjectedFault):
        inject("postprocess", seq("abc-1"))
    with pytest.raises(InjectedFault):
        inject("forward", seq("x-3"))
    with pytest.raises(ValueError, match="point:regex"):
        injector_from_spec("nowhere:x")


def test_real_server_keeps_serving_after_request_faults(llama_dir, tmp_path, monkeypatch):
    """`baton serve` with BATON_FAULT_INJECT: its 2nd call fails in post-processing, its 3rd in the
    forward; both end INTERNAL, health stays SERVING, and the 4th call is the correct greedy output."""
    prompt = "The quick brown fox"
    ((ids, text, _),) = offline(llama_dir, [prompt], max_tokens=12, ignore_eos=True)
    monkeypatch.setenv("BATON_FAULT_INJECT", "postprocess:-1$,forward:-2$")  # request ids end in -<call number>
    server = ServerProcess(
        tmp_path, "--model", str(llama_dir), "--model-name", "tiny", "--num-kv-blocks", "64", "--block-size", "8"
    )
    try:
        with BatonClient(server.target, timeout=60) as c:
            ask = lambda: c.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True).completions[0]  # noqa: E731
            assert list(ask().token_ids) == ids
            for phase in ("postprocess", "forward"):
                with pytest.raises(grpc.RpcError) as e:
                    ask()
                assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
                assert f"{phase} failed" in e.value.details() and "injected fault" in e.value.details()
                assert c.health() == "SERVING"
            got = ask()
            assert (list(got.token_ids), got.text) == (ids, text)
            info = c.server_info()
            assert (info.state, info.engine_requests, info.kv_blocks_free) == ("serving", 0, 64)
            assert info.failure_reason == ""
    finally:
        assert server.terminate() == 0
    log = server.log()
    assert "failed in postprocess" in log and "failed in forward" in log
