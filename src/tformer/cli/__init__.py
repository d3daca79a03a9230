"""Command-line interface: parsing and dispatch only; each subcommand is a plain importable function."""
