"""The `kvq` command line (`commands.main`) and its embedded demo (`demo`)."""
