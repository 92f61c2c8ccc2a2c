"""The run stack: a checked job built and run (RL or offline loop); see docs/ARCHITECTURE.md.

  check.py    the spec checked against files and devices: a `Job` (tokenizer, plan, data)
  layouts.py  the placement resolved into a `RunPlan`: the planner's plan object, whatever
              `placement.kind` says (`execution_plan`), and its layouts on this machine
  build.py    engine calls, model states, runtimes, reward pools, the runner
  runner.py   one algorithm's graph run one step at a time (typed StepResult)
  rl.py       the job, RL or offline (SFT, reward modelling, DPO): beginning, step loop, summary
  evaluate.py held-out evaluation of RL and offline runs
"""
