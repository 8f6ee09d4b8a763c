"""The trainer: holds the resident backbone and tenant slots, consumes the Training Queue."""

from services.trainer.service import TrainerConfig, run

__all__ = ["TrainerConfig", "run"]
