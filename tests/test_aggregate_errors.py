"""Every bad input listed in SPEC section 4 raises an error naming the argument."""

import jax
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import tree as ptree

M, K = 3, 4


def _params(m=M):
  rng = np.random.default_rng(0)
  return {"features": {"w": rng.normal(size=(m, 5)).astype(np.float32)},
          "classifier": {"kernel": rng.normal(size=(m, 2, K)).astype(np.float32)}}


def _counts(m=M, k=K):
  return np.ones((m, k), np.float32)


P = _params()
N = np.array([1.0, 2.0, 3.0])
SOFT = np.full((M, 5), 0.2, np.float32)
STATE = agg.fedrema_init(M)

# (name, call, exception, pattern); every call is expected to raise.
BAD_INPUTS = [
    # Leaves disagree on M.
    ("leaves_m_fedavg", lambda: agg.fedavg({"a": np.zeros((3, 2)), "b": np.zeros((4,))}),
     ValueError, "params"),
    ("leaves_m_cw", lambda: agg.cw_fedavg(
        {"a": np.zeros((3, 2)), "b": np.zeros((4,))}, _counts()), ValueError, "params"),
    ("leaves_m_feddwa", lambda: agg.feddwa(
        {"a": np.zeros((3, 2)), "b": np.zeros((2,))},
        {"a": np.zeros((3, 2)), "b": np.zeros((2,))}), ValueError, "params"),
    ("leaves_m_fedsa", lambda: agg.fedsa({"a": np.zeros((3, 2)), "b": np.zeros((2,))}),
     ValueError, "params"),
    # class_dist.
    ("class_dist_m", lambda: agg.cw_fedavg(P, _counts(M + 1)), ValueError, "class_dist"),
    ("class_dist_m_models", lambda: agg.class_models(P, _counts(M - 1)), ValueError,
     "class_dist"),
    ("class_dist_ndim", lambda: agg.cw_fedavg(P, np.ones(M)), ValueError, "class_dist"),
    ("class_dist_ndim3", lambda: agg.cw_fedavg(P, np.ones((M, K, 1))), ValueError,
     "class_dist"),
    ("class_dist_negative", lambda: agg.cw_fedavg(P, -_counts()), ValueError,
     "class_dist"),
    ("class_dist_nan", lambda: agg.cw_fedavg(P, np.where(np.eye(M, K) > 0, np.nan, 1.0)),
     ValueError, "class_dist"),
    ("class_dist_inf", lambda: agg.class_models(P, np.full((M, K), np.inf)), ValueError,
     "class_dist"),
    # num_samples.
    ("num_samples_len_fedavg", lambda: agg.fedavg(P, N[:2]), ValueError, "num_samples"),
    ("num_samples_len_cw", lambda: agg.cw_fedavg(P, _counts(), np.ones(M + 1)),
     ValueError, "num_samples"),
    ("num_samples_len_fedclassavg", lambda: agg.fedclassavg(P, np.ones(M + 1)),
     ValueError, "num_samples"),
    ("num_samples_len_fedrema", lambda: agg.fedrema(P, N[:2], SOFT, STATE),
     ValueError, "num_samples"),
    ("num_samples_len_fedsa", lambda: agg.fedsa(P, np.ones((M, 1))), ValueError,
     "num_samples"),
    ("num_samples_negative_fedavg", lambda: agg.fedavg(P, -N), ValueError,
     "num_samples"),
    ("num_samples_negative_cw", lambda: agg.cw_fedavg(P, _counts(), -N), ValueError,
     "num_samples"),
    ("num_samples_nan_fedsa", lambda: agg.fedsa(P, np.array([1.0, np.nan, 1.0])),
     ValueError, "num_samples"),
    # FedReMa statistics and state.
    ("soft_m", lambda: agg.fedrema(P, N, SOFT[:2], STATE), ValueError, "soft"),
    ("soft_ndim", lambda: agg.fedrema(P, N, SOFT[0], STATE), ValueError, "soft"),
    ("dependency_shape", lambda: agg.fedrema(P, N, SOFT, agg.fedrema_init(M + 1)),
     ValueError, "dependency"),
    ("relevance_ndim", lambda: agg.relevance(SOFT[0]), ValueError, "soft"),
    ("mds_ndim", lambda: agg.mds(np.ones((2, 2))), ValueError, "s_row"),
    ("soft_logits_ndim", lambda: agg.soft_logits(np.ones(3)), ValueError, "logits"),
    # Hyperparameters.
    ("alpha_high", lambda: agg.feddwa(P, P, alpha=1.5), ValueError, "alpha"),
    ("alpha_low", lambda: agg.feddwa(P, P, alpha=-0.1), ValueError, "alpha"),
    ("temperature_zero", lambda: agg.feddwa(P, P, temperature=0.0), ValueError,
     "temperature"),
    ("temperature_negative", lambda: agg.feddwa(P, P, temperature=-1.0), ValueError,
     "temperature"),
    ("soft_logits_temperature", lambda: agg.soft_logits(SOFT, temperature=0.0),
     ValueError, "temperature"),
    ("num_mic", lambda: agg.fedsa(P, num_mic=1), ValueError, "num_mic"),
    ("num_mac", lambda: agg.fedsa(P, num_mac=0), ValueError, "num_mac"),
    ("num_mic_type", lambda: agg.fedsa(P, num_mic=4.0), TypeError, "num_mic"),
    # Non-float leaves.
    ("int_leaves_fedavg", lambda: agg.fedavg({"w": np.ones((M, 2), np.int32)}),
     TypeError, "params"),
    ("int_leaves_cw", lambda: agg.cw_fedavg({"w": np.ones((M, 2), np.int32)}, _counts()),
     TypeError, "params"),
    ("int_leaves_fedclassavg", lambda: agg.fedclassavg({"w": np.ones((M, 2), bool)}),
     TypeError, "params"),
    ("int_leaves_feddwa", lambda: agg.feddwa({"w": np.ones((M, 2), np.int32)},
                                             {"w": np.ones((M, 2), np.int32)}),
     TypeError, "params"),
    ("int_leaves_fedrema", lambda: agg.fedrema({"w": np.ones((M, 2), np.int32)}, N,
                                               SOFT, STATE), TypeError, "params"),
    ("int_leaves_fedsa", lambda: agg.fedsa({"w": np.ones((M, 2), np.int32)}),
     TypeError, "params"),
    ("int_received", lambda: agg.feddwa(P, jax.tree.map(lambda x: x.astype(int), P)),
     TypeError, "received"),
    # Masks.
    ("mask_shape_fedavg", lambda: agg.fedavg(P, mask=np.ones(M + 1, bool)), ValueError,
     "mask"),
    ("mask_shape_cw", lambda: agg.cw_fedavg(P, _counts(), mask=np.ones((M, 1), bool)),
     ValueError, "mask"),
    ("mask_shape_fedsa", lambda: agg.fedsa(P, mask=np.ones(M - 1, bool)), ValueError,
     "mask"),
    ("mask_dtype_fedavg", lambda: agg.fedavg(P, mask=np.ones(M, np.int32)), TypeError,
     "mask"),
    ("mask_dtype_feddwa", lambda: agg.feddwa(P, P, mask=np.ones(M, np.float32)),
     TypeError, "mask"),
    ("mask_dtype_fedrema", lambda: agg.fedrema(P, N, SOFT, STATE, mask=np.ones(M)),
     TypeError, "mask"),
    ("mask_dtype_fedclassavg", lambda: agg.fedclassavg(P, mask=np.ones(M, np.int32)),
     TypeError, "mask"),
    ("mask_dtype_class_models", lambda: agg.class_models(P, _counts(), mask=np.ones(M)),
     TypeError, "mask"),
    # received.
    ("received_structure", lambda: agg.feddwa(P, {"features": P["features"]}),
     ValueError, "received"),
    ("received_shape", lambda: agg.feddwa(P, _params(M + 1)), ValueError, "received"),
    # personalize / estimate_class_dist.
    ("personalize_k", lambda: agg.personalize(P, np.ones((2, M + 1))), ValueError,
     "class_dist"),
    ("personalize_ndim", lambda: agg.personalize(P, np.ones(M)), ValueError,
     "class_dist"),
    ("personalize_negative", lambda: agg.personalize(P, -np.ones((2, M))), ValueError,
     "class_dist"),
    ("estimate_1d", lambda: agg.estimate_class_dist(np.ones(K, np.float32)), ValueError,
     "kernel"),
    ("estimate_int", lambda: agg.estimate_class_dist(np.ones((2, K), np.int32)),
     TypeError, "kernel"),
    # pflax.tree helpers and state constructor.
    ("fedrema_init", lambda: agg.fedrema_init(0), ValueError, "num_clients"),
    ("probe_feature_dim", lambda: agg.probe_logits(lambda p, h: h, P, jax.random.key(0),
                                                   0), ValueError, "feature_dim"),
]


@pytest.mark.parametrize("call,error,pattern",
                         [pytest.param(c, e, p, id=n) for n, c, e, p in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(call, error, pattern):
  with pytest.raises(error, match=pattern):
    call()


def test_shape_message_states_expected_shape():
  with pytest.raises(ValueError, match=r"class_dist.*\(M, K\).*\(3, 4\).*\(4, 4\)"):
    agg.cw_fedavg(P, _counts(M + 1))
  with pytest.raises(ValueError, match=r"num_samples.*\(M,\).*\(3,\).*\(2,\)"):
    agg.fedavg(P, N[:2])


def test_errors_are_raised_at_trace_time_under_jit():
  calls = [
      (lambda p, c: agg.cw_fedavg(p, c), (P, _counts(M + 1)), "class_dist"),
      (lambda p, n: agg.fedavg(p, n), (P, N[:2]), "num_samples"),
      (lambda p, s: agg.fedrema(p, N, s, STATE)[0], (P, SOFT[:2]), "soft"),
      (lambda p, m: agg.fedavg(p, mask=m), (P, np.ones(M + 1, bool)), "mask"),
      (lambda p, r: agg.feddwa(p, r), (P, {"features": P["features"]}), "received"),
  ]
  for fn, args, pattern in calls:
    traced = []

    def wrapped(*a, fn=fn):
      traced.append(True)
      return fn(*a)

    # lower() traces without compiling: the error must come from tracing.
    with pytest.raises(ValueError, match=pattern):
      jax.jit(wrapped).lower(*args)
    assert traced
  # Concrete value checks cannot run on tracers; inside jit they are skipped,
  # never coerced (the caller's values are used as given).
  out = jax.jit(lambda a: agg.feddwa(P, jax.tree.map(lambda x: x + 1, P), alpha=a))(0.5)
  assert np.all(np.isfinite(jax.tree.leaves(out)[0]))


def test_tree_errors():
  with pytest.raises(ValueError, match="stacked"):
    ptree.num_clients({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))})
  with pytest.raises(ValueError, match="stacked"):
    ptree.finite_clients({})
  with pytest.raises(ValueError, match="weights"):
    ptree.mix(np.ones(M), P)
