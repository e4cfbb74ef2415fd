"""Framework-neutral modules shared by both stacks; importing them imports neither JAX nor Torch.

constants      format constants and layout arithmetic (docs/FORMAT.md)
layouts        per-format array shapes, group-size rules and codec argument checks
containers     storage accounting of the packed containers
window         the raw-row window policy
checks         shape/dtype checks of every public call, host-side data checks
registry       the format registry (one instance per stack) and layout lookup
cache_config   `PagedCacheConfig` and the page-local group-size rule
policies       named storage policies (`kvq report`)
"""
