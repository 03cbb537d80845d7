"""LayerSkip self-speculation (Elhoushi et al., 2024): the model's own first E layers draft.

The draft is the target's first E decoder layers, then the shared final norm and LM head (what
LayerSkip training - baton.train.early_exit - teaches to predict); the full model verifies the k
drafted tokens in one pass with the usual rule (decoder.py: greedy identical to plain decoding,
sampling distribution-preserving). No second model is loaded: the draft runs on the very modules
of the engine's model.

KV reuse (LayerSkip's "cache reuse"), in an engine whose process holds the model: the draft's
layers < E are the target's, so the draft writes their K/V straight into the engine's own paged
cache, at the sequence's real slots. Before the schedule it allocates the slots of the pending
token and d_1..d_{k-1} in the engine's block manager (its own new blocks: a block another sequence
shares is copied first, as any write does; a prefix-cached block is full and is never written), and
runs k passes of layers < E, one row per sequence each; the target's prefill already filled layers
< E of the prompt, and accepted tokens keep what the draft wrote, so nothing is computed twice.
The drafted rows' layer-E inputs are kept by late entry (serve/runner/late_entry.py), which bind
installs on the engine's runner: in the verification forward those rows enter at layer E, the
other rows of the step (d_k, which the draft never fed, and every other sequence's prefill or
decode) run layers < E as a sub-batch, then all rows run layers >= E together. Rejected proposals'
slots are trimmed or overwritten later, as in any verification; a preempted, truncated or
re-slotted sequence simply runs from the embedding (an entry is used only in the next forward, for
the same tokens at the same slots).

A tensor-parallel engine (DistributedRunner, T x 1) reuses the KV the same way on every rank: the
driver installs late entry on every rank's runner, each draft depth is one small command (the
one-token chunks and their block-table deltas), every rank runs its shard of layers < E into its
own paged cache and keeps the rows' layer-E inputs, and the vocab-parallel head gives the driver
the logits to draw from - no hidden state crosses a process.

Pipeline-parallel engines (layers < E and the LM head are on different stages) and token trees
(tree_width > 1) keep the DraftProposer mirror (draft.py), logged at start: a paged cache of
layers < E of the draft's own, rolled back after each verification, which must also prefill every
prompt through layers < E, and a verification that recomputes layers < E for the k proposals; a
pipeline-parallel engine's process holds no whole model, so the checkpoint is loaded for it.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from baton.common.checkpoint import read_config
from baton.common.config import ModelConfig
from baton.common.model import CausalLM
from baton.serve.core.sequence import Sequence
from baton.serve.runner.late_entry import Drafter, LateEntryRanks, install_late_entry
from baton.serve.runner.model_runner import ModelRunner, kv_block_bytes
from baton.serve.runner.step_plan import Chunk
from baton.serve.sampler import apply_penalties, target_distributions
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.draft import DraftProposer

log = logging.getLogger(__name__)

BLOCK_SIZE = 16


def exit_layer_for(cfg: SpeculativeConfig, model_config: ModelConfig) -> int:
    """The draft's depth E: `exit_layer` when given, else the checkpoint's first recorded exit."""
    n = model_config.num_hidden_layers
    if model_config.is_hybrid:
        raise ValueError(
            "speculative method 'layerskip' is not for hybrid (Mamba2) models: its draft has no state slots"
        )
    if cfg.exit_layer is None:
        if not model_config.early_exit_layers:
            raise ValueError(
                "speculative method 'layerskip' needs an exit layer: this checkpoint records no early exits "
                "(early_exit_layers in config.json, written by a `baton train` recipe with an early_exit: "
                f"section); pass --exit-layer E (1 <= E < {n}) to draft from its first E layers anyway"
            )
        return model_config.early_exit_layers[0]
    if not 1 <= cfg.exit_layer < n:
        raise ValueError(f"exit_layer must be in 1..{n - 1} (the model has {n} layers), got {cfg.exit_layer}")
    return cfg.exit_layer


def check_checkpoint(cfg: SpeculativeConfig, model_dir: str | Path) -> None:
    """Before a server binds its port: the checkpoint's config.json gives the draft a depth."""
    from baton.common.checkpoint import read_config

    if (Path(model_dir) / "config.json").is_file():
        exit_layer_for(cfg, read_config(model_dir))


class LayerSkipProposer(DraftProposer):
    """A DraftProposer whose draft is the target's first E layers (module docstring)."""

    def __init__(
        self,
        cfg: SpeculativeConfig,
        model: CausalLM | None,
        model_dir: str | Path | None,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.cfg = cfg
        self.mirrors: dict[int, Sequence] = {}  # reuse: only the draft's sampling state (token ids, generator)
        self._ids = itertools.count()
        self._source = (model, model_dir, device, dtype)
        if model is None and model_dir is None:
            raise ValueError("speculative method 'layerskip' needs the model or its checkpoint directory")
        mcfg = model.config if model is not None else read_config(model_dir)
        self.exit_layer = exit_layer_for(cfg, mcfg)
        self.reuse = cfg.tree_width == 1  # decided in bind, which sees the engine's runner
        self.sharded = False  # reuse on a DistributedRunner: the ranks draft and keep the hidden states
        self.drafter: Drafter | None = None  # with reuse: late entry on the engine's runner (or its ranks)
        self.runner: ModelRunner | None = None
        self.bm: BlockManager | None = None
        if not self.reuse:
            self._build_mirror("a token tree")

    def _build_mirror(self, why: str) -> None:
        """The DraftProposer's own cache of layers < E (no KV reuse), on the engine's model or on
        the checkpoint loaded in this process (a sharded engine's process holds no whole model)."""
        model, model_dir, device, dtype = self._source
        if model is None:
            from baton.common.checkpoint import load_checkpoint

            model = load_checkpoint(model_dir, device=device, dtype=dtype if dtype.is_floating_point else None).model
        p = next(model.parameters())
        block_bytes = kv_block_bytes(model, BLOCK_SIZE, p.dtype, num_layers=self.exit_layer)
        num_blocks = max(4, self.cfg.draft_kv_cache_bytes // block_bytes)
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, BLOCK_SIZE, layers=range(self.exit_layer))
        log.info("LayerSkip E=%d: %s drafts with a mirror KV cache of layers < E (no KV reuse)", self.exit_layer, why)

    def bind(self, runner, block_manager: BlockManager) -> None:
        if not self.reuse:
            return
        if isinstance(runner, ModelRunner):  # this process holds the model
            self.drafter = install_late_entry(runner, self.exit_layer)
        elif isinstance(runner, LateEntryRanks):  # a sharded model's driver: on every rank, or None
            self.drafter, self.sharded = runner.install_late_entry(self.exit_layer), True
        else:
            raise ValueError("LayerSkip KV reuse needs the engine's own ModelRunner or a DistributedRunner")
        if self.drafter is None:
            self.reuse = self.sharded = False
            self._build_mirror("a pipeline-parallel engine (layers < E and the LM head are on different stages)")
            return
        self.runner, self.bm = runner, block_manager
        log.info(
            "LayerSkip E=%d: the draft writes layers < E into the engine's KV cache%s, verification enters at E",
            self.exit_layer,
            " on every tensor rank" if self.sharded else "",
        )

    @property
    def num_late_rows(self) -> int:
        """Rows that entered the verification at E so far (0 with the mirror draft)."""
        return 0 if self.drafter is None else self.drafter.num_late_rows

    def _view(self, seq: Sequence) -> Sequence:
        """seq's tokens (the drafts are appended to them) and the draft's own sampling stream."""
        m = self.mirrors.get(seq.seq_id)
        if m is None:
            m = Sequence(next(self._ids), seq.request_id, seq.index, seq.prompt_token_ids, seq.params)
            if seq.params.seed is not None:  # a stream apart from the target's (seed + index), as DraftProposer's
                m.generator = torch.Generator().manual_seed((seq.params.seed * 7919 + seq.index + 1) % 2**64)
            self.mirrors[seq.seq_id] = m
        m.token_ids = list(seq.token_ids)
        return m

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        if not self.reuse:
            return super().propose(seqs, ks)
        runner, bm = self.runner, self.bm
        live = [s for s in seqs if ks[s.seq_id] > 0 and bm.allocate_slots(s, ks[s.seq_id])]  # pending + d_1..d_{k-1}
        if not live:
            return
        runner.apply_block_ops(bm.take_pending())  # copy-on-write of a shared block before it is written
        views = {s.seq_id: self._view(s) for s in live}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in live}
        for depth in range(max(ks[s.seq_id] for s in live)):
            batch = [s for s in live if depth < ks[s.seq_id]]
            chunks = [
                Chunk(
                    s.seq_id,
                    s.num_computed_tokens + depth,
                    s.num_evicted_tokens,
                    [views[s.seq_id].token_ids[-1]],
                    s.block_table,
                    None,
                    "last",
                )
                for s in batch
            ]
            logits = self.drafter.draft(chunks, fresh=depth == 0)  # keeps the rows' layer-E inputs
            tokens, q = self._draw(logits, [views[s.seq_id] for s in batch])
            for i, s in enumerate(batch):
                views[s.seq_id].token_ids.append(tokens[i])
                probs[s.seq_id].append(q[i])
        for s in live:
            s.spec_token_ids = views[s.seq_id].token_ids[s.num_tokens :]  # d_1..d_k
            s.spec_draft_probs = None if s.params.greedy else torch.stack(probs[s.seq_id])

    @staticmethod
    def _draw(logits: torch.Tensor, views: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's draft token: a greedy row's argmax (after its penalties), a sampled row's draw
        from the distribution it is verified against (its q, returned; None for greedy rows)."""
        logits = logits.float().cpu()
        sampled = [i for i, v in enumerate(views) if not v.params.greedy]
        q: list[torch.Tensor | None] = [None] * len(views)
        if sampled:
            for i, row in zip(sampled, target_distributions(logits[sampled], [views[i] for i in sampled])):
                q[i] = row
        tokens = [
            int(torch.argmax(apply_penalties(logits[i], v)))
            if q[i] is None
            else int(torch.multinomial(q[i], 1, generator=v.generator))
            for i, v in enumerate(views)
        ]
        return tokens, q

    def release(self, seq: Sequence) -> None:
        if not self.reuse:
            return super().release(seq)
        self.mirrors.pop(seq.seq_id, None)  # (late entry drops what the next step does not use)
