"""Datasets (bundled, from arrays, IDX and .npz files, TFDS), federated partitions,
stacked client data (NumPy, host side), augmentation."""

from pflax._src.data.arrays import Dataset
from pflax._src.data.arrays import from_arrays
from pflax._src.data.arrays import pooled
from pflax._src.data.augment import color_jitter
from pflax._src.data.augment import horizontal_flip
from pflax._src.data.augment import random_resized_crop
from pflax._src.data.augment import simclr
from pflax._src.data.augment import translate
from pflax._src.data.clients import StackedClients
from pflax._src.data.clients import stack_clients
from pflax._src.data.datasets import load
from pflax._src.data.datasets import load_digits
from pflax._src.data.datasets import load_tfds
from pflax._src.data.dirichlet import dirichlet
from pflax._src.data.federation import ClientData
from pflax._src.data.federation import Federation
from pflax._src.data.federation import federate
from pflax._src.data.federation import stack_federations
from pflax._src.data.files import load_idx
from pflax._src.data.files import load_npz
from pflax._src.data.groups import groups
from pflax._src.data.partition import Partition
from pflax._src.data.partition import class_counts
from pflax._src.data.pathological import pathological
from pflax._src.data.split import deal_test_split
from pflax._src.data.split import train_test_split

__all__ = (
    "ClientData",
    "Dataset",
    "Federation",
    "Partition",
    "StackedClients",
    "class_counts",
    "color_jitter",
    "deal_test_split",
    "dirichlet",
    "federate",
    "from_arrays",
    "groups",
    "horizontal_flip",
    "load",
    "load_digits",
    "load_idx",
    "load_npz",
    "load_tfds",
    "pathological",
    "pooled",
    "random_resized_crop",
    "simclr",
    "stack_clients",
    "stack_federations",
    "train_test_split",
    "translate",
)
