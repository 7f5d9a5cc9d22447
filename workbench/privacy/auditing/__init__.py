"""Auditing: a lower bound on a run's epsilon from its own training run (bound.py: the statistics of Steinke, Nasr &
Jagielski 2023; canaries.py: the canaries and observers a run with ``audit=canaries`` trains with). The command line,
``python -m workbench.audit``, runs a job and so lives above the job runner, in workbench/audit/."""
