"""Shared kernel argument specs, one module per operation (tokamax's `arg_specs`)."""
