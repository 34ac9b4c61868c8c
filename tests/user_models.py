"""The source of a user's NNX model module, written to a temporary folder by the
tests that import a model from a `"module:attr"` string (in process and in a
deployed Flower federation)."""

NNX_NET_SOURCE = """
from flax import nnx

class Net(nnx.Module):
  def __init__(self, rngs):
    self.body = nnx.Linear(64, 8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(x.reshape(x.shape[0], -1))))
"""
