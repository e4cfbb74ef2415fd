"""Checks of the kernels that drive them through the public cache ops: the argument specs the
kernel tests and benchmarks share (`arg_specs.<op>`) and the deviceless GPU build check
(`cuda_compile`: compile every configuration for sm_80 / sm_90a / sm_120a with no GPU).

Top layer: nothing below imports it.
"""
