"""Precision beyond autocast: float8 training (:mod:`trainer.precision.fp8`)."""
