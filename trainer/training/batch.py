"""The global batch over the ranks (docs/multi-gpu.md): each rank's share, its foreground
oversampling, and the loss weight that makes uneven shares average like one process.

Pure arithmetic, no torch: the CLI checks the split before any rank starts (trainer.run),
and every rank computes the same split from the plans' batch size (trainer.training.worker).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankBatch:
    """One rank's share of the global batch."""

    batch_size: int
    oversample_share: float  # fraction of this rank's samples forced to contain foreground


def split_global_batch(
    global_batch: int, world_size: int, oversample: float = 0.33
) -> list[RankBatch]:
    """Split the plans batch size G over W ranks, keeping foreground oversampling exact.

    Sizes: G // W each, the first G mod W ranks one more. Global slot i is forced to hold
    foreground iff i >= round(G * (1 - p)); a rank's share is the forced fraction of its
    slots, so the whole batch has exactly as many forced samples as on one GPU.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch < world_size:
        raise ValueError(
            f"global batch size {global_batch} < world size {world_size}: every rank needs at "
            f"least one sample; use at most {global_batch} processes (-num_gpus / "
            "--nproc_per_node) or a plans file with a larger batch size"
        )
    if not 0.0 <= oversample <= 1.0:
        raise ValueError(f"oversample must lie in [0, 1], got {oversample}")
    first_forced = round(global_batch * (1 - oversample))
    base, extra = divmod(global_batch, world_size)
    out, low = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        high = low + size
        forced = max(0, high - max(low, first_forced))
        out.append(RankBatch(batch_size=size, oversample_share=forced / size))
        low = high
    return out


def loss_weight(batch_sizes: list[int], global_rank: int) -> float:
    """Factor for a rank's per-sample-mean loss terms: b_r * W / G.

    DDP averages gradients over the W ranks; with uneven shares (G=5 -> [3, 2]) the plain
    mean of per-rank means over-weights the smaller batch. Scaled, the average equals the
    single-process mean over the whole global batch.
    """
    return batch_sizes[global_rank] * len(batch_sizes) / sum(batch_sizes)
