"""`python -m jaxrlhf.plan`: the planner's command line, which lives in jaxrlhf/plan_cli.py.

Python looks for this file when asked to run the package; it is the entry point's hook, not
part of the planner. tests/test_layers.py counts it among the entry points and holds it to
this one forwarding import, so nothing of the planner's layer can hide here.
"""

from jaxrlhf.plan_cli import run

if __name__ == "__main__":
    run()
