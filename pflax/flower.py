"""pflax's algorithms in a real federation with Flower (`pip install 'pflax[flower]'`).

`PflaxStrategy` is a Flower strategy whose server step is a pflax algorithm's,
on the stacked uploads of the round; `client_app()` trains it on a node;
`server_app()` runs an `Experiment`. Three ways to run them:

- `LocalFederation`: Flower's deployment engine on this machine, a SuperLink
  and one SuperNode per client as separate processes on 127.0.0.1
  (`pflax-run --flower`);
- `LocalFederation(..., simulation=True)`: Flower's simulation engine (a
  SuperLink running the clients as Ray actors; `pflax-run --flower simulation`);
- `run_in_process`: real Flower messages delivered by `InProcessGrid` in this
  process, with no SuperLink (tests, notebooks, debugging).

Importing this module builds no Flower app: the apps that `pflax-run --flower` and
`write_app` name live in `pflax._src.flower.apps`, which Flower's processes import.

For a federation across machines: `write_app` and `write_run_config` make
what `flwr run` submits to your SuperLink, `write_certificates` and
`write_node_key` its TLS certificates and SuperNode keys; start each SuperNode with
`--node-config 'partition-id=I'`, and give `client_app` your own data function
for clients that hold their own data (docs/flower.md).

Your own model (any kind `pflax.models.as_model` takes, or a list of them for
heterogeneous clients): `Experiment(..., model=MyModel)` in one process
(`run_in_process` gives it to the nodes' `client_app(model=...)`), or
`Experiment(..., model="mymodels:MyModel")`, an import string that every
process of a deployed federation imports (docs/models.md).
"""

from pflax._src.flower.wire import from_record  # first: Flower's install check
from pflax._src.flower.wire import pack
from pflax._src.flower.wire import to_record
from pflax._src.flower.wire import unpack
from pflax._src.flower.client import client_app
from pflax._src.flower.client import client_id
from pflax._src.flower.client import simulated_partition
from pflax._src.flower.experiment import Experiment
from pflax._src.flower.in_process import InProcessGrid
from pflax._src.flower.in_process import in_process_nodes
from pflax._src.flower.in_process import run_in_process
from pflax._src.flower.server import PflaxStrategy
from pflax._src.flower.server import server_app
from pflax._src.flower.deploy import LocalFederation
from pflax._src.flower.deploy import write_app
from pflax._src.flower.deploy import write_run_config
from pflax._src.flower.keys import write_certificates
from pflax._src.flower.keys import write_node_key

__all__ = (
    "Experiment",
    "InProcessGrid",
    "LocalFederation",
    "PflaxStrategy",
    "client_app",
    "client_id",
    "from_record",
    "in_process_nodes",
    "pack",
    "run_in_process",
    "server_app",
    "simulated_partition",
    "to_record",
    "unpack",
    "write_app",
    "write_certificates",
    "write_node_key",
    "write_run_config",
)
