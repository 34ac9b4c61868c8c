"""A real federation with Flower: the server and client apps, the wire format, deployments."""
