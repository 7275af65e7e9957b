"""SyncBatchNormalization across ranks: N ranks at batch b compute as 1 rank at batch N*b.

Run with 2 or 3 ranks, under the test launcher or plainly:
`mpiexec -n 3 python tests/workers/sync_batch_norm_worker.py`.

Every rank builds the same models and generates the same global data, and
computes the single-rank reference itself with plain
`keras.layers.BatchNormalization` on all the rows:

    fit: Dense -> SyncBatchNormalization -> Dense (and a 4-D input
        normalised on axis 1) trained by `model.fit` with a
        DistributedOptimizer at batch b on each rank's rows must end with
        the weights and moving statistics of the reference at batch N*b,
        identical on every rank; the same model with plain
        BatchNormalization must not (else the check could not tell).
    uneven: one training call in which the ranks hold different numbers of
        rows (one rank none, with 3 ranks), eagerly and in a tf.function:
        the outputs, the moving mean and variance, and the gradients of the
        inputs, gamma and beta must be those of one call on all the rows;
        also with a mask, with renorm and with mixed_float16.

Wrong values are collected and reported at the end (exit 1); an unexpected
exception exits at once, and the launcher then stops the other ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
import time
import traceback

import numpy as np
import tensorflow as tf

# Up to 3 ranks share 2 cores.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import keras_ring as kr  # noqa: E402

STEPS = 5
BATCH = 4  # rows per rank per step
SEED = 1234
MOMENTUM = 0.9  # the moving statistics move by 10% of the batch's per step
# float32: both sides sum the same values in a different order (per rank,
# then over the ranks), so they differ by rounding, about 1e-7 relative. Local
# instead of global statistics change the weights by 1e-2 or more.
RTOL, ATOL = 1e-5, 1e-5
# mixed_float16: the statistics are float32 on both sides (from the same
# float16 inputs); outputs and the gradients of inputs are float16, where
# that rounding can flip the last of 11 bits.
HALF_TOL = 4e-3
# Rows per rank of the one uneven call: 8 in all.
UNEVEN_ROWS = {2: [5, 3], 3: [5, 0, 3]}

RANK = SIZE = None
failures = []


def fail(message):
    failures.append(f"rank {RANK}: {message}")


def build_model(kind, normalization):
    keras.utils.set_random_seed(SEED)
    if kind == "dense":
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8),
                normalization(momentum=MOMENTUM),
                keras.layers.Dense(2),
            ]
        )
    # Channels first: 3 channels of 2x4, normalised on axis 1.
    return keras.Sequential(
        [
            keras.Input((3, 2, 4)),
            keras.layers.Dense(4),
            normalization(axis=1, momentum=MOMENTUM),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def global_data(kind):
    """STEPS global batches of SIZE * BATCH rows; the inputs' mean is far from 0."""
    rows = STEPS * SIZE * BATCH
    rng = np.random.default_rng(SEED)
    shape = (6,) if kind == "dense" else (3, 2, 4)
    x = rng.normal(loc=1.5, scale=2.0, size=(rows, *shape)).astype("float32")
    y = rng.normal(size=(rows, 2)).astype("float32")
    return x, y


def rank_rows(array):
    """This rank's rows: [RANK*b, (RANK+1)*b) of each global batch of SIZE*b rows."""
    batches = array.reshape(-1, SIZE * BATCH, *array.shape[1:])
    return batches[:, RANK * BATCH : (RANK + 1) * BATCH].reshape(-1, *array.shape[1:])


def compare(what, got, expected, rtol=RTOL, atol=ATOL):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        fail(f"{what}: shape {got.shape}, expected {expected.shape}")
    elif not np.allclose(got, expected, rtol=rtol, atol=atol):
        fail(f"{what}: differs by up to {np.max(np.abs(got - expected)):.3g} "
             f"(rtol={rtol}, atol={atol})")


def gathered_equal(array):
    """Whether every rank holds exactly this array."""
    flat = np.ascontiguousarray(array, np.float64).ravel()
    gathered = kr.allgather(tf.constant(flat[None, :])).numpy()
    return bool((gathered == gathered[0]).all())


def check_fit():
    for kind in ("dense", "axis1"):
        x, y = global_data(kind)
        reference = build_model(kind, keras.layers.BatchNormalization)
        initial = reference.get_weights()
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
        reference.fit(x, y, batch_size=SIZE * BATCH, shuffle=False, verbose=0)
        trained = {}
        for name, normalization in (
            ("SyncBatchNormalization", kr.SyncBatchNormalization),
            ("BatchNormalization", keras.layers.BatchNormalization),
        ):
            model = build_model(kind, normalization)
            model.set_weights(initial)
            model.compile(optimizer=kr.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                          loss="mse", jit_compile=False)
            model.fit(rank_rows(x), rank_rows(y), batch_size=BATCH, shuffle=False, verbose=0)
            trained[name] = model
        model = trained["SyncBatchNormalization"]
        layer = model.layers[1]
        if not isinstance(layer, kr.SyncBatchNormalization):
            fail(f"{kind}: layer 1 is a {type(layer).__name__}")
        names = [w.path for w in model.weights]
        for name, got, expected in zip(names, model.get_weights(), reference.get_weights()):
            compare(f"fit {kind}: {name}", got, expected)
        for variable in (layer.moving_mean, layer.moving_variance):
            if not gathered_equal(variable.numpy()):
                fail(f"fit {kind}: {variable.path} differs between ranks")
        if np.allclose(layer.moving_mean.numpy(), layer.moving_mean_initializer(
                layer.moving_mean.shape)):
            fail(f"fit {kind}: the moving mean never moved")
        local = trained["BatchNormalization"]
        if all(np.allclose(a, b, rtol=RTOL, atol=ATOL)
               for a, b in zip(local.get_weights(), reference.get_weights())):
            fail(f"fit {kind}: plain BatchNormalization also matches the reference: the "
                 "check cannot tell synchronised statistics from local ones")


def uneven_case(variant):
    """The 8 rows of the uneven call (and mask and cotangent), and the layers' arguments."""
    rng = np.random.default_rng([SEED, len(variant)])
    shape = (8, 3, 4) if variant == "masked" else (8, 4)
    x = rng.normal(loc=3.0, scale=2.0, size=shape).astype("float32")
    cotangent = rng.normal(size=shape).astype("float32")
    mask = rng.uniform(size=shape[:-1]) < 0.7 if variant == "masked" else None
    options = {"momentum": 0.0}  # the moving statistics become the batch's
    if variant == "renorm":
        options.update(renorm=True, renorm_clipping={"rmax": 1.5, "rmin": 0.5, "dmax": 0.5})
    if variant == "mixed_float16":
        options["dtype"] = "mixed_float16"
        x = x.astype("float16")
    return x, mask, cotangent, options


def call_and_differentiate(layer, x, mask, cotangent, mode):
    def run(x, mask, cotangent):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(tf.cast(outputs, cotangent.dtype) * cotangent)
        return outputs, *tape.gradient(loss, [x, layer.gamma, layer.beta])

    if mode == "function":
        run = tf.function(run, jit_compile=False)
    mask = None if mask is None else tf.constant(mask)
    return [t.numpy() for t in run(tf.constant(x), mask, tf.constant(cotangent))]


def new_layer(normalization, x, options):
    layer = normalization(**options)
    layer.build(x.shape)
    rng = np.random.default_rng(SEED)
    layer.gamma.assign(rng.uniform(0.5, 1.5, size=layer.gamma.shape))
    layer.beta.assign(rng.normal(size=layer.beta.shape))
    return layer


def check_finite_differences(sizes, mine):
    """The input gradient is that of the job's loss (the sum of every rank's), in float64."""
    x, _, cotangent, options = uneven_case("plain")
    x, cotangent = x.astype("float64"), cotangent.astype("float64")
    layer = new_layer(kr.SyncBatchNormalization, x, {**options, "dtype": "float64"})

    def job_loss(x_mine):
        outputs = layer(tf.constant(x_mine), training=True)
        return kr.allreduce(tf.reduce_sum(outputs * cotangent[mine]), op=kr.Sum).numpy()

    _, x_grad, _, _ = call_and_differentiate(layer, x[mine], None, cotangent[mine], "eager")
    step = 1e-6
    for owner in (r for r in range(SIZE) if sizes[r]):
        for column in range(2):
            # Every rank evaluates the job's loss; `owner` moves one of its inputs.
            losses = []
            for sign in (1, -1):
                moved = x[mine].copy()
                if RANK == owner:
                    moved[0, column] += sign * step
                losses.append(job_loss(moved))
            if RANK == owner:
                compare(f"finite differences: d loss / d x[0, {column}] of rank {owner}",
                        (losses[0] - losses[1]) / (2 * step), x_grad[0, column],
                        rtol=1e-6, atol=1e-7)


def check_uneven():
    sizes = UNEVEN_ROWS[SIZE]
    mine = slice(sum(sizes[:RANK]), sum(sizes[: RANK + 1]))
    for variant in ("plain", "masked", "renorm", "mixed_float16"):
        x, mask, cotangent, options = uneven_case(variant)
        half = variant == "mixed_float16"
        for mode in ("eager", "function"):
            what = f"uneven {variant} {mode} ({sizes[RANK]} of {sum(sizes)} rows)"
            reference = new_layer(keras.layers.BatchNormalization, x, options)
            expected = call_and_differentiate(reference, x, mask, cotangent, mode)
            layer = new_layer(kr.SyncBatchNormalization, x, options)
            got = call_and_differentiate(
                layer, x[mine], None if mask is None else mask[mine], cotangent[mine], mode
            )
            outputs, x_grad, gamma_grad, beta_grad = got
            tol = {"rtol": HALF_TOL, "atol": HALF_TOL} if half else {}
            compare(f"{what}: outputs", outputs, expected[0][mine], **tol)
            compare(f"{what}: input gradient", x_grad, expected[1][mine], **tol)
            # gamma and beta are used on every rank: their gradient is the sum.
            for name, grad, full in (("gamma", gamma_grad, expected[2]),
                                     ("beta", beta_grad, expected[3])):
                total = kr.allreduce(tf.constant(grad), op=kr.Sum).numpy()
                compare(f"{what}: {name} gradient summed over ranks", total, full,
                        **({"rtol": HALF_TOL, "atol": 10 * HALF_TOL} if half else {}))
            for variable, ref_variable in zip(layer.non_trainable_weights,
                                              reference.non_trainable_weights):
                compare(f"{what}: {variable.name}", variable.numpy(), ref_variable.numpy())
                if not gathered_equal(variable.numpy()):
                    fail(f"{what}: {variable.name} differs between ranks")
            if variant == "plain":
                # And against NumPy, in float64, over the 8 rows.
                compare(f"{what}: moving mean vs NumPy", layer.moving_mean.numpy(),
                        x.astype(np.float64).mean(axis=0))
                compare(f"{what}: moving variance vs NumPy", layer.moving_variance.numpy(),
                        x.astype(np.float64).var(axis=0))
            if variant == "masked":
                weights = np.broadcast_to(mask[..., None], x.shape)
                compare(f"{what}: moving mean vs NumPy", layer.moving_mean.numpy(),
                        (x * weights).sum(axis=(0, 1)) / weights.sum(axis=(0, 1)))
    check_finite_differences(sizes, mine)
    # Inference communicates nothing: one rank alone may run it (a collective
    # would wait for the others forever).
    if RANK == 0:
        x, _, _, options = uneven_case("plain")
        reference = new_layer(keras.layers.BatchNormalization, x, options)
        layer = new_layer(kr.SyncBatchNormalization, x, options)
        compare("inference on rank 0 alone", layer(x[:3], training=False),
                reference(x[:3], training=False))
    kr.barrier()


def main():
    global RANK, SIZE
    kr.init()
    RANK, SIZE = kr.rank(), kr.size()
    start = time.time()
    try:
        check_fit()
        check_uneven()
    except Exception:  # noqa: BLE001 -- any failure must stop all ranks
        traceback.print_exc()
        print(f"sync_batch_norm_worker: rank {RANK} failed with an exception", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        print(f"sync_batch_norm_worker: rank {RANK}: {len(failures)} failures", file=sys.stderr)
        sys.exit(1)
    if RANK == 0:
        print(f"sync_batch_norm_worker: passed on {SIZE} ranks in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
