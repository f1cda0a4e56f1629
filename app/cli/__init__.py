"""`nnui` subcommands, the TUI's headless twin: the parser, one module per command group
(status, control, launch, predict, cv, history, schedule, adopted) and their dispatch
(commands.py). `app.main` is the entry point."""
