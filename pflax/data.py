"""Datasets, federated partitions and stacked client data (NumPy, host side)."""

from pflax._src.data.clients import ClientData
from pflax._src.data.clients import stack_clients
from pflax._src.data.datasets import Dataset
from pflax._src.data.datasets import load
from pflax._src.data.datasets import load_digits
from pflax._src.data.datasets import load_tfds
from pflax._src.data.dirichlet import dirichlet
from pflax._src.data.groups import groups
from pflax._src.data.partition import Partition
from pflax._src.data.partition import class_counts
from pflax._src.data.pathological import pathological
from pflax._src.data.split import train_test_split

__all__ = (
    "ClientData",
    "Dataset",
    "Partition",
    "class_counts",
    "dirichlet",
    "groups",
    "load",
    "load_digits",
    "load_tfds",
    "pathological",
    "stack_clients",
    "train_test_split",
)
