"""Command-line entry points. Each subcommand of `nanoqwen` is a module here with
``add_arguments(parser)`` and ``run(args) -> int``; `errors.run_main` turns a NanoqwenError into one line
on stderr and a non-zero exit."""
