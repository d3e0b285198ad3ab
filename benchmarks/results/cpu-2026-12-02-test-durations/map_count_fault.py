"""Keep compiled XLA CPU executables alive until the process's memory maps pass vm.max_map_count."""
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
def maps(): return sum(1 for _ in open("/proc/self/maps"))
def make(i):
    def f(x):
        for j in range(40):  # reductions between elementwise ops: many separate kernels
            x = jnp.sin(x * (i + j)) + jnp.cumsum(x)[::-1] * jnp.max(x)
        return x
    return f
keep = []
x = jnp.ones((64,))
for i in range(100000):
    keep.append(jax.jit(make(i)).lower(x).compile())
    if i % 20 == 0:
        print(i, maps(), flush=True)
