"""LoongSage plugin: Advantage estimators, policy losses, KL estimators, loss aggregations, filters and off-policy corrections."""

__version__ = "0.1.0"
