"""Pallas GPU kernels (Triton backend) for the hot paths, each beside its XLA reference.

One package per operation, in the tokamax layout:
  <op>/api.py            the public function; `backend=` picks the implementation
  <op>/xla.py            the XLA reference the kernel is held to
  <op>/pallas_triton.py  the Pallas kernel (Triton backend; interpret mode on CPU)
  <op>/arg_specs.py      argument specs shared by the tests and the benchmarks
`backend.py` resolves `backend=`, `_exact.py` holds the correctly rounded kernel arithmetic.
"""
