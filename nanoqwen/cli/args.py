"""What every nanoqwen command line shares: `--version`, and help that shows each option's default."""

from __future__ import annotations

import argparse

from .. import __version__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends "(default: X)" to an option's help when the default
    says something (not None, False or empty) and the help does not already name it."""

    def _get_help_string(self, action):
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
        if quiet or "default" in text:
            return text
        return f"{text} (default: {action.default})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with that formatter; its subcommands' parsers are of this class too."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def parser(prog: str, description: str | None) -> Parser:
    p = Parser(prog=prog, description=description)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p
