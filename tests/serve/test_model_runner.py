"""The model runner's packing: single tokens and short chunks become decode rows, longer chunks
the prefill path; either way a step's logits equal a plain forward over the whole sequence. Its
InputBatch, which keeps block-table rows between steps, builds the same tensors as a rebuild
from scratch through joins, finishes, preemption and chunked prefill."""

import dataclasses
import random

import pytest
import torch
from baton.common.config import ModelConfig
from baton.common.model import DecoderLayer, build_model
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.runner.input_batch import InputBatch
from baton.serve.runner.model_runner import DECODE_ROWS, ModelRunner
from baton.serve.runner.step_plan import Chunk, StepPlan
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_short_chunks_run_as_decode_rows_and_match_a_dense_forward():
    model = build_model(CFG, seed=0)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    g = torch.Generator().manual_seed(0)
    lens = {"a": 10, "b": 13, "c": 20}
    seqs = {}
    for i, (name, n) in enumerate(lens.items()):
        seqs[name] = Sequence(
            i, name, 0, torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist(), SamplingParams()
        )
    seqs["a"].block_table, seqs["b"].block_table, seqs["c"].block_table = [0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11]

    def step(plan):
        step_plan, _ = runner.plan([(seqs[k], n) for k, n in plan])
        md = step_plan.tensors(runner.device)[2]
        result = runner.execute([(seqs[k], n) for k, n in plan])
        logits, groups = result.logits, result.groups
        for k, n in plan:
            seqs[k].num_computed_tokens += n
        return md, logits, groups

    md, _, groups = step([("a", 9), ("b", 7)])  # a: a 9-token chunk (prefill path), b: 7 decode rows
    assert 7 <= DECODE_ROWS < 9
    assert md.num_decodes == 7 and md.decode_context_lens.tolist() == list(range(1, 8))
    assert md.prefill_prefix_lens.tolist() == [0] and groups == []  # neither sequence is complete yet

    md, logits, groups = step([("c", 20), ("b", 6), ("a", 1)])  # c: prefill; b: 6 rows over a cached prefix
    assert md.num_decodes == 6 + 1 and md.decode_context_lens.tolist() == [8, 9, 10, 11, 12, 13, 10]
    assert [s.request_id for s, _ in groups] == ["b", "a", "c"]  # decode rows first, then chunks
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([s.token_ids]))[0, -1] for s, _ in groups])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
def test_the_last_layer_runs_for_the_sampled_rows_only_and_still_writes_every_rows_kv(window):
    """A step of chunks samples one row per finished prompt: the last layer's MLP sees those rows
    alone, the logits equal a dense forward's, and the K/V every layer wrote equal a runner's that
    computes every row (so the next steps, decoding over them, equal the dense forward too)."""
    cfg = dataclasses.replace(CFG, sliding_window=window, model_type="mistral" if window else CFG.model_type)
    runners = {}
    for pruned in (True, False):
        runners[pruned] = ModelRunner(build_model(cfg, seed=0), num_blocks=16, block_size=4)
        runners[pruned].answer_sampled_rows = pruned
    dense = build_model(cfg, seed=0)
    mlp_rows = []
    runners[True].layers[-1].mlp.register_forward_hook(lambda m, a, out: mlp_rows.append(a[0].shape[1]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (10, 13, 20)]
    seqs = {p: [Sequence(i, str(i), 0, list(t), SamplingParams()) for i, t in enumerate(prompts)] for p in runners}
    for group in seqs.values():
        for s, table in zip(group, ([0, 1, 2, 12], [3, 4, 5, 6], [7, 8, 9, 10, 11, 13])):
            s.block_table = table
    steps = [[(0, 9), (1, 7)], [(2, 20), (1, 6), (0, 1)], [(0, 1), (1, 1), (2, 1)]]
    for n_step, plan in enumerate(steps):
        got = {}
        for pruned, runner in runners.items():
            group = seqs[pruned]
            got[pruned] = runner.execute([(group[i], n) for i, n in plan])
            for i, n in plan:
                group[i].num_computed_tokens += n
        for (k0, v0), (k1, v1) in zip(runners[True].kv_caches, runners[False].kv_caches):
            torch.testing.assert_close(k0, k1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v0, v1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[True].logits, got[False].logits, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            want = [dense(torch.tensor([s.token_ids[: s.num_computed_tokens]]))[0, -1] for s, _ in got[True].groups]
        if want:
            torch.testing.assert_close(got[True].logits, torch.stack(want), atol=1e-4, rtol=1e-4)
        assert len(got[True].logits) == [0, 3, 3][n_step]
        for j, (s, _) in enumerate(got[False].groups):  # the next tokens, the same for both runners
            for group in seqs.values():
                group[s.seq_id].token_ids.append(int(got[False].logits[j].argmax()))
    assert mlp_rows == [0, 3, 3]  # nothing sampled, then 3 of 27 rows, then a decode step's 3 of 3


def test_the_model_runner_fuses_residual_norms():
    model = build_model(
        ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
        seed=0,
    )
    ModelRunner(model, num_blocks=8, block_size=8)
    assert all(m.fuse_residual_norm for m in model.modules() if isinstance(m, DecoderLayer))


def _same(got, want) -> bool:
    """Every tensor equal in dtype, shape and values; every other field equal."""

    def eq(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if dataclasses.is_dataclass(a):
            return all(eq(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
        if isinstance(a, list):
            return len(a) == len(b) and all(map(eq, a, b))
        return a == b

    return all(map(eq, got, want))


LENGTHS, OUTS = [5, 19, 11, 30, 7, 14, 23, 9], [6, 20, 3, 12, 25, 8, 15, 10]


class _LengthOnly(list):
    """A stale-row bug: a row is rewritten only when its table's length changes (append-only
    updates), so a table whose blocks changed in place (swap-in, recompute) stays stale."""

    def __ne__(self, other):
        return len(self) != len(other)


class _AppendOnlyBatch(InputBatch):
    def _write(self, r: int, table: list[int]) -> None:
        super()._write(r, table)
        self.written[r] = _LengthOnly(table)


def _run_checked(batch: InputBatch, mode: str) -> dict:
    """A staggered workload that joins, finishes, chunks prompts and is preempted (`mode`): every
    step's InputBatch tensors against StepPlan.tensors, the rebuild from Python lists."""
    model = build_model(CFG, seed=0)
    sched = SchedulerConfig(max_num_batched_tokens=24, preemption_mode=mode)
    engine = LLMEngine(model, config=EngineConfig(num_kv_blocks=20, block_size=4, scheduler=sched))
    batch.device = engine.runner.device
    engine.runner.inputs = batch
    seen = {"steps": 0, "mismatches": 0, "rows": 0, "mixed": 0, "chunked": 0}

    def checked(plan):
        got = InputBatch.tensors(batch, plan)
        md = got[2]
        seen["steps"] += 1
        seen["mismatches"] += not _same(got, plan.tensors(batch.device))
        seen["rows"] += md.num_decodes + md.num_prefills
        seen["mixed"] += bool(md.num_decodes and md.num_prefills)
        seen["chunked"] += bool((md.prefill_prefix_lens > 0).any())
        return got

    batch.tensors = checked
    g = torch.Generator().manual_seed(1)
    lengths, outs = LENGTHS, OUTS
    step, pending = 0, list(range(len(lengths)))
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i = pending.pop(0)
            prompt = torch.randint(0, CFG.vocab_size, (lengths[i],), generator=g).tolist()
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=outs[i], ignore_eos=True))
        engine.step()
        step += 1
    seen["preemptions"] = engine.scheduler.num_preemptions
    seen["writes"] = batch.num_row_writes
    seen["rows_left"] = len(batch.row_of)
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_input_batch_equals_a_rebuild_through_joins_finishes_preemption_and_chunks(mode):
    seen = _run_checked(InputBatch(torch.device("cpu"), rows=2, width=2), mode)  # tiny: it grows
    assert seen["mismatches"] == 0, seen
    assert seen["preemptions"] > 0 and seen["mixed"] > 0 and seen["chunked"] > 0, seen  # the events happened
    assert seen["writes"] < seen["rows"] / 2, seen  # and most rows were kept, not rewritten
    assert seen["rows_left"] == 0  # every finished sequence gave its row back
    stale = _run_checked(_AppendOnlyBatch(torch.device("cpu")), mode)
    assert stale["mismatches"] > 0, stale  # the comparison catches a row left stale


def _fuzz_mismatches(batch: InputBatch, steps: int = 300) -> int:
    """Random table changes of every kind between steps - a new block, a block replaced in place,
    blocks dropped from the front, a whole new table, sequences leaving (released or not) and
    joining, the order shuffled, short chains and prefill chunks - each step's tensors against
    StepPlan.tensors. Returns the steps that differed."""
    rng, tables, next_id, bad = random.Random(0), {}, 0, 0
    for _ in range(steps):
        while len(tables) < rng.randint(1, 12):
            tables[next_id], next_id = [rng.randrange(100) for _ in range(rng.randint(1, 6))], next_id + 1
        for sid, t in list(tables.items()):
            op = rng.random()
            if op < 0.2:
                t.append(rng.randrange(100))
            elif op < 0.3:
                t[rng.randrange(len(t))] = rng.randrange(100)
            elif op < 0.4 and len(t) > 1:
                del t[: rng.randint(1, len(t) - 1)]
            elif op < 0.45:
                tables[sid] = [rng.randrange(100) for _ in range(rng.randint(1, 9))]
            elif op < 0.55:
                del tables[sid]
                if rng.random() < 0.7:
                    batch.release(sid)
        order = list(tables)
        rng.shuffle(order)
        chunks = []
        for sid in order[: rng.randint(1, len(order))]:
            t = tables[sid]
            n = min(rng.choice([1, 1, 1, 3, 12]), len(t) * 4)
            start = len(t) * 4 - n
            chunks.append(Chunk(sid, start, 0, [7] * n, t, None, "last"))
        chunks.sort(key=lambda c: len(c.tokens) > DECODE_ROWS)  # packing order
        plan = StepPlan.from_chunks(chunks, 4)
        bad += not _same(batch.tensors(plan), plan.tensors(batch.device))
    return bad


class _UnpaddedBatch(InputBatch):
    """A stale-tail bug: a shorter table written over a longer one leaves the old blocks behind."""

    def _write(self, r: int, table: list[int]) -> None:
        self.written[r] = None
        super()._write(r, table)


def test_the_input_batch_equals_a_rebuild_under_random_table_changes():
    assert _fuzz_mismatches(InputBatch(torch.device("cpu"), rows=1, width=1)) == 0
    assert _fuzz_mismatches(_AppendOnlyBatch(torch.device("cpu"))) > 0  # the test sees stale rows
    assert _fuzz_mismatches(_UnpaddedBatch(torch.device("cpu"))) > 0  # and stale tails
