"""LoongSage plugin: advantage estimators, policy losses, KL estimators, loss aggregations,
filters, off-policy corrections and reward shaping.

The helpers a trainer or host calls directly are re-exported here; importing this package does
not import torch.
"""

from .metrics import adv_zero_ratio, rollout_group_metrics

__version__ = "0.1.0"

__all__ = ["adv_zero_ratio", "rollout_group_metrics", "__version__"]
