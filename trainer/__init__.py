"""trainer: a PyTorch training framework whose whole step is compiled and arranged around communication.

from trainer import Trainer, load_config
Trainer(load_config("configs/tiny.yaml", ["train.steps=100"])).fit()
"""

from trainer.config import Config, ConfigError, load_config

__version__ = "0.2.0"


def __getattr__(name):
    if name == "Trainer":  # lazy: `trainer print-config` need not import the loop
        from trainer.loop import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "ConfigError", "Trainer", "load_config", "__version__"]
