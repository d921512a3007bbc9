"""The commands: the CLI and what each command runs (serve, audit, verify, ...)."""
