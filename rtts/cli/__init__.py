"""The ``rtts`` command line.

- :mod:`rtts.cli.main`: the commands (serve, worker, job, model, bench, doctor)
- :mod:`rtts.cli.options`: flags, ``RTTS_*`` variables and ``rtts.toml`` from one declaration
- :mod:`rtts.cli.doctor`: install checks (``rtts doctor``)
"""
