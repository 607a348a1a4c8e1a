"""Job start for the JAX benchmark: jax.distributed.initialize() from the
JAX_* env (as Trainer's JAX examples), one psum over every process, exit."""

import os

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
    process_id=int(os.environ["JAX_PROCESS_ID"]),
)
import jax.numpy as jnp  # noqa: E402

total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jnp.ones((jax.local_device_count(),)))
assert int(total[0]) == jax.device_count(), total
jax.distributed.shutdown()
