"""The run stack: a checked job built and run (RL or offline loop); see DESIGN.md's layers.

  check.py    the spec checked against files and devices: a `Job` (tokenizer, plan)
  layouts.py  the placement resolved into a `RunPlan` (the planner's plan object, run as is)
  build.py    data, engine calls, model states, runtimes, reward pools, the runner
  runner.py   one algorithm's graph run one step at a time
  rl.py       the RL loop (warm start, evaluation, checkpoints)
  offline.py  the offline loop (SFT, reward modelling, DPO)
"""
