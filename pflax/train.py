"""Local training of all clients of a round in one compiled program."""

from pflax._src.train import Batch
from pflax._src.train import ClientResult
from pflax._src.train import STRATEGIES
from pflax._src.train import batch_schedule
from pflax._src.train import bytes_per_client
from pflax._src.train import chunk_size_for_budget
from pflax._src.train import default_strategy
from pflax._src.train import default_threads
from pflax._src.train import epoch_order
from pflax._src.train import evaluate_client
from pflax._src.train import has_convolution
from pflax._src.train import init_opt_state
from pflax._src.train import make_trainer
from pflax._src.train import map_clients
from pflax._src.train import step_keys
from pflax._src.train import train_client

__all__ = (
    "Batch",
    "ClientResult",
    "STRATEGIES",
    "batch_schedule",
    "bytes_per_client",
    "chunk_size_for_budget",
    "default_strategy",
    "default_threads",
    "epoch_order",
    "evaluate_client",
    "has_convolution",
    "init_opt_state",
    "make_trainer",
    "map_clients",
    "step_keys",
    "train_client",
)
