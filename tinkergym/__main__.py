"""``python -m tinkergym`` runs the command line."""

from tinkergym.cli import main

main()
