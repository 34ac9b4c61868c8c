"""Every bad input listed in docs/methods.md#errors raises an error naming the argument."""

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


def _with_nan(tree, client):
  """A copy of `tree` whose first leaf is NaN for one client."""
  tree = jax.tree.map(np.copy, tree)
  jax.tree.leaves(tree)[0][client] = np.nan
  return tree


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
    # Zero total weight (issue 11, item 4): concrete inputs name the cause.
    ("zero_weight_fedavg", lambda: agg.fedavg(P, np.zeros(M)), ValueError,
     "num_samples.*weight 0"),
    ("zero_weight_unmasked_fedavg", lambda: agg.fedavg(
        P, np.array([0.0, 5.0, 0.0]), mask=np.array([True, False, True])), ValueError,
     "num_samples.*unmasked"),
    ("all_masked_fedavg", lambda: agg.fedavg(P, mask=np.zeros(M, bool)), ValueError,
     "mask is all False"),
    ("all_masked_fedsa", lambda: agg.fedsa(P, mask=np.zeros(M, bool)), ValueError,
     "mask is all False"),
    ("zero_weight_fedclassavg", lambda: agg.fedclassavg(P, np.zeros(M)), ValueError,
     "num_samples"),
    ("all_masked_class_models", lambda: agg.class_models(
        P, _counts(), mask=np.zeros(M, bool)), ValueError, "mask is all False"),
    ("zero_class_dist_cw", lambda: agg.cw_fedavg(P, np.zeros((M, K))), ValueError,
     "class_dist.*weight 0"),
    ("zero_num_samples_cw", lambda: agg.cw_fedavg(P, _counts(), np.zeros(M)),
     ValueError, "num_samples.*weight 0"),
    ("zero_weights_weighted_mean", lambda: ptree.weighted_mean(P, np.zeros(M)),
     ValueError, "weights.*weight 0"),
    # No clients or no classes (item 6): not a ZeroDivisionError.
    ("no_clients_fedavg", lambda: agg.fedavg({"w": np.zeros((0, 2), np.float32)}),
     ValueError, "params has M = 0"),
    ("no_clients_cw", lambda: agg.cw_fedavg({"w": np.zeros((0, 2), np.float32)},
                                            np.zeros((0, K))), ValueError, "M = 0"),
    ("no_clients_feddwa", lambda: agg.feddwa({"w": np.zeros((0, 2), np.float32)},
                                             {"w": np.zeros((0, 2), np.float32)}),
     ValueError, "M = 0"),
    ("no_clients_weighted_mean", lambda: ptree.weighted_mean(
        {"w": np.zeros((0, 2), np.float32)}), ValueError, "stacked has M = 0"),
    ("no_classes_cw", lambda: agg.cw_fedavg(P, np.zeros((M, 0))), ValueError,
     r"class_dist.*K >= 1"),
    ("no_classes_class_models", lambda: agg.class_models(P, np.zeros((M, 0))),
     ValueError, r"class_dist.*K >= 1"),
    ("no_classes_personalize", lambda: agg.personalize(
        {"w": np.zeros((0, 2), np.float32)}, np.zeros((M, 0))), ValueError,
     "class_models has M = 0"),
    ("no_classes_estimate", lambda: agg.estimate_class_dist(np.zeros((3, 0), np.float32)),
     ValueError, r"kernel.*K >= 1"),
    # Complex parameters (item 6).
    ("complex_fedavg", lambda: agg.fedavg({"w": np.ones((M, 2), np.complex64)}),
     TypeError, "params.*complex64"),
    ("complex_cw", lambda: agg.cw_fedavg({"w": np.ones((M, 2), np.complex64)},
                                         _counts()), TypeError, "params"),
    ("complex_fedsa", lambda: agg.fedsa({"w": np.ones((M, 2), np.complex64)}),
     TypeError, "params"),
    ("complex_received", lambda: agg.feddwa(
        P, jax.tree.map(lambda x: x.astype(np.complex64), P)), TypeError, "received"),
    ("complex_kernel", lambda: agg.estimate_class_dist(np.ones((2, K), np.complex64)),
     TypeError, "kernel"),
    # A mask that is neither (M,) nor bool, given as a Python list.
    ("mask_list_len", lambda: agg.fedavg(P, mask=[True, False]), ValueError, "mask"),
    ("mask_list_int", lambda: agg.cw_fedavg(P, _counts(), mask=[1, 0, 1]), TypeError,
     "mask"),
    # A non-finite `received` of a client that is not masked (item 6).
    ("received_nan", lambda: agg.feddwa(P, _with_nan(P, 1)), ValueError,
     r"received: clients \[1\]"),
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


# ------------------------------------------- issue 11: zero weight, masks, selectors


def test_traced_zero_weight_gives_documented_finite_result():
  # Inside jit the concrete check cannot run: global aggregators return zeros,
  # personalized ones return `params` unchanged (never NaN).
  zeros, none = np.zeros(M, np.float32), np.zeros(M, bool)
  cases = [
      (lambda n: agg.fedavg(P, n), zeros, "zeros"),
      (lambda m: agg.fedavg(P, N, mask=m), none, "zeros"),
      (lambda n: agg.class_models(P, _counts(), n), zeros, "zeros"),
      (lambda w: ptree.weighted_mean(P, w), zeros, "zeros"),
      (lambda n: agg.fedclassavg(P, n), zeros, "params"),
      (lambda m: agg.fedclassavg(P, N, mask=m), none, "params"),
      (lambda c: agg.cw_fedavg(P, c), np.zeros((M, K), np.float32), "params"),
      (lambda n: agg.cw_fedavg(P, _counts(), n), zeros, "params"),
      (lambda m: agg.cw_fedavg(P, _counts(), mask=m), none, "params"),
  ]
  for fn, arg, expected in cases:
    out = jax.jit(fn)(arg)
    for leaf, x in zip(jax.tree.leaves(out), jax.tree.leaves(P)):
      want = x if expected == "params" else np.zeros(np.shape(leaf))
      np.testing.assert_array_equal(leaf, want)


def test_mask_given_as_a_python_list():
  mask = [True, False, True]
  received = jax.tree.map(lambda x: x + 1.0, P)
  calls = [
      lambda m: agg.fedavg(P, N, mask=m),
      lambda m: agg.fedclassavg(P, N, mask=m),
      lambda m: agg.cw_fedavg(P, _counts(), mask=m),
      lambda m: agg.class_models(P, _counts(), mask=m),
      lambda m: agg.feddwa(P, received, mask=m),
  ]
  for call in calls:
    for a, b in zip(jax.tree.leaves(call(mask)),
                    jax.tree.leaves(call(np.array(mask)))):
      np.testing.assert_array_equal(a, b)


def _flax_cnn(m=M):
  """Parameters shaped like a plain Flax CNN: no `features` / `classifier` names."""
  rng = np.random.default_rng(1)
  leaf = lambda *s: rng.normal(size=(m,) + s).astype(np.float32)
  return {"Conv_0": {"kernel": leaf(3, 3, 1, 2), "bias": leaf(2)},
          "Dense_0": {"kernel": leaf(4, 3), "bias": leaf(3)},
          "Dense_1": {"kernel": leaf(3, K), "bias": leaf(K)}}


def test_selector_that_selects_nothing_names_where_and_lists_keys():
  cnn = _flax_cnn()
  nothing = jax.tree.map(lambda _: False, cnn)
  calls = [
      lambda: agg.cw_fedavg(cnn, _counts(), where=ptree.under("classifier", "output")),
      lambda: agg.cw_fedavg(cnn, _counts(), where=ptree.under("Dense_9")),   # a typo
      lambda: agg.cw_fedavg(cnn, _counts(), where=nothing),
      lambda: agg.fedclassavg(cnn, N),                # default under("classifier")
      lambda: agg.fedclassavg(cnn, N, where=nothing),
  ]
  for call in calls:
    with pytest.raises(ValueError, match="where selects no leaf") as err:
      call()
    for key in ("Conv_0", "Dense_0", "Dense_1"):
      assert key in str(err.value)
  # A selector that matches works as before (and None still selects everything).
  out = agg.fedclassavg(cnn, N, where=ptree.under("Dense_1"))
  np.testing.assert_array_equal(out["Conv_0"]["kernel"], cnn["Conv_0"]["kernel"])
  assert np.allclose(out["Dense_1"]["bias"], out["Dense_1"]["bias"][0])
  agg.cw_fedavg(cnn, _counts(), where=None)


def test_unstacked_list_of_clients_points_to_tree_stack():
  clients = [jax.tree.map(lambda x, i=i: x[i], P) for i in range(M)]
  n = np.ones(M, np.float32)
  calls = [
      lambda p: agg.fedavg(p), lambda p: agg.fedclassavg(p),
      lambda p: agg.cw_fedavg(p, _counts()), lambda p: agg.class_models(p, _counts()),
      lambda p: agg.feddwa(p, p), lambda p: agg.fedsa(p),
      lambda p: agg.fedrema(p, n, SOFT, STATE), lambda p: ptree.weighted_mean(p),
      lambda p: ptree.mix(np.ones((1, M)), p),
  ]
  for call in calls:
    for seq in (clients, tuple(clients)):
      with pytest.raises(TypeError, match=r"pflax\.tree\.stack"):
        call(seq)
  # A model whose top level is a list of parts with different shapes is fine.
  parts = [{"w": np.ones((M, 2), np.float32)}, {"w": np.ones((M, 5), np.float32)}]
  out = agg.fedavg(parts, N)
  np.testing.assert_allclose(out[1]["w"], np.ones(5))
