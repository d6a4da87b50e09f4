"""Chat data to fixed-shape training batches: readers, templates and loss masks, length buckets,
anchors, bad-row accounting and target regeneration (see docs/data.md)."""

from dflash_train.data.anchors import sample_anchors
from dflash_train.data.batching import Batch
from dflash_train.data.loader import DataStats, TrainData, build_train_data
from dflash_train.data.skips import SkipCounts

__all__ = ["Batch", "DataStats", "SkipCounts", "TrainData", "build_train_data", "sample_anchors"]
