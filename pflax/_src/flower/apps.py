"""The Flower apps of `pflax-run --flower` and of `write_app`'s `pyproject.toml`.

Built when a Flower process imports this module (`pflax._src.flower.apps:clientapp`,
`...:serverapp`), never by `import pflax.flower`.
"""

from pflax._src.flower.client import client_app
from pflax._src.flower.server import server_app

clientapp = client_app()
"""The ClientApp of `pflax-run --flower` (its client of the simulated partition)."""
serverapp = server_app()
"""The ServerApp of `pflax-run --flower` (its experiment from the run config)."""
