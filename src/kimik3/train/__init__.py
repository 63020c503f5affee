"""Training: data packing, chunked loss, quantile balancing, optimizers, the step, the loop, checkpoints.

    from kimik3.train import Trainer, load_train_config
    Trainer(load_train_config("tiny")).run()

or `kimik3 train tiny` (the shipped preset; docs/training.md).
"""

from kimik3.train.balancing import Balancer
from kimik3.train.config import TrainConfig, load_train_config
from kimik3.train.loop import Trainer

__all__ = ["Balancer", "TrainConfig", "Trainer", "load_train_config"]
