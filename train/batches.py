"""The training data, batch by batch: global batches in an order that does not depend on the
world size, and each rank's micro-batches of them.

Every optimizer step consumes the next `global_batch` blocks of a seeded per-epoch shuffle; each
rank then takes its own micro-batches out of that global batch. The data position is therefore
one pair (epoch, index) shared by all ranks, and a run resumed at another world size (same global
batch) sees exactly the same samples in every step. An epoch's tail shorter than a global batch
is skipped, so every step has the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import datasets
import torch
from baton.common.data import torch_loader


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0  # blocks of this epoch already consumed


class GlobalBatches:
    def __init__(self, ds: datasets.Dataset, global_batch: int, seed: int, position: DataPosition | None = None):
        if len(ds) < global_batch:
            raise ValueError(
                f"the training split has {len(ds)} blocks, fewer than one global batch of {global_batch}: "
                "use more data, a shorter data.seq_len or a smaller batch"
            )
        self.ds, self.global_batch, self.seed = ds, global_batch, seed
        self.position = position or DataPosition()
        self._it: Iterator[torch.Tensor] | None = None

    def next(self) -> torch.Tensor:
        """The next [global_batch, seq_len + 1] block of token ids."""
        while True:
            if self._it is None:
                self._it = torch_loader(
                    self.ds, self.global_batch, seed=self.seed + self.position.epoch, start_index=self.position.index
                )
            batch = next(self._it, None)
            if batch is not None and batch.shape[0] == self.global_batch:
                self.position.index += self.global_batch
                return batch
            self.position, self._it = DataPosition(self.position.epoch + 1, 0), None

    def state_dict(self) -> dict[str, int]:
        return asdict(self.position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (state_dict() of the run resumed)."""
        self.position, self._it = DataPosition(**state), None


def micro_batches(batch: torch.Tensor, micro: int, accum: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's `accum` micro-batches of a global batch: micro-batch a of rank r holds rows
    (a * world_size + r) * micro ... + micro, so every row is used exactly once."""
    return [batch[(a * world_size + rank) * micro : (a * world_size + rank + 1) * micro] for a in range(accum)]
