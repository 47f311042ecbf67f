"""CLI subcommands. Each module here defines `register(subparsers)`; `m2po_megatron.cli` discovers them,
so adding a subcommand never edits the CLI itself. Modules import their heavy dependencies lazily, inside
the handler, so `m2po --help` stays fast."""
