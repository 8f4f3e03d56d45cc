"""The `localllm` command: every subcommand, on the top floor (nothing imports this room)."""
