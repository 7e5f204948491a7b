"""``python -m runner`` is ``primus-cli``: for a checkout that is not pip-installed (a GPU box with the
repository and its dependencies on PYTHONPATH only)."""

from runner.cli import main

if __name__ == "__main__":
    main(prog_name="primus-cli")
