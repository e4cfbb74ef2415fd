"""kvq's Torch stack: a Torch codec with kvq_jax's API and bytes, and a zero-copy DLPack bridge.

The Torch codec and the bridge land with their own issue; until then this package only names
the vLLM `kv_cache_dtype` strings that map onto the kvq format registry.
"""

#: vLLM `kv_cache_dtype` value -> kvq format name (one place for the mapping).
KV_CACHE_DTYPES = {"int4": "int4", "nvfp4": "nvfp4", "fp8_e4m3": "fp8_e4m3"}
