"""The ``sekali`` command: :mod:`cli.main` dispatches to one module per subcommand in
:mod:`cli.commands`."""
