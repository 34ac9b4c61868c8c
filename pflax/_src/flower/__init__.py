"""A real federation with Flower: the server and client apps, the wire format, deployments.

The server runs `server.PflaxStrategy`, a Flower strategy (message API) whose
server step is the engine's (`pflax._src.simulation.protocol`); it keeps the
algorithm's state between rounds and sends each client its own model. A
client runs `client.client_app()`: pflax's local training with the loss and
optimizer of its architecture group. Messages (`wire`):

1. `query` (once): the server sends the experiment (`experiment.Experiment`);
   each client answers with its client id (`node_config["partition-id"]`),
   training class counts, input shape and test size (`replies`).
2. `train` (every round, to the round's participants): the client's starting
   model and loss context, and its key, epochs and batch size; the reply holds
   the trained model and the mean loss. A warm-up (FedClassAvg's) is a `train`
   round 0 of every client.
3. `evaluate` (every `eval_every` rounds, to every client): the models to test
   by kind (`pflax.algorithms.EVALUATED`); the reply holds correct counts.

`in_process` runs a federation in one process, `deploy` on this machine.
"""

import os

# pflax's federations reach only the addresses their user gives: Flower's
# telemetry and update check stay off unless the user sets these variables.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
