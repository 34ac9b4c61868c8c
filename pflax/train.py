"""Local training of all clients of a round, with the semantics of a per-client loop."""

from pflax._src.training.mapping import STRATEGIES
from pflax._src.training.train import PRECISIONS
from pflax._src.training.train import TRAINER_STRATEGIES
from pflax._src.training.mapping import bytes_per_client
from pflax._src.training.mapping import chunk_size_for_budget
from pflax._src.training.mapping import default_strategy
from pflax._src.training.mapping import default_threads
from pflax._src.training.mapping import map_clients
from pflax._src.training.train import Batch
from pflax._src.training.train import ClientResult
from pflax._src.training.train import LossFn
from pflax._src.training.train import batch_schedule
from pflax._src.training.train import evaluate_client
from pflax._src.training.train import init_opt_state
from pflax._src.training.train import make_trainer
from pflax._src.training.train import train_client
from pflax._src.training.train import with_precision

__all__ = (
    "Batch",
    "ClientResult",
    "LossFn",
    "PRECISIONS",
    "STRATEGIES",
    "TRAINER_STRATEGIES",
    "batch_schedule",
    "bytes_per_client",
    "chunk_size_for_budget",
    "default_strategy",
    "default_threads",
    "evaluate_client",
    "init_opt_state",
    "make_trainer",
    "map_clients",
    "train_client",
    "with_precision",
)
